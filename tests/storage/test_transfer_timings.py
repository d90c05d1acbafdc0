"""Timed device copies are folded into the link meters as they complete: bounded records."""

from __future__ import annotations

import torch

from storage.transfers import FOLD_TIMINGS, Transfers


class _Event:
    """A CUDA event double: completes when the test says so, 2 ms after its start."""

    def __init__(self) -> None:
        self.done = False

    def query(self) -> bool:
        return self.done

    def elapsed_time(self, end: _Event) -> float:
        return 2.0  # milliseconds, as torch.cuda.Event reports


def test_timed_copies_stay_bounded_without_stats_calls() -> None:
    io = Transfers(torch.device("cpu"), nvme=None, staging=None, direct_device=False)
    in_flight = _Event()
    io._record_timing("host->device", 10, _Event(), in_flight)  # never completes here
    ends = []
    for _ in range(10 * FOLD_TIMINGS):
        end = _Event()
        end.done = True
        ends.append(end)
        io._record_timing("host->device", 100, _Event(), end)
        assert len(io._timings) <= FOLD_TIMINGS
    link = io.stats()["host->device"]
    assert link.bytes == 100 * len(ends) and link.count == len(ends)
    assert abs(link.seconds - 0.002 * len(ends)) < 1e-9
    assert len(io._timings) == 1  # the copy still in flight is kept, counted once it lands
    in_flight.done = True
    assert io.stats()["host->device"].bytes == 100 * len(ends) + 10
    assert io._timings == []
