"""TieredStore: named tensors on three tiers, paged onto the compute device on demand.

Each tensor has one *home* tier (``DEVICE``, ``HOST`` or ``NVME``) holding its
authoritative copy, and one :class:`ResidencyMachine` saying whether a copy
is usable on the compute device (``RELEASED -> IN_FLIGHT -> RESIDENT ->
RELEASED``). Page-ins and write-backs run off the caller's thread: on the CPU
on a small thread pool (file I/O through the I/O backend's own threads), on
CUDA as ``non_blocking`` copies on two side streams with events, so they
overlap the caller's compute. :meth:`Ticket.wait` is the one sync point of a
batch of transfers.

Operations on one tensor run in the order they were issued (each waits for the
previous one), so a page-in never reads contents that a write-back in flight
is still replacing.

Memory: the device arena and the host arena are carved once at setup; a
page-in takes a temporary slot of the device arena, ``DEVICE``-home tensors a
permanent one, ``HOST``-home tensors a slot of the host arena. NVMe
transfers land straight in aligned slots where the backend allows (CPU; kvikio
on CUDA), else they pass through the staging pool.

Re-opening: ``register(name, home=Tier.NVME)`` with no tensor, shape or dtype
adopts an array already in the NVMe group (as does giving its exact shape and
dtype); a different shape or dtype raises ``ValueError``.

All methods are called from one thread (the training loop's).
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import ClassVar

import torch

from storage.device import DeviceArena, Slot
from storage.host import HostArena, StagingPool
from storage.io import ALIGNMENT, IOBackend, IOConfig, aligned_empty, open_backend, padded
from storage.nvme import ArraySpec, NvmeTier
from storage.tiers import Residency, Tier, format_bytes

__all__ = ["LINKS", "LinkStats", "ResidencyMachine", "StateError", "StoreConfig", "Ticket"]
__all__ += ["TieredStore"]

LINKS = ("nvme->host", "host->device", "device->host", "host->nvme", "nvme->device", "device->nvme")
"""Copy links counted by :meth:`TieredStore.stats`; ``nvme->device`` / ``device->nvme`` are file
transfers that land in (or leave from) a device-arena slot without staging."""

_Events = tuple[torch.cuda.Event, ...]
_Work = Callable[[_Events], "torch.cuda.Event | None"]


class StateError(ValueError):
    """An illegal residency transition: names the tensor, its state and the attempt."""


class ResidencyMachine:
    """The residency of one tensor, changed only through the transition table."""

    TRANSITIONS: ClassVar[dict[tuple[Residency, str], Residency]] = {
        (Residency.RELEASED, "page_in"): Residency.IN_FLIGHT,
        (Residency.IN_FLIGHT, "arrive"): Residency.RESIDENT,
        (Residency.IN_FLIGHT, "fail"): Residency.RELEASED,
        (Residency.RESIDENT, "release"): Residency.RELEASED,
        (Residency.RELEASED, "home_on_device"): Residency.RESIDENT,
        (Residency.RESIDENT, "home_off_device"): Residency.RELEASED,
    }
    """``(state, event) -> next state``; any other pair is illegal."""
    _HINTS: ClassVar[dict[Residency, str]] = {
        Residency.RELEASED: "prefetch_async() it and wait on the ticket first",
        Residency.IN_FLIGHT: "wait on its ticket first",
        Residency.RESIDENT: "it is already on the device: use get(), or release() it first",
    }

    def __init__(self, name: str, state: Residency = Residency.RELEASED) -> None:
        self.name = name
        self.state = state

    def check(self, event: str) -> Residency:
        """The state ``event`` leads to; raises :class:`StateError` if illegal now."""
        nxt = self.TRANSITIONS.get((self.state, event))
        if nxt is None:
            raise StateError(
                f"tensor {self.name!r} is {self.state.value.upper()}: transition {event!r} is "
                f"illegal from that state; {self._HINTS[self.state]}"
            )
        return nxt

    def apply(self, event: str) -> Residency:
        """Take the transition ``event`` (see :attr:`TRANSITIONS`)."""
        self.state = self.check(event)
        return self.state


@dataclass(frozen=True)
class LinkStats:
    """Traffic on one copy link since the store opened."""

    bytes: int
    """Bytes moved."""
    seconds: float
    """Seconds during which at least one transfer was running on the link."""
    count: int
    """Transfers completed."""

    @property
    def bandwidth(self) -> float:
        """Bytes per busy second (bytes/s); 0 before any transfer."""
        return self.bytes / self.seconds if self.seconds > 0 else 0.0


class _Meter:
    """Thread-safe byte and busy-time counter of one link (overlapping transfers counted once)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._bytes = self._count = self._active = 0
        self._busy = self._since = 0.0

    @contextlib.contextmanager
    def timing(self, nbytes: int) -> Iterator[None]:
        with self._lock:
            if self._active == 0:
                self._since = time.perf_counter()
            self._active += 1
        try:
            yield
        finally:
            with self._lock:
                self._active -= 1
                self._bytes += nbytes
                self._count += 1
                if self._active == 0:
                    self._busy += time.perf_counter() - self._since

    def add(self, nbytes: int, seconds: float) -> None:
        with self._lock:
            self._bytes, self._count, self._busy = (
                self._bytes + nbytes,
                self._count + 1,
                self._busy + seconds,
            )

    def snapshot(self) -> LinkStats:
        with self._lock:
            busy = self._busy + (time.perf_counter() - self._since if self._active else 0.0)
            return LinkStats(bytes=self._bytes, seconds=busy, count=self._count)


