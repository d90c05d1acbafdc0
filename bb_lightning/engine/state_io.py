"""Reading and writing a training engine's state: fp32 masters, moments, frozen weights.

Each flat state is read from its home one at a time into the engine's first scratch set
(HOST-home state is seen in place; a state larger than one optimizer piece into buffers of
its own) and handed out per parameter by name; under data
parallelism the reading passes gather every rank's shard (collectives) and the writing
ones keep each rank's own shard. :class:`EngineStateDict` is the model's state dict read
from the store on demand. The :class:`~bb_lightning.engine.trainer_engine.TrainingEngine`
methods of the same names call these.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from bb_lightning.engine.flat_state import FlatState
from bb_lightning.placement import STATE_KINDS, StateKind
from storage.store import TieredStore
from storage.tiers import Tier

if TYPE_CHECKING:
    from bb_lightning.engine.trainer_engine import TrainingEngine

__all__ = [
    "EngineStateDict",
    "finish_gathers",
    "iter_frozen",
    "iter_shards",
    "iter_state",
    "load_state",
    "load_state_dict",
    "state_dict",
]


def iter_state(
    engine: TrainingEngine, kinds: Sequence[StateKind] = STATE_KINDS, *, start: int = 0
) -> Iterator[tuple[str, dict[StateKind, Tensor]]]:
    """Each parameter's name and fp32 state (``master``, ``exp_avg``, ``exp_avg_sq``).

    Reads one flat state at a time into the engine's scratch buffers (HOST-home
    state is seen in place): the tensors yielded are views, valid until the next
    item (copy to keep them). Under data parallelism each flat state is gathered
    from every rank's shard: a collective, so every rank iterates it to the end with
    the same ``kinds``; a rank that stops early ends its part with
    :meth:`finish_gathers`. ``start`` skips the first flat states.
    """
    engine.grads.wait()
    engine.pager.release_all_except(())
    engine.pool.settle()
    scratch = engine.pool.sets[0].fp32
    wide, whole = _whole_buffers(engine, kinds), _whole_buffers(engine, kinds)
    engine.gathered_states = start
    for state, names in engine.named_states()[start:]:
        views: dict[StateKind, list[Tensor]] = {}
        for kind, name in zip(STATE_KINDS, state.state_names, strict=True):
            if kind in kinds:
                flat = _read(
                    engine.store, name, _flat(engine.store, name, scratch[kind], state.numel)
                )
                if engine.comm is not None:
                    flat = state.gather(flat, wide[kind], whole[kind])
                views[kind] = state.master_views(flat)
        engine.gathered_states += 1
        for j, key in enumerate(names):
            yield key, {kind: v[j] for kind, v in views.items()}


def finish_gathers(engine: TrainingEngine, kinds: Sequence[StateKind] = STATE_KINDS) -> None:
    """The gathers left of an :meth:`iter_state` pass this rank stopped early (an
    error while writing what it read), so that the other ranks' passes end too."""
    for _ in engine.iter_state(kinds, start=engine.gathered_states):
        pass


def iter_shards(
    engine: TrainingEngine, kinds: Sequence[StateKind] = STATE_KINDS
) -> Iterator[tuple[FlatState, list[str], dict[StateKind, Tensor]]]:
    """Each flat state, its parameters' names, and the flat state as this rank stores
    it per kind (its shard under data parallelism; no collective).

    Reads one flat state at a time into the engine's scratch buffers (HOST-home state
    is seen in place): the tensors yielded are valid until the next item.
    """
    engine.grads.wait()
    engine.pager.release_all_except(())
    engine.pool.settle()
    scratch = engine.pool.sets[0].fp32
    for state, names in engine.named_states():
        flats = {
            kind: _read(engine.store, name, _flat(engine.store, name, scratch[kind], state.numel))
            for kind, name in zip(STATE_KINDS, state.state_names, strict=True)
            if kind in kinds
        }
        yield state, names, flats


