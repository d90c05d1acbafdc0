"""The engine factory: a store sized for a placement, and the engine that executes it.

:func:`build_engine` opens a :class:`storage.store.TieredStore` (the given
:class:`~storage.store.StoreConfig`, or one sized from the placement: what it needs plus
1 MiB per tier, and for a planned fit the room the plan may grow into on a re-plan) and
builds the :class:`~bb_lightning.engine.trainer_engine.TrainingEngine` of ``fit`` or the
weights-only :class:`~bb_lightning.engine.inference.InferenceEngine` of ``predict`` /
``validate`` (compute-dtype block weights in the store, no master weights, moments or
gradient accumulators). The strategy's hooks ask the engine through one protocol,
:class:`Engine` (:func:`engine_calls`), whichever kind the call built.
"""

from __future__ import annotations

import dataclasses
import tempfile
import weakref
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import Tensor, nn

from bb_lightning.engine import checkpoint as ckpt
from bb_lightning.engine.budgets import (
    check_budgets,
    frozen_shard_counts,
    param_counts,
    required_budgets,
    shard_counts,
    weights_budgets,
)
from bb_lightning.engine.chunked import boundary_budgets
from bb_lightning.engine.flat import ParamLoader, torch_dtype
from bb_lightning.engine.inference import InferenceEngine, PieceSource, external_blocks
from bb_lightning.engine.kv_paged import paged_kv_budgets
from bb_lightning.engine.shard import ShardComm
from bb_lightning.engine.swapped import SWAP_BYTES_PER_ELEMENT, swap_budgets
from bb_lightning.engine.trainer_engine import TrainingEngine
from bb_lightning.hf.converted import ConvertedStore, StoreCheckpoint
from bb_lightning.hf.hf_load import HFCheckpoint, check_generation, check_supported
from bb_lightning.hf.structure import check_block_calls
from bb_lightning.module import CausalLMModule
from bb_lightning.placement import Placement
from bb_lightning.planner import FitJob, Plan, PredictJob
from bb_lightning.strategy.handback import HollowGuard, fits_host, hand_back, param_bytes, take_back
from bb_lightning.strategy.session import hf_model
from storage.deferred import double_requested
from storage.external import FilePiece
from storage.store import StoreConfig, TieredStore
from storage.tiers import Tier

__all__ = [
    "AnyEngine",
    "Assembly",
    "Engine",
    "EngineSlot",
    "as_scratch",
    "build_engine",
    "checkpoint_loader",
    "engine_calls",
    "release",
    "store_config",
]

AnyEngine = TrainingEngine | InferenceEngine
"""The engine of a Trainer call: training (fit), or weights only (predict, validate)."""

_SLACK = 1 << 20
"""Bytes added to each automatically sized store budget (allocator alignment)."""


@dataclass(frozen=True)
class Assembly:
    """An engine, the store it pages through, and the store's temporary NVMe directory."""

    engine: AnyEngine
    store: TieredStore
    tmpdir: tempfile.TemporaryDirectory[str] | None


