"""TieredStore: named tensors on three tiers, paged onto the compute device on demand.

Each tensor has one *home* tier (``DEVICE``, ``HOST`` or ``NVME``) holding its
authoritative copy, and one :class:`ResidencyMachine` saying whether a copy
is usable on the compute device (``RELEASED -> IN_FLIGHT -> RESIDENT ->
RELEASED``). Page-ins and write-backs run off the caller's thread: on the CPU
on small thread pools, one for tensors homed on NVMe and one for copies between
memory tiers, so memory copies never wait behind disk traffic (file I/O through
the I/O backend's own threads), on
CUDA as ``non_blocking`` copies on two side streams with events, so they
overlap the caller's compute. A :class:`Ticket` is the sync point of a batch of
transfers: :meth:`Ticket.wait` orders the caller's later device work after them,
:meth:`Ticket.wait_host` makes what they wrote to host memory visible to the host
(and their host sources free to reuse). Under the CPU double of CUDA's semantics
(``StoreConfig.cuda_double``, :mod:`storage.deferred`) copies between the device
arena and host memory behave as on CUDA: a host destination holds poison until
the host synchronised on the copy.

Operations on one tensor run in the order they were issued (each waits for the
previous one), so a page-in never reads contents that a write-back in flight
is still replacing.

Memory: the device arena and the host arena are carved once at setup; a
page-in takes a temporary slot of the device arena, ``DEVICE``-home tensors a
permanent one, ``HOST``-home tensors a slot of the host arena. When the compute
device is the CPU, host and device memory are the same RAM: a page-in of a
``HOST``-home tensor still goes RELEASED -> IN_FLIGHT -> RESIDENT, but its device
copy is its home slot itself (no copy, no device slot), and its write-back is a
no-op; under the CPU double it takes a device slot and is copied as on CUDA
(:attr:`TieredStore.pages_host_in_place`). NVMe
transfers land straight in aligned slots where the backend allows (CPU; kvikio
on CUDA), else they stream through the staging pool piece by piece, so no
tensor is limited by the size of a staging buffer (see
:mod:`storage.transfers`; residency lives in :mod:`storage.residency`).

Re-opening: ``register(name, home=Tier.NVME)`` with no tensor, shape or dtype
adopts an array already in the NVMe group (as does giving its exact shape and
dtype); a different shape or dtype raises ``ValueError``.

Threads: methods may run on several threads at once for different tensors
(say, a worker thread reading and writing optimizer state with :meth:`read` /
:meth:`write` while the training loop pages blocks in and out); the arenas,
staging pool, NVMe catalogue, link meters and the per-tensor order of
operations are thread-safe, and residency checks with their transitions are
taken under one lock. Registering, moving and closing are setup steps: run
them while no other thread uses the store.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import torch

from storage.deferred import CopyDouble, CopyEvent, double_requested
from storage.device import DeviceArena, Slot, resolve_device
from storage.external import ExternalSource, FilePiece, ReadOnlyTensorError
from storage.host import HostArena, StagingPool
from storage.io import ALIGNMENT, IOBackend, IOConfig, open_backend, padded
from storage.numa import device_numa_node
from storage.nvme import ArraySpec, NvmeTier
from storage.observers import TransferKind, TransferObserver, added, observed, removed
from storage.residency import Record, ResidencyMachine, StateError, Ticket
from storage.tiers import Link, Residency, Tier
from storage.transfers import (
    LINKS,
    Events,
    LinkStats,
    Transfers,
    Work,
    done_future,
    flat_bytes,
    order_after,
    settled,
    settled_all,
)

__all__ = ["LINKS", "LinkStats", "ResidencyMachine", "StateError", "StoreConfig", "Ticket"]
__all__ += ["TieredStore", "flat_bytes", "resolve_device"]


@dataclass(frozen=True, kw_only=True)
class StoreConfig:
    """Budgets and placement of a :class:`TieredStore`."""

    device_budget: int
    """Bytes of the device arena (ordinary memory without CUDA); rounded down to 4 KiB."""
    host_budget: int
    """Bytes of the host arena (pinned when the device is CUDA); rounded down to 4 KiB."""
    nvme_path: str | None = None
    """Directory of the NVMe tier's zarr group; ``None`` for no NVMe tier."""
    nvme_budget: int = 0
    """Bytes the NVMe tier may hold."""
    staging_buffers: int = 4
    """Aligned host buffers (pinned when the device is CUDA) for NVMe transfers that cannot
    go direct."""
    staging_bytes: int = 64 << 20
    """Bytes of each staging buffer (a multiple of 4096): the piece size of staged NVMe
    transfers, which stream a tensor of any size through one buffer at a time."""
    stage_nvme: bool = False
    """Stage every NVMe transfer, piece by piece, even where it could land straight in an
    arena slot (on the CPU, or with kvikio); off by default."""
    io: IOConfig = field(default_factory=IOConfig)
    """I/O backend of the NVMe tier."""
    device: str | None = None
    """Compute device: ``"cuda"``, ``"cuda:1"``, ``"cpu"``; ``None`` = cuda when available."""
    copy_threads: int = 2
    """Threads that run page-ins and write-backs, per pool: one pool serves tensors homed
    on NVMe, one the others (on CUDA they only issue copies)."""
    scratch_checksums: bool = False
    """Give NVMe-homed tensors registered as scratch (``register(..., scratch=True)``:
    rewritten often, never reopened by another process) CRC-32C trailers too. Off: their
    chunks are written and read without one (format 1 layout), which spares a checksum
    pass over every byte each way (about 1 CPU second per 6 GB on one core)."""
    nvme_scratch: Mapping[str, Any] | None = None
    """The NVMe directory is the opening run's scratch (:mod:`storage.scratch`): a
    JSON-serialisable description of what the run built it for, recorded in the
    directory's marker. A missing directory is created when its parent exists; a file, or
    a directory holding anything but a run's scratch (a converted store, a checkpoint, a
    user's files), is refused and left untouched; the last run's scratch arrays are
    removed. None: a plain store directory, reopened with its arrays."""
    cuda_double: bool | None = None
    """On a CPU device, run copies between the device arena and host memory under the CPU
    double of CUDA's semantics (:mod:`storage.deferred`: destinations poisoned until the
    host synchronises), for tests; None reads the environment variable
    ``BB_CUDA_DOUBLE``. Never on a CUDA device (it has the real semantics)."""

    def __post_init__(self) -> None:
        for key in ("device_budget", "host_budget", "nvme_budget"):
            value = getattr(self, key)
            if not isinstance(value, int) or value < 0:
                raise ValueError(f"StoreConfig.{key}={value!r} must be an int >= 0 (bytes)")
        if self.nvme_path is None and self.nvme_budget:
            raise ValueError(
                f"StoreConfig.nvme_budget={self.nvme_budget} bytes but nvme_path is None: "
                f"set nvme_path to a directory, or nvme_budget=0"
            )
        if self.nvme_path is not None and self.nvme_budget <= 0:
            raise ValueError(
                f"StoreConfig.nvme_path={self.nvme_path!r} with nvme_budget=0 bytes: "
                f"give the NVMe tier a budget > 0, or nvme_path=None"
            )
        if self.staging_buffers < 1:
            raise ValueError(f"StoreConfig.staging_buffers={self.staging_buffers} must be >= 1")
        if self.staging_bytes <= 0 or self.staging_bytes % ALIGNMENT:
            raise ValueError(
                f"StoreConfig.staging_bytes={self.staging_bytes} must be a positive multiple of "
                f"{ALIGNMENT} bytes: use e.g. {max(ALIGNMENT, padded(self.staging_bytes))}"
            )
        if self.copy_threads < 1:
            raise ValueError(f"StoreConfig.copy_threads={self.copy_threads} must be >= 1")
        resolve_device(self.device)

    @property
    def budgets(self) -> dict[Tier, int]:
        """Bytes per tier the store holds: the device and host budgets rounded down to
        4 KiB as their arenas are carved, the NVMe budget as given."""
        return {
            Tier.DEVICE: self.device_budget - self.device_budget % ALIGNMENT,
            Tier.HOST: self.host_budget - self.host_budget % ALIGNMENT,
            Tier.NVME: self.nvme_budget,
        }


