"""A dry :class:`~storage.store.TieredStore`: every tier holds ``meta`` tensors, no data moves.

:class:`DryStore` keeps the store's whole bookkeeping (registry, residency state machine,
arena slots, NVMe catalogue and capacity, the order of operations on one tensor, the
per-link counters of :meth:`~storage.store.TieredStore.stats`) while its arenas are
``meta`` buffers (no memory), its NVMe tier a catalogue without files, and every copy is
counted on its link instead of executed. It behaves as a store on a CUDA device: the
compute device is ``meta`` (standing for ``cuda``), a HOST-home tensor is paged in by a
copy into a device slot (:attr:`pages_host_in_place` is False), gradients leave the
device by a counted copy (:attr:`copies_to_host` is True), and an NVMe transfer to or
from device memory goes through host staging (``h2d`` after ``nvme_read``)
unless ``direct_device`` says the I/O backend reads into device memory (kvikio).

Transfers run at once on the calling thread (the order of operations is the order of
the calls), so a dry run is deterministic. Link seconds are 0: only bytes and counts
mean anything. Host memory and files are never touched, so a model of any size runs.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from types import SimpleNamespace
from typing import Any

import torch

from storage.deferred import CopyEvent
from storage.device import Arena, Slot
from storage.io import ALIGNMENT
from storage.nvme import ArraySpec
from storage.residency import Record
from storage.store import StoreConfig, TieredStore
from storage.tiers import Budget, Link, Tier
from storage.transfers import Events, Transfers, Work

__all__ = ["DryNvme", "DryStore", "MetaArena"]

META = torch.device("meta")


class MetaArena(Arena):
    """An arena whose buffer is a ``meta`` tensor of its capacity: slots are carved and
    counted as in a real arena, and hold no memory."""

    def __init__(self, capacity: int, *, label: str) -> None:
        """``capacity`` in bytes, rounded down to 4 KiB as the real arenas are."""
        capacity -= capacity % ALIGNMENT
        super().__init__(torch.empty(capacity, dtype=torch.uint8, device=META), label=label)
        self._key = self.buffer.untyped_storage()._cdata

    def holds(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` is a view of this arena's buffer (``meta`` tensors all sit at
        address 0, so the storage tells, not the address)."""
        return tensor.is_meta and tensor.untyped_storage()._cdata == self._key


class DryNvme:
    """The NVMe tier's catalogue and capacity, with no files: what
    :class:`~storage.nvme.NvmeTier` tells the store about its arrays, and reads and writes
    that complete at once without moving data."""

    def __init__(self, capacity: int) -> None:
        """``capacity`` in bytes (the tier's budget)."""
        self._budget = Budget(Tier.NVME, capacity)
        self._arrays: dict[str, ArraySpec] = {}
        self._mutex = threading.Lock()

    @property
    def capacity(self) -> int:
        """The tier's budget, bytes."""
        return self._budget.capacity

    @property
    def used(self) -> int:
        """Bytes reserved by the arrays, bytes."""
        return self._budget.used

    def contains(self, name: str) -> bool:
        """Whether array ``name`` exists."""
        return name in self._arrays

    def spec(self, name: str) -> ArraySpec:
        """Name, shape, dtype and size of array ``name``."""
        return self._arrays[name]

    def chunk_path(self, name: str) -> Any:
        """A path-like whose ``exists()`` is False: no chunk is ever written."""
        return SimpleNamespace(exists=lambda: False)

    def create(
        self,
        name: str,
        shape: Sequence[int],
        dtype: torch.dtype,
        *,
        checksum: bool = True,
        durable: bool = True,
    ) -> ArraySpec:
        """Reserve array ``name``'s bytes under the capacity (``ValueError`` when full)."""
        dims = tuple(int(d) for d in shape)
        nbytes = torch.Size(dims).numel() * torch.empty((), dtype=dtype).element_size()
        with self._mutex:
            if name in self._arrays:
                raise ValueError(f"tensor {name!r} already exists in the dry NVMe tier")
            self._budget.reserve(name, nbytes)
            spec = ArraySpec(name=name, shape=dims, dtype=dtype, nbytes=nbytes, checksum=checksum)
            self._arrays[name] = spec
        return spec

    def set_durable(self, name: str, durable: bool) -> None:
        """Nothing to change: no chunk is written."""

    def delete(self, name: str) -> None:
        """Forget array ``name`` and free its bytes."""
        with self._mutex:
            if self._arrays.pop(name, None) is not None:
                self._budget.release(name)

    def read_async(self, name: str, dst: torch.Tensor, *, offset: int = 0, nbytes: int) -> Any:
        """A read that completed at once (``dst`` untouched)."""
        return _DONE

    def write_async(self, name: str, src: torch.Tensor) -> Any:
        """A write that completed at once."""
        return _DONE

    def write_piece_async(self, name: str, src: torch.Tensor, *, offset: int, nbytes: int) -> Any:
        """A piece written at once."""
        return _DONE

    @contextlib.contextmanager
    def begin_write(self, name: str) -> Any:
        """A piecewise write whose pieces complete at once."""
        yield SimpleNamespace(write_async=lambda *a, **k: _DONE, commit=lambda: None)

    def close(self) -> None:
        """Nothing to release."""


