"""What every operation of a :class:`~storage.store.TieredStore` builds on: the arenas,
the I/O backend and the NVMe tier it opens, the registry of its tensors, the bookkeeping
of their records, its observers, its accounting and closing (:class:`StoreCore`).

The operations themselves (paging, synchronous reads and writes, moves) are
:class:`~storage.store.TieredStore`'s; the module doc of :mod:`storage.store` describes them.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Sequence
from concurrent.futures import Future

import torch

from storage.deferred import CopyDouble, CopyEvent, double_requested
from storage.device import DeviceArena, Slot, resolve_device
from storage.external import ExternalSource, FilePiece, ReadOnlyTensorError
from storage.host import HostArena, StagingPool
from storage.io import ALIGNMENT, IOBackend, open_backend, padded
from storage.numa import device_numa_node
from storage.nvme import ArraySpec, NvmeTier
from storage.observers import TransferKind, TransferObserver, added, observed, removed
from storage.residency import Record, ResidencyMachine, StateError, Ticket
from storage.store_config import StoreConfig
from storage.tiers import Link, Residency, Tier
from storage.transfers import (
    Events,
    LinkStats,
    Transfers,
    Work,
    flat_bytes,
    order_after,
    settled,
)

__all__ = ["StoreCore", "check_writable", "padded_source"]


class StoreCore:
    """The state of a :class:`~storage.store.TieredStore` and the steps its operations share."""

    # -- construction ----------------------------------------------------------------------

    def __init__(self, config: StoreConfig) -> None:
        """Carve the arenas, open the I/O backend and the NVMe tier (taking its lock)."""
        self.config = config
        self.device = resolve_device(config.device)
        self._cuda = self.device.type == "cuda"
        self._records: dict[str, Record] = {}
        self._observers: tuple[TransferObserver, ...] | None = None
        self._closed = True
        self._lock = threading.RLock()  # residency check + transition + slot, as one step
        self._device_arena = DeviceArena(config.device_budget, self.device)
        # host memory is page-locked only for a CUDA device (a CPU device on a machine with
        # a GPU copies nothing to it), on the GPU's NUMA node where sysfs tells it
        self.host_node = device_numa_node(self.device) if self._cuda else None
        """The NUMA node the store's pinned host buffers are placed on (None: unknown, or
        a CPU device)."""
        self._host_arena = HostArena(config.host_budget, pin=self._cuda, node=self.host_node)
        self._backend: IOBackend | None = None
        self._nvme: NvmeTier | None = None
        self._staging: StagingPool | None = None
        if config.nvme_path is not None:
            backend = open_backend(config.io)
            try:
                self._nvme = NvmeTier(
                    config.nvme_path,
                    capacity=config.nvme_budget,
                    backend=backend,
                    scratch=config.nvme_scratch,
                )
            except BaseException:
                backend.close()
                raise
            self._backend = backend
            self._staging = StagingPool(
                config.staging_buffers, config.staging_bytes, pin=self._cuda, node=self.host_node
            )
        double = None
        if not self._cuda and double_requested(config.cuda_double):
            double = CopyDouble()
        self._io = Transfers(
            self.device,
            double=double,
            device_memory=self._device_arena.holds,
            nvme=self._nvme,
            staging=self._staging,
            direct_device=self._backend is not None and self._backend.name == "kvikio",
            stage_nvme=config.stage_nvme,
            threads=config.copy_threads,
        )
        self._closed = False

    # -- registry --------------------------------------------------------------------------

    def register(
        self,
        name: str,
        tensor: torch.Tensor | None = None,
        *,
        shape: Sequence[int] | None = None,
        dtype: torch.dtype | None = None,
        home: Tier,
        scratch: bool = False,
        source: Sequence[FilePiece] | None = None,
    ) -> None:
        """Add tensor ``name`` homed on ``home``, from ``tensor`` (copied) or ``shape``/``dtype``.

        Without a tensor its contents are zeros (on ``NVME``: metadata only
        until the first write). On ``NVME``, a name already in the group is
        adopted when shape and dtype match (both may be omitted), keeping its
        layout. ``scratch``: the caller rewrites the tensor often and no other
        process reopens it; on NVMe (now or after a :meth:`move`) its chunk then
        has no CRC-32C trailer unless ``StoreConfig.scratch_checksums`` is set,
        and is rewritten in place, without the fsyncs and rename of an atomic
        write (:meth:`storage.nvme.NvmeTier.set_durable`).
        ``source`` (with ``home=Tier.NVME``, ``shape`` and ``dtype``): the tensor's bytes
        are these file pieces, concatenated (:mod:`storage.external`); it is read from
        them in place, read-only, and takes no NVMe budget nor an NVMe tier.
        Raises ``ValueError`` when the tier cannot hold it, naming the bytes
        needed and free; nothing changes then.
        """
        self._check_open()
        home = Tier(home)
        if not isinstance(name, str) or not name:
            raise ValueError(f"tensor name {name!r} must be a non-empty string")
        if name in self._records:
            raise ValueError(
                f"tensor {name!r} is already registered (home {self._records[name].home.value}): "
                f"use write() to change its contents or move() to change its tier"
            )
        if source is not None:
            self._register_external(name, tensor, shape, dtype, home, source)
            return
        nvme = self._nvme_for(name) if home is Tier.NVME else None
        existing = nvme.spec(name) if nvme is not None and nvme.contains(name) else None
        if tensor is not None:
            shape = tuple(tensor.shape) if shape is None else tuple(shape)
            dtype = tensor.dtype if dtype is None else dtype
            if shape != tuple(tensor.shape) or dtype != tensor.dtype:
                raise ValueError(
                    f"tensor {name!r}: shape={shape}, dtype={dtype} disagree with the tensor's "
                    f"{tuple(tensor.shape)}, {tensor.dtype}: pass either the tensor or shape/dtype"
                )
        elif existing is not None:
            shape = existing.shape if shape is None else shape
            dtype = existing.dtype if dtype is None else dtype
        if shape is None or not isinstance(dtype, torch.dtype):
            raise ValueError(
                f"tensor {name!r}: pass a tensor, or shape= and a torch dtype= (got {shape}, "
                f"{dtype})"
            )
        dims = tuple(int(d) for d in shape)
        if any(d < 0 for d in dims):
            raise ValueError(f"tensor {name!r}: shape {dims} has a negative dimension")
        nbytes = torch.Size(dims).numel() * torch.empty((), dtype=dtype).element_size()
        checksum = not scratch or self.config.scratch_checksums
        if existing is not None:  # an adopted array keeps its layout
            checksum = existing.checksum
        spec = ArraySpec(name=name, shape=dims, dtype=dtype, nbytes=nbytes, checksum=checksum)
        rec = Record(spec=spec, home=home, residency=ResidencyMachine(name), scratch=scratch)
        if home is Tier.NVME:
            assert nvme is not None
            if existing is not None:
                if (existing.shape, existing.dtype) != (dims, dtype):
                    raise ValueError(
                        f"tensor {name!r}: the NVMe group holds it with shape {existing.shape} "
                        f"and {existing.dtype}, not {dims} and {dtype}: register it with the "
                        f"stored shape and dtype, or use another name"
                    )
                rec.written = nvme.chunk_path(name).exists() or nbytes == 0
                nvme.set_durable(name, not scratch)
            else:
                nvme.create(name, dims, dtype, checksum=checksum, durable=not scratch)
                rec.written = False
        else:
            arena = self._device_arena if home is Tier.DEVICE else self._host_arena
            rec.home_slot = self._allocate(arena, spec)
            if home is Tier.DEVICE:
                rec.device_slot = rec.home_slot
                rec.residency.apply("home_on_device")
        try:
            if tensor is not None:
                data = flat_bytes(tensor)  # kept alive until the copy completed
                after = self._ready_if(self._on_device(data) or home is Tier.DEVICE)
                settled(self._io.store(rec, data, self._tier_of(tensor), None, after))
                del data
            elif home is not Tier.NVME:
                assert rec.home_slot is not None
                settled(self._io.fill_zero(rec.home_slot.raw()[:nbytes], ()))
        except BaseException:
            self._drop_home(rec, delete_nvme=existing is None)
            raise
        self._records[name] = rec

    def _register_external(
        self,
        name: str,
        tensor: torch.Tensor | None,
        shape: Sequence[int] | None,
        dtype: torch.dtype | None,
        home: Tier,
        source: Sequence[FilePiece],
    ) -> None:
        if home is not Tier.NVME or tensor is not None or shape is None or dtype is None:
            raise ValueError(
                f"tensor {name!r}: a tensor read from file pieces is registered with "
                f"home=Tier.NVME, shape= and dtype= and no tensor (got home {home.value}): "
                "pass those"
            )
        dims = tuple(int(d) for d in shape)
        if any(d < 0 for d in dims):
            raise ValueError(f"tensor {name!r}: shape {dims} has a negative dimension")
        nbytes = torch.Size(dims).numel() * torch.empty((), dtype=dtype).element_size()
        spec = ArraySpec(name=name, shape=dims, dtype=dtype, nbytes=nbytes, checksum=False)
        external = ExternalSource(name, source, nbytes)
        self._records[name] = Record(
            spec=spec, home=home, residency=ResidencyMachine(name), external=external
        )

    def unregister(self, name: str) -> None:
        """Remove tensor ``name`` and free what its home holds (its NVMe array deleted).

        It must be RELEASED (or homed on DEVICE); its pending operations finish first.
        Raises :class:`StateError` otherwise, and for a read-only tensor, nothing removed.
        """
        rec = self._record(name)
        check_writable(rec, "be unregistered")
        with self._lock:
            if rec.home is not Tier.DEVICE and rec.residency.state is not Residency.RELEASED:
                raise StateError(
                    f"tensor {name!r} is {rec.residency.state.value.upper()}: unregister() needs "
                    f"it RELEASED; {rec.residency.hint()}"
                )
        self._io.settle(rec, sync=True)
        with self._lock:
            self._drop_home(rec, delete_nvme=True)
            rec.device_slot = None
            del self._records[name]

    def names(self) -> list[str]:
        """Registered tensor names, sorted."""
        return sorted(self._records)

    def spec(self, name: str) -> ArraySpec:
        """Name, shape, dtype and size (bytes) of tensor ``name``."""
        return self._record(name).spec

    def state(self, name: str) -> Residency:
        """Residency of tensor ``name`` on the compute device."""
        return self._record(name).residency.state

    def home(self, name: str) -> Tier:
        """Home tier of tensor ``name``."""
        return self._record(name).home

    # -- how the device reaches host memory ------------------------------------------------

    @property
    def pages_host_in_place(self) -> bool:
        """Whether a page-in of a HOST-home tensor is its home slot itself (no copy, no device
        slot, write-back a no-op): on a CPU device, except under the double, which pages it
        into a device slot with deferred copies as on CUDA."""
        return not self._cuda and self._io.double is None

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` ran (every tensor and arena is gone)."""
        return self._closed

    @property
    def pins_host(self) -> bool:
        """Whether host buffers that copies to and from the device use should be page-locked
        (a CUDA device); on a CPU device they stay pageable even where CUDA is visible."""
        return self._cuda

    @property
    def copies_to_host(self) -> bool:
        """Whether tensors on the compute device need a copy to reach host memory: on CUDA,
        and on a CPU device under the double (where such copies are deferred)."""
        return self._cuda or self._io.double is not None

    # -- transfers (run on the copy threads, each after the previous one on its tensor) ----

    def _on_device(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` is device memory: CUDA, or a slot of the device arena."""
        return tensor.is_cuda or self._device_arena.holds(tensor)

    def _ready_if(self, needed: bool) -> Events:
        """The caller's stream's progress for a transfer that touches device memory
        (``needed``); nothing for one between host memory and files only."""
        return self._io.ready() if needed else ()

    def _ticket(
        self,
        entries: list[tuple[Record, Future[CopyEvent | None]]],
        *,
        results: dict[str, torch.Tensor],
        paged: frozenset[str] = frozenset(),
    ) -> Ticket:
        return Ticket(
            entries,
            paged=paged,
            results=results,
            on_fail=self._abort,
            device=self.device,
            order=order_after,
        )

    def _submit(self, rec: Record, work: Work, kind: TransferKind) -> Future[CopyEvent | None]:
        self._check_open()
        observers = self._observers
        if observers is not None:
            work = observed(work, observers, kind, rec.spec.name)
        return self._io.submit(rec, work, urgent=kind is TransferKind.PAGE_IN)

    # -- observers -------------------------------------------------------------------------

    def add_observer(self, observer: TransferObserver) -> None:
        """Call ``observer`` on the copy thread at the start and the end of each transfer
        submitted from now on (:mod:`storage.observers`); ``ValueError`` if it already is."""
        self._observers = added(self._observers, observer)

    def remove_observer(self, observer: TransferObserver) -> None:
        """Stop calling ``observer`` for transfers submitted from now on (no-op if absent)."""
        self._observers = removed(self._observers, observer)

    # -- bookkeeping -----------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise ValueError("the TieredStore is closed: open a new one")

    def _record(self, name: str) -> Record:
        self._check_open()
        try:
            return self._records[name]
        except KeyError:
            raise KeyError(f"tensor {name!r} is not registered: register() it first") from None

    def _records_of(self, names: str | Sequence[str]) -> list[Record]:
        listed = [names] if isinstance(names, str) else list(names)
        if len(set(listed)) != len(listed):
            raise ValueError(f"tensor names {listed} repeat a name: list each tensor once")
        return [self._record(name) for name in listed]

    def _allocate(self, arena: DeviceArena | HostArena, spec: ArraySpec) -> Slot:
        return arena.allocate(spec.nbytes, owner=spec.name)

    def _nvme_for(self, name: str) -> NvmeTier:
        if self._nvme is None:
            raise ValueError(
                f"tensor {name!r} cannot be homed on nvme: the store has no NVMe tier; set "
                f"StoreConfig.nvme_path and nvme_budget"
            )
        return self._nvme

    def _check_like(self, rec: Record, tensor: torch.Tensor) -> None:
        spec = rec.spec
        if tuple(tensor.shape) != spec.shape or tensor.dtype != spec.dtype:
            raise ValueError(
                f"tensor {spec.name!r} has shape {spec.shape} and {spec.dtype}, but the given "
                f"tensor has {tuple(tensor.shape)} and {tensor.dtype}: pass a matching tensor"
            )

    def _in_place(self, rec: Record) -> bool:
        """A HOST-home tensor paged in as its home slot itself (see :attr:`pages_host_in_place`)."""
        return rec.home is Tier.HOST and self.pages_host_in_place

    def _tier_of(self, tensor: torch.Tensor) -> Tier:
        return Tier.DEVICE if tensor.device == self.device else Tier.HOST

    def _abort(self, rec: Record) -> None:
        """A page-in failed: back to RELEASED, slot freed."""
        self._leave_device(rec, "fail")

    def _leave_device(self, rec: Record, event: str) -> None:
        """Take residency transition ``event`` (to RELEASED) and free ``rec``'s device slot
        unless it is its home slot."""
        rec.residency.apply(event)
        assert rec.device_slot is not None
        if rec.device_slot is not rec.home_slot:
            self._device_arena.free(rec.device_slot)
        rec.device_slot = None

    def _drop_home(self, rec: Record, *, delete_nvme: bool) -> None:
        """Free what the home tier of ``rec`` holds for it."""
        if rec.home is Tier.NVME:
            if delete_nvme:
                assert self._nvme is not None
                self._nvme.delete(rec.spec.name)
        elif rec.home_slot is not None:
            arena = self._device_arena if rec.home is Tier.DEVICE else self._host_arena
            arena.free(rec.home_slot)
            rec.home_slot = None

    # -- accounting and lifecycle ----------------------------------------------------------

    def stats(self) -> dict[Link, LinkStats]:
        """Traffic per link in :data:`LINKS` since the store opened (bytes, busy s, count)."""
        return self._io.stats()

    def holds(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor``'s first byte lies in the store's device or host arena."""
        return self._device_arena.holds(tensor) or self._host_arena.holds(tensor)

    def usage(self) -> dict[Tier, tuple[int, int]]:
        """``(used, capacity)`` bytes per tier; arena slots count padded to 4 KiB.

        DEVICE includes the slots of tensors paged in or in flight.
        """
        nvme = (self._nvme.used, self._nvme.capacity) if self._nvme is not None else (0, 0)
        return {
            Tier.DEVICE: (self._device_arena.used, self._device_arena.capacity),
            Tier.HOST: (self._host_arena.used, self._host_arena.capacity),
            Tier.NVME: nvme,
        }

    def close(self) -> None:
        """Wait for transfers in flight, stop the copy threads, release the NVMe lock, unpin
        and unmap the host arena and staging buffers (views of them must not be used)."""
        if self._closed:
            return
        self._closed = True
        for rec in self._records.values():
            with contextlib.suppress(BaseException):
                self._io.settle(rec, sync=True)
        self._io.shutdown()
        self._io.synchronize()
        self.stats()
        if self._nvme is not None:
            self._nvme.close()
        if self._backend is not None:
            self._backend.close()
        self._host_arena.release()  # pinned memory goes back now, not at exit
        if self._staging is not None:
            self._staging.release()


def padded_source(tensor: torch.Tensor) -> torch.Tensor | None:
    """``tensor``'s bytes and those after it up to a multiple of 4 KiB, as one ``uint8``
    view, when an NVMe write may leave from it directly: a contiguous CPU tensor at an
    aligned address whose storage extends over the padding (an arena slot, or a view of
    one); None otherwise. The padding is only read, and the chunk is cut to its size."""
    if tensor.device.type != "cpu" or not tensor.is_contiguous():
        return None
    if tensor.data_ptr() % ALIGNMENT:
        return None
    nbytes = padded(tensor.numel() * tensor.element_size())
    storage = tensor.untyped_storage()
    start = tensor.storage_offset() * tensor.element_size()
    if start + nbytes > storage.nbytes():
        return None
    return torch.empty(0, dtype=torch.uint8).set_(storage, start, (nbytes,), (1,))


def check_writable(rec: Record, what: str) -> None:
    """:class:`ReadOnlyTensorError` for a tensor read from files the store does not own."""
    if rec.external is not None:
        files = ", ".join(str(p.path) for p in rec.external.pieces[:2])
        raise ReadOnlyTensorError(
            f"tensor {rec.spec.name!r} is read-only (its bytes are files the store does not "
            f"own: {files}, ...), so it cannot {what}: register another tensor to write"
        )
