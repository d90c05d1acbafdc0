"""The live bytes of each tier during a dry run, counted op by op on ``meta`` tensors.

:class:`MemoryAccountant` is a ``TorchDispatchMode`` entered on the thread that runs a
dry step. Every tensor there is a ``meta`` tensor; the accountant says which stand for
device memory and which for host memory, and counts the bytes each tier holds:

- a factory op that names no device or the CPU (``torch.empty(n)``, ``.to("cpu")``,
  ``pin_memory=True``) makes host memory: it is redirected to ``meta`` and its storage
  marked host; one naming ``meta`` makes device memory;
- any other op's new storage is device memory when one of its tensor inputs is, else
  host memory (the host AdamW's temporaries); a real CPU tensor given to an op (a
  ``torch.tensor`` literal) is taken as a host ``meta`` tensor of its shape;
- ``.item()`` has no value to read: it answers 1 (1.0, True), which keeps a step on its
  ordinary path (no overflow, no padding);
- a storage is counted from the op that made it until its last tensor dies (a weakref
  finalizer on its untyped storage, as ``torch.distributed._tools.mem_tracker`` does);
- a copy between device and host memory made outside the store (``copy_`` or ``.to``
  across tiers) is counted on its link in :attr:`MemoryAccountant.moved`: the bytes of
  the device side's dtype when it blocks, of the host side's when ``non_blocking`` (a
  blocking copy converts dtypes on the CPU, a non-blocking one on the GPU:
  ``aten/src/ATen/native/cuda/Copy.cu``).

Device bytes are rounded as CUDA's caching allocator rounds blocks
(``c10/cuda/CUDACachingAllocator.cpp``): every request up to a multiple of
``kMinBlockSize`` = 512 B; a request over ``kSmallSize`` = 1 MiB is served from the large
pool, whose segments are rounded up to ``kRoundLarge`` = 2 MiB, and counted at that
rounding (a request under ``kMinLargeAlloc`` = 10 MiB may share a ``kLargeBuffer`` =
20 MiB segment with others, so this is the segment bytes of a block that does not share
its segment). Small blocks share 2 MiB segments and are counted at 512 B granularity.
Host bytes are counted as requested.

Each peak is kept with where it happened: the phase and the block the driver names
(:meth:`MemoryAccountant.where`).
"""

from __future__ import annotations

import functools
import threading
import weakref
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_map

from storage.tiers import Link, Tier

__all__ = [
    "K_MIN_BLOCK_SIZE",
    "K_ROUND_LARGE",
    "K_SMALL_SIZE",
    "MemoryAccountant",
    "Peak",
    "cuda_block_bytes",
]

K_MIN_BLOCK_SIZE = 512
"""``kMinBlockSize``: every CUDA caching-allocator block is a multiple of 512 bytes."""
K_SMALL_SIZE = 1 << 20
"""``kSmallSize``: requests up to 1 MiB come from the small pool (2 MiB segments)."""
K_ROUND_LARGE = 2 << 20
"""``kRoundLarge``: large-pool segments are rounded up to 2 MiB."""

_META = torch.device("meta")
_aten = torch.ops.aten


