"""``Trainer(strategy="balance_beam")``: Lightning lifecycle glue over the paging engine.

The strategy never moves the whole model to the device. At setup it finds the
repeated blocks, decides a :class:`~bb_lightning.engine.pager.Placement`
(given, from the planner, or a default), opens a
:class:`storage.store.TieredStore` and hands everything to
:class:`~bb_lightning.engine.trainer_engine.TrainingEngine`; the engine keeps
only the embedding, final norm and head on the device. Lightning's torch
optimizer stays for its bookkeeping (learning-rate schedulers, hooks), but its
``step`` runs the engine's host AdamW.
"""

from __future__ import annotations

import contextlib
import tempfile
from collections.abc import Callable, Generator, Mapping
from typing import Any, Literal

import lightning.pytorch as pl
import torch
from lightning.pytorch.strategies import SingleDeviceStrategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities import rank_zero_info
from transformers import PreTrainedModel

from bb_lightning.engine.pager import Placement
from bb_lightning.engine.trainer_engine import (
    ClipConfig,
    TrainingEngine,
    adamw_from_optimizer,
    required_budgets,
)
from bb_lightning.planner import FitJob, ModelProfile, PlanOverrides, make_plan, measure, preset
from bb_lightning.structure import find_block_list
from storage.store import StoreConfig, TieredStore
from storage.tiers import Tier

__all__ = ["BalanceBeamStrategy"]

ComputeDtype = Literal["bf16", "fp32"]
_DTYPES: dict[str, torch.dtype] = {"bf16": torch.bfloat16, "fp32": torch.float32}
_SLACK = 1 << 20
"""Bytes added to each automatically sized store budget (allocator alignment)."""