_DONE = SimpleNamespace(wait=lambda: None)


class _DryTransfers(Transfers):
    """:class:`~storage.transfers.Transfers` that count each copy on its link and run
    every operation at once on the calling thread."""

    def __init__(
        self, *, nvme: DryNvme | None, device_memory: Callable[[torch.Tensor], bool], direct: bool
    ) -> None:
        super().__init__(
            torch.device("cpu"),
            nvme=nvme,  # type: ignore[arg-type]
            staging=None,
            direct_device=direct,
            threads=1,
            device_memory=device_memory,
        )
        self.device = META
        for pool in (self._pool, self._urgent_pool, self._memory_pool):
            pool.shutdown(wait=False)

    def submit(self, rec: Record, work: Work, *, urgent: bool = False) -> Future[CopyEvent | None]:
        fut: Future[CopyEvent | None] = Future()
        try:
            fut.set_result(work(()))
        except BaseException as exc:  # reported through the operation's ticket
            fut.set_exception(exc)
        with self._order:
            rec.last = fut
        return fut

    def shutdown(self) -> None:
        """No threads to stop."""

    def _direct(self, buf: torch.Tensor) -> bool:
        """Host slots read and write files directly; device slots only with ``direct``."""
        return not self._device_memory(buf) or self._direct_device

    def load(self, rec: Record, slot: Slot, tier: Tier, after: Events) -> CopyEvent | None:
        if rec.home is Tier.NVME and tier is Tier.DEVICE and not self._direct(slot.raw()):
            self._count(Link.NVME_TO_HOST, rec.spec.nbytes)  # staged: disk, then the link up
            self._count(Link.HOST_TO_DEVICE, rec.spec.nbytes)
            return None
        return super().load(rec, slot, tier, after)

    def store(
        self,
        rec: Record,
        data: torch.Tensor,
        tier: Tier,
        raw: torch.Tensor | None,
        after: Events,
    ) -> CopyEvent | None:
        if rec.home is Tier.NVME and tier is Tier.DEVICE and not self._direct(data):
            self._count(Link.DEVICE_TO_HOST, rec.spec.nbytes)  # staged: the link down, then disk
            self._count(Link.HOST_TO_NVME, rec.spec.nbytes)
            rec.written = True
            return None
        if rec.home is Tier.NVME:
            nbytes = rec.spec.nbytes
            if nbytes:
                self._count(Link.between(tier, Tier.NVME), nbytes)
            rec.written = True
            return None
        return super().store(rec, data, tier, raw, after)

    def read_home(self, rec: Record, out: torch.Tensor | None) -> torch.Tensor:
        self._count(Link.NVME_TO_HOST, rec.spec.nbytes)
        if out is None:
            return torch.empty(rec.spec.shape, dtype=rec.spec.dtype, device=META)
        return out

    def _nvme_read(self, rec: Record, buf: torch.Tensor, tier: Tier, offset: int, n: int) -> None:
        self._count(Link.between(Tier.NVME, tier), n)

    def copy(
        self,
        dst: torch.Tensor,
        dst_tier: Tier,
        src: torch.Tensor,
        src_tier: Tier,
        after: Events,
        *,
        src_on_device: bool | None = None,
    ) -> CopyEvent | None:
        link = Link.between(src_tier, dst_tier)
        if link is not None:
            self._count(link, dst.numel())
        return None

    def fill_zero(self, dst: torch.Tensor, after: Events) -> CopyEvent | None:
        return None

    def _count(self, link: Link | None, nbytes: int) -> None:
        if link is not None:
            self.meters[link].add(nbytes, 0.0)


