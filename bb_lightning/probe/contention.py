"""Probes on a shared machine: time passes, keep the fastest, and say when not to trust them.

A probe that runs beside a busy process measures that process's share of the
cores, not the machine: a plan priced from it is pessimistic, and a hardware
profile cached from it stays pessimistic. The probes of
:mod:`bb_lightning.probe.measure` and :mod:`bb_lightning.probe.calibrate`
therefore time every series of passes interleaved with the others, keep the
fastest pass of each, and check the figures:

- *steadiness*: the fastest pass of a series is matched by another one within
  :data:`SPREAD` (``DISK_SPREAD`` for disks); one fast pass among slow ones means
  something else ran during the others;
- *drift*: the matrix products the model-shaped probes time beside the model's
  passes run at no less than :data:`DRIFT` x the hardware profile's rate (the median
  product: one lucky product among slowed ones does not pass);
- *neighbours*: other processes took no more than :data:`BUSY_SHARE` of the CPU
  time of this process's cores during the probe (``/proc/stat``, via psutil).

A probe that fails a check measures again, :data:`MAX_ROUNDS` rounds at most; one
still failing says so in one warning line and is not cached.

Timing goes through a :class:`Timing`, so that tests can script what each pass
takes; :data:`SYSTEM` is the real clock and CPU counters.
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable, Iterable, Sequence

import psutil

__all__ = [
    "BUSY_SHARE",
    "DISK_SPREAD",
    "DRIFT",
    "MAX_ROUNDS",
    "QUIET_SHARE",
    "QUIET_WINDOW",
    "SPREAD",
    "SYSTEM",
    "Timing",
    "best_rate",
    "fastest",
    "median_rate",
    "rates",
    "spread",
    "unsteady",
]

SPREAD = 1.5
"""Largest ratio of the second-fastest to the fastest pass of a series for a steady probe."""
DISK_SPREAD = 2.0
"""The same for disk transfers (write-back and device queues vary more than compute)."""
DRIFT = 0.6
"""Smallest ratio of the matrix-product rate timed beside a model-shaped probe to the
hardware profile's ``device_flops`` for an undisturbed probe."""
BUSY_SHARE = 0.25
"""Largest share of this process's cores' CPU time other processes may take during a probe."""
MAX_ROUNDS = 3
"""Rounds of passes a probe takes at most (the first one included) while a check fails."""
QUIET_WINDOW = 0.3
"""Seconds :meth:`Timing.quiet_core` watches the cores for."""
QUIET_SHARE = 0.25
"""Largest busy share of a core :meth:`Timing.quiet_core` still calls quiet."""


class Timing:
    """How a probe times its passes and watches the machine (the real clock and counters)."""

    def seconds(self, label: str, run: Callable[[], None]) -> float:
        """Seconds ``run()`` takes (it synchronises its device itself); ``label`` names the
        series it belongs to."""
        t0 = time.perf_counter()
        run()
        return time.perf_counter() - t0

    def watch(self) -> Callable[[], float]:
        """Start watching the machine; the returned function gives the share (0..1) of the
        CPU time of this process's cores that other processes took since."""
        cpus = sorted(_affinity())
        t0, own0, busy0 = time.perf_counter(), _own_seconds(), _busy_seconds(cpus)

        def share() -> float:
            wall = (time.perf_counter() - t0) * len(cpus)
            others = _busy_seconds(cpus) - busy0 - (_own_seconds() - own0)
            return min(max(others / wall, 0.0), 1.0) if wall > 0 else 0.0

        return share

    def quiet_core(self) -> int | None:
        """The core of this process's that other processes use least, watched over
        :data:`QUIET_WINDOW` seconds while this thread sleeps; None when every one of them
        was busy :data:`QUIET_SHARE` of the time or more, or there is only one."""
        cpus = sorted(_affinity())
        if len(cpus) < 2:
            return None
        before = psutil.cpu_times(percpu=True)
        time.sleep(QUIET_WINDOW)
        after = psutil.cpu_times(percpu=True)
        shares = {}
        for i in cpus:
            if i < len(before) and i < len(after):
                wall = sum(after[i]) - sum(before[i])
                idle = after[i].idle - before[i].idle
                shares[i] = 1.0 - idle / wall if wall > 0 else 1.0
        if not shares:
            return None
        core = min(shares, key=lambda i: shares[i])
        return core if shares[core] < QUIET_SHARE else None


SYSTEM = Timing()
"""The real clock and CPU counters."""


def _affinity() -> set[int]:
    try:
        return os.sched_getaffinity(0)
    except AttributeError:
        return set(range(os.cpu_count() or 1))


def _busy_seconds(cpus: Sequence[int]) -> float:
    """CPU seconds the given CPUs spent not idle (steal time included: a hypervisor's
    other guests are neighbours too)."""
    per_cpu = psutil.cpu_times(percpu=True)
    total = 0.0
    for i in cpus:
        if i < len(per_cpu):
            t = per_cpu[i]
            total += sum(t) - t.idle - getattr(t, "iowait", 0.0) - getattr(t, "guest", 0.0)
            total -= getattr(t, "guest_nice", 0.0)
    return total


def _own_seconds() -> float:
    t = psutil.Process().cpu_times()
    return t.user + t.system + t.children_user + t.children_system


def fastest(times: Iterable[float]) -> float:
    """The shortest of ``times`` (seconds)."""
    return min(times)


def spread(times: Sequence[float]) -> float:
    """Second-fastest over fastest of ``times`` (1.0 with fewer than two)."""
    if len(times) < 2:
        return 1.0
    a, b = sorted(times)[:2]
    return b / max(a, 1e-12)


def unsteady(series: dict[str, list[float]], limit: float = SPREAD) -> dict[str, float]:
    """The series whose two fastest passes differ by more than ``limit``, with that ratio."""
    out = {}
    for label, times in series.items():
        s = spread(times)
        if s > limit:
            out[label] = s
    return out


def median(times: Sequence[float]) -> float:
    """The median of ``times``."""
    return statistics.median(times)


def rates(
    work: float,
    run: Callable[[], None],
    seconds: float,
    min_runs: int,
    timing: Timing = SYSTEM,
    label: str = "",
) -> list[float]:
    """``work / seconds`` of repeated ``run()`` calls within ``seconds`` (at least min_runs),
    each timed by ``timing`` under ``label``."""
    found: list[float] = []
    deadline = time.perf_counter() + seconds
    while len(found) < min_runs or time.perf_counter() < deadline:
        found.append(work / max(timing.seconds(label, run), 1e-9))
    return found


def best_rate(
    work: float,
    run: Callable[[], None],
    seconds: float,
    min_runs: int = 2,
    timing: Timing = SYSTEM,
    label: str = "",
) -> float:
    """Best ``work / seconds`` over repeated ``run()`` calls (peak of a device or link)."""
    return max(rates(work, run, seconds, min_runs, timing, label))


def median_rate(
    work: float,
    run: Callable[[], None],
    seconds: float,
    min_runs: int = 3,
    timing: Timing = SYSTEM,
    label: str = "",
) -> float:
    """Median ``work / seconds`` over repeated ``run()`` calls (typical of a shared resource)."""
    return statistics.median(rates(work, run, seconds, min_runs, timing, label))
