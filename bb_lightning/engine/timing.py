"""Cheap phase timers for the measure-then-adapt loop.

A :class:`PhaseTimer` accumulates seconds per named phase with
``time.perf_counter`` (a few hundred nanoseconds per phase entry). The engine
times what the caller's thread waits for (page-ins, gradient copies, the
optimizer step) and the wall time of each optimizer step; the compute time of a
step is what remains. On CUDA, kernels are asynchronous, so the caller's clock
covers them only up to a synchronisation: the step boundary synchronises (the
optimizer waits for the gradients), and ``sync`` lets a timer synchronise the
device before it reads the clock at the end of a step.

A wait on a page-in does not block the host on CUDA: it makes the compute
stream wait for the copy. :meth:`PhaseTimer.stream_wait` times such a wait with
two CUDA events recorded on the current stream around it (the stream stalls
between them for as long as the copy is exposed) and reads them at the end of
the step, after its sync; on other devices the wait blocks the caller and the
wall clock times it, as :meth:`PhaseTimer.phase` does.

:class:`StepTimes` is one step's split, in seconds.
"""

from __future__ import annotations

import collections
import contextlib
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol

import torch

__all__ = ["KEEP_FIRST", "KEEP_STEPS", "PHASES", "PhaseTimer", "StepTimes"]

KEEP_STEPS = 1024
"""Closed steps a :class:`PhaseTimer` keeps (the most recent); older ones live on as sums."""
KEEP_FIRST = 64
"""Warm-up steps a :class:`PhaseTimer` keeps, so that :meth:`PhaseTimer.mean` can skip them."""

PHASES = ("wait_page_in", "wait_grads", "optimizer")
"""Phases timed on the caller's thread: waits on page-ins (exposed host-to-device or NVMe
transfer), waits on gradient copies to the host (exposed device-to-host transfer) and the
host optimizer step (the part not overlapped with backward)."""


@dataclass(frozen=True, kw_only=True)
class StepTimes:
    """Seconds of one optimizer step, measured on the caller's thread."""

    step: float
    """Wall time from the first micro-batch of the step to the end of its optimizer step."""
    wait_page_in: float
    """Time spent waiting for blocks to arrive on the device (exposed transfer)."""
    wait_grads: float
    """Time spent waiting for gradients to reach the host accumulators (exposed transfer)."""
    optimizer: float
    """Time spent in the optimizer step after backward (overlapped work not counted)."""

    @property
    def compute(self) -> float:
        """The rest of the step: forward, backward and recomputation, seconds."""
        return max(0.0, self.step - self.wait_page_in - self.wait_grads - self.optimizer)


class TimingEvent(Protocol):
    """What :meth:`PhaseTimer.stream_wait` needs of an event (``torch.cuda.Event``)."""

    def record(self) -> Any:
        """Record the event on the current stream."""

    def synchronize(self) -> Any:
        """Wait on the host until the event completed."""

    def elapsed_time(self, end: Any) -> float:
        """Milliseconds from this event to ``end``."""


def _cuda_event() -> TimingEvent:
    return torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call, no-any-return]


class PhaseTimer:
    """Accumulates seconds per phase and closes one :class:`StepTimes` per optimizer step.

    Not thread-safe: phases are timed on the caller's (training) thread only.
    """

    def __init__(
        self,
        sync: Callable[[], None] | None = None,
        event: Callable[[], TimingEvent] = _cuda_event,
    ) -> None:
        """Create a timer; ``sync`` (e.g. ``torch.cuda.synchronize``) runs before step ends;
        ``event`` makes the timing events of :meth:`stream_wait` on CUDA."""
        self._sync = sync
        self._event = event
        self._pending: list[tuple[str, TimingEvent, TimingEvent]] = []
        self._totals = dict.fromkeys(PHASES, 0.0)
        self._start: float | None = None
        self.steps: collections.deque[StepTimes] = collections.deque(maxlen=KEEP_STEPS)
        """The most recent closed steps (at most :data:`KEEP_STEPS`), oldest first."""
        self.count = 0
        """Steps closed since the timer was made."""
        self._first: list[StepTimes] = []  # the first KEEP_FIRST steps, for mean(skip)
        self._sums = [0.0, 0.0, 0.0, 0.0]  # step, wait_page_in, wait_grads, optimizer

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Add the time spent inside the block to phase ``name`` (one of :data:`PHASES`)."""
        if name not in self._totals:
            raise ValueError(f"unknown phase {name!r}: use one of {PHASES}")
        start = time.perf_counter()
        try:
            yield
        finally:
            self._totals[name] += time.perf_counter() - start

    @contextlib.contextmanager
    def stream_wait(self, name: str, device: torch.device) -> Iterator[None]:
        """Add the time the block makes ``device`` wait to phase ``name``.

        On CUDA the block orders the current stream after a copy: events on that stream
        before and after it measure the stall, read at :meth:`end_step` (after its sync).
        Elsewhere the block blocks the caller: timed by the wall clock, as :meth:`phase`.
        May run on another thread than the step's (autograd's device thread). On CUDA,
        waits outside a step (validation, generation) are not timed: no events pile up.
        """
        if device.type != "cuda":
            with self.phase(name):
                yield
            return
        if name not in self._totals:
            raise ValueError(f"unknown phase {name!r}: use one of {PHASES}")
        if self._start is None:
            yield
            return
        start = self._event()
        start.record()
        try:
            yield
        finally:
            end = self._event()
            end.record()
            self._pending.append((name, start, end))

    @property
    def in_step(self) -> bool:
        """Whether a step was begun and not yet ended."""
        return self._start is not None

    def begin_step(self) -> None:
        """Mark the start of an optimizer step's first micro-batch (later calls do nothing)."""
        if self._start is None:
            self._start = time.perf_counter()

    def end_step(self) -> StepTimes | None:
        """Close the current step and return its times (None when no step was begun)."""
        if self._start is None:
            return None
        if self._sync is not None:
            self._sync()
        pending, self._pending = self._pending, []
        for name, start, end in pending:
            end.synchronize()  # done already after the sync; needed without one
            self._totals[name] += start.elapsed_time(end) / 1e3
        times = StepTimes(step=time.perf_counter() - self._start, **self._totals)
        self.steps.append(times)
        self.count += 1
        if len(self._first) < KEEP_FIRST:
            self._first.append(times)
        for i, value in enumerate(_fields(times)):
            self._sums[i] += value
        self._totals = dict.fromkeys(PHASES, 0.0)
        self._start = None
        return times

    def mean(self, skip: int = 1) -> StepTimes | None:
        """Mean of the closed steps after the first ``skip`` ones (None when there are none).

        With ``skip`` >= the steps closed, the last step; ``skip`` is at most :data:`KEEP_FIRST`.
        """
        if self.count == 0:
            return None
        if skip >= self.count:
            return self.steps[-1]
        if skip > KEEP_FIRST:
            raise ValueError(f"skip={skip} > KEEP_FIRST={KEEP_FIRST}: skip fewer warm-up steps")
        sums = list(self._sums)
        for early in self._first[:skip]:
            for i, value in enumerate(_fields(early)):
                sums[i] -= value
        n = self.count - skip
        step, page_in, grads, optimizer = (max(0.0, x / n) for x in sums)
        return StepTimes(step=step, wait_page_in=page_in, wait_grads=grads, optimizer=optimizer)


def _fields(times: StepTimes) -> tuple[float, float, float, float]:
    return (times.step, times.wait_page_in, times.wait_grads, times.optimizer)
