"""A CPU double of CUDA's copy semantics: copies that land only when the host synchronises.

On CUDA a ``non_blocking`` copy on a side stream is only *issued* when the call
returns. Waiting on its event from a stream (``stream.wait_event``) *orders*
later device work after it; the host may read a host destination, or reuse a
host source, only after it *synchronised* on the event (``event.synchronize()``,
or ``event.query()`` returning True). On the CPU every copy used to complete at
once, so code that confused the two waits passed every test.

:class:`CopyDouble` plays the GPU for a store on a CPU device. A copy between
the device arena and host memory becomes a :class:`DeferredCopy`:

- at issue, its destination holds a poison pattern (``0xFF`` bytes, which read
  as NaN in every floating dtype);
- an ordering wait (:meth:`DeferredEvent.order`) runs it as far as device work
  can see: a device destination gets the data, a host destination stays
  poisoned (the source is read now, the bytes land at the host sync);
- a host sync (:meth:`DeferredEvent.synchronize`, :meth:`DeferredEvent.query`)
  completes it: the host destination gets the data, and if a host source
  changed since the copy read it, the copy reads it again (the GPU may read a
  source until it completes), so the destination shows the overwrite;
- a new copy runs the copies it is ordered after first: at issue they read their
  sources (one the new copy overwrites is read for good: the GPU ran them first), and
  when the new copy runs they complete, host destinations included, as a stream
  waiting on an event starts only once that work has finished on the GPU; a new copy
  that reads or writes a host buffer still being read re-checks that buffer.

The double is on when ``StoreConfig.cuda_double`` is True, or when it is None
and the environment variable :data:`DOUBLE_ENV` is ``1`` (:func:`double_requested`
is the one place that reads it). It only ever runs on a CPU compute device; a
CUDA device has the real semantics.
"""

from __future__ import annotations

import os
import threading
import time
import zlib
from collections.abc import Iterable, Iterator, Sequence

import torch

__all__ = ["DOUBLE_ENV", "CopyDouble", "CopyEvent", "DeferredCopy", "DeferredEvent", "TimingMark"]
__all__ += ["POISON_BYTE", "double_requested"]

DOUBLE_ENV = "BB_CUDA_DOUBLE"
"""Environment variable (``1`` | ``0``) that turns the CPU double on where the config leaves
it unset (``StoreConfig.cuda_double=None``)."""

POISON_BYTE = 0xFF
"""The byte a destination holds until its copy lands: NaN in fp32, bf16 and fp16."""

_TRUE = ("1", "true", "on", "yes")
_FALSE = ("", "0", "false", "off", "no")


def double_requested(flag: bool | None) -> bool:
    """Whether the CPU double is asked for: ``flag``, or :data:`DOUBLE_ENV` when it is None."""
    if flag is not None:
        return bool(flag)
    value = os.environ.get(DOUBLE_ENV, "").strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise ValueError(
        f"environment variable {DOUBLE_ENV}={value!r} is neither on ({'/'.join(_TRUE)}) nor "
        f"off ({'/'.join(_FALSE[1:])}): unset it or pick one of them"
    )


def _span(t: torch.Tensor) -> tuple[int, int]:
    start = t.data_ptr()
    return start, start + t.numel() * t.element_size()


def _overlap(a: tuple[int, int], b: tuple[int, int]) -> bool:
    return a[0] < b[1] and b[0] < a[1]


def _crc(t: torch.Tensor) -> int:
    return zlib.crc32(t.detach().numpy().tobytes())


def _pending_before(copies: Iterable[DeferredCopy]) -> Iterator[DeferredCopy]:
    """``copies`` and those they are ordered after, transitively, that have not completed."""
    seen: set[int] = set()
    stack = list(copies)
    while stack:
        c = stack.pop()
        if c.complete or id(c) in seen:
            continue
        seen.add(id(c))
        yield c
        stack.extend(c.after)


class DeferredCopy:
    """One copy of flat bytes in flight under the double."""

    def __init__(
        self,
        dst: torch.Tensor,
        src: torch.Tensor,
        *,
        to_device: bool,
        from_host: bool,
        after: Sequence[DeferredCopy],
    ) -> None:
        self.dst, self.src = dst, src
        self.to_device = to_device
        """Whether the destination is device memory (visible to ordered device work)."""
        self.from_host = from_host
        """Whether the source is host memory (the host must not reuse it until completion)."""
        self.after = list(after)
        self.read: torch.Tensor | None = None
        """The source bytes as the copy read them (host destinations land them at the sync)."""
        self.crc: int | None = None
        self.landed = False
        self.complete = False
        self.started = self.ended = 0.0