def load_state(
    engine: TrainingEngine,
    fill: Callable[[str, StateKind, Tensor], None],
    kinds: Sequence[StateKind],
) -> None:
    """Set the fp32 state of every parameter; ``fill(name, kind, out)`` writes into ``out``.

    ``out`` is an fp32 host view of the parameter's shape. When ``master`` is among
    ``kinds``, the compute-dtype weights (paged and resident) are re-derived from it.
    Under data parallelism every rank fills whole parameters and keeps its shard of the
    state and of the weights (no collective: each rank reads the values itself).
    """
    engine.grads.wait()
    engine.pager.release_all_except(())
    engine.pool.settle()
    scratch = engine.pool.sets[0]
    wide = _whole_buffers(engine, kinds)
    for i, (state, names) in enumerate(engine.named_states()):
        flats: dict[StateKind, Tensor] = {}
        mine: dict[StateKind, Tensor] = {}  # what this rank stores: its shard under comm
        for kind, name in zip(STATE_KINDS, state.state_names, strict=True):
            if kind not in kinds:
                continue
            flat = _flat(engine.store, name, scratch.fp32[kind], state.numel)
            whole = flat if engine.comm is None else wide[kind][: state.full_numel]
            flats[kind] = whole
            for key, view in zip(names, state.master_views(whole), strict=True):
                fill(key, kind, view)
            if engine.comm is not None:
                state.local(whole, flat)
            mine[kind] = flat
            if engine.store.home(name) is not Tier.HOST:
                engine.store.write(name, flat)
        if "master" not in kinds:
            continue
        master = flats["master"]
        if i < engine.pager.num_blocks:  # this rank's weights (its shard under comm)
            ticket = engine.pager.write_weights(i, mine["master"], scratch.cast)
            if ticket is not None:
                ticket.wait_host()  # scratch.cast is refilled for the next block
        else:
            for p, v in zip(engine.resident_params, state.master_views(master), strict=True):
                p.data.copy_(v)


def _whole_buffers(engine: TrainingEngine, kinds: Sequence[StateKind]) -> dict[StateKind, Tensor]:
    """fp32 host buffers of every rank's shards of the largest flat state, per kind
    (data parallelism; none otherwise)."""
    if engine.comm is None:
        return {}
    n = max(s.numel for s in engine.states) * engine.comm.world_size
    return {kind: torch.empty(n, dtype=torch.float32) for kind in kinds}


def _flat(store: TieredStore, name: str, scratch: Tensor, numel: int) -> Tensor:
    """Where the state ``name`` is worked on: its host view (HOST home), ``scratch``, or
    where the state is larger than a scratch buffer (one optimizer piece), a buffer of its
    own, outside the store, for as long as the caller holds it."""
    if store.home(name) is Tier.HOST:
        return store.host_view(name)
    if scratch.numel() < numel:
        return torch.empty(numel, dtype=torch.float32)
    return scratch[:numel]


def _read(store: TieredStore, name: str, flat: Tensor) -> Tensor:
    """``flat`` holding the contents of ``name`` (read unless it is the host view)."""
    if store.home(name) is Tier.HOST:
        return flat
    return store.read(name, out=flat)


def iter_frozen(engine: TrainingEngine) -> Iterator[tuple[str, Tensor]]:
    """Each frozen parameter's name and value (fp32 host copies, read from the store)."""
    first: dict[int, str] = {}
    for key, p in engine.model.named_parameters():
        first.setdefault(id(p), key)
    for i in range(engine.pager.num_blocks):
        for p, value in zip(engine.pager.frozen[i], engine.pager.read_frozen(i), strict=True):
            yield first[id(p)], value
    for p in engine.frozen_params:
        yield first[id(p)], p.detach().to("cpu", torch.float32)


