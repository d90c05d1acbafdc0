"""The engine factory: the store sized for a placement, and the engine that executes it."""

from __future__ import annotations

import tempfile
import weakref
from collections.abc import Mapping
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.trainer.states import TrainerFn

from bb_lightning.engine import checkpoint as ckpt
from bb_lightning.engine.inference import InferenceEngine, weights_budgets
from bb_lightning.engine.pager import Placement
from bb_lightning.engine.trainer_engine import (
    ParamLoader,
    TrainingEngine,
    check_budgets,
    param_counts,
    required_budgets,
)
from bb_lightning.hf_load import HFCheckpoint, check_generation, check_supported
from bb_lightning.module import CausalLMModule
from bb_lightning.planner import (
    PredictJob,
)
from bb_lightning.session import _hf_model
from bb_lightning.structure import find_block_list
from storage.io import ALIGNMENT
from storage.store import StoreConfig, TieredStore
from storage.tiers import Tier

_SLACK = 1 << 20
"""Bytes added to each automatically sized store budget (allocator alignment)."""


class _AssemblyMixin:
    """Methods of :class:`~bb_lightning.strategy.BalanceBeamStrategy`."""

    def _build_engine(self, module: pl.LightningModule, trainer: pl.Trainer) -> None:
        self.close()
        _, blocks = find_block_list(module)
        dtype = self.resolved_dtype()
        loader = checkpoint_loader(module)
        placement = self.placement or self._plan(module, len(blocks), trainer)
        numels, rest, frozen = param_counts(module, list(blocks))  # trainable / frozen
        config = self._store_config(numels, rest, placement, dtype, frozen)
        need = required_budgets(numels, rest, placement, dtype, frozen)
        check_budgets(need, _arena_bytes(config))
        self.store = TieredStore(config)
        self._finalizer = weakref.finalize(self, _release, self.store, self._tmpdir)
        try:
            self.engine = TrainingEngine(
                module,
                list(blocks),
                self.store,
                placement,
                compute_dtype=dtype,
                device=self.root_device,
                loader=loader,
            )
        except BaseException:
            self.close()
            raise

    def _build_inference(self, module: pl.LightningModule, trainer: pl.Trainer) -> None:
        """The weights-only engine: compute-dtype block weights in the store, nothing else."""
        self.close()
        _, blocks = find_block_list(module)
        dtype = self.resolved_dtype()
        loader = checkpoint_loader(module, generation=trainer.state.fn == TrainerFn.PREDICTING)
        placement = self.placement or self._plan(module, len(blocks), trainer)
        need = weights_budgets([sum(p.numel() for p in b.parameters()) for b in blocks],
                               placement, dtype)  # fmt: skip
        config = self.store_config
        if config is None:
            path = self.nvme_path
            if need[Tier.NVME] and path is None:
                self._tmpdir = tempfile.TemporaryDirectory(prefix="balance-beam-")
                path = self._tmpdir.name
            config = StoreConfig(
                device_budget=need[Tier.DEVICE] + _SLACK,
                host_budget=need[Tier.HOST] + _SLACK,
                nvme_path=path if need[Tier.NVME] else None,
                nvme_budget=need[Tier.NVME] + _SLACK if need[Tier.NVME] else 0,
                device=str(self.root_device),
            )
        check_budgets(need, _arena_bytes(config))
        self.store = TieredStore(config)
        self._finalizer = weakref.finalize(self, _release, self.store, self._tmpdir)
        try:
            self.inference = InferenceEngine(module, list(blocks), self.store, placement,
                                             compute_dtype=dtype, device=self.root_device,
                                             loader=loader)  # fmt: skip
        except BaseException:
            self.close()
            raise
        if isinstance(module, CausalLMModule):  # where its generator keeps the KV cache
            module.kv_cache_tier = None if self.plan is None else self.plan.kv_cache
        job = None if self.plan is None else self.plan.job
        if isinstance(job, PredictJob):  # prefill in the planned micro-batches
            assert self.plan is not None
            self.inference.paged.max_tokens = self.plan.micro_batch * job.prompt_len

    def _store_config(
        self,
        numels: list[int],
        rest: int,
        placement: Placement,
        dtype: torch.dtype,
        frozen: list[int] | None = None,
    ) -> StoreConfig:
        if self.store_config is not None:
            return self.store_config
        need = required_budgets(numels, rest, placement, dtype, frozen)
        if self.plan is not None:  # room for re-plans, within what the plan may use
            n = len(numels)
            most = {
                t: required_budgets(
                    numels,
                    rest,
                    Placement.uniform(n, weights=t, master=t, prefetch_depth=n),
                    dtype,
                    frozen,
                )[t]
                for t in Tier
            }
            for mem in self.plan.memory:
                need[mem.tier] = max(need[mem.tier], min(most[mem.tier], mem.budget))
            if self.nvme_path is None and Tier.NVME not in (*placement.weights, *placement.master):
                need[Tier.NVME] = 0
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


def _release(store: TieredStore, tmpdir: tempfile.TemporaryDirectory[str] | None) -> None:
    """Close ``store`` and remove its temporary directory (also run at garbage collection)."""
    store.close()
    if tmpdir is not None:
        tmpdir.cleanup()


def _arena_bytes(config: StoreConfig) -> dict[Tier, int]:
    """The bytes each tier of a store with ``config`` holds (arenas round down)."""
    return {
        Tier.DEVICE: config.device_budget - config.device_budget % ALIGNMENT,
        Tier.HOST: config.host_budget - config.host_budget % ALIGNMENT,
        Tier.NVME: config.nvme_budget,
    }


def _load_inference(engine: InferenceEngine, state_dict: Mapping[str, Any]) -> None:
    """Weights of a plain state dict or a checkpoint directory into the inference engine."""
    if isinstance(state_dict, ckpt.CheckpointStateDict):
        path = state_dict.path
        engine.load_weights(lambda key: ckpt.read_array(path, "master", key))
        for key, value in state_dict.buffers.items():
            engine.model.get_buffer(key).copy_(value)
    else:
        engine.load_state_dict(state_dict)


def checkpoint_loader(module: torch.nn.Module, *, generation: bool = False) -> ParamLoader | None:
    """Reads meta-device parameters from the module's local checkpoint (safetensors or .bin).

    None when no parameter is on the meta device (the engine reads the parameters).
    Raises ``ValueError`` (one line) for a Hugging Face model balance_beam cannot serve
    (:func:`~bb_lightning.hf_load.check_supported`; with ``generation``, also
    :func:`~bb_lightning.hf_load.check_generation`).
    """
    net = _hf_model(module)
    streaming = any(p.is_meta for p in module.parameters())
    if net is not None:
        check_supported(net.config, streaming=streaming)
        if generation:
            check_generation(net)
    if not streaming:
        return None
    source = getattr(module, "checkpoint_dir", None)
    if net is None or source is None:
        raise ValueError(
            f"{type(module).__name__} has parameters on the meta device but no Hugging Face "
            "model with a local checkpoint_dir to read them from: build the model with weights"
        )
    reader = HFCheckpoint(source, net)  # transformers' key mapping and conversions, peft names
    keys = {id(p): key for key, p in net.named_parameters()}
    # A parameter built with a value (a LoRA adapter beside a meta base) keeps it.
    return lambda p: reader.get(keys[id(p)]) if p.is_meta else p.detach()
