"""The copy machinery of a :class:`storage.store.TieredStore`: page-in, write-back, staging.

:class:`Transfers` moves flat bytes between the arenas and the NVMe tier and
counts the traffic per copy link (:data:`LINKS`). On CUDA a copy is a
``non_blocking`` copy on one of two side streams (towards the device / towards the
host, keyed :attr:`Link.HOST_TO_DEVICE` / :attr:`Link.DEVICE_TO_HOST`), ordered
after the events it is given, and returns its own event; on the CPU it runs
in the calling thread (a copy thread of the store) and returns ``None``, unless
the store runs under the CPU double of CUDA's semantics (:mod:`storage.deferred`):
then a copy between the device arena and host memory is deferred like a CUDA
copy and returns a :class:`storage.deferred.DeferredEvent`.

Two waits, two names: :func:`order_after` makes later work on the caller's stream
come after a copy (the device sees its data; the host does not yet), and
:func:`settled` blocks the host until the copy completed (its host destination
may be read and its host source reused). A copy's timing events are read back as
copies go, never by blocking the thread that issues a copy: those that finished are read
(polled), and when more than :data:`MAX_PENDING_TIMINGS` are still running the oldest of
one stream are merged into one span (:meth:`Transfers.stats` reads the rest).

NVMe transfers land straight in (or leave from) a 4 KiB-aligned arena slot
where the I/O backend can reach it: host memory, or device memory with
kvikio. Otherwise they stream through the staging pool piece by piece, one
staging buffer at a time, so a tensor of any size passes through buffers of
``StoreConfig.staging_bytes``; a staged write still replaces the chunk
atomically (:meth:`storage.nvme.NvmeTier.begin_write`).
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch

from storage.deferred import CopyDouble, CopyEvent, DeferredEvent
from storage.device import Slot
from storage.host import StagingPool
from storage.io import ALIGNMENT, aligned_empty
from storage.nvme import NvmeTier
from storage.residency import Record
from storage.threads import single_threaded
from storage.tiers import Link, Tier

__all__ = ["LINKS", "Events", "LinkStats", "Transfers", "Work", "done_future", "flat_bytes"]
__all__ += ["MAX_PENDING_TIMINGS", "order_after", "settled", "settled_all"]

LINKS = tuple(Link)
"""Copy links counted by :meth:`TieredStore.stats`; ``nvme_read_direct`` / ``nvme_write_direct`` are
file transfers that land in (or leave from) a device-arena slot without staging."""

Events = tuple[CopyEvent, ...]
"""Events a copy must wait for (empty on the CPU, except under the double)."""

MAX_PENDING_TIMINGS = 256
"""Timing records (a copy's start and end events) that may wait to be read at once; beyond,
the oldest of each stream merge pairwise into spans (first start to second end, bytes and
copies summed) until half as many remain. The issuing thread never waits for a copy."""
Work = Callable[[Events], "CopyEvent | None"]
"""A transfer to run after the given events; returns the event of its last copy (CUDA)."""


@dataclass(frozen=True)
class LinkStats:
    """Traffic on one copy link since the store opened."""

    bytes: int
    """Bytes moved."""
    seconds: float
    """Seconds during which at least one transfer was running on the link."""
    count: int
    """Transfers completed (a staged transfer counts once per piece)."""

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

    def add(self, nbytes: int, seconds: float, count: int = 1) -> None:
        with self._lock:
            self._bytes, self._count, self._busy = (
                self._bytes + nbytes,
                self._count + count,
                self._busy + seconds,
            )

    def snapshot(self) -> LinkStats:
        with self._lock:
            busy = self._busy + (time.perf_counter() - self._since if self._active else 0.0)
            return LinkStats(bytes=self._bytes, seconds=busy, count=self._count)


@dataclass(frozen=True)
class _Timing:
    """The start and end events of copies on one lane (a stream) not read back yet."""

    link: Link
    nbytes: int
    start: Any
    end: Any
    lane: int
    """The stream the copies ran on (records of one lane run in the order issued)."""
    count: int = 1
    """Copies the span covers."""

    def seconds(self) -> float:
        """Milliseconds from start to end, in seconds (the span has finished)."""
        return float(self.start.elapsed_time(self.end)) / 1e3

    def then(self, later: _Timing) -> _Timing:
        """One span from this record's start to ``later``'s end (same link and lane): its
        seconds include any gap between the two, so the link's rate is never overstated."""
        return _Timing(
            self.link,
            self.nbytes + later.nbytes,
            self.start,
            later.end,
            self.lane,
            self.count + later.count,
        )


def _merge_oldest(timings: list[_Timing], keep: int) -> list[_Timing]:
    """Merge the oldest records into the next one of their link and lane until at most
    ``keep`` remain (a record with no later one of its kind stays as it is)."""
    out = list(timings)
    i = 0
    while len(out) > keep and i < len(out):
        key = (out[i].link, out[i].lane)
        later = next((k for k in range(i + 1, len(out)) if (out[k].link, out[k].lane) == key), 0)
        if later:
            first = out.pop(i)
            out[later - 1] = first.then(out[later - 1])
        else:
            i += 1
    return out


def flat_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """The bytes of ``tensor`` as a 1-D ``uint8`` tensor (a view when contiguous)."""
    return tensor.detach().contiguous().reshape(-1).view(torch.uint8)


def done_future() -> Future[CopyEvent | None]:
    """A future that is already done, with no event: an operation with nothing left to wait for."""
    fut: Future[CopyEvent | None] = Future()
    fut.set_result(None)
    return fut


def settled(event: CopyEvent | None) -> None:
    """Block the host until ``event`` (if any) has completed: its data is host-visible."""
    if event is not None:
        event.synchronize()


def order_after(event: CopyEvent | None, device: torch.device) -> None:
    """Order later work on ``device``'s current stream after ``event`` (the host never waits).

    Device work queued afterwards sees the copy's data; the host does not, and must
    not reuse the copy's host source: use :func:`settled` for that.
    """
    if event is None:
        return
    if isinstance(event, DeferredEvent):
        event.order()
    else:
        torch.cuda.current_stream(device).wait_event(event)


def settled_all(events: Events) -> None:
    """Block the host until every event of ``events`` has completed."""
    for event in events:
        event.synchronize()


def _link(source: Tier, destination: Tier) -> Link:
    """The link between two different tiers."""
    link = Link.between(source, destination)
    assert link is not None, f"no copy link within tier {source.value}"
    return link


def _stream_after(stream: torch.cuda.Stream, after: Events) -> None:
    """Make the side ``stream`` wait for the CUDA events of ``after``."""
    for event in after:
        assert isinstance(event, torch.cuda.Event), "a CUDA stream waits on CUDA events only"
        stream.wait_event(event)


class Transfers:
    """Copies between arenas and files for one store, metered per link.

    Transfers run on copy threads (:meth:`submit`), each after the previous
    operation on its tensor, so a page-in never reads contents that a write-back
    in flight is still replacing. Tensors homed on NVMe use ``threads`` disk
    threads, and their page-ins (``urgent`` submissions: the compute waits for them)
    ``threads`` disk threads of their own, so a block's weights never queue behind the
    optimizer state's reads and write-backs; the others (copies between memory tiers)
    use ``threads`` threads of their own, so a page-in from host memory never queues
    behind disk traffic. ``direct_device`` says whether
    the I/O backend reads into and writes from device memory (kvikio);
    ``stage_nvme`` routes every NVMe transfer through ``staging`` even where
    it could go direct. ``double`` runs copies that touch device memory (as
    ``device_memory`` tells, the store's device arena) under the CPU double.
    """

    def __init__(
        self,
        device: torch.device,
        *,
        nvme: NvmeTier | None,
        staging: StagingPool | None,
        direct_device: bool,
        stage_nvme: bool = False,
        threads: int = 2,
        double: CopyDouble | None = None,
        device_memory: Callable[[torch.Tensor], bool] | None = None,
    ) -> None:
        self.device = device
        self.cuda = device.type == "cuda"
        self.double = double if not self.cuda else None
        """The CPU double of CUDA copies (:mod:`storage.deferred`), or None."""
        self._device_memory = device_memory or (lambda t: False)
        self.nvme = nvme
        self.staging = staging
        self._direct_device = direct_device
        self._stage_all = stage_nvme
        self.meters = {link: _Meter() for link in LINKS}
        self._timings: deque[_Timing] = deque()
        self._timings_lock = threading.Lock()
        self.streams: dict[Link, torch.cuda.Stream] = {}
        """The side stream of copies towards the device (``HOST_TO_DEVICE``) and of those
        towards the host (``DEVICE_TO_HOST``); empty without CUDA."""
        if self.cuda:
            self.streams = {
                d: torch.cuda.Stream(device) for d in (Link.HOST_TO_DEVICE, Link.DEVICE_TO_HOST)
            }
        # on a CPU device the copy threads run beside the compute's own thread team
        # (storage/threads.py says why they must not form teams of their own)
        init = None if self.cuda else single_threaded
        self._pool = ThreadPoolExecutor(threads, "bb-store", initializer=init)
        self._urgent_pool = ThreadPoolExecutor(threads, "bb-store-in", initializer=init)
        self._memory_pool = ThreadPoolExecutor(threads, "bb-store-mem", initializer=init)
        self._order = threading.Lock()  # guards Record.last across caller threads

    # -- ordering --------------------------------------------------------------------------

    def submit(self, rec: Record, work: Work, *, urgent: bool = False) -> Future[CopyEvent | None]:
        """Run ``work`` on a copy thread after the previous operation on ``rec``.

        Callable from several threads: the operation is chained after whichever one on
        ``rec`` was issued last, by any thread. ``urgent`` (a page-in the compute will
        wait for) runs an NVMe-homed tensor's transfer on the disk threads kept for
        page-ins, ahead of the other disk traffic queued so far.
        """

        def job() -> CopyEvent | None:
            after: Events = ()
            if prev is not None:
                try:
                    event = prev.result()
                except BaseException:  # reported through that operation's ticket
                    event = None
                after = () if event is None else (event,)
            return work(after)

        if rec.home is not Tier.NVME:
            pool = self._memory_pool
        else:
            pool = self._urgent_pool if urgent else self._pool
        with self._order:
            prev = rec.last
            rec.last = fut = pool.submit(job)
        return fut

    def settle(self, rec: Record, *, sync: bool = False) -> CopyEvent | None:
        """Wait for the operations issued on ``rec``; re-raises the last one's error once.

        Returns the CUDA event of the last copy (synchronised with ``sync``).
        """
        with self._order:
            fut = rec.last
        if fut is None:
            return None
        try:
            event = fut.result()
        finally:  # operations issued meanwhile keep their place in the chain
            with self._order:
                if rec.last is fut:
                    rec.last = None
        if sync:
            settled(event)
        return event

    def remember(self, rec: Record, event: CopyEvent | None) -> None:
        """Keep ``event`` (of an operation already waited for with :meth:`settle`) as the
        last operation on ``rec`` when none was issued since, so that a later
        ``settle(rec, sync=True)`` still synchronises the host on it."""
        if event is None:
            return
        fut: Future[CopyEvent | None] = Future()
        fut.set_result(event)
        with self._order:
            if rec.last is None:
                rec.last = fut

    def shutdown(self) -> None:
        """Wait for the copy threads to finish their work and stop them."""
        self._pool.shutdown(wait=True)
        self._urgent_pool.shutdown(wait=True)
        self._memory_pool.shutdown(wait=True)

    def _side_stream(self, buf: torch.Tensor, link: Link) -> contextlib.AbstractContextManager[Any]:
        """``link``'s side stream as the current one for a file transfer to CUDA ``buf``."""
        return torch.cuda.stream(self.streams[link]) if buf.is_cuda else contextlib.nullcontext()

    def _direct(self, buf: torch.Tensor) -> bool:
        """Whether an NVMe transfer can use ``buf`` (an aligned slot) without staging."""
        return not self._stage_all and (not buf.is_cuda or self._direct_device)

    # -- whole transfers -------------------------------------------------------------------

    def load(self, rec: Record, slot: Slot, tier: Tier, after: Events) -> CopyEvent | None:
        """Copy the home contents of ``rec`` into ``slot`` of the ``tier`` arena."""
        nbytes = rec.spec.nbytes
        dst = slot.raw()
        if rec.home is not Tier.NVME:
            assert rec.home_slot is not None
            return self.copy(dst[:nbytes], tier, rec.home_slot.raw()[:nbytes], rec.home, after)
        if not rec.written or nbytes == 0:
            return self.fill_zero(dst[:nbytes], after)
        if rec.external is not None:
            return self._external_read(rec, dst[:nbytes], tier, after)
        if self._direct(dst):
            settled_all(after)
            with self._side_stream(dst, Link.HOST_TO_DEVICE):  # not the compute's stream
                self._nvme_read(rec, dst, tier, 0, nbytes)
            return None
        return self._staged_read(rec, dst[:nbytes], tier, after)

    def store(
        self,
        rec: Record,
        data: torch.Tensor,
        tier: Tier,
        raw: torch.Tensor | None,
        after: Events,
    ) -> CopyEvent | None:
        """Copy ``data`` (flat bytes on ``tier``) to the home of ``rec``.

        ``raw`` is ``data``'s whole padded arena slot when it is one, so an
        NVMe write can leave from it directly.
        """
        nbytes = rec.spec.nbytes
        if rec.home is not Tier.NVME:
            assert rec.home_slot is not None
            return self.copy(rec.home_slot.raw()[:nbytes], rec.home, data, tier, after)
        if nbytes == 0:
            rec.written = True
            return None
        if raw is not None and self._direct(raw):
            settled_all(after)
            assert self.nvme is not None
            with self.meters[_link(tier, Tier.NVME)].timing(nbytes):
                with self._side_stream(raw, Link.DEVICE_TO_HOST):
                    self.nvme.write_async(rec.spec.name, raw).wait()
        else:
            self._staged_write(rec, data, tier, after)
        rec.written = True
        return None

    def read_home(self, rec: Record, out: torch.Tensor | None) -> torch.Tensor:
        """The written NVMe contents of ``rec`` in ``out`` (contiguous, CPU) or a new tensor."""
        spec = rec.spec
        if out is None:
            buf = aligned_empty(spec.nbytes)
            self._nvme_read(rec, buf, Tier.HOST, 0, spec.nbytes)
            return buf[: spec.nbytes].view(spec.dtype).view(spec.shape)
        dst = flat_bytes(out)
        if rec.external is not None:  # buffered reads: any address, any length
            self._nvme_read(rec, dst, Tier.HOST, 0, spec.nbytes)
            return out
        # Straight into ``out`` when no padding would be written past it: aligned address
        # and a whole number of blocks.
        if not (dst.data_ptr() % ALIGNMENT or spec.nbytes % ALIGNMENT) and self._direct(dst):
            self._nvme_read(rec, dst, Tier.HOST, 0, spec.nbytes)
        else:
            self._staged_read(rec, dst, Tier.HOST, ())
        return out

    # -- staged transfers (piece by piece through one staging buffer) ----------------------

    def _pieces(self, nbytes: int) -> Iterator[tuple[int, int]]:
        assert self.staging is not None
        step = self.staging.buffer_bytes
        for offset in range(0, nbytes, step):
            yield offset, min(step, nbytes - offset)

    def _staged_read(
        self, rec: Record, dst: torch.Tensor, tier: Tier, after: Events
    ) -> CopyEvent | None:
        """Read the chunk of ``rec`` into flat bytes ``dst`` on ``tier`` through staging."""
        assert self.staging is not None
        event = None
        with self.staging.borrow() as buf:
            for offset, n in self._pieces(rec.spec.nbytes):
                self._nvme_read(rec, buf, Tier.HOST, offset, n)
                event = self.copy(dst[offset : offset + n], tier, buf[:n], Tier.HOST, after)
                settled(event)  # the buffer takes the next piece once this copy is done
        return event

    def _staged_write(self, rec: Record, data: torch.Tensor, tier: Tier, after: Events) -> None:
        """Write flat bytes ``data`` on ``tier`` to the chunk of ``rec`` through staging."""
        assert self.nvme is not None and self.staging is not None
        nbytes = rec.spec.nbytes
        meter = self.meters[Link.HOST_TO_NVME]
        with self.nvme.begin_write(rec.spec.name) as handle, self.staging.borrow() as buf:
            for offset, n in self._pieces(nbytes):
                settled(self.copy(buf[:n], Tier.HOST, data[offset : offset + n], tier, after))
                with meter.timing(n):
                    handle.write_async(buf, offset=offset, nbytes=n).wait()
                    if offset + n == nbytes:
                        handle.commit()

    def _nvme_read(self, rec: Record, buf: torch.Tensor, tier: Tier, offset: int, n: int) -> None:
        if rec.external is not None:  # files the store does not own, read in place
            with self.meters[_link(Tier.NVME, tier)].timing(n):
                rec.external.read_into(buf, offset, n)
            return
        assert self.nvme is not None
        with self.meters[_link(Tier.NVME, tier)].timing(n):
            self.nvme.read_async(rec.spec.name, buf, offset=offset, nbytes=n).wait()

    def _external_read(
        self, rec: Record, dst: torch.Tensor, tier: Tier, after: Events
    ) -> CopyEvent | None:
        """Read the file pieces of ``rec`` into flat bytes ``dst`` on ``tier``: straight into
        host memory, through a host buffer (pinned on CUDA) into CUDA memory."""
        n = rec.spec.nbytes
        if not dst.is_cuda:
            settled_all(after)
            self._nvme_read(rec, dst, tier, 0, n)
            return None
        buf = aligned_empty(n, pin=True)
        self._nvme_read(rec, buf, Tier.HOST, 0, n)
        event = self.copy(dst, tier, buf[:n], Tier.HOST, after)
        settled(event)  # the buffer is freed on return
        return event

    # -- copies ----------------------------------------------------------------------------

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
        """Copy flat bytes; on CUDA a ``non_blocking`` copy on a side stream, returning its event.

        ``src_on_device`` says that ``src`` is device memory though it lies outside the
        device arena (the double defers such copies too); None: the arena decides.
        """
        link = Link.between(src_tier, dst_tier)
        nbytes = dst.numel()
        if self.cuda and (dst.is_cuda or src.is_cuda):
            to_host = src.is_cuda and not dst.is_cuda
            stream = self.streams[Link.DEVICE_TO_HOST if to_host else Link.HOST_TO_DEVICE]
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            with torch.cuda.stream(stream):
                _stream_after(stream, after)
                start.record(stream)
                dst.copy_(src, non_blocking=True)
                end.record(stream)
            self._time_copy(link, nbytes, start, end, lane=int(to_host))
            return end
        to_device, from_device = self._device_memory(dst), self._device_memory(src)
        from_device = from_device if src_on_device is None else src_on_device
        if self.double is not None and (to_device or from_device):
            deferred = self.double.copy(
                dst, src, to_device=to_device, from_host=not from_device, after=after
            )
            self._time_copy(link, nbytes, *deferred.timing(), lane=2)
            return deferred
        settled_all(after)
        meter = None if link is None else self.meters[link]
        with meter.timing(nbytes) if meter is not None else contextlib.nullcontext():
            dst.copy_(src)
        return None

    def fill_zero(self, dst: torch.Tensor, after: Events) -> CopyEvent | None:
        """Zero flat bytes ``dst``; on CUDA on the stream towards the device, returning its event."""
        if not dst.is_cuda:
            settled_all(after)
            dst.zero_()
            return None
        stream = self.streams[Link.HOST_TO_DEVICE]
        with torch.cuda.stream(stream):
            _stream_after(stream, after)
            dst.zero_()
            done = torch.cuda.Event()
            done.record(stream)
        return done

    def ready(self) -> Events:
        """An event on the caller's current stream: side-stream copies start after it."""
        if not self.cuda:
            return ()
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))
        return (event,)

    def _time_copy(
        self, link: Link | None, nbytes: int, start: Any, end: Any, *, lane: int = 0
    ) -> None:
        """Queue a copy's timing events (``lane``: its stream) and read back those that
        finished, never waiting for one (see :data:`MAX_PENDING_TIMINGS`)."""
        if link is None:  # within one tier: not a counted link
            return
        with self._timings_lock:
            timings = self._timings
            timings.append(_Timing(link, nbytes, start, end, lane))
            while timings and timings[0].end.query():
                self._read_back(timings.popleft())
            if len(timings) <= MAX_PENDING_TIMINGS:
                return
            running = []
            for t in timings:  # polled: a copy on another stream may hold the front
                if t.end.query():
                    self._read_back(t)
                else:
                    running.append(t)
            if len(running) > MAX_PENDING_TIMINGS // 2:
                running = _merge_oldest(running, MAX_PENDING_TIMINGS // 2)
            self._timings = deque(running)

    def _read_back(self, timing: _Timing) -> None:
        """Add a finished record to its link's meter."""
        self.meters[timing.link].add(timing.nbytes, timing.seconds(), timing.count)

    @property
    def pending_timings(self) -> int:
        """Copies whose timing events have not been read back yet."""
        with self._timings_lock:
            return len(self._timings)

    def synchronize(self) -> None:
        """Block the host until every copy issued so far has completed."""
        if self.cuda:
            torch.cuda.synchronize(self.device)
        elif self.double is not None:
            self.double.finish()

    def stats(self) -> dict[Link, LinkStats]:
        """Traffic per link in :data:`LINKS` (bytes, busy seconds, count)."""
        with self._timings_lock:
            pending: deque[_Timing] = deque()
            for timing in self._timings:
                if timing.end.query():
                    self._read_back(timing)
                else:
                    pending.append(timing)
            self._timings = pending
        return {link: meter.snapshot() for link, meter in self.meters.items()}
