"""``Trainer(strategy="balance_beam")``: Lightning lifecycle glue over the paging engine.

Each hook delegates: the planning session (:mod:`bb_lightning.strategy.session`) reads the job
and plans a :class:`~bb_lightning.placement.Placement`, the engine factory
(:mod:`bb_lightning.strategy.assembly`) opens the store and builds the engine, the adapt
controller (:mod:`bb_lightning.strategy.adapt`) re-plans from measured step times. The lifecycle
(engines kept between calls, weights handed back) is in ``docs/architecture.md``,
"strategy / glue".
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Generator, Mapping
from datetime import timedelta
from typing import Any, Literal

import lightning.pytorch as pl
import torch
from lightning.fabric.plugins import ClusterEnvironment
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities import rank_zero_info
from typing_extensions import override

from bb_lightning.engine import checkpoint as ckpt
from bb_lightning.engine import train_kernels
from bb_lightning.engine.compiled import check_backend, compile_blocks
from bb_lightning.engine.hf_quirks import activation_checkpointing_on
from bb_lightning.engine.inference import InferenceEngine, release_free_heap
from bb_lightning.engine.optimizer_step import adamw_groups_from_optimizer
from bb_lightning.engine.trainer_engine import TrainingEngine
from bb_lightning.hf.structure import find_block_list
from bb_lightning.placement import Placement
from bb_lightning.planner import FitJob, HardwareProfile, Plan, PlanOverrides, PredictJob
from bb_lightning.strategy import assembly, session, world
from bb_lightning.strategy.adapt import AdaptController
from bb_lightning.strategy.calls import call_placement, checkpointing_off, end_call, host_step
from bb_lightning.strategy.handback import handback_dtype
from bb_lightning.strategy.ranks import RankedStrategy
from bb_lightning.strategy.register import STRATEGY_NAME, add_to
from bb_lightning.strategy.session import ComputeDtype, clip_config
from bb_lightning.strategy.settings import HandBackConfig, PlanningConfig, grouped
from bb_lightning.strategy.state_reads import StateReads
from bb_lightning.strategy.summary import describe_placement, use_paged_summary
from storage.store import StoreConfig, TieredStore

__all__ = ["BalanceBeamStrategy", "HandBackConfig", "PlanningConfig"]


class BalanceBeamStrategy(RankedStrategy):
    """Strategy that pages transformer blocks through a three-tier store, one device per
    process; with ``devices=G, num_nodes=M`` (G x M > 1) data parallel over G x M ranks.

    Data parallelism (:mod:`bb_lightning.strategy.world`; devices, ranks and collectives in
    :class:`~bb_lightning.strategy.ranks.RankedStrategy`): every rank pages a full copy of the
    weights and holds its shard of the optimizer state; rank 0 plans; ranks are started by
    Lightning's script launcher (``start_method="popen"``), torchrun or srun.

    Settings come in groups, or as flat keyword arguments of the same names (as recipes
    and LightningCLI give them); a setting given both ways is refused.

    Args:
        store: budgets (bytes) and NVMe directory of the tensor store; None sizes
            the budgets from the placement (what it needs, plus 1 MiB each).
        planning: how the blocks are placed and the optimizer steps run
            (:class:`~bb_lightning.strategy.settings.PlanningConfig`: ``placement``,
            ``compute_dtype``, ``overrides``, ``job``, ``hardware``, ``warmup_steps``,
            ``adapt_tolerance``, ``overlap_optimizer``, ``compile_blocks``, each documented
            there).
        hand_back: what the module holds at the end of every ``trainer.*`` call
            (:class:`~bb_lightning.strategy.settings.HandBackConfig`: ``gather_on_teardown``,
            ``gather_limit``).
        nvme_path: directory of the NVMe tier; None plans without NVMe (a temporary
            directory, removed at close, only when overrides force NVMe tiers).
        parallel_devices: the devices of this node's ranks; None: the Trainer's.
        cluster_environment: where ranks come from; None: Lightning's detection
            (torchrun, SLURM, ..., else its own launcher).
        process_group_backend: backend of the world process group; None:
            ``"gloo"`` on CPU devices, ``"cpu:gloo,cuda:nccl"`` on CUDA devices.
        timeout: of the process groups' collectives.
        start_method: ``"popen"`` (the only one: ``"spawn"`` and ``"fork"`` hand the
            module's state dict back to the parent, and paged weights are not in it).
    """

    strategy_name = STRATEGY_NAME
    streams_weights = True
    """Modules may leave parameters on the meta device: the engine reads their checkpoint."""

    def __init__(
        self,
        *,
        store: StoreConfig | None = None,
        planning: PlanningConfig | None = None,
        hand_back: HandBackConfig | None = None,
        nvme_path: str | None = None,
        placement: Placement | None = None,
        compute_dtype: ComputeDtype | None = None,
        overrides: PlanOverrides | None = None,
        job: FitJob | PredictJob | None = None,
        hardware: str | HardwareProfile | None = None,
        warmup_steps: int = 3,
        adapt_tolerance: float | None = 0.25,
        overlap_optimizer: bool = True,
        compile_blocks: str | None = None,
        gather_on_teardown: bool | None = None,
        gather_limit: int | None = None,
        accelerator: pl.accelerators.Accelerator | None = None,
        checkpoint_io: Any | None = None,
        precision_plugin: Any | None = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: ClusterEnvironment | None = None,
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
        start_method: Literal["popen"] = "popen",
    ) -> None:
        super().__init__(
            accelerator=accelerator, checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin, parallel_devices=parallel_devices,
            cluster_environment=cluster_environment, process_group_backend=process_group_backend,
            timeout=timeout, start_method=start_method,
        )  # fmt: skip
        plan, back = grouped(
            planning, hand_back, placement=placement, compute_dtype=compute_dtype,
            overrides=overrides, job=job, hardware=hardware, warmup_steps=warmup_steps,
            adapt_tolerance=adapt_tolerance, overlap_optimizer=overlap_optimizer,
            compile_blocks=compile_blocks, gather_on_teardown=gather_on_teardown, gather_limit=gather_limit,
        )  # fmt: skip
        session.check_settings(
            plan.compute_dtype, back.gather_limit, store, nvme_path, hardware=plan.hardware
        )
        self._adapt = AdaptController(
            warmup_steps=plan.warmup_steps, tolerance=plan.adapt_tolerance
        )
        self.overlap_optimizer = plan.overlap_optimizer
        self._reads = StateReads()
        self.compile_blocks = plan.compile_blocks
        if plan.compile_blocks is not None:
            check_backend(plan.compile_blocks)
        self.gather_on_teardown, self.gather_limit = back.gather_on_teardown, back.gather_limit
        self._slot = assembly.EngineSlot()
        """The engine, its store, and where the module's weights are between calls."""
        self._checkpointing: list[torch.nn.Module] = []
        """Modules whose activation checkpointing is off during this ``trainer.*`` call."""
        self._kernels_back = _nothing  # restores sdpa and the norms after a fit
        self.plan: Plan | None = None
        """The plan in force (None when the placement was given or no plan could be made)."""
        self.plan_history: list[Plan] = []
        """Every plan applied in this run, first to last."""
        self.plan_metrics: dict[str, float] = self._adapt.metrics
        """Predicted and measured seconds per step after warm-up (``self.log``-able)."""
        self.store_config = store
        self.nvme_path = nvme_path
        self.placement, self.compute_dtype, self.job = plan.placement, plan.compute_dtype, plan.job
        self.overrides, self.hardware = plan.overrides, plan.hardware

    @property
    def warmup_steps(self) -> int:
        """Optimizer steps measured before comparing with the plan."""
        return self._adapt.warmup_steps

    @property
    def adapt_tolerance(self) -> float | None:
        """Relative difference of measured and predicted times that triggers a re-plan."""
        return self._adapt.tolerance

    @property
    def engine(self) -> TrainingEngine | None:
        """The training engine of ``fit`` (kept for later calls on the same module)."""
        engine = self._slot.engine
        return engine if isinstance(engine, TrainingEngine) else None

    @property
    def inference(self) -> InferenceEngine | None:
        """The weights-only engine of ``predict`` / ``validate`` run without fit state."""
        engine = self._slot.engine
        return engine if isinstance(engine, InferenceEngine) else None

    @property
    def store(self) -> TieredStore | None:
        """The tensor store of the engine (None before ``setup`` and after :meth:`close`)."""
        return self._slot.store

    # -- model construction and setup ------------------------------------------

    @contextlib.contextmanager
    @override
    def tensor_init_context(self, empty_init: bool | None = None) -> Generator[None, None, None]:
        """Build the model on the host in fp32: the engine pages it to the device."""
        yield

    @override
    def model_to_device(self) -> None:
        """Nothing: the engine moves only the parameters outside the blocks."""

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        """Build the engine once per module; set up Lightning's optimizer for bookkeeping."""
        assert self.accelerator is not None
        self.accelerator.setup(trainer)
        module = self.lightning_module
        assert module is not None
        if trainer.state.fn == TrainerFn.FITTING:
            session.check_clipping(trainer, module)  # fails before anything is built
            self._kernels_back = train_kernels.install(self.root_device, module)
        self._slot.take_back(module)
        call = getattr(trainer.state.fn, "value", "fit")
        self._checkpointing = checkpointing_off(module, call)
        use_paged_summary(trainer)  # the model summary counts the paged blocks' real sizes
        fit_state = self.engine is not None and self.engine.model is module
        if trainer.state.fn == TrainerFn.FITTING:
            if not fit_state:
                self._build(module, trainer, training=True)
        elif not fit_state and (self.inference is None or self.inference.model is not module):
            self._build(module, trainer, training=False)
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()
        # The engine clips the host gradients at its step; the device parameters hold none.
        self.precision_plugin.clip_gradients = _engine_clips  # type: ignore[method-assign]

    def resolved_dtype(self) -> torch.dtype:
        """The compute dtype: the constructor's, else the Trainer's precision."""
        return session.compute_dtype(self.compute_dtype, str(self.precision_plugin.precision))

    def _build(self, module: pl.LightningModule, trainer: pl.Trainer, *, training: bool) -> None:
        """The engine of this call, over a store sized for the placement (closed first)."""
        self.close()
        _, blocks = find_block_list(module)
        predicting = trainer.state.fn == TrainerFn.PREDICTING
        loader = assembly.checkpoint_loader(module, generation=predicting)
        placement, plan = call_placement(
            module, trainer, len(blocks), given=self.placement, overrides=self.overrides,
            hardware=self.hardware, job=self.job, nvme_path=self.nvme_path,
            dtype=self.resolved_dtype(), device=self.root_device, ranks=self,
            ranks_per_node=max(1, self.num_processes),
        )  # fmt: skip
        if plan is not None:
            self._adopt(plan)
        ranks = self.world_size
        nvme, store = world.rank_stores(self.nvme_path, self.store_config, self.global_rank, ranks)
        built = assembly.build_engine(
            module, list(blocks), placement, training=training, device=self.root_device,
            loader=loader, store=store, nvme_path=nvme, plan=self.plan,
            comm=self.shard_comm() if ranks > 1 else None,  # one process: no collectives
            boundary_numel=session.boundary_numel(module, trainer, placement, plan, training),
        )  # fmt: skip
        self._slot.hold(built, self)
        if self.compile_blocks is not None:
            compile_blocks(built.engine.paged, self.compile_blocks)
        if self.root_device.type == "cpu":  # what the build freed, the heap would keep
            release_free_heap()

    def _adopt(self, plan: Plan) -> None:
        self.plan = plan
        self.plan_history.append(plan)

    @override
    def setup_optimizers(self, trainer: pl.Trainer) -> None:
        """Lightning's optimizers, whose ``step`` runs the engine's host AdamW.

        ``configure_optimizers`` sees every parameter with its shape (a paged block's
        parameters hold a meta stand-in meanwhile), as code grouping them by ``ndim``
        expects."""
        engine = self.engine
        with engine.pager.shaped() if engine is not None else contextlib.nullcontext():
            super().setup_optimizers(trainer)
        for optimizer in self.optimizers:
            adamw_groups_from_optimizer(optimizer)
            optimizer.step = host_step(  # type: ignore[method-assign]
                optimizer, engine=lambda: self.engine, trainer=self._trainer,
                overlap=lambda: self.overlap_optimizer, after=self._after_step,
            )  # fmt: skip

    def _trainer(self) -> pl.Trainer | None:
        return self.lightning_module.trainer if self.lightning_module else None

    # -- measure, then adapt -------------------------------------------------------

    @override
    def on_train_batch_start(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> None:
        """Start timing the optimizer step this micro-batch belongs to, and its state reads."""
        engine = self.engine
        if engine is not None and not engine.timer.in_step:
            self._adapt.begin_step(engine)
            overlapped = self.overlap_optimizer and clip_config(self._trainer()).value is None
            self._reads.window_start(engine, self._trainer(), overlapped)

    @override
    def pre_backward(self, closure_loss: torch.Tensor) -> None:
        super().pre_backward(closure_loss)
        if self.engine is not None:
            self._reads.before_backward(self.engine)

    def _after_step(self) -> None:
        engine = self.engine
        assert engine is not None
        replanned = self._adapt.end_step(engine, self.plan, self._log_metrics, self.max_reducer())
        if replanned is not None:
            self._adopt(replanned)

    def _log_metrics(self, metrics: Mapping[str, float]) -> None:
        trainer = self._trainer()
        if trainer is not None and trainer.logger is not None:
            trainer.logger.log_metrics(dict(metrics), step=trainer.global_step)

    # -- training hooks ------------------------------------------------------

    @override
    def post_backward(self, closure_loss: torch.Tensor) -> None:
        """Move this backward's gradients into the host accumulators."""
        if self.engine is not None:
            self.engine.after_backward()
            self._reads.after_backward(self.engine)

    @override
    def on_train_start(self) -> None:
        """Say the placement before the first step (rank zero) when no plan table did."""
        if self.engine is not None and self.plan is None:
            rank_zero_info(
                f"balance_beam placement: {describe_placement(self.engine.pager.placement)}"
            )

    # -- checkpoints ------------------------------------------------------------

    @override
    def lightning_module_state_dict(self) -> Mapping[str, Any]:  # type: ignore[override]
        """The module's state dict with fp32 master weights, read lazily from the store.

        Under the engine this is a read-only :class:`~bb_lightning.engine.trainer_engine.
        EngineStateDict`: Lightning's ``dump_checkpoint`` puts it into every checkpoint
        dict without materialising the model on the host; each parameter is read when a
        key is asked for (``dict(...)`` of it makes a full fp32 copy).
        """
        calls = self._slot.calls
        if calls is None:
            return super().lightning_module_state_dict()
        return calls.checkpoint_state_dict()

    @override
    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        """Load a state dict (plain, or a checkpoint directory's) into the engine or module."""
        state_dict = checkpoint["state_dict"]
        calls = self._slot.calls
        if calls is None:
            super().load_model_state_dict({**checkpoint, "state_dict": dict(state_dict)}, strict)
        else:
            calls.load_weights(state_dict)

    @override
    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        """Lightning's optimizer state (learning rates), then moments and step count."""
        super().load_optimizer_state_dict(checkpoint)
        calls = self._slot.calls
        if calls is not None:
            calls.load_optimizer(checkpoint.get("state_dict"))

    @property
    @override
    def restore_checkpoint_after_setup(self) -> bool:
        """Checkpoints load into the engine, which :meth:`setup` builds: restore after it."""
        return True

    @override
    def save_checkpoint(
        self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None
    ) -> None:
        """Write a checkpoint directory at ``filepath`` (:mod:`bb_lightning.engine.checkpoint`)."""
        if storage_options is not None:
            raise ValueError(
                f"storage_options={storage_options!r}: balance_beam checkpoints take none: "
                "pass storage_options=None"
            )
        if self.engine is None:
            raise ValueError(
                f"cannot save {filepath!r}: the balance_beam engine is built in setup; "
                "save after trainer.fit has started"
            )
        weights_only = "optimizer_states" not in checkpoint
        save = functools.partial(
            ckpt.save_checkpoint, self.engine, trainer_state=checkpoint, weights_only=weights_only
        )
        if self.world_size == 1:
            save(filepath)
        else:  # several ranks: all take part in the state's gathers, rank 0 writes
            follow = functools.partial(ckpt.follow_save, self.engine, weights_only=weights_only)
            world.save_on_ranks(self, filepath, save, follow)

    @override
    def load_checkpoint(
        self, checkpoint_path: Any, weights_only: bool | None = None
    ) -> dict[str, Any]:
        """Lightning's checkpoint dict of a checkpoint directory; parameters read lazily."""
        return ckpt.load_checkpoint(checkpoint_path, weights_only=weights_only)

    @override
    def remove_checkpoint(self, filepath: Any) -> None:
        """Delete a checkpoint directory (``ModelCheckpoint``'s ``save_top_k`` rotation)."""
        if self.is_global_zero:
            ckpt.remove_checkpoint(filepath)

    # -- teardown -----------------------------------------------------------

    @override
    def teardown(self) -> None:
        """Release paged blocks and give the module its weights back (see ``gather_on_teardown``)."""
        module = self.lightning_module
        self._kernels_back()  # first: whatever fails below, sdpa and the modules are as they were
        self._kernels_back = _nothing
        end_call(
            self._slot, self, module.trainer if module is not None and module._trainer else None,
            ranks=self, ranks_per_node=self.num_processes,
            dtype=handback_dtype(self.precision_plugin.precision),  # as plain Lightning leaves it
            hand_back=HandBackConfig(
                gather_on_teardown=self.gather_on_teardown, gather_limit=self.gather_limit
            ),
            budget_given=self.store_config is not None,
        )  # fmt: skip
        activation_checkpointing_on(self._checkpointing)
        self._checkpointing = []
        self.teardown_ranks()
        self.precision_plugin.teardown()
        assert self.accelerator is not None
        self.accelerator.teardown()
        self.checkpoint_io.teardown()

    def gather_full_model(self) -> torch.nn.Module:
        """Put the weights into the module's parameters (host); close the store.

        The module then runs without the strategy (ordinary forwards, every parameter
        materialised on the CPU in the dtype plain Lightning leaves it in, bf16 under
        ``"bf16-true"``, else fp32: the fp32 master weights after ``fit``, the
        compute-dtype weights after a weights-only ``validate`` / ``predict``); a later
        ``trainer.*`` call pages it again from these values (the AdamW moments are not
        kept). Returns the module. With several ranks every rank calls it (the weights
        are read with collectives).
        """
        module = self.lightning_module
        assert module is not None
        self._slot.gather(handback_dtype(self.precision_plugin.precision))
        self.close()
        return module

    def close(self) -> None:
        """Remove the engine's wrappers and close the store (NVMe lock released).

        A module handed back keeps its weights; a hollow one keeps raising (its weights
        are gone with the store).
        """
        self._slot.close()

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        """Register ``"balance_beam"`` unless already there (as :mod:`bb_lightning.strategy.register`
        does on importing the package)."""
        add_to(strategy_registry)


# -- helpers -----------------------------------------------------------------------------


def _engine_clips(*args: Any, **kwargs: Any) -> None:
    """Lightning's clipping of the device parameters' ``.grad`` (none under the engine)."""


def _nothing() -> None:
    """What restores nothing."""