@dataclass(frozen=True, kw_only=True)
class StoreConfig:
    """Budgets and placement of a :class:`TieredStore`."""

    device_budget: int
    """Bytes of the device arena (ordinary memory without CUDA); rounded down to 4 KiB."""
    host_budget: int
    """Bytes of the host arena (pinned where CUDA exists); rounded down to 4 KiB."""
    nvme_path: str | None = None
    """Directory of the NVMe tier's zarr group; ``None`` for no NVMe tier."""
    nvme_budget: int = 0
    """Bytes the NVMe tier may hold."""
    staging_buffers: int = 4
    """Aligned host buffers (pinned on CUDA) for NVMe transfers that cannot go direct."""
    staging_bytes: int = 64 << 20
    """Bytes of each staging buffer (a multiple of 4096); on CUDA with the POSIX backend it
    bounds the size of one NVMe-home tensor."""
    io: IOConfig = field(default_factory=IOConfig)
    """I/O backend of the NVMe tier."""
    device: str | None = None
    """Compute device: ``"cuda"``, ``"cuda:1"``, ``"cpu"``; ``None`` = cuda when available."""
    copy_threads: int = 2
    """Threads that run page-ins and write-backs (on CUDA they only issue copies)."""

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


def resolve_device(spec: str | None) -> torch.device:
    """The compute device for ``StoreConfig.device`` (``ValueError`` when unusable)."""
    if spec is None:
        if torch.cuda.is_available():
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")
    try:
        device = torch.device(spec)
    except (RuntimeError, TypeError) as exc:
        raise ValueError(
            f"StoreConfig.device={spec!r} is not a device: use 'cuda' or 'cpu'"
        ) from exc
    if device.type == "cpu":
        return device
    if device.type != "cuda":
        raise ValueError(f"StoreConfig.device={spec!r}: only 'cuda[:N]' and 'cpu' are supported")
    if not torch.cuda.is_available():
        raise ValueError(f"StoreConfig.device={spec!r} but CUDA is not available: use 'cpu'")
    index = torch.cuda.current_device() if device.index is None else device.index
    if index >= torch.cuda.device_count():
        raise ValueError(
            f"StoreConfig.device={spec!r} but only {torch.cuda.device_count()} CUDA devices exist"
        )
    return torch.device("cuda", index)