def cuda_block_bytes(nbytes: int) -> int:
    """Bytes the CUDA caching allocator holds for a request of ``nbytes`` (see the
    module doc): 512 B granularity up to 1 MiB, 2 MiB segments above."""
    if nbytes <= 0:
        return 0
    step = K_MIN_BLOCK_SIZE if nbytes <= K_SMALL_SIZE else K_ROUND_LARGE
    return -(-nbytes // step) * step


@dataclass(frozen=True)
class Peak:
    """The most bytes one tier held, and where."""

    tier: Tier
    """The tier."""
    bytes: int
    """Live bytes at the peak."""
    phase: str
    """What the step was doing (``forward``, ``backward``, ``optimizer``, ...)."""
    block: int | None
    """The block last paged in (None: outside the blocks)."""
    top: tuple[tuple[str, int], ...] = ()
    """The ops whose outputs held the most of the tier at the peak, with their bytes
    (``base`` first: what was held throughout)."""


class MemoryAccountant(TorchDispatchMode):
    """Counts device and host bytes of the ``meta`` tensors a dry step makes (module doc).

    ``base`` bytes per tier are held throughout (the arenas carved at setup, the
    weights resident outside them); ``known`` storages (given by
    :meth:`ignore`) are never counted again as new ones. ``is_host`` tells whether an
    untracked input tensor stands for host memory (the store's host arena).
    """

    def __init__(self, is_host: Callable[[torch.Tensor], bool] = lambda t: False) -> None:
        super().__init__()
        self.is_host = is_host
        self.base: dict[Tier, int] = {Tier.DEVICE: 0, Tier.HOST: 0}
        self.live: dict[Tier, int] = {Tier.DEVICE: 0, Tier.HOST: 0}
        self.moved: dict[Link, int] = {}
        """Bytes copied between device and host memory outside the store, per link."""
        self.extra: dict[Tier, Callable[[], int]] = {}
        """More live bytes per tier read at each peak check (say, mapped host buffers)."""
        self._tiers: dict[int, Tier] = {}
        self._known: set[int] = set()
        self._sizes: dict[int, int] = {}
        self._known_refs: dict[int, weakref.ref[Any]] = {}
        self._ops: dict[int, str] = {}
        self._known_tier: dict[int, Tier] = {}
        self._by_op: dict[tuple[Tier, str], int] = {}
        self._refs: dict[int, weakref.ref[Any]] = {}
        self._lock = threading.Lock()
        self.phase = "setup"
        self.block: int | None = None
        self.peaks: dict[Tier, Peak] = {
            t: Peak(t, 0, "setup", None) for t in (Tier.DEVICE, Tier.HOST)
        }

    # -- where the step is ------------------------------------------------------------------

    def where(self, phase: str, block: int | None = None) -> None:
        """Name what the step does now (peaks found from here on are said to be there)."""
        self.phase, self.block = phase, block

    def block_acquiring(self, i: int) -> None:
        """A block is being paged in (a pager observer)."""
        self.block = i

    def block_acquired(self, i: int) -> None:
        """A block is on the device (a pager observer)."""
        self.block = i

    def block_released(self, i: int) -> None:
        """A block leaves the device (a pager observer)."""

    # -- storages ---------------------------------------------------------------------------

    def ignore(self, tensors: Iterable[torch.Tensor], tier: Tier | None = None) -> None:
        """Never count the storages of ``tensors`` (already paid for in :attr:`base`, or
        counted where they were made); ``tier``: the memory they stand for."""
        for t in tensors:
            storage = t.untyped_storage()
            key = storage._cdata
            if key not in self._known:  # a dead storage's address may be reused
                self._known.add(key)
                if tier is not None:
                    self._known_tier[key] = tier
                self._known_refs[key] = weakref.ref(storage, functools.partial(self._unknow, key))
            with self._lock:
                counted = self._tiers.pop(key, None)
                if counted is not None:
                    size = self._sizes.pop(key)
                    self.live[counted] -= size
                    self._by_op[counted, self._ops.pop(key, "")] -= size

    def _unknow(self, key: int, _ref: object = None) -> None:
        self._known.discard(key)
        self._known_tier.pop(key, None)
        self._known_refs.pop(key, None)

    def restart_peaks(self) -> None:
        """Forget the peaks so far (the live bytes now are the new ones)."""
        self.peaks = {t: Peak(t, 0, self.phase, self.block) for t in (Tier.DEVICE, Tier.HOST)}
        self.check()

    def tier_of(self, t: torch.Tensor) -> Tier:
        """The tier ``t``'s storage stands for (device unless known to be host)."""
        key = t.untyped_storage()._cdata
        tier = self._tiers.get(key) or self._known_tier.get(key)
        if tier is not None:
            return tier
        return Tier.HOST if not t.is_meta or self.is_host(t) else Tier.DEVICE

    def current(self, tier: Tier) -> int:
        """Live bytes of ``tier`` now."""
        extra = self.extra.get(tier)
        return self.base[tier] + self.live[tier] + (extra() if extra is not None else 0)

    def check(self) -> None:
        """Record a new peak of any tier at the current place."""
        for tier in (Tier.DEVICE, Tier.HOST):
            now = self.current(tier)
            if now > self.peaks[tier].bytes:
                self.peaks[tier] = Peak(tier, now, self.phase, self.block, self._top(tier))

    def _top(self, tier: Tier, count: int = 4) -> tuple[tuple[str, int], ...]:
        held = sorted(
            ((op, n) for (t, op), n in self._by_op.items() if t is tier and n > 0),
            key=lambda item: -item[1],
        )
        return (("base", self.base[tier]), *held[:count])

    def _moved(self, src: torch.Tensor, dst: torch.Tensor, non_blocking: bool) -> None:
        """Count a copy from ``src`` to ``dst`` when it crosses between device and host."""
        a, b = self.tier_of(src), self.tier_of(dst)
        link = Link.between(a, b)
        if link is not None:
            nbytes = _moved_bytes(src, dst, b is Tier.DEVICE, not non_blocking)
            with self._lock:
                self.moved[link] = self.moved.get(link, 0) + nbytes

    def _track(self, t: torch.Tensor, tier: Tier, op: str = "") -> None:
        storage = t.untyped_storage()
        key = storage._cdata
        if key in self._known or key in self._tiers:
            return
        nbytes = storage.nbytes()
        size = cuda_block_bytes(nbytes) if tier is Tier.DEVICE else nbytes
        with self._lock:
            self._tiers[key] = tier
            self._sizes[key] = size
            self._ops[key] = op
            self.live[tier] += size
            self._by_op[tier, op] = self._by_op.get((tier, op), 0) + size
        self._refs[key] = weakref.ref(storage, functools.partial(self._free, key, size, tier))

    def _free(self, key: int, size: int, tier: Tier, _ref: object = None) -> None:
        with self._lock:
            if self._tiers.pop(key, None) is not None:
                size = self._sizes.pop(key, size)
                self.live[tier] -= size
                op = self._ops.pop(key, "")
                self._by_op[tier, op] -= size
            self._refs.pop(key, None)

    # -- the dispatch ---------------------------------------------------------------------

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = dict(kwargs or {})
        if func is _aten._local_scalar_dense.default:
            return _one(args[0].dtype)
        if func in (_aten.is_pinned.default,):
            return True
        if func in (_aten._pin_memory.default,):
            return args[0]
        inputs = _tensors((args, kwargs), [])
        tiers = {self.tier_of(t) for t in inputs}
        host = None
        if "device" in kwargs or not inputs:
            device = kwargs.get("device")
            if device is not None:
                host = torch.device(device).type != "meta"
            elif not inputs:
                host = True
            if host is not None:
                kwargs["device"] = _META
            kwargs.pop("pin_memory", None)
        if any(not t.is_meta for t in inputs):  # real host memory, counted where it is made
            made: list[torch.Tensor] = []
            args, kwargs = tree_map(lambda x: _to_meta(x, made), (args, kwargs))
            self.ignore(made, Tier.HOST)
        out = func(*args, **kwargs)
        if host is None:
            host = Tier.DEVICE not in tiers
        tier = Tier.HOST if host else Tier.DEVICE
        for t in _tensors(out, []):
            if t.is_meta:
                key = t.untyped_storage()._cdata
                if key not in self._tiers and key not in self._known:
                    self._track(t, tier, _op_name(func))
        if func is _aten.copy_.default:
            self._moved(args[1], args[0], bool(args[2]) if len(args) > 2 else False)
        elif func is _aten._to_copy.default and tier is not self.tier_of(args[0]):
            self._moved(args[0], out, bool(kwargs.get("non_blocking", False)))  # out tracked
        self.check()
        return out


def _tensors(tree: Any, out: list[torch.Tensor]) -> list[torch.Tensor]:
    """``out`` with the tensors of ``tree`` (an operator's arguments or result: tensors,
    scalars and options in tuples, lists and dicts) appended in order: what
    ``tree_flatten`` finds, without its per-node bookkeeping on every operator."""
    if isinstance(tree, torch.Tensor):
        out.append(tree)
    elif isinstance(tree, (tuple, list)):
        for item in tree:
            _tensors(item, out)
    elif isinstance(tree, dict):
        for item in tree.values():
            _tensors(item, out)
    return out


def _moved_bytes(src: torch.Tensor, dst: torch.Tensor, on_device: bool, blocking: bool) -> int:
    """Bytes a copy from ``src`` to ``dst`` moves over the link (see the module doc);
    ``on_device``: ``dst`` is the device side."""
    device_side, host_side = (dst, src) if on_device else (src, dst)
    side = device_side if blocking else host_side
    return dst.numel() * side.element_size()


def _op_name(func: Any) -> str:
    """``aten._log_softmax.default`` -> ``_log_softmax``."""
    name = str(func)
    name = name.removeprefix("aten.")
    return name.removesuffix(".default")


def _to_meta(x: Any, made: list[torch.Tensor]) -> Any:
    """A real tensor as a ``meta`` tensor of its shape, dtype and strides (kept in
    ``made``)."""
    if isinstance(x, torch.Tensor) and not x.is_meta:
        made.append(torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device=_META))
        return made[-1]
    return x


def _one(dtype: torch.dtype) -> bool | int | float:
    """What ``.item()`` answers on a ``meta`` tensor of ``dtype``."""
    if dtype is torch.bool:
        return True
    if dtype.is_floating_point or dtype.is_complex:
        return 1.0
    return 1