class DryStore(TieredStore):
    """A :class:`~storage.store.TieredStore` on ``meta`` tensors that counts its traffic
    and moves nothing (see the module doc).

    ``direct_device``: NVMe transfers land in and leave from device slots directly (the
    kvikio backend); False stages them through host memory (the POSIX backend).
    """

    def __init__(self, config: StoreConfig, *, direct_device: bool = False) -> None:
        """The store of ``config``'s budgets (its NVMe path is only a flag: no file is
        made); the compute device is ``meta``."""
        self.config = config
        self.device = META
        self._cuda = False
        self.host_node: int | None = None  # no host buffer is page-locked, on no node
        self._records: dict[str, Record] = {}
        self._observers = None
        self._lock = threading.RLock()
        self._device_arena = MetaArena(config.device_budget, label="device")  # type: ignore[assignment]
        self._host_arena = MetaArena(config.host_budget, label="host")  # type: ignore[assignment]
        self._backend = None
        self._staging = None
        nvme = DryNvme(config.nvme_budget) if config.nvme_path is not None else None
        self._nvme = nvme  # type: ignore[assignment]
        self._io = _DryTransfers(nvme=nvme, device_memory=self._device_arena.holds,
                                 direct=direct_device)  # fmt: skip
        self._closed = False

    @property
    def pages_host_in_place(self) -> bool:
        """False: as on CUDA, a HOST-home tensor is paged in by a copy into a device slot."""
        return False

    @property
    def copies_to_host(self) -> bool:
        """True: as on CUDA, tensors on the device reach host memory by a copy."""
        return True

    def is_device_memory(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` is a view of the device arena."""
        return self._device_arena.holds(tensor)

    def is_host_memory(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` is a view of the host arena."""
        return self._host_arena.holds(tensor)

    def _on_device(self, tensor: torch.Tensor) -> bool:
        return self._device_arena.holds(tensor)

    def _tier_of(self, tensor: torch.Tensor) -> Tier:
        """A tensor outside the host arena counts as device memory when it is a view of
        the device arena or was made on the compute side (not by the host optimizer)."""
        return Tier.DEVICE if self._device_arena.holds(tensor) else Tier.HOST

    def _check_out(self, rec: Record, out: torch.Tensor) -> None:
        self._check_like(rec, out)

    def read(self, name: str, out: torch.Tensor | None = None) -> torch.Tensor:
        """The home contents of ``name`` (counted, not read) in ``out`` or a new ``meta``
        tensor."""
        rec = self._record(name)
        result = torch.empty(rec.spec.shape, dtype=rec.spec.dtype, device=META)
        return super().read(name, result if out is None else out)

    def copy_to_host_async(
        self, dsts: Sequence[torch.Tensor], srcs: Sequence[torch.Tensor]
    ) -> list[CopyEvent | None]:
        """Count each copy on the ``d2h`` link (nothing is copied)."""
        if len(dsts) != len(srcs):
            raise ValueError(f"{len(dsts)} destinations for {len(srcs)} sources: pass pairs")
        for src in srcs:
            self._io.meters[Link.DEVICE_TO_HOST].add(src.numel() * src.element_size(), 0.0)
        return [None] * len(srcs)

    def close(self) -> None:
        """Forget the tensors (nothing to release)."""
        self._closed = True