def flat_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """The bytes of ``tensor`` as a 1-D ``uint8`` tensor (a view when contiguous)."""
    return tensor.detach().contiguous().reshape(-1).view(torch.uint8)


@dataclass(eq=False)
class _Record:
    """Everything the store knows about one tensor."""

    spec: ArraySpec
    home: Tier
    residency: ResidencyMachine
    home_slot: Slot | None = None
    """Its slot in the device arena (``DEVICE`` home) or host arena (``HOST`` home)."""
    device_slot: Slot | None = None
    """Its slot in the device arena while paged in (the home slot for ``DEVICE`` home)."""
    written: bool = True
    """``NVME`` home: whether its chunk file exists (never-written tensors read as zeros)."""
    last: Future[torch.cuda.Event | None] | None = None
    """The last operation issued on it; the next one waits for it."""

    def device_view(self) -> torch.Tensor:
        assert self.device_slot is not None, f"{self.spec.name} has no device slot"
        return self.device_slot.view(self.spec.shape, self.spec.dtype)


class Ticket:
    """Handle of page-ins or write-backs in flight; :meth:`wait` is their sync point."""

    def __init__(
        self,
        entries: list[tuple[_Record, Future[torch.cuda.Event | None]]],
        *,
        paged: frozenset[str],
        results: dict[str, torch.Tensor],
        on_fail: Callable[[_Record], None],
        device: torch.device,
    ) -> None:
        self._entries = entries
        self._device = device
        self._paged = paged
        self._results = results
        self._on_fail = on_fail
        self._waited = False

    def done(self) -> bool:
        """Whether every transfer has been issued and finished on the host side; never blocks."""
        return all(fut.done() for _, fut in self._entries)

    def wait(self) -> dict[str, torch.Tensor]:
        """Block until the transfers completed; page-ins become ``RESIDENT``.

        Returns ``name -> device tensor`` (views into the device arena for
        page-ins, the written source for write-backs). On CUDA the current
        stream is made to wait for the copies instead of the host. Re-raises
        the first transfer error (failed page-ins go back to ``RELEASED``).
        """
        if self._waited:
            return dict(self._results)
        error: BaseException | None = None
        for rec, fut in self._entries:
            try:
                event = fut.result()
            except BaseException as exc:
                error = error or exc
                if rec.spec.name in self._paged:
                    self._on_fail(rec)
                self._results.pop(rec.spec.name, None)
                continue
            if event is not None:
                torch.cuda.current_stream(self._device).wait_event(event)
            if rec.spec.name in self._paged:
                rec.residency.apply("arrive")
        self._waited = True
        if error is not None:
            raise error
        return dict(self._results)


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
        self._records: dict[str, _Record] = {}
        self._meters = {link: _Meter() for link in LINKS}
        self._timings: list[tuple[str, int, torch.cuda.Event, torch.cuda.Event]] = []
        self._timings_lock = threading.Lock()
        self._closed = True
        self._device_arena = DeviceArena(config.device_budget, self.device)
        self._host_arena = HostArena(config.host_budget)
        self._backend: IOBackend | None = None
        self._nvme: NvmeTier | None = None
        self._staging: StagingPool | None = None
        if config.nvme_path is not None:
            backend = open_backend(config.io)
            try:
                self._nvme = NvmeTier(
                    config.nvme_path, capacity=config.nvme_budget, backend=backend
                )
            except BaseException:
                backend.close()
                raise
            self._backend = backend
            self._staging = StagingPool(config.staging_buffers, config.staging_bytes)
        # NVMe transfers land in device-arena slots directly on the CPU and with kvikio
        self._direct = not self._cuda or (
            self._backend is not None and self._backend.name == "kvikio"
        )
        self._streams: dict[str, torch.cuda.Stream] = {}
        if self._cuda:
            self._streams = {d: torch.cuda.Stream(self.device) for d in ("h2d", "d2h")}
        self._pool = ThreadPoolExecutor(config.copy_threads, thread_name_prefix="bb-store")
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
    ) -> None:
        """Add tensor ``name`` homed on ``home``, from ``tensor`` (copied) or ``shape``/``dtype``.

        Without a tensor its contents are zeros (on ``NVME``: metadata only
        until the first write). On ``NVME``, a name already in the group is
        adopted when shape and dtype match (both may be omitted). Raises
        ``ValueError`` when the tier cannot hold it, naming the bytes needed
        and free; nothing changes then.
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
        spec = ArraySpec(name=name, shape=dims, dtype=dtype, nbytes=nbytes)
        rec = _Record(spec=spec, home=home, residency=ResidencyMachine(name))
        if home is Tier.NVME:
            assert nvme is not None
            self._check_staging(spec)
            if existing is not None:
                if (existing.shape, existing.dtype) != (dims, dtype):
                    raise ValueError(
                        f"tensor {name!r}: the NVMe group holds it with shape {existing.shape} "
                        f"and {existing.dtype}, not {dims} and {dtype}: register it with the "
                        f"stored shape and dtype, or use another name"
                    )
                rec.written = nvme.chunk_path(name).exists() or nbytes == 0
            else:
                nvme.create(name, dims, dtype)
                rec.written = False
        else:
            arena = self._device_arena if home is Tier.DEVICE else self._host_arena
            rec.home_slot = self._allocate(arena, spec)
            if home is Tier.DEVICE:
                rec.device_slot = rec.home_slot
                rec.residency.apply("home_on_device")
        try:
            if tensor is not None:
                self._settled(self._store(rec, flat_bytes(tensor), self._tier_of(tensor), None, ()))
            elif home is not Tier.NVME:
                assert rec.home_slot is not None
                self._settled(self._fill_zero(rec.home_slot.raw()[:nbytes], ()))
        except BaseException:
            self._drop_home(rec, delete_nvme=existing is None)
            raise
        self._records[name] = rec

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
        for rec in records:
            if rec.home is not Tier.DEVICE:
                rec.residency.check("page_in")
        ready = self._ready()
        slots: list[Slot] = []
        try:
            for rec in records:
                if rec.home is not Tier.DEVICE:
                    slots.append(self._allocate(self._device_arena, rec.spec))
        except BaseException:
            for slot in slots:
                self._device_arena.free(slot)
            raise
        entries: list[tuple[_Record, Future[torch.cuda.Event | None]]] = []
        paged = frozenset(r.spec.name for r in records if r.home is not Tier.DEVICE)
        results: dict[str, torch.Tensor] = {}
        it = iter(slots)
        for rec in records:
            if rec.home is not Tier.DEVICE:
                slot = next(it)
                rec.residency.apply("page_in")
                rec.device_slot = slot
                entries.append((rec, self._submit(rec, self._page_in_work(rec, slot, ready))))
            else:
                entries.append((rec, rec.last or _done_future()))
            results[rec.spec.name] = rec.device_view()
        return Ticket(
            entries, paged=paged, results=results, on_fail=self._abort, device=self.device
        )

    def get(self, name: str) -> torch.Tensor:
        """The device tensor of RESIDENT tensor ``name`` (a view into the device arena).

        For a DEVICE-home tensor it waits for a ``write_back_async(name, src)`` in flight.
        """
        rec = self._record(name)
        if rec.residency.state is not Residency.RESIDENT:
            hint = ResidencyMachine._HINTS[rec.residency.state]
            raise StateError(f"tensor {name!r} is {rec.residency.state.value.upper()}: {hint}")
        if rec.home is Tier.DEVICE and rec.last is not None:  # a write_back_async(name, src)
            event = self._settle(rec)
            if event is not None:
                torch.cuda.current_stream(self.device).wait_event(event)
        return rec.device_view()

    def release(self, names: str | Sequence[str]) -> None:
        """Free the device slots of RESIDENT ``names`` (-> RELEASED); no-op for DEVICE home.

        Waits for a write-back of the tensor still reading its device copy.
        Raises :class:`StateError` for a tensor not RESIDENT (nothing released then).
        """
        records = [r for r in self._records_of(names) if r.home is not Tier.DEVICE]
        for rec in records:
            rec.residency.check("release")
        for rec in records:
            event = self._settle(rec)
            if event is not None:  # later kernels and page-ins into this slot come after it
                torch.cuda.current_stream(self.device).wait_event(event)
            rec.residency.apply("release")
            assert rec.device_slot is not None
            self._device_arena.free(rec.device_slot)
            rec.device_slot = None

    def write_back_async(self, name: str, src: torch.Tensor | None = None) -> Ticket:
        """Copy the device copy of ``name`` (or ``src``) to its home tier, overlapped.

        The device copy stays usable; neither it nor ``src`` may be modified
        until the ticket is done. ``src`` replaces the home contents only (the
        device copy is left as it is).
        """
        rec = self._record(name)
        src_raw: torch.Tensor | None = None
        if src is None:
            if rec.residency.state is not Residency.RESIDENT:
                raise StateError(
                    f"tensor {name!r} is {rec.residency.state.value.upper()}: write-back needs "
                    f"its device copy; {ResidencyMachine._HINTS[rec.residency.state]}"
                )
            out = rec.device_view()
            if rec.home is Tier.DEVICE:
                return Ticket([(rec, rec.last or _done_future())], paged=frozenset(),
                              results={name: out}, on_fail=self._abort, device=self.device)  # fmt: skip
            assert rec.device_slot is not None
            data, tier, src_raw = (
                rec.device_slot.raw()[: rec.spec.nbytes],
                Tier.DEVICE,
                rec.device_slot.raw(),
            )
        else:
            self._check_like(rec, src)
            out, data, tier = src, flat_bytes(src), self._tier_of(src)
            if data.is_cuda and self._cuda:
                data.record_stream(self._streams["d2h"])
        ready = self._ready()
        fut = self._submit(rec, lambda after: self._store(rec, data, tier, src_raw, after + ready))
        return Ticket([(rec, fut)], paged=frozenset(), results={name: out}, on_fail=self._abort,
                      device=self.device)  # fmt: skip

    # -- synchronous access ----------------------------------------------------------------

    def read(self, name: str, out: torch.Tensor | None = None) -> torch.Tensor:
        """The home-tier contents of ``name`` in a new (or the given) CPU tensor.

        Waits for this tensor's pending operations first. Changes made to a
        paged-in device copy show here only after a write-back.
        """
        rec = self._record(name)
        spec = rec.spec
        if out is not None:
            self._check_like(rec, out)
            if out.device.type != "cpu" or not out.is_contiguous():
                raise ValueError(
                    f"tensor {name!r}: out must be a contiguous CPU tensor, got one on "
                    f"{out.device}: pass out=None to get a new one"
                )
        self._settle(rec, sync=True)
        if rec.home is Tier.NVME and rec.written and spec.nbytes:
            fits = self._staging is not None and padded(spec.nbytes) <= self._staging.buffer_bytes
            if out is None or not fits:
                buf = aligned_empty(spec.nbytes)
                self._nvme_read(rec, buf, Tier.HOST)
                result = buf[: spec.nbytes].view(spec.dtype).view(spec.shape)
                return result if out is None else out.copy_(result)
            assert self._staging is not None
            with self._staging.borrow() as buf:
                self._nvme_read(rec, buf, Tier.HOST)
                flat_bytes(out).copy_(buf[: spec.nbytes])
            return out
        result = torch.empty(spec.shape, dtype=spec.dtype) if out is None else out
        if rec.home is Tier.NVME:
            return result.zero_()
        assert rec.home_slot is not None
        dst = result.view(-1).view(torch.uint8) if spec.nbytes else result
        if spec.nbytes:
            src = rec.home_slot.raw()[: spec.nbytes]
            self._settled(self._copy(dst, Tier.HOST, src, rec.home, self._ready()))
        return result

    def write(self, name: str, tensor: torch.Tensor) -> None:
        """Set the contents of ``name`` from ``tensor`` (same shape and dtype, any device).

        Updates the home tier and, when paged in, the device copy; returns
        when both hold the new contents.
        """
        rec = self._record(name)
        self._check_like(rec, tensor)
        self._settle(rec, sync=True)
        data = flat_bytes(tensor)
        ready = self._ready()
        self._settled(self._store(rec, data, self._tier_of(tensor), None, ready))
        if rec.home is not Tier.DEVICE and rec.device_slot is not None:
            dst = rec.device_slot.raw()[: rec.spec.nbytes]
            self._settled(self._copy(dst, Tier.DEVICE, data, self._tier_of(tensor), ready))

    def move(self, name: str, tier: Tier) -> None:
        """Change the home tier of ``name``, keeping its contents.

        The tensor must be RELEASED (or homed on DEVICE). The destination's
        budget is checked first; on any failure nothing changes.
        """
        rec = self._record(name)
        tier = Tier(tier)
        if tier is rec.home:
            return
        if rec.home is not Tier.DEVICE and rec.residency.state is not Residency.RELEASED:
            raise StateError(
                f"tensor {name!r} is {rec.residency.state.value.upper()}: move() to "
                f"{tier.value} needs it RELEASED; {ResidencyMachine._HINTS[rec.residency.state]}"
            )
        self._settle(rec, sync=True)
        new = _Record(spec=rec.spec, home=tier, residency=rec.residency, written=False)
        if tier is Tier.NVME:
            nvme = self._nvme_for(name)
            self._check_staging(rec.spec)
            if nvme.contains(name):
                raise ValueError(
                    f"tensor {name!r}: the NVMe group already holds an unregistered array of "
                    f"that name: delete it from the group or rename the tensor"
                )
            nvme.create(name, rec.spec.shape, rec.spec.dtype)
        else:
            arena = self._device_arena if tier is Tier.DEVICE else self._host_arena
            new.home_slot = self._allocate(arena, rec.spec)
        try:
            if tier is Tier.NVME:
                assert rec.home_slot is not None
                raw = rec.home_slot.raw()
                event = self._store(new, raw[: rec.spec.nbytes], rec.home, raw, self._ready())
            else:
                assert new.home_slot is not None
                event = self._load(rec, new.home_slot, tier, self._ready())
            self._settled(event)
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

    # -- transfers (run on the copy threads, or in the caller for synchronous calls) ------

    def _page_in_work(self, rec: _Record, slot: Slot, ready: _Events) -> _Work:
        return lambda after: self._load(rec, slot, Tier.DEVICE, after + ready)

    def _load(
        self, rec: _Record, slot: Slot, tier: Tier, after: _Events
    ) -> torch.cuda.Event | None:
        """Copy the home contents of ``rec`` into ``slot`` of the ``tier`` arena."""
        nbytes = rec.spec.nbytes
        dst = slot.raw()
        if rec.home is not Tier.NVME:
            assert rec.home_slot is not None
            return self._copy(dst[:nbytes], tier, rec.home_slot.raw()[:nbytes], rec.home, after)
        if not rec.written or nbytes == 0:
            return self._fill_zero(dst[:nbytes], after)
        if not dst.is_cuda or self._direct:
            self._settled_all(after)
            self._nvme_read(rec, dst, tier)
            return None
        assert self._staging is not None
        with self._staging.borrow() as buf:
            self._nvme_read(rec, buf, Tier.HOST)
            event = self._copy(dst[:nbytes], tier, buf[:nbytes], Tier.HOST, after)
            self._settled(event)  # the staging buffer is reused once the copy is done
        return event

    def _store(
        self,
        rec: _Record,
        data: torch.Tensor,
        tier: Tier,
        raw: torch.Tensor | None,
        after: _Events,
    ) -> torch.cuda.Event | None:
        """Copy ``data`` (flat bytes on ``tier``) to the home of ``rec``.

        ``raw`` is ``data``'s whole padded arena slot when it is one, so an
        NVMe write can leave from it directly.
        """
        nbytes = rec.spec.nbytes
        if rec.home is not Tier.NVME:
            assert rec.home_slot is not None
            return self._copy(rec.home_slot.raw()[:nbytes], rec.home, data, tier, after)
        if nbytes == 0:
            rec.written = True
            return None
        if raw is not None and (not raw.is_cuda or self._direct):
            self._settled_all(after)
            self._nvme_write(rec, raw, tier)
        elif self._staging is not None and padded(nbytes) <= self._staging.buffer_bytes:
            with self._staging.borrow() as buf:
                self._settled(self._copy(buf[:nbytes], Tier.HOST, data, tier, after))
                self._nvme_write(rec, buf, Tier.HOST)
        else:  # larger than a staging buffer: only on the CPU (see _check_staging)
            buf = aligned_empty(nbytes)
            self._settled(self._copy(buf[:nbytes], Tier.HOST, data, tier, after))
            self._nvme_write(rec, buf, Tier.HOST)
        rec.written = True
        return None

    def _copy(
        self, dst: torch.Tensor, dst_tier: Tier, src: torch.Tensor, src_tier: Tier, after: _Events
    ) -> torch.cuda.Event | None:
        """Copy flat bytes; on CUDA a ``non_blocking`` copy on a side stream, returning its event."""
        link = f"{src_tier.value}->{dst_tier.value}"
        nbytes = dst.numel()
        if self._cuda and (dst.is_cuda or src.is_cuda):
            stream = self._streams["d2h" if src.is_cuda and not dst.is_cuda else "h2d"]
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            with torch.cuda.stream(stream):
                for event in after:
                    stream.wait_event(event)
                start.record(stream)
                dst.copy_(src, non_blocking=True)
                end.record(stream)
            if link in self._meters:
                with self._timings_lock:
                    self._timings.append((link, nbytes, start, end))
            return end
        self._settled_all(after)
        meter = self._meters.get(link)
        with meter.timing(nbytes) if meter is not None else contextlib.nullcontext():
            dst.copy_(src)
        return None

    def _fill_zero(self, dst: torch.Tensor, after: _Events) -> torch.cuda.Event | None:
        if not dst.is_cuda:
            self._settled_all(after)
            dst.zero_()
            return None
        stream = self._streams["h2d"]
        with torch.cuda.stream(stream):
            for event in after:
                stream.wait_event(event)
            dst.zero_()
            done = torch.cuda.Event()
            done.record(stream)
        return done

    def _nvme_read(self, rec: _Record, buf: torch.Tensor, tier: Tier) -> None:
        assert self._nvme is not None
        with self._meters[f"nvme->{tier.value}"].timing(rec.spec.nbytes):
            self._nvme.read_async(rec.spec.name, buf).wait()

    def _nvme_write(self, rec: _Record, buf: torch.Tensor, tier: Tier) -> None:
        assert self._nvme is not None
        with self._meters[f"{tier.value}->nvme"].timing(rec.spec.nbytes):
            self._nvme.write_async(rec.spec.name, buf).wait()

    # -- ordering and synchronisation ------------------------------------------------------

    def _submit(self, rec: _Record, work: _Work) -> Future[torch.cuda.Event | None]:
        """Run ``work`` on a copy thread after the previous operation on ``rec``."""
        self._check_open()
        prev = rec.last

        def job() -> torch.cuda.Event | None:
            after: _Events = ()
            if prev is not None:
                try:
                    event = prev.result()
                except BaseException:  # reported through that operation's ticket
                    event = None
                after = () if event is None else (event,)
            return work(after)

        rec.last = self._pool.submit(job)
        return rec.last

    def _settle(self, rec: _Record, *, sync: bool = False) -> torch.cuda.Event | None:
        """Wait for the operations issued on ``rec``; re-raises the last one's error once.

        Returns the CUDA event of the last copy (synchronised with ``sync``).
        """
        fut, rec.last = rec.last, None
        if fut is None:
            return None
        event = fut.result()
        if sync:
            self._settled(event)
        return event

    def _ready(self) -> _Events:
        """An event on the caller's current stream: side-stream copies start after it."""
        if not self._cuda:
            return ()
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))
        return (event,)

    @staticmethod
    def _settled(event: torch.cuda.Event | None) -> None:
        if event is not None:
            event.synchronize()

    @staticmethod
    def _settled_all(events: _Events) -> None:
        for event in events:
            event.synchronize()

    # -- bookkeeping -----------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise ValueError("the TieredStore is closed: open a new one")

    def _record(self, name: str) -> _Record:
        self._check_open()
        try:
            return self._records[name]
        except KeyError:
            raise KeyError(f"tensor {name!r} is not registered: register() it first") from None

    def _records_of(self, names: str | Sequence[str]) -> list[_Record]:
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

    def _check_staging(self, spec: ArraySpec) -> None:
        """On CUDA with the POSIX backend every NVMe transfer fits one staging buffer."""
        assert self._staging is not None
        if not self._direct and padded(spec.nbytes) > self._staging.buffer_bytes:
            raise ValueError(
                f"tensor {spec.name!r} of {format_bytes(spec.nbytes)} ({spec.nbytes} bytes) "
                f"cannot pass through a staging buffer of {self._staging.buffer_bytes} bytes: "
                f"raise StoreConfig.staging_bytes to at least {padded(spec.nbytes)}"
            )

    def _check_like(self, rec: _Record, tensor: torch.Tensor) -> None:
        spec = rec.spec
        if tuple(tensor.shape) != spec.shape or tensor.dtype != spec.dtype:
            raise ValueError(
                f"tensor {spec.name!r} has shape {spec.shape} and {spec.dtype}, but the given "
                f"tensor has {tuple(tensor.shape)} and {tensor.dtype}: pass a matching tensor"
            )

    def _tier_of(self, tensor: torch.Tensor) -> Tier:
        return Tier.DEVICE if tensor.device == self.device else Tier.HOST

    def _abort(self, rec: _Record) -> None:
        """A page-in failed: back to RELEASED, slot freed."""
        rec.residency.apply("fail")
        assert rec.device_slot is not None
        self._device_arena.free(rec.device_slot)
        rec.device_slot = None

    def _drop_home(self, rec: _Record, *, delete_nvme: bool) -> None:
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

    def stats(self) -> dict[str, LinkStats]:
        """Traffic per link in :data:`LINKS` since the store opened (bytes, busy s, count)."""
        with self._timings_lock:
            pending = []
            for link, nbytes, start, end in self._timings:
                if end.query():
                    self._meters[link].add(nbytes, start.elapsed_time(end) / 1e3)
                else:
                    pending.append((link, nbytes, start, end))
            self._timings = pending
        return {link: meter.snapshot() for link, meter in self._meters.items()}

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
        """Wait for transfers in flight, stop the copy threads, release the NVMe lock."""
        if self._closed:
            return
        self._closed = True
        for rec in self._records.values():
            with contextlib.suppress(BaseException):
                self._settle(rec, sync=True)
        self._pool.shutdown(wait=True)
        if self._cuda:
            torch.cuda.synchronize(self.device)
            self.stats()
        if self._nvme is not None:
            self._nvme.close()
        if self._backend is not None:
            self._backend.close()

    def __enter__(self) -> TieredStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _done_future() -> Future[torch.cuda.Event | None]:
    fut: Future[torch.cuda.Event | None] = Future()
    fut.set_result(None)
    return fut