def build_engine(
    module: nn.Module,
    blocks: Sequence[nn.Module],
    placement: Placement,
    *,
    training: bool,
    device: torch.device,
    loader: ParamLoader | None,
    store: StoreConfig | None = None,
    nvme_path: str | None = None,
    plan: Plan | None = None,
    comm: ShardComm | None = None,
    open_store: Callable[[StoreConfig], TieredStore] = TieredStore,
    boundary_numel: int = 0,
) -> Assembly:
    """Open the store for ``placement`` and build the engine of ``module``'s ``blocks``.

    ``store`` None sizes the budgets (:func:`store_config`; with ``plan``, a training
    store keeps room for its re-plans). ``comm``: data parallelism, the training
    engine stores this rank's shard of the optimizer state (the weights-only engine
    needs no collectives and ignores it). ``open_store`` opens the store of the sized
    config (a dry run's :class:`storage.dry.DryStore`). Raises ``ValueError`` when the
    budgets cannot hold the placement; a failure leaves nothing open. The store holds
    room for the boundary inputs the placement keeps off the device: ``boundary_numel``
    elements per block, else a plan's micro-batch x sequence x width.
    """
    external: dict[int, list[FilePiece]] = {}
    if not training and loader is not None:
        check_store_dtype(module, placement)
        external = external_blocks(blocks, placement, store_pieces(module, placement))
    shards = 1 if comm is None or not training else comm.world_size
    if training:
        numels, rest, frozen = param_counts(module, list(blocks))  # trainable / frozen
        parts = shard_counts(module, list(blocks), shards) if shards > 1 else ([], 0)
        frozen_parts = frozen_shard_counts(list(blocks), shards) if shards > 1 else []
        need = required_budgets(numels, rest, placement, frozen, shards=shards,
                                shard_numels=parts[0], shard_rest=parts[1],
                                shard_frozen=frozen_parts)  # fmt: skip
        cpu = device.type == "cpu" and not double_requested(getattr(store, "cuda_double", None))
        need = _with_boundaries(need, placement, plan, boundary_numel, cpu)
        sized = _replan_room(need, numels, rest, placement, frozen, plan, nvme_path,
                             (shards, parts))  # fmt: skip
    else:
        need = weights_budgets([sum(p.numel() for p in b.parameters()) for b in blocks],
                               placement, external)  # fmt: skip
        kv = paged_kv_budgets(placement, _kv_sizes(plan), device, store)
        need = need if kv is None else {t: need[t] + kv[t] for t in Tier}
        sized = need
    config, tmpdir = (store, None) if store is not None else store_config(sized, nvme_path, device)
    config = as_scratch(config, blocks, placement, training=training)
    opened: TieredStore | None = None
    try:
        check_budgets(need, _arena_bytes(config))
        opened = open_store(config)
        engine: AnyEngine
        if training:
            engine = TrainingEngine(
                module, list(blocks), opened, placement, device=device, loader=loader, comm=comm
            )
        else:
            engine = InferenceEngine(
                module, list(blocks), opened, placement, device=device, loader=loader,
                external=external,
            )  # fmt: skip
    except BaseException:
        if opened is not None:
            opened.close()
        if tmpdir is not None:
            tmpdir.cleanup()
        raise
    if isinstance(engine, InferenceEngine):
        kv_store = opened if paged_kv_budgets(placement, _kv_sizes(plan), device, store) else None
        _configure_inference(module, placement, config.nvme_path or nvme_path, kv_store)
    return Assembly(engine, opened, tmpdir)


def _kv_sizes(plan: Plan | None) -> tuple[int, int, int, int] | None:
    """A generation plan's concurrent sequences, cache positions, bf16 KV bytes per token
    and layer, and layers (None: no generation plan)."""
    if plan is None or not isinstance(plan.job, PredictJob):
        return None
    model = plan.model
    return plan.concurrent_seqs, plan.job.cache_len, model.kv_bytes_per_token, model.num_blocks


def store_pieces(module: nn.Module, placement: Placement) -> PieceSource | None:
    """Where the module's converted store (``module.converted``) holds each meta parameter's
    bytes in the compute dtype: the weights-only engine pages NVMe-homed blocks straight
    from those chunk files (no copy in the run's NVMe tier, the store never written).
    None for a module not read from a converted store."""
    store: ConvertedStore | None = getattr(module, "converted", None)
    net = hf_model(module)
    if store is None or net is None:
        return None
    reader = StoreCheckpoint(store, net)
    keys = {id(p): key for key, p in net.named_parameters()}
    dtype = torch_dtype(placement)
    return lambda p: reader.piece(keys[id(p)], dtype) if p.is_meta and id(p) in keys else None


def check_store_dtype(module: nn.Module, placement: Placement) -> None:
    """``ValueError`` (one line) when the module's weights come from a converted store whose
    floating-point dtype is not the one ``placement`` computes in: the weights of ``predict``
    and ``validate`` are served as stored, never cast into a second copy."""
    store: ConvertedStore | None = getattr(module, "converted", None)
    if store is None or store.dtype == placement.compute_dtype:
        return
    want = placement.compute_dtype
    raise ValueError(
        f"store {store.path} holds {store.describe()}, but the run computes in {want}: run "
        f"with the store's dtype (precision, compute_dtype), or convert the model again with "
        f"--dtype {_SHORT.get(want, want)} into another directory"
    )