class BalanceBeamStrategy(SingleDeviceStrategy):
    """Single-device strategy that pages transformer blocks through a three-tier store."""

    strategy_name = "balance_beam"

    def __init__(
        self,
        *,
        store: StoreConfig | None = None,
        placement: Placement | None = None,
        nvme_path: str | None = None,
        compute_dtype: ComputeDtype | None = None,
        overrides: PlanOverrides | None = None,
        job: FitJob | None = None,
        hardware: str | None = None,
        accelerator: pl.accelerators.Accelerator | None = None,
        checkpoint_io: Any | None = None,
        precision_plugin: Any | None = None,
    ) -> None:
        """Configure the strategy.

        Args:
            store: budgets (bytes) and NVMe directory of the tensor store; None sizes
                the budgets from the placement (what it needs, plus 1 MiB each).
            placement: per-block homes and prefetch depth; None asks the planner.
            nvme_path: NVMe directory when ``store`` is None and the placement uses NVMe
                (None: a temporary directory, removed at close).
            compute_dtype: ``"bf16"`` or ``"fp32"``; None follows the Trainer's precision
                (``"bf16-true"``/``"bf16-mixed"`` -> bf16, ``"32-true"`` -> fp32).
            overrides: passed to the planner; without ``job`` only ``weights_tier``,
                ``master_tier`` and ``prefetch_depth`` are read (default host, host, 1).
            job: the fit job (sequence length, global batch) for the planner; with it and
                no ``placement`` the planner decides the placement and its explanation is
                printed. The Trainer's batch size and accumulation stay the caller's.
            hardware: planner hardware profile: a preset name or ``"measure"`` (default).
        """
        device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
        super().__init__(
            device=device,
            accelerator=accelerator,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
        )
        if compute_dtype is not None and compute_dtype not in _DTYPES:
            raise ValueError(f"compute_dtype={compute_dtype!r}: use 'bf16' or 'fp32'")
        self.store_config = store
        self.placement = placement
        self.nvme_path = nvme_path
        self.compute_dtype = compute_dtype
        self.overrides = overrides
        self.job = job
        self.hardware = hardware
        self.engine: TrainingEngine | None = None
        self.store: TieredStore | None = None
        self._tmpdir: tempfile.TemporaryDirectory[str] | None = None

    # -- model construction and setup ------------------------------------------

    @contextlib.contextmanager
    def tensor_init_context(self, empty_init: bool | None = None) -> Generator[None, None, None]:
        """Build the model on the host in fp32: the engine pages it to the device."""
        yield

    def model_to_device(self) -> None:
        """Nothing: the engine moves only the parameters outside the blocks."""

    def setup(self, trainer: pl.Trainer) -> None:
        """Build the engine once per module; set up Lightning's optimizer for bookkeeping."""
        assert self.accelerator is not None
        self.accelerator.setup(trainer)
        module = self.lightning_module
        assert module is not None
        if self.engine is None or self.engine.model is not module:
            self._build_engine(module)
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()

    def resolved_dtype(self) -> torch.dtype:
        """The compute dtype: the constructor's, else the Trainer's precision."""
        if self.compute_dtype is not None:
            return _DTYPES[self.compute_dtype]
        flag = str(self.precision_plugin.precision)
        if flag.startswith("bf16"):
            return torch.bfloat16
        if flag in ("32-true", "32"):
            return torch.float32
        raise ValueError(
            f"precision={flag!r} is not supported by balance_beam: use 'bf16-true', "
            "'bf16-mixed' or '32-true'"
        )

    def _build_engine(self, module: pl.LightningModule) -> None:
        self.close()
        _, blocks = find_block_list(module)
        dtype = self.resolved_dtype()
        placement = self.placement or self._plan(module, len(blocks))
        numels = [sum(p.numel() for p in b.parameters()) for b in blocks]
        in_blocks = {id(p) for b in blocks for p in b.parameters()}
        rest = sum(p.numel() for p in module.parameters() if id(p) not in in_blocks)
        self.store = TieredStore(self._store_config(numels, rest, placement, dtype))
        self.engine = TrainingEngine(
            module,
            list(blocks),
            self.store,
            placement,
            compute_dtype=dtype,
            device=self.root_device,
        )

    def _plan(self, module: pl.LightningModule, num_blocks: int) -> Placement:
        if self.job is not None:
            return self._plan_with_planner(module)
        tiers = [getattr(self.overrides, k, None) for k in ("weights_tier", "master_tier")]
        depth = getattr(self.overrides, "prefetch_depth", None) or 1
        if tiers[0] is None:
            rank_zero_info(
                "balance_beam: no placement given; paging every block from host memory "
                "(pass placement= or overrides=PlanOverrides(weights_tier=...))"
            )
        return Placement.uniform(
            num_blocks,
            weights=Tier(tiers[0] or Tier.HOST),
            master=Tier(tiers[1] or Tier.HOST),
            prefetch_depth=depth,
        )

    def _plan_with_planner(self, module: pl.LightningModule) -> Placement:
        nets = [m for m in module.modules() if isinstance(m, PreTrainedModel)]
        if not nets or self.job is None:
            raise ValueError(
                f"{type(module).__name__} holds no Hugging Face model to profile: pass placement="
            )
        name = self.hardware or "measure"
        hardware = measure() if name == "measure" else preset(name)
        plan = make_plan(
            ModelProfile.from_module(nets[0]), hardware, self.job, overrides=self.overrides
        )
        rank_zero_info(plan.explain())
        return Placement(
            weights=tuple(plan.weights),
            master=tuple(plan.master),
            prefetch_depth=plan.prefetch_depth,
        )

    def _store_config(
        self, numels: list[int], rest: int, placement: Placement, dtype: torch.dtype
    ) -> StoreConfig:
        if self.store_config is not None:
            return self.store_config
        need = required_budgets(numels, rest, placement, dtype)
        path = self.nvme_path
        if need[Tier.NVME] and path is None:
            self._tmpdir = tempfile.TemporaryDirectory(prefix="balance-beam-")
            path = self._tmpdir.name
        return StoreConfig(
            device_budget=need[Tier.DEVICE] + _SLACK,
            host_budget=need[Tier.HOST] + _SLACK,
            nvme_path=path if need[Tier.NVME] else None,
            nvme_budget=need[Tier.NVME] + _SLACK if need[Tier.NVME] else 0,
            device=str(self.root_device),
        )

    def setup_optimizers(self, trainer: pl.Trainer) -> None:
        """Lightning's optimizers, whose ``step`` runs the engine's host AdamW."""
        super().setup_optimizers(trainer)
        for optimizer in self.optimizers:
            adamw_from_optimizer(optimizer)
            optimizer.step = self._host_step(optimizer)  # type: ignore[method-assign]

    def _host_step(self, optimizer: torch.optim.Optimizer) -> Callable[..., Any]:
        def step(closure: Callable[[], Any] | None = None) -> Any:
            loss = closure() if closure is not None else None
            trainer = self.lightning_module.trainer if self.lightning_module else None
            clip = ClipConfig(
                value=None if trainer is None else trainer.gradient_clip_val,
                algorithm=str(getattr(trainer, "gradient_clip_algorithm", None) or "norm"),
            )
            assert self.engine is not None
            self.engine.optimizer_step(adamw_from_optimizer(optimizer), clip)
            optimizer._opt_called = True  # type: ignore[attr-defined]  # for LR schedulers
            return loss

        return step

    # -- training hooks ------------------------------------------------------

    def post_backward(self, closure_loss: torch.Tensor) -> None:
        """Move this backward's gradients into the host accumulators."""
        if self.engine is not None:
            self.engine.after_backward()

    def on_train_start(self) -> None:
        """Print the placement before the first step (rank zero)."""
        if self.engine is not None:
            rank_zero_info(f"balance_beam placement: {self.engine.pager.placement}")

    # -- checkpoints ------------------------------------------------------------

    def lightning_module_state_dict(self) -> dict[str, Any]:
        """Full state dict with fp32 master weights, so ordinary checkpoints work."""
        if self.engine is None:
            return super().lightning_module_state_dict()
        return dict(self.engine.state_dict())

    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        """Load a full state dict into the engine (or the module before setup)."""
        if self.engine is None:
            super().load_model_state_dict(checkpoint, strict=strict)
        else:
            self.engine.load_state_dict(checkpoint["state_dict"])

    # -- teardown -----------------------------------------------------------

    def teardown(self) -> None:
        """Release paged blocks; the store stays open for the next ``trainer.*`` call."""
        if self.engine is not None:
            self.engine.grads.wait()
            self.engine.pager.release_all_except(())
        self.precision_plugin.teardown()
        assert self.accelerator is not None
        self.accelerator.teardown()
        self.checkpoint_io.teardown()

    def close(self) -> None:
        """Remove the engine's wrappers and close the store (NVMe lock released)."""
        if self.engine is not None:
            self.engine.close()
            self.engine = None
        if self.store is not None:
            self.store.close()
            self.store = None
        if self._tmpdir is not None:
            self._tmpdir.cleanup()
            self._tmpdir = None

    @classmethod
    def register_strategies(cls, strategy_registry: Any) -> None:
        """Register ``"balance_beam"`` unless already there."""
        if cls.strategy_name not in strategy_registry:
            strategy_registry.register(
                cls.strategy_name, cls, description="pages blocks through a tiered store"
            )