class TimingMark:
    """The start or end mark of a deferred copy, read like a timing ``torch.cuda.Event``."""

    def __init__(self, copy: DeferredCopy, *, end: bool) -> None:
        self._copy, self._end = copy, end

    def query(self) -> bool:
        """Whether the copy completed (never runs it)."""
        return self._copy.complete

    def synchronize(self) -> None:
        """Nothing: a timing mark never completes a copy (only the copy's own event does)."""

    def elapsed_time(self, end: TimingMark) -> float:
        """Milliseconds from this mark to ``end`` (the copy's own run time)."""
        return max(0.0, (end._copy.ended - self._copy.started) * 1e3)


class DeferredEvent:
    """Stands for the CUDA event recorded after some deferred copies."""

    def __init__(self, double: CopyDouble, copies: Sequence[DeferredCopy]) -> None:
        self.double = double
        self.copies = list(copies)

    def synchronize(self) -> None:
        """Host sync: the copies complete (host destinations get their bytes)."""
        self.double.complete(self.copies)

    def query(self) -> bool:
        """True, after completing the copies (the GPU may have finished them by now)."""
        self.synchronize()
        return True

    def order(self) -> None:
        """Ordering wait: device destinations get their bytes, host ones stay poisoned."""
        self.double.order(self.copies)

    def timing(self) -> tuple[TimingMark, TimingMark]:
        """Start and end marks of the event's (single) copy, for the link meters."""
        return TimingMark(self.copies[0], end=False), TimingMark(self.copies[-1], end=True)


class CopyDouble:
    """The GPU of a CPU store under the double: issues, orders and completes deferred copies.

    Thread-safe: one lock guards every copy's state (copies are issued on the store's copy
    threads and waited for on others).
    """

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self._open: list[DeferredCopy] = []
        self.poisoned_bytes = 0
        """Bytes poisoned at issue since the double started (tests check it moves)."""

    def copy(
        self,
        dst: torch.Tensor,
        src: torch.Tensor,
        *,
        to_device: bool,
        from_host: bool,
        after: Iterable[object],
    ) -> DeferredEvent:
        """Issue ``dst <- src`` (flat ``uint8`` of one length) after the events ``after``."""
        prior = [c for e in after if isinstance(e, DeferredEvent) for c in e.copies]
        with self._lock:
            for c in prior:
                self._run(c)
            span_dst, span_src = _span(dst), _span(src)
            for c in list(self._open):
                if c.from_host and (
                    _overlap(_span(c.src), span_src) or _overlap(_span(c.src), span_dst)
                ):
                    self._reread(c)
            for c in _pending_before(prior):  # they read their sources before this copy
                if c.from_host and _overlap(_span(c.src), span_dst):  # overwrites them
                    c.crc = None  # its poison is no change by the host: done reading
            new = DeferredCopy(dst, src, to_device=to_device, from_host=from_host, after=prior)
            dst.fill_(POISON_BYTE)
            self.poisoned_bytes += dst.numel()
            self._open.append(new)
        return DeferredEvent(self, [new])

    def order(self, copies: Iterable[DeferredCopy]) -> None:
        """Run ``copies`` as seen from ordered device work (see :class:`DeferredEvent`)."""
        with self._lock:
            for c in copies:
                self._run(c)

    def complete(self, copies: Iterable[DeferredCopy]) -> None:
        """Complete ``copies`` as a host sync does."""
        with self._lock:
            for c in copies:
                self._complete(c)

    def finish(self) -> None:
        """Complete every copy in flight (a device-wide synchronisation)."""
        with self._lock:
            for c in list(self._open):
                self._complete(c)

    @property
    def in_flight(self) -> int:
        """Copies issued and not completed."""
        with self._lock:
            return len(self._open)

    # -- internals (under the lock) ----------------------------------------------------------

    def _run(self, c: DeferredCopy) -> None:
        if c.read is not None or c.complete:
            return
        for p in c.after:  # finished on the GPU before ``c`` starts: a host destination
            self._complete(p)  # of ``p`` that ``c`` reads holds its bytes
        c.started = time.perf_counter()
        c.read = c.src.clone()
        if c.from_host:
            c.crc = _crc(c.src)
        if c.to_device:
            c.dst.copy_(c.read)
            c.landed = True
        c.ended = time.perf_counter()

    def _reread(self, c: DeferredCopy) -> None:
        """A host source still being read: the copy sees its current bytes."""
        if c.read is None or c.crc is None or _crc(c.src) == c.crc:
            return
        c.read = c.src.clone()
        c.crc = _crc(c.src)
        if c.to_device:
            c.dst.copy_(c.read)

    def _complete(self, c: DeferredCopy) -> None:
        if c.complete:
            return
        for p in c.after:
            self._complete(p)
        self._run(c)
        self._reread(c)
        assert c.read is not None
        if not c.to_device:
            c.dst.copy_(c.read)
            c.landed = True
        c.read = None
        c.complete = True
        c.after = []  # complete: nothing before it matters any more
        if c in self._open:
            self._open.remove(c)


CopyEvent = torch.cuda.Event | DeferredEvent
"""The event of a copy: CUDA's, or the double's."""