_SHORT = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}
"""The ``convert --dtype`` name of each compute dtype."""


def store_config(
    need: Mapping[Tier, int], nvme_path: str | None, device: torch.device
) -> tuple[StoreConfig, tempfile.TemporaryDirectory[str] | None]:
    """A store holding ``need`` bytes per tier (plus 1 MiB each), and the temporary NVMe
    directory made when NVMe bytes are needed but ``nvme_path`` is None."""
    path, tmpdir = nvme_path, None
    if need[Tier.NVME] and path is None:
        tmpdir = tempfile.TemporaryDirectory(prefix="balance-beam-")
        path = tmpdir.name
    config = StoreConfig(
        device_budget=need[Tier.DEVICE] + _SLACK,
        host_budget=need[Tier.HOST] + _SLACK,
        nvme_path=path if need[Tier.NVME] else None,
        nvme_budget=need[Tier.NVME] + _SLACK if need[Tier.NVME] else 0,
        device=None if device.type == "meta" else str(device),  # meta: a dry run's store
    )
    return config, tmpdir


def as_scratch(
    config: StoreConfig, blocks: Sequence[nn.Module], placement: Placement, *, training: bool
) -> StoreConfig:
    """``config`` with its NVMe directory taken as the run's scratch (:mod:`storage.scratch`):
    the engines write every tensor they store before reading it, so the last run's arrays
    there are removed whatever they were built for, and a directory holding anything else
    (a converted store, a checkpoint, a user's files) is refused untouched. The marker
    records what this run built it for: the engine, the compute dtype, each block's
    parameter count and the placement."""
    if config.nvme_path is None:
        return config
    built_for = {
        "engine": "training" if training else "weights only",
        "compute_dtype": placement.compute_dtype,
        "block_params": [sum(p.numel() for p in b.parameters()) for b in blocks],
        "placement": placement.to_dict(),
    }
    return dataclasses.replace(config, nvme_scratch=built_for)


def _replan_room(
    need: dict[Tier, int],
    numels: list[int],
    rest: int,
    placement: Placement,
    frozen: list[int],
    plan: Plan | None,
    nvme_path: str | None,
    sharding: tuple[int, tuple[list[int], int]] = (1, ([], 0)),
) -> dict[Tier, int]:
    """``need`` raised by the plan's headroom in each tier (room for re-plans), within
    what any placement of these blocks may use.

    Not to the plan's budgets: a tier's budget also pays for what the plan puts there
    outside the store (on the device the activations, logits, gradients in flight and
    the weights outside the blocks), and the store allocates its device arena whole. A
    device arena sized to the budget left no room for the activations: on an H200 capped
    at 24 GiB a plan of 17.95 GiB (2 GiB of it in the store) held an 18.4 GiB arena and
    ran out of device memory in its first forward.
    """
    need = dict(need)
    if plan is not None:  # room for re-plans, within what the plan may use
        n = len(numels)
        most = {
            t: required_budgets(
                numels,
                rest,
                Placement.uniform(
                    n,
                    weights=t,
                    master=t,
                    prefetch_depth=n,
                    compute_dtype=placement.compute_dtype,
                ),
                frozen,
                shards=sharding[0],
                shard_numels=sharding[1][0],
                shard_rest=sharding[1][1],
            )[t]
            for t in Tier
        }
        for mem in plan.memory:
            room = need[mem.tier] + max(mem.headroom, 0)
            need[mem.tier] = max(need[mem.tier], min(most[mem.tier], room))
        homes = (*placement.weights, *placement.master, placement.boundaries)
        if nvme_path is None and Tier.NVME not in homes:
            need[Tier.NVME] = 0
    return need