def _padded_bytes(tensor: torch.Tensor) -> torch.Tensor | None:
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


class TieredStore:
    """Named tensors on DEVICE / HOST / NVME tiers with asynchronous page-in and write-back.

    Lifecycle of a non-``DEVICE`` tensor: :meth:`prefetch_async` (RELEASED ->
    IN_FLIGHT), :meth:`Ticket.wait` (-> RESIDENT), :meth:`get`, optionally
    :meth:`write_back_async`, :meth:`release` (-> RELEASED). ``DEVICE``-home
    tensors are always RESIDENT: prefetching them returns their tensor and
    releasing them is a no-op, so callers can treat every tensor alike.
    """

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

    # -- paging ----------------------------------------------------------------------------

    def prefetch_async(self, names: str | Sequence[str]) -> Ticket:
        """Start copying ``names`` into device-arena slots (RELEASED -> IN_FLIGHT).

        Checks every name before starting anything. Raises
        :class:`storage.device.ArenaFullError` when the device arena cannot
        hold the tensors in flight (nothing starts then).
        """
        records = self._records_of(names)
        with self._lock:
            return self._prefetch_locked(records)

    def _prefetch_locked(self, records: list[Record]) -> Ticket:
        for rec in records:
            if rec.home is not Tier.DEVICE:
                rec.residency.check("page_in")
        ready = self._io.ready()
        slots: list[Slot] = []
        try:
            for rec in records:
                if rec.home is not Tier.DEVICE and not self._in_place(rec):
                    slots.append(self._allocate(self._device_arena, rec.spec))
        except BaseException:
            for slot in slots:
                self._device_arena.free(slot)
            raise
        entries: list[tuple[Record, Future[CopyEvent | None]]] = []
        paged = frozenset(r.spec.name for r in records if r.home is not Tier.DEVICE)
        results: dict[str, torch.Tensor] = {}
        it = iter(slots)
        for rec in records:
            if self._in_place(rec):  # the host copy is already in device memory
                rec.residency.apply("page_in")
                rec.device_slot = rec.home_slot
                entries.append((rec, self._submit(rec, lambda after: None, TransferKind.PAGE_IN)))
            elif rec.home is not Tier.DEVICE:
                slot = next(it)
                rec.residency.apply("page_in")
                rec.device_slot = slot
                work = self._page_in_work(rec, slot, ready)
                entries.append((rec, self._submit(rec, work, TransferKind.PAGE_IN)))
            else:
                entries.append((rec, rec.last or done_future()))
            results[rec.spec.name] = rec.device_view()
        return self._ticket(entries, paged=paged, results=results)

    def get(self, name: str) -> torch.Tensor:
        """The device tensor of RESIDENT tensor ``name`` (a view into the device arena).

        For a DEVICE-home tensor (or a HOST-home one paged in place on a CPU device) it
        waits for a ``write_back_async(name, src)`` in flight.
        """
        rec = self._record(name)
        if rec.residency.state is not Residency.RESIDENT:
            hint = rec.residency.hint()
            raise StateError(f"tensor {name!r} is {rec.residency.state.value.upper()}: {hint}")
        in_place = rec.home is Tier.DEVICE or rec.device_slot is rec.home_slot
        if in_place and rec.last is not None:  # a write_back_async(name, src)
            order_after(self._io.settle(rec), self.device)
        return rec.device_view()

    def release(self, names: str | Sequence[str]) -> None:
        """Free the device slots of RESIDENT ``names`` (-> RELEASED); no-op for DEVICE home.

        Waits for a write-back of the tensor still reading its device copy.
        Raises :class:`StateError` for a tensor not RESIDENT (nothing released then).
        """
        records = [r for r in self._records_of(names) if r.home is not Tier.DEVICE]
        with self._lock:
            for rec in records:
                rec.residency.check("release")
        for rec in records:
            event = self._io.settle(rec)
            # later kernels and page-ins into this slot come after it; host_view() and
            # read() still synchronise on it (a write-back lands in host memory)
            order_after(event, self.device)
            self._io.remember(rec, event)
            with self._lock:
                rec.residency.apply("release")
                assert rec.device_slot is not None
                if rec.device_slot is not rec.home_slot:
                    self._device_arena.free(rec.device_slot)
                rec.device_slot = None

    def write_back_async(self, name: str, src: torch.Tensor | None = None) -> Ticket:
        """Copy the device copy of ``name`` (or ``src``) to its home tier, overlapped.

        The device copy stays usable; neither it nor ``src`` may be modified
        until the ticket is done. ``src`` replaces the home contents only (the
        device copy is left as it is).
        """
        rec = self._record(name)
        _check_writable(rec, "write back")
        src_raw: torch.Tensor | None = None
        if src is None:
            if rec.residency.state is not Residency.RESIDENT:
                raise StateError(
                    f"tensor {name!r} is {rec.residency.state.value.upper()}: write-back needs "
                    f"its device copy; {rec.residency.hint()}"
                )
            out = rec.device_view()
            if rec.home is Tier.DEVICE or rec.device_slot is rec.home_slot:  # nothing to copy
                return self._ticket([(rec, rec.last or done_future())], results={name: out})
            assert rec.device_slot is not None
            data, tier, src_raw = (
                rec.device_slot.raw()[: rec.spec.nbytes],
                Tier.DEVICE,
                rec.device_slot.raw(),
            )
        else:
            self._check_like(rec, src)
            out, data, tier = src, flat_bytes(src), self._tier_of(src)
            src_raw = _padded_bytes(src) if rec.home is Tier.NVME else None
            if data.is_cuda and self._cuda:  # used by the stream that runs the copy
                to_device = rec.home is Tier.DEVICE
                data.record_stream(
                    self._io.streams[Link.HOST_TO_DEVICE if to_device else Link.DEVICE_TO_HOST]
                )
        # host-only write-backs (a host source to a HOST or NVMe home) need no device progress
        ready = self._ready_if(self._on_device(data) or rec.home is Tier.DEVICE)
        fut = self._submit(
            rec,
            lambda after: self._io.store(rec, data, tier, src_raw, after + ready),
            TransferKind.WRITE_BACK,
        )
        return self._ticket([(rec, fut)], results={name: out})

    @property
    def pages_host_in_place(self) -> bool:
        """Whether a page-in of a HOST-home tensor is its home slot itself (no copy, no device
        slot, write-back a no-op): on a CPU device, except under the double, which pages it
        into a device slot with deferred copies as on CUDA."""
        return not self._cuda and self._io.double is None

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

    def copy_to_host_async(
        self, dsts: Sequence[torch.Tensor], srcs: Sequence[torch.Tensor]
    ) -> list[CopyEvent | None]:
        """Copy each contiguous tensor of ``srcs`` on the compute device into the matching
        host tensor of ``dsts`` (pinned, contiguous, same shape and dtype), after the
        caller's queued device work; on CUDA ``non_blocking`` on the stream towards the host.

        Returns the copies' events: :func:`storage.transfers.settled` on each before the
        host reads ``dsts``; ``srcs`` may be freed at once (their memory is kept for the
        copy). Counted on the ``device->host`` link.
        """
        if len(dsts) != len(srcs):
            raise ValueError(f"{len(dsts)} destinations for {len(srcs)} sources: pass pairs")
        ready = self._io.ready()
        events: list[CopyEvent | None] = []
        for dst, src in zip(dsts, srcs, strict=True):
            if dst.shape != src.shape or dst.dtype != src.dtype or not dst.is_contiguous():
                raise ValueError(
                    f"destination {tuple(dst.shape)} {dst.dtype} (contiguous: "
                    f"{dst.is_contiguous()}) does not take source {tuple(src.shape)} "
                    f"{src.dtype}: pass a contiguous host tensor like the source"
                )
            data = flat_bytes(src)
            if data.is_cuda:
                data.record_stream(self._io.streams[Link.DEVICE_TO_HOST])
            out = flat_bytes(dst)
            events.append(
                self._io.copy(out, Tier.HOST, data, Tier.DEVICE, ready, src_on_device=True)
            )
        return events

    # -- synchronous access ----------------------------------------------------------------

    def read(self, name: str, out: torch.Tensor | None = None) -> torch.Tensor:
        """The home-tier contents of ``name`` in a new (or the given) CPU tensor.

        Waits for this tensor's pending operations first. Changes made to a
        paged-in device copy show here only after a write-back. An NVMe read goes
        straight into ``out`` when ``out`` starts at a 4 KiB-aligned address and the
        tensor is a whole number of 4 KiB blocks (else through the staging buffers).
        """
        rec = self._record(name)
        if out is not None:
            self._check_out(rec, out)
        self._io.settle(rec, sync=True)
        if out is None and rec.home is Tier.NVME and rec.written and rec.spec.nbytes:
            return self._io.read_home(rec, None)
        result = torch.empty(rec.spec.shape, dtype=rec.spec.dtype) if out is None else out
        settled(self._read_into(rec, result, self._ready_if(rec.home is Tier.DEVICE)))
        return result

    def read_async(self, name: str, out: torch.Tensor) -> Ticket:
        """Start reading the home-tier contents of ``name`` into ``out`` on the copy threads.

        ``out`` is a contiguous CPU tensor of the tensor's shape and dtype; it must not be
        used until the ticket is done (:meth:`Ticket.wait` returns ``{name: out}``). The
        read runs after this tensor's pending operations (a write-back in flight lands
        first) and follows the same rules as :meth:`read`.
        """
        rec = self._record(name)
        self._check_out(rec, out)
        ready = self._ready_if(rec.home is Tier.DEVICE)  # else no device memory is read
        fut = self._submit(
            rec, lambda after: self._read_into(rec, out, after + ready), TransferKind.READ
        )
        return self._ticket([(rec, fut)], results={name: out})

    def _check_out(self, rec: Record, out: torch.Tensor) -> None:
        self._check_like(rec, out)
        if out.device.type != "cpu" or not out.is_contiguous():
            raise ValueError(
                f"tensor {rec.spec.name!r}: out must be a contiguous CPU tensor, got one on "
                f"{out.device}: pass out=None to get a new one"
            )

    def _read_into(self, rec: Record, out: torch.Tensor, after: Events) -> CopyEvent | None:
        """Copy the home contents of ``rec`` into the CPU tensor ``out``."""
        spec = rec.spec
        if not spec.nbytes:
            return None
        if rec.home is Tier.NVME:
            settled_all(after)
            if rec.written:
                self._io.read_home(rec, out)
            else:
                out.zero_()
            return None
        assert rec.home_slot is not None
        src = rec.home_slot.raw()[: spec.nbytes]
        return self._io.copy(flat_bytes(out), Tier.HOST, src, rec.home, after)

    def write(self, name: str, tensor: torch.Tensor) -> None:
        """Set the contents of ``name`` from ``tensor`` (same shape and dtype, any device).

        Updates the home tier and, when paged in, the device copy; returns
        when both hold the new contents.
        """
        rec = self._record(name)
        _check_writable(rec, "write")
        self._check_like(rec, tensor)
        self._io.settle(rec, sync=True)
        data = flat_bytes(tensor)
        tier = self._tier_of(tensor)
        slot = rec.device_slot  # by identity: Slots compare their buffers' elements
        device_copy = rec.home is not Tier.DEVICE and slot is not None and slot is not rec.home_slot
        ready = self._ready_if(self._on_device(data) or rec.home is Tier.DEVICE or device_copy)
        settled(self._io.store(rec, data, tier, None, ready))
        if device_copy:
            assert rec.device_slot is not None
            dst = rec.device_slot.raw()[: rec.spec.nbytes]
            settled(self._io.copy(dst, Tier.DEVICE, data, tier, ready))

    def host_view(self, name: str) -> torch.Tensor:
        """The home contents of HOST-home ``name`` as a view of the host arena (no copy).

        Waits for this tensor's pending operations first. Changes made through the view
        are its new contents (as after :meth:`write`, without a device copy to update):
        the caller must not change it while the tensor is paged in on a CUDA device or
        while another thread reads or writes it. Raises ``ValueError`` for another home,
        and :class:`StateError` while it is paged in by copy (on CUDA, or under the double).
        """
        rec = self._record(name)
        if rec.home is not Tier.HOST:
            raise ValueError(
                f"tensor {name!r} is homed on {rec.home.value}, not host: only HOST-home "
                f"tensors have a host view; use read() and write() instead"
            )
        if not self.pages_host_in_place and rec.residency.state is not Residency.RELEASED:
            raise StateError(
                f"tensor {name!r} is {rec.residency.state.value.upper()} on {self.device}: "
                f"a host view would miss its device copy; {rec.residency.hint()}"
            )
        self._io.settle(rec, sync=True)
        assert rec.home_slot is not None
        return rec.home_slot.view(rec.spec.shape, rec.spec.dtype)

    def move(self, name: str, tier: Tier) -> None:
        """Change the home tier of ``name``, keeping its contents.

        The tensor must be RELEASED (or homed on DEVICE). The destination's
        budget is checked first; on any failure nothing changes.
        """
        rec = self._record(name)
        tier = Tier(tier)
        if tier is rec.home:
            return
        _check_writable(rec, f"move to {tier.value}")
        if rec.home is not Tier.DEVICE and rec.residency.state is not Residency.RELEASED:
            raise StateError(
                f"tensor {name!r} is {rec.residency.state.value.upper()}: move() to "
                f"{tier.value} needs it RELEASED; {rec.residency.hint()}"
            )
        self._io.settle(rec, sync=True)
        new = Record(
            spec=rec.spec, home=tier, residency=rec.residency, written=False, scratch=rec.scratch
        )
        if tier is Tier.NVME:
            nvme = self._nvme_for(name)
            if nvme.contains(name):
                raise ValueError(
                    f"tensor {name!r}: the NVMe group already holds an unregistered array of "
                    f"that name: delete it from the group or rename the tensor"
                )
            nvme.create(
                name,
                rec.spec.shape,
                rec.spec.dtype,
                checksum=rec.spec.checksum,
                durable=not rec.scratch,
            )
        else:
            arena = self._device_arena if tier is Tier.DEVICE else self._host_arena
            new.home_slot = self._allocate(arena, rec.spec)
        try:
            if tier is Tier.NVME:
                assert rec.home_slot is not None
                raw = rec.home_slot.raw()
                event = self._io.store(new, raw[: rec.spec.nbytes], rec.home, raw, self._io.ready())
            else:
                assert new.home_slot is not None
                event = self._io.load(rec, new.home_slot, tier, self._io.ready())
            settled(event)
        except BaseException:
            self._drop_home(new, delete_nvme=True)
            raise
        self._drop_home(rec, delete_nvme=True)
        if rec.home is Tier.DEVICE:
            rec.residency.apply("home_off_device")
            rec.device_slot = None
        rec.home, rec.home_slot, rec.written = tier, new.home_slot, new.written
        if tier is Tier.DEVICE:
            rec.residency.apply("home_on_device")
            rec.device_slot = rec.home_slot

    # -- transfers (run on the copy threads, each after the previous one on its tensor) ----

    def _on_device(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` is device memory: CUDA, or a slot of the device arena."""
        return tensor.is_cuda or self._device_arena.holds(tensor)

    def _ready_if(self, needed: bool) -> Events:
        """The caller's stream's progress for a transfer that touches device memory
        (``needed``); nothing for one between host memory and files only."""
        return self._io.ready() if needed else ()

    def _page_in_work(self, rec: Record, slot: Slot, ready: Events) -> Work:
        return lambda after: self._io.load(rec, slot, Tier.DEVICE, after + ready)

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
        rec.residency.apply("fail")
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

    def __enter__(self) -> TieredStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _check_writable(rec: Record, what: str) -> None:
    """:class:`ReadOnlyTensorError` for a tensor read from files the store does not own."""
    if rec.external is not None:
        files = ", ".join(str(p.path) for p in rec.external.pieces[:2])
        raise ReadOnlyTensorError(
            f"tensor {rec.spec.name!r} is read-only (its bytes are files the store does not "
            f"own: {files}, ...), so it cannot {what}: register another tensor to write"
        )