def state_dict(engine: TrainingEngine) -> dict[str, Tensor]:
    """The model's state dict with every parameter as its fp32 master copy (host);
    frozen parameters as their stored values in fp32."""
    values = {key: s["master"].clone() for key, s in engine.iter_state(("master",))}
    values.update(engine.iter_frozen())
    first = {id(p): key for key, p in reversed(list(engine.model.named_parameters()))}
    out: dict[str, Tensor] = {}
    for key, t in engine.model.state_dict(keep_vars=True).items():
        out[key] = values[first[id(t)]] if id(t) in first else t.detach().to("cpu")
    return out


def load_state_dict(engine: TrainingEngine, state_dict: Mapping[str, Tensor]) -> None:
    """Set master weights, paged weights and resident parameters from a full state dict.

    Raises ``ValueError`` naming the first parameter missing or of another shape.
    """
    names = [key for _, keys in engine.named_states() for key in keys]
    missing = [k for k in names if k not in state_dict]
    if missing:
        raise ValueError(f"state dict lacks {len(missing)} parameters, e.g. {missing[:3]}")

    def fill(key: str, kind: StateKind, out: Tensor) -> None:
        value = state_dict[key]
        if tuple(value.shape) != tuple(out.shape):
            raise ValueError(
                f"parameter {key!r} has shape {tuple(value.shape)} in the state dict but "
                f"{tuple(out.shape)} in the model: load a state dict of this model"
            )
        out.copy_(value)

    engine.load_state(fill, ("master",))


class EngineStateDict(Mapping[str, Tensor]):
    """The model's state dict with parameters as fp32 masters, read from the store on demand.

    Nothing is read until a key is asked for; then the flat state holding that
    parameter is read (one block's masters, kept until a key of another flat state
    is asked for), and the parameter returned as a copy (host, fp32). Iterating it
    therefore holds at most one block's masters besides the tensors the caller keeps,
    where :meth:`TrainingEngine.state_dict` holds the whole model. Buffers and other
    non-parameter entries are the module's own tensors (moved to the host).
    """

    def __init__(self, engine: TrainingEngine) -> None:
        self.engine = engine
        self._entries: dict[str, Tensor] = engine.model.state_dict(keep_vars=True)
        first = {id(p): key for key, p in reversed(list(engine.model.named_parameters()))}
        self._where: dict[str, tuple[int, int]] = {}
        names_at = {key: (i, j) for i, (_, keys) in enumerate(engine.named_states())
                    for j, key in enumerate(keys)}  # fmt: skip
        frozen_at = {id(p): (i, j) for i, ps in enumerate(engine.pager.frozen)
                     for j, p in enumerate(ps)}  # fmt: skip
        self._frozen: dict[str, tuple[int, int]] = {}
        """Keys of frozen block parameters: (block, index in its frozen weights)."""
        for key, t in self._entries.items():
            if id(t) in frozen_at:
                self._frozen[key] = frozen_at[id(t)]
            elif id(t) in first and first[id(t)] in names_at:
                self._where[key] = names_at[first[id(t)]]
        self._cached: tuple[int, list[Tensor]] | None = None
        self._frozen_cached: tuple[int, list[Tensor]] | None = None

    @property
    def parameter_keys(self) -> frozenset[str]:
        """Keys whose values are parameters (fp32 masters in the store)."""
        return frozenset(self._where)

    def __getitem__(self, key: str) -> Tensor:
        where = self._where.get(key)
        if key in self._frozen:
            i, j = self._frozen[key]
            if self._frozen_cached is None or self._frozen_cached[0] != i:
                self._frozen_cached = (i, self.engine.pager.read_frozen(i))
            return self._frozen_cached[1][j].clone()
        if where is None:
            return self._entries[key].detach().to("cpu")
        i, j = where
        if self._cached is None or self._cached[0] != i:
            engine = self.engine
            engine.grads.wait()
            state = engine.states[i]  # under data parallelism a collective: every rank asks
            self._cached = (i, state.master_views(state.gather(state.read_master())))
        return self._cached[1][j].clone()

    def __contains__(self, key: object) -> bool:
        return key in self._entries

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)