def _with_boundaries(
    need: dict[Tier, int], placement: Placement, plan: Plan | None, numel: int, in_place: bool
) -> dict[Tier, int]:
    """``need`` plus the boundary inputs of one micro-batch kept off the device
    (:func:`~bb_lightning.engine.chunked.boundary_budgets`): ``numel`` elements per
    block, or with ``numel`` 0 the plan's ``micro_batch x seq_len x hidden_size``; and the
    swapped blocks' saved activations (:func:`~bb_lightning.engine.swapped.swap_budgets`):
    :data:`~bb_lightning.engine.swapped.SWAP_BYTES_PER_ELEMENT` per ``numel`` element and
    dtype byte, or the plan's activation bytes per token (bf16, scaled to the dtype), in
    the plan's row chunks (``in_place``: none, a CPU device keeps them where made)."""
    swap = chunk = numel * placement.compute_bytes * SWAP_BYTES_PER_ELEMENT
    if not numel and plan is not None and isinstance(plan.job, FitJob):
        numel = plan.micro_batch * plan.job.seq_len * plan.model.hidden_size
        per_seq = plan.job.seq_len * plan.model.swap_bytes_per_token
        per_seq *= max(1, placement.compute_bytes // 2)  # bf16 bytes in the profile
        swap = plan.micro_batch * per_seq
        chunk = min(placement.chunk_rows or plan.micro_batch, plan.micro_batch) * per_seq
    room = boundary_budgets(placement, numel)
    saved = swap_budgets(placement, 0 if in_place else swap, chunk)
    return {t: need[t] + room[t] + saved[t] for t in Tier}


def _configure_inference(
    module: nn.Module, placement: Placement, nvme_path: str | None, kv_store: TieredStore | None
) -> None:
    """The placement's KV-cache tier and decode-attention tier into the module (its generator
    keeps the cache there and attends there; the blocks' caches homed on NVMe go under
    ``nvme_path``/kv-cache, one on the host beside the device's attention in ``kv_store``;
    the engine takes the prefill chunk from the placement itself)."""
    if isinstance(module, CausalLMModule):
        module.kv_store = kv_store
        module.kv_cache_tier = placement.kv_cache
        module.decode_attention_tier = placement.decode_attention
        kv_dir = None if nvme_path is None else str(Path(nvme_path) / "kv-cache")
        module.kv_cache_nvme = (placement.kv_cache_nvme_blocks, kv_dir)


def release(store: TieredStore, tmpdir: tempfile.TemporaryDirectory[str] | None) -> None:
    """Close ``store`` and remove its temporary directory (also run at garbage collection)."""
    store.close()
    if tmpdir is not None:
        tmpdir.cleanup()


def _arena_bytes(config: StoreConfig) -> dict[Tier, int]:
    """The bytes each tier of a store with ``config`` holds (arenas round down)."""
    return dict(config.budgets)


# -- the checkpoint hooks, on either engine ---------------------------------------------


class Engine(Protocol):
    """What the strategy's hooks ask of the engine of a ``trainer.*`` call, whichever kind
    it is (:func:`engine_calls` gives it for the training and the weights-only engine);
    another engine implements these and the strategy needs no change."""

    def checkpoint_state_dict(self) -> Mapping[str, Tensor]:
        """The module's state dict as checkpoints hold it (fp32 weights)."""
        ...

    def load_weights(self, state_dict: Mapping[str, Any]) -> None:
        """Weights of a plain state dict or a checkpoint directory's into the engine."""
        ...

    def load_optimizer(self, state_dict: Any) -> None:
        """AdamW moments and step count of a checkpoint directory (where the engine has any)."""
        ...

    def settle(self) -> None:
        """Finish pending copies and release the paged blocks (the end of a call)."""
        ...


@dataclass(frozen=True)
class _TrainingCalls:
    engine: TrainingEngine

    def checkpoint_state_dict(self) -> Mapping[str, Tensor]:
        # fp32 master weights read lazily from the store
        return self.engine.lazy_state_dict()

    def load_weights(self, state_dict: Mapping[str, Any]) -> None:
        if isinstance(state_dict, ckpt.CheckpointStateDict):
            ckpt.restore_weights(self.engine, state_dict)
        else:
            self.engine.load_state_dict(state_dict)

    def load_optimizer(self, state_dict: Any) -> None:
        if isinstance(state_dict, ckpt.CheckpointStateDict):
            ckpt.restore_optimizer(self.engine, state_dict)

    def settle(self) -> None:
        self.engine.grads.wait()
        self.engine.pager.release_all_except(())


@dataclass(frozen=True)
class _InferenceCalls:
    engine: InferenceEngine

    def checkpoint_state_dict(self) -> Mapping[str, Tensor]:
        # fp32 host copies of the compute-dtype weights
        return self.engine.state_dict()

    def load_weights(self, state_dict: Mapping[str, Any]) -> None:
        if isinstance(state_dict, ckpt.CheckpointStateDict):
            path = state_dict.path
            self.engine.load_weights(lambda key: ckpt.read_array(path, "master", key))
            for key, value in state_dict.buffers.items():
                self.engine.model.get_buffer(key).copy_(value)
        else:
            self.engine.load_state_dict(state_dict)

    def load_optimizer(self, state_dict: Any) -> None:
        """A weights-only engine has no optimizer state."""

    def settle(self) -> None:
        self.engine.pager.release_all_except(())


def engine_calls(engine: AnyEngine) -> Engine:
    """The :class:`Engine` calls of a training or weights-only engine."""
    if isinstance(engine, TrainingEngine):
        return _TrainingCalls(engine)
    return _InferenceCalls(engine)


def checkpoint_loader(module: torch.nn.Module, *, generation: bool = False) -> ParamLoader | None:
    """Reads meta-device parameters from the module's local checkpoint (safetensors or .bin)
    or converted store (``module.converted``, read-only).

    None when no parameter is on the meta device (the engine reads the parameters).
    Raises ``ValueError`` (one line) for a Hugging Face model balance_beam cannot serve
    (:func:`~bb_lightning.hf.hf_load.check_supported`; with ``generation``, also
    :func:`~bb_lightning.hf.hf_load.check_generation`).
    """
    net = hf_model(module)
    streaming = any(p.is_meta for p in module.parameters())
    if net is not None:
        check_supported(net.config, streaming=streaming)
        if generation:
            check_generation(net)
        check_block_calls(net)  # each block once per pass, in order
    if not streaming:
        return None
    source = getattr(module, "checkpoint_dir", None)
    if net is None or source is None:
        raise ValueError(
            f"{type(module).__name__} has parameters on the meta device but no Hugging Face "
            "model with a local checkpoint_dir to read them from: build the model with weights"
        )
    store: ConvertedStore | None = getattr(module, "converted", None)
    reader: HFCheckpoint | StoreCheckpoint
    if store is not None:  # a converted store: read-only, tensor by tensor
        reader = StoreCheckpoint(store, net)
    else:  # transformers' key mapping and conversions, peft names
        reader = HFCheckpoint(source, net)
    keys = {id(p): key for key, p in net.named_parameters()}
    # A parameter built with a value (a LoRA adapter beside a meta base) keeps it.
    return lambda p: reader.get(keys[id(p)]) if p.is_meta else p.detach()


# -- the engine between trainer.* calls -------------------------------------------------


class EngineSlot:
    """The engine a strategy keeps between ``trainer.*`` calls, its store, and where the
    module's weights are after a call.

    The engine and its store outlive ``teardown`` so that ``fit``, ``validate`` and ``fit``
    again reuse them (AdamW moments and step count kept). At the end of a call
    :meth:`hand_back` gives the module its weights back (:mod:`bb_lightning.strategy.handback`), or
    leaves them in the store behind a :class:`~bb_lightning.strategy.handback.HollowGuard`; the next
    call's :meth:`take_back` pages them again from the module's values. :meth:`close`, or
    garbage collection of the owner, closes the store.
    """

    def __init__(self) -> None:
        self.engine: AnyEngine | None = None
        """The engine of the last ``trainer.*`` call (training, or weights only)."""
        self.store: TieredStore | None = None
        self.tmpdir: tempfile.TemporaryDirectory[str] | None = None
        self.finalizer: weakref.finalize[Any, Any] | None = None
        """Closes the store when the owner is collected (or at exit)."""
        self.handed_back: AnyEngine | None = None
        """The engine whose module holds its weights (handed back at teardown)."""
        self.guard: HollowGuard | None = None
        """Guards a module left hollow at teardown (weights only in the store)."""

    @property
    def calls(self) -> Engine | None:
        """What the strategy's hooks ask of the engine held (None when the slot is empty)."""
        return None if self.engine is None else engine_calls(self.engine)

    def hold(self, built: Assembly, owner: object) -> None:
        """Keep ``built`` (the slot is empty: :meth:`close` first)."""
        self.engine, self.store, self.tmpdir = built.engine, built.store, built.tmpdir
        self.finalizer = weakref.finalize(owner, release, built.store, built.tmpdir)

    def hand_back(
        self,
        owner: object,
        dtype: torch.dtype,
        gather: bool | None,
        limit: int | None,
        agree: Callable[[bool], bool] | None = None,
        *,
        share: int = 1,
        stopped: str | None = None,
        room: int | None = None,
    ) -> None:
        """The module's weights back in its parameters (``dtype``), or a loud hollow module.

        ``gather`` True always gives them back and closes the store; None gives them back
        when the weights in ``dtype`` fit ``limit`` bytes of host memory (None: the default share,
        :func:`~bb_lightning.strategy.handback.fits_host`, divided among the ``share`` ranks of
        this node that each hand a copy back, and at most ``room``: the bytes a host
        budget the user gave the store leaves unused); False leaves them in the store. With
        several ranks (the engine's reads are collectives) ``agree`` makes the decision
        every rank's: True only when the weights fit on every rank. ``stopped`` (several
        ranks whose call ended in an error: the other ranks may be gone) leaves the module
        hollow for that reason, without any collective.
        """
        engine = self.engine
        if engine is None or self.handed_back is engine or self.guard is not None:
            return
        if stopped is not None:
            self.guard = HollowGuard(engine, owner, stopped, dtype)
            return
        if gather:
            self.gather(dtype)
            self.close()
            return
        nbytes = param_bytes(engine, dtype)
        held = f"{nbytes / 2**30:.3g} GiB of {str(dtype).removeprefix('torch.')} weights"
        fits_here, most = fits_host(nbytes, limit, share, room)
        fits = fits_here if agree is None or gather is not None else agree(fits_here)
        if gather is None and fits:
            hand_back(engine, dtype)
            self.handed_back = engine
            return
        by_budget = limit is None and room is not None and most == room
        cap = "what StoreConfig.host_budget leaves beside the store; " if by_budget else ""
        why = (
            "gather_on_teardown=False"
            if gather is False
            else f"{held} > host limit {most / 2**30:.3g} GiB ({cap}gather_limit)"
            if not fits_here
            else f"{held} > another rank's host limit (gather_limit)"
        )
        self.guard = HollowGuard(engine, owner, why, dtype)

    def gather(self, dtype: torch.dtype) -> None:
        """Give the module its weights back (``dtype``), whatever their size."""
        engine = self.engine
        if engine is not None and self.handed_back is not engine:
            if self.guard is not None:
                self.guard.remove()
                self.guard = None
            hand_back(engine, dtype)
            self.handed_back = engine

    def take_back(self, module: nn.Module) -> None:
        """Page a module handed back at the last teardown again (its values into the store)."""
        if self.guard is not None:
            self.guard.remove()
            self.guard = None
        engine, self.handed_back = self.handed_back, None
        if engine is not None and engine.model is module:
            take_back(engine)
        elif engine is not None:  # another module: the old one keeps its weights
            self._drop(engine)

    def _drop(self, engine: AnyEngine) -> None:
        """Forget a handed-back engine without touching its module's parameters."""
        if engine is self.engine:
            if isinstance(engine, TrainingEngine):  # a weights-only one has no more to stop
                engine.close()
            self.engine = None

    def close(self) -> None:
        """Remove the engine's wrappers and close the store (NVMe lock released).

        A module handed back keeps its weights; a hollow one keeps raising (its weights
        are gone with the store).
        """
        if self.handed_back is not None:
            self._drop(self.handed_back)
            self.handed_back = None
        if self.guard is not None:  # a weights-only engine gives unstreamed weights back
            engine = self.engine
            if isinstance(engine, InferenceEngine) and not engine.streamed:
                self.guard.remove()
            else:
                self.guard.store_closed()
            self.guard = None
        if self.engine is not None:
            self.engine.close()  # a weights-only engine gives the module its parameters back
            self.engine = None
        if self.finalizer is not None:
            self.finalizer()
            self.finalizer = None
        elif self.store is not None:
            self.store.close()
        self.store = None
        if self.tmpdir is not None:
            self.tmpdir.cleanup()
            self.tmpdir = None
