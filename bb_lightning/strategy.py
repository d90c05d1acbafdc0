"""``Trainer(strategy="balance_beam")``: Lightning lifecycle glue over the paging engine.

Each hook delegates: the planning session (:mod:`bb_lightning.session`) reads the job
and plans a :class:`~bb_lightning.placement.Placement`, the engine factory
(:mod:`bb_lightning.assembly`) opens the store and builds the engine, the adapt
controller (:mod:`bb_lightning.adapt`) re-plans from measured step times. The lifecycle
(engines kept between calls, weights handed back) is in ``docs/architecture.md``,
"strategy / glue".
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import pickle
import tempfile
import weakref
from collections.abc import Callable, Generator, Mapping
from datetime import timedelta
from typing import Any, Literal

import lightning.pytorch as pl
import torch
from lightning.fabric.plugins import ClusterEnvironment
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.utilities.distributed import (
    _distributed_is_initialized,
    _init_dist_connection,
    _sync_ddp_if_available,
)
from lightning.fabric.utilities.distributed import group as _group
from lightning.fabric.utilities.seed import reset_seed
from lightning.pytorch.strategies import ParallelStrategy
from lightning.pytorch.strategies.launchers.subprocess_script import _SubprocessScriptLauncher
from lightning.pytorch.trainer.states import TrainerFn, TrainerStatus
from lightning.pytorch.utilities import rank_zero_info
from lightning.pytorch.utilities.rank_zero import rank_zero_only
from lightning_utilities.core.rank_zero import rank_zero_only as utils_rank_zero_only
from typing_extensions import override

from bb_lightning import assembly, session, world
from bb_lightning.adapt import AdaptController
from bb_lightning.engine import checkpoint as ckpt
from bb_lightning.engine.flat import dtype_name
from bb_lightning.engine.hf_quirks import activation_checkpointing_off, activation_checkpointing_on
from bb_lightning.engine.inference import InferenceEngine
from bb_lightning.engine.shard import ShardComm
from bb_lightning.engine.trainer_engine import TrainingEngine, adamw_groups_from_optimizer
from bb_lightning.handback import budget_room, handback_dtype
from bb_lightning.placement import Placement
from bb_lightning.planner import FitJob, HardwareProfile, Plan, PlanOverrides, PredictJob
from bb_lightning.register import STRATEGY_NAME, add_to
from bb_lightning.session import ComputeDtype, clip_config
from bb_lightning.structure import find_block_list
from bb_lightning.summary import describe_placement, use_paged_summary
from storage.store import StoreConfig, TieredStore

__all__ = ["BalanceBeamStrategy"]


class BalanceBeamStrategy(ParallelStrategy):
    """Strategy that pages transformer blocks through a three-tier store, one device per
    process; with ``devices=G, num_nodes=M`` (G x M > 1) data parallel over G x M ranks.

    Data parallelism: every rank pages a full copy of the weights and holds its shard of
    the optimizer state (:mod:`bb_lightning.engine.shard`); rank 0 plans and every rank
    runs its placement; each rank's NVMe tier is ``<nvme_path>/rank<global rank>``;
    checkpoints go to a directory every rank sees. Processes are started by Lightning's
    script launcher (``start_method="popen"``), torchrun or srun.

    Args:
        store: budgets (bytes) and NVMe directory of the tensor store; None sizes
            the budgets from the placement (what it needs, plus 1 MiB each).
        placement: per-block homes and prefetch depth; None asks the planner.
        nvme_path: directory of the NVMe tier; None plans without NVMe (a temporary
            directory, removed at close, only when overrides force NVMe tiers).
        compute_dtype: ``"bf16"`` or ``"fp32"``; None follows the Trainer's precision
            (``"bf16-true"``/``"bf16-mixed"`` -> bf16, ``"32-true"`` -> fp32).
        overrides: choices forced on the planner (tiers, prefetch depth). Where no
            plan can be made (no Hugging Face model, or not fitting) only
            ``weights_tier``, ``master_tier`` and ``prefetch_depth`` are read.
        job: the fit job (sequence length, global batch); None derives it from the
            Trainer and the first batch. The DataLoader's batch size and the
            accumulation stay the caller's. A :class:`PredictJob` plans ``predict``
            (None derives it: see :func:`predict_job`).
        hardware: a preset name, a :class:`HardwareProfile`, or ``"measure"`` / None
            (measure this machine, cached).
        warmup_steps: optimizer steps measured before comparing with the plan (>= 1).
        adapt_tolerance: relative difference of measured and predicted phase times
            that triggers a re-plan; None only logs the comparison.
        overlap_optimizer: step each block during backward when no clipping is set.
        gather_on_teardown: at the end of every ``trainer.*`` call, None gives the
            module its trained weights back (host fp32 parameters; the store stays
            open for the next call) when they fit ``gather_limit``, else leaves them
            in the store (``state_dict()`` raises naming ``bb-lightning export``,
            ``save_pretrained`` streams from the store); True always gives them back
            and closes the store (:meth:`gather_full_model`); False always leaves
            them in the store.
        gather_limit: most bytes of weights given back to the module's parameters (in
            the dtype they are given back in: bf16 under ``"bf16-true"``); None: 80% of the host memory available at that time (with
            several ranks, the rank with the least) and, with ``store`` given, at most
            what its ``host_budget`` leaves beside the store's host arena.
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
        placement: Placement | None = None,
        nvme_path: str | None = None,
        compute_dtype: ComputeDtype | None = None,
        overrides: PlanOverrides | None = None,
        job: FitJob | PredictJob | None = None,
        hardware: str | HardwareProfile | None = None,
        warmup_steps: int = 3,
        adapt_tolerance: float | None = 0.25,
        overlap_optimizer: bool = True,
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
        check_start_method(start_method)
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
        )
        self._root_device = (
            torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
        )
        """The device outside a Trainer (no ``parallel_devices``): CUDA device 0 when visible."""
        self._num_nodes = 1
        self._process_group_backend = process_group_backend
        self._timeout = timeout
        self.start_method = start_method
        self._comm: ShardComm | None = None
        """The engine's collectives (world size > 1), made once after the world group."""
        session.check_settings(compute_dtype, gather_limit, store, nvme_path, hardware=hardware)
        self._adapt = AdaptController(warmup_steps=warmup_steps, tolerance=adapt_tolerance)
        self.overlap_optimizer = overlap_optimizer
        self.gather_on_teardown = gather_on_teardown
        self.gather_limit = gather_limit
        self._slot = assembly.EngineSlot()
        """The engine, its store, and where the module's weights are between calls."""
        self._checkpointing: list[torch.nn.Module] = []
        """Modules whose activation checkpointing is off during this ``trainer.*`` call."""
        self.plan: Plan | None = None
        """The plan in force (None when the placement was given or no plan could be made)."""
        self.plan_history: list[Plan] = []
        """Every plan applied in this run, first to last."""
        self.plan_metrics: dict[str, float] = self._adapt.metrics
        """Predicted and measured seconds per step after warm-up (``self.log``-able)."""
        self.store_config = store
        self.placement = placement
        self.nvme_path = nvme_path
        self.compute_dtype = compute_dtype
        self.overrides = overrides
        self.job = job
        self.hardware = hardware

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

    @property
    def _tmpdir(self) -> tempfile.TemporaryDirectory[str] | None:
        return self._slot.tmpdir

    @property
    def _finalizer(self) -> weakref.finalize[Any, Any] | None:
        return self._slot.finalizer

    # -- devices and ranks --------------------------------------------------------

    @property
    @override
    def root_device(self) -> torch.device:
        """This rank's device: the Trainer's devices at the local rank (``accelerator="cpu"``
        -> cpu, ``devices=[i]`` -> cuda:i); CUDA device 0 when visible outside a Trainer."""
        devices = self.parallel_devices
        if not devices:
            return self._root_device
        if self.local_rank >= len(devices):
            raise ValueError(
                f"local rank {self.local_rank} has no device among {devices}: give the Trainer "
                "as many devices as processes per node (devices=...)"
            )
        return torch.device(devices[self.local_rank])

    @property
    def num_nodes(self) -> int:
        """Nodes of the run (the Trainer's ``num_nodes``)."""
        return self._num_nodes

    @num_nodes.setter
    def num_nodes(self, num_nodes: int) -> None:
        self._num_nodes = num_nodes

    @property
    def num_processes(self) -> int:
        """Processes (ranks, one device each) per node: the Trainer's devices."""
        return len(self.parallel_devices) if self.parallel_devices is not None else 0

    @property
    def is_distributed(self) -> bool:
        """Whether there are several ranks (then Lightning shards the data among them)."""
        return self.world_size > 1

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, int]:
        """Lightning's distributed samplers: every rank of every node, this one's rank."""
        return {"num_replicas": self.num_nodes * self.num_processes, "rank": self.global_rank}

    @property
    def process_group_backend(self) -> str:
        """Backend of the world process group (the constructor's, else by device)."""
        if self._process_group_backend is not None:
            return self._process_group_backend
        return "gloo" if self.root_device.type == "cpu" else "cpu:gloo,cuda:nccl"

    @override
    def _configure_launcher(self) -> None:
        """Lightning's script launcher for several ranks it starts itself (not torchrun/srun)."""
        assert self.cluster_environment is not None
        ranks = self.num_nodes * self.num_processes
        if ranks > 1 and not self.cluster_environment.creates_processes_externally:
            self._launcher = _SubprocessScriptLauncher(
                self.cluster_environment, self.num_processes, self.num_nodes
            )

    @override
    def setup_environment(self) -> None:
        """Set the device up; with several ranks, join the world process group."""
        super().setup_environment()
        if self.num_nodes * self.num_processes <= 1:
            return
        reset_seed()
        self.set_world_ranks()
        assert self.cluster_environment is not None
        kwargs: dict[str, Any] = {"timeout": self._timeout}
        if self.root_device.type != "cpu":
            kwargs["device_id"] = self.root_device
        created = not torch.distributed.is_initialized()
        _init_dist_connection(self.cluster_environment, self.process_group_backend, **kwargs)
        if created:
            world.destroy_group_at_exit()

    def set_world_ranks(self) -> None:
        """Global rank = node rank x processes per node + local rank; world = nodes x processes."""
        if self.cluster_environment is not None:
            self.cluster_environment.set_global_rank(
                self.node_rank * self.num_processes + self.local_rank
            )
            self.cluster_environment.set_world_size(self.num_nodes * self.num_processes)
        # Lightning's rank-zero helpers (logging, warnings) read the rank from these
        rank_zero_only.rank = utils_rank_zero_only.rank = self.global_rank  # type: ignore[attr-defined]

    @override
    def barrier(self, name: str | None = None) -> None:
        """Wait for every rank (nothing with one process)."""
        if not _distributed_is_initialized():
            return
        if torch.distributed.get_backend() == "nccl":
            torch.distributed.barrier(device_ids=[self.root_device.index])
        else:
            torch.distributed.barrier()

    @override
    def broadcast(self, obj: Any, src: int = 0) -> Any:
        """Rank ``src``'s ``obj`` (pickled) on every rank (``obj`` itself with one process)."""
        if not _distributed_is_initialized():
            return obj
        box = [obj]
        torch.distributed.broadcast_object_list(box, src, group=_group.WORLD)
        return box[0]

    @override
    def reduce(
        self, tensor: torch.Tensor | Any, group: Any | None = None, reduce_op: Any | None = "mean"
    ) -> torch.Tensor | Any:
        """``tensor`` reduced over the ranks (``"mean"``, ``"sum"``, ``"max"``... or a
        ``ReduceOp``), in place; anything but a tensor is returned as is."""
        if isinstance(tensor, torch.Tensor):
            return _sync_ddp_if_available(tensor, group, reduce_op=reduce_op)
        return tensor

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
        self._slot.take_back(module)
        self._checkpointing = activation_checkpointing_off(module)
        if self._checkpointing:
            rank_zero_info(
                f"balance_beam: the model's activation checkpointing is off during "
                f"trainer.{getattr(trainer.state.fn, 'value', 'fit')} (paged blocks are "
                "recomputed in backward by balance_beam itself) and on again after it"
            )
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
        loader = assembly.checkpoint_loader(
            module, generation=trainer.state.fn == TrainerFn.PREDICTING
        )
        if self.placement is None:
            placement = self._plan(module, len(blocks), trainer)
        else:  # the placement given, computing in the resolved dtype
            dtype = dtype_name(self.resolved_dtype())
            placement = dataclasses.replace(self.placement, compute_dtype=dtype)
        rank, ranks = self.global_rank, self.world_size
        world.make_shared_nvme_dir(self.nvme_path, ranks)
        if self.store_config is not None:
            world.make_shared_nvme_dir(self.store_config.nvme_path, ranks)
        built = assembly.build_engine(
            module, list(blocks), placement, training=training,
            device=self.root_device, loader=loader,
            store=world.rank_store_config(self.store_config, rank, ranks),
            nvme_path=world.rank_nvme_path(self.nvme_path, rank, ranks), plan=self.plan,
            comm=self.shard_comm() if ranks > 1 else None,  # one process: no collectives
        )  # fmt: skip
        self._slot.hold(built, self)

    def shard_comm(self) -> ShardComm:
        """The engine's collectives on a process group of their own (made once, on every
        rank, after the world process group: several ranks only)."""
        if self._comm is None:
            self._comm = ShardComm.from_world(timeout=self._timeout)
        return self._comm

    def _plan(self, module: pl.LightningModule, num_blocks: int, trainer: pl.Trainer) -> Placement:
        """Plan the job of this call (:mod:`bb_lightning.session`); adopt the plan."""
        hardware = self.hardware
        if self.world_size > 1 and (hardware is None or hardware == "measure"):
            hardware = self._measured_nodes()
        planning = session.PlanningSession(
            overrides=self.overrides, hardware=hardware, nvme_path=self.nvme_path,
            dtype=self.resolved_dtype(), device=self.root_device,
            world_size=self.world_size, ranks_per_node=max(1, self.num_processes),
        )  # fmt: skip
        job = session.read_job(trainer, module, self.job, world_size=self.world_size)
        if self.world_size == 1:
            placement, plan = planning.place(session.hf_model(module), job, num_blocks)
        else:  # rank 0 plans, every rank runs its placement
            placement, plan = self._planned_on_rank_zero(
                lambda: planning.place(session.hf_model(module), job, num_blocks)
            )
            if not self.is_global_zero:
                session.follow_plan(job, plan)
        if plan is not None:
            self._adopt(plan)
        return placement

    def _measured_nodes(self) -> HardwareProfile:
        """The local rank 0 of each node measures it (cached per machine) while its other
        ranks wait; every rank gets the slowest node's figures (:func:`world.slowest_node`).
        A rank whose measurement fails makes every rank raise, none waits."""
        mine: HardwareProfile | str | None = None
        if self.local_rank == 0:
            try:
                mine = session.measure_machine(self.nvme_path)
            except Exception as err:
                mine = f"rank {self.global_rank} cannot measure its node: {err}"
        gathered: list[Any] = [None] * self.world_size
        torch.distributed.all_gather_object(gathered, mine)
        failed = [g for g in gathered if isinstance(g, str)]
        if failed:
            raise RuntimeError("; ".join(failed))
        return world.slowest_node(gathered)

    def _planned_on_rank_zero(
        self, place: Callable[[], tuple[Placement, Plan | None]]
    ) -> tuple[Placement, Plan | None]:
        """``place()`` run on rank 0, its result (or its error) broadcast to every rank."""
        outcome: tuple[Placement, Plan | None] | BaseException | None = None
        failed: Exception | None = None
        if self.is_global_zero:
            try:
                outcome = place()
            except Exception as err:  # the other ranks raise it too, not wait for a plan
                failed = err
                outcome = err if _picklable(err) else RuntimeError(f"rank 0 cannot plan: {err}")
        outcome = self.broadcast(outcome)
        if failed is not None:
            raise failed
        if isinstance(outcome, BaseException):
            raise outcome
        assert outcome is not None
        return outcome

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
            optimizer.step = self._host_step(optimizer)  # type: ignore[method-assign]

    def _host_step(self, optimizer: torch.optim.Optimizer) -> Callable[..., Any]:
        def step(closure: Callable[[], Any] | None = None) -> Any:
            # Called at the accumulation boundary, before the window's last backward (in
            # the closure); the lr read now is this step's (schedulers step afterwards).
            trainer = self.lightning_module.trainer if self.lightning_module else None
            clip = clip_config(trainer)
            adamw = adamw_groups_from_optimizer(optimizer)
            engine = self.engine
            assert engine is not None
            if self.overlap_optimizer and clip.value is None and closure is not None:
                engine.begin_overlapped_step(adamw)
            loss = closure() if closure is not None else None
            engine.optimizer_step(adamw, clip)
            optimizer._opt_called = True  # type: ignore[attr-defined]  # for LR schedulers
            self._after_step()
            return loss

        # torch's LR schedulers take a step marked so as recording ``_opt_called`` (above).
        step._wrapped_by_lr_sched = True  # type: ignore[attr-defined]
        return step

    # -- measure, then adapt -------------------------------------------------------

    @override
    def on_train_batch_start(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> None:
        """Start timing the optimizer step this micro-batch belongs to; at the start of a
        window that ends in an overlapped step, start reading its optimizer state ahead."""
        engine = self.engine
        if engine is not None and not engine.timer.in_step:
            self._adapt.begin_step(engine)
            trainer = self.lightning_module.trainer if self.lightning_module else None
            if self.overlap_optimizer and clip_config(trainer).value is None:
                engine.read_state_ahead()  # this window ends in an overlapped step

    def _after_step(self) -> None:
        engine = self.engine
        assert engine is not None
        reduce_max = None if self.world_size == 1 else self._reduce_max
        replanned = self._adapt.end_step(engine, self.plan, self._log_metrics, reduce_max)
        if replanned is not None:
            self._adopt(replanned)

    def _reduce_max(self, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor`` (host) all-reduced with MAX over the ranks (the world group, on this
        rank's device: an NCCL-only world reduces no host tensors); returned on the host."""
        result: torch.Tensor = self.reduce(tensor.to(self.root_device), reduce_op="max")
        return result.cpu()

    def _log_metrics(self, metrics: Mapping[str, float]) -> None:
        trainer = self.lightning_module.trainer if self.lightning_module else None
        if trainer is not None and trainer.logger is not None:
            trainer.logger.log_metrics(dict(metrics), step=trainer.global_step)

    # -- training hooks ------------------------------------------------------

    @override
    def post_backward(self, closure_loss: torch.Tensor) -> None:
        """Move this backward's gradients into the host accumulators."""
        if self.engine is not None:
            self.engine.after_backward()

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
        if self.world_size == 1:
            ckpt.save_checkpoint(self.engine, filepath, checkpoint, weights_only=weights_only)
            return
        # several ranks: all take part in the state's gathers, rank 0 writes
        path = self.broadcast(str(filepath))
        world.check_shared_directory(
            os.path.dirname(os.path.abspath(path)),
            global_rank=self.global_rank, barrier=self.barrier, broadcast=self.broadcast,
            all_true=self.reduce_boolean_decision,
        )  # fmt: skip
        if self.is_global_zero:
            ckpt.save_checkpoint(self.engine, path, checkpoint, weights_only=weights_only)
        else:
            ckpt.follow_save(self.engine, weights_only=weights_only)

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
        calls = self._slot.calls
        if calls is not None:
            dtype = handback_dtype(self.precision_plugin.precision)  # as plain Lightning leaves it
            stopped = self._stopped_with_error()
            if stopped is None:
                calls.settle()
            else:  # a collective still queued may fail now that another rank is gone
                with contextlib.suppress(Exception):
                    calls.settle()
            agree = None if self.world_size == 1 else self.reduce_boolean_decision
            store = self._slot.store  # a StoreConfig given: its host budget caps the copy too
            room = None if self.store_config is None or store is None else budget_room(store)
            self._slot.hand_back(
                self, dtype, self.gather_on_teardown, self.gather_limit, agree,
                share=max(1, self.num_processes) if self.world_size > 1 else 1,
                stopped=stopped, room=room,
            )  # fmt: skip
        activation_checkpointing_on(self._checkpointing)
        self._checkpointing = []
        if self.cluster_environment is not None and self.world_size > 1:
            self.cluster_environment.teardown()
        self.precision_plugin.teardown()
        assert self.accelerator is not None
        self.accelerator.teardown()
        self.checkpoint_io.teardown()

    def _stopped_with_error(self) -> str | None:
        """Why the weights stay in the store when this ``trainer.*`` call of several ranks
        ended in an error (None otherwise): the other ranks may have stopped, and giving
        the weights back takes collectives with every rank."""
        module = self.lightning_module
        trainer = module.trainer if module is not None and module._trainer else None
        if self.world_size == 1 or trainer is None:
            return None
        if trainer.state.status != TrainerStatus.INTERRUPTED:
            return None
        return (
            f"the call stopped with an error on rank {self.global_rank} of {self.world_size}, "
            "so no rank gathers the weights"
        )

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
        """Register ``"balance_beam"`` unless already there (as :mod:`bb_lightning.register`
        does on importing the package)."""
        add_to(strategy_registry)


# -- helpers -----------------------------------------------------------------------------


def _engine_clips(*args: Any, **kwargs: Any) -> None:
    """Lightning's clipping of the device parameters' ``.grad`` (none under the engine)."""


def _picklable(obj: object) -> bool:
    try:
        pickle.dumps(obj)
    except Exception:
        return False
    return True


def check_start_method(start_method: str) -> None:
    """Refuse a start method other than ``"popen"`` (the script launcher, torchrun, srun)."""
    if start_method != "popen":
        raise ValueError(
            f"start_method={start_method!r}: balance_beam cannot run under {start_method}: "
            "that launcher returns the module's state_dict to the parent process, and paged "
            "weights are not in the module; use start_method='popen' (the default), torchrun "
            "or srun"
        )
