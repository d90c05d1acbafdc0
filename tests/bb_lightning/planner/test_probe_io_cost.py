"""The NVMe probe's loop of matrix products beside reads and writes: what it counts.

How much the compute loses is a timing and is reported by ``bench/io_beside_compute.py``;
here only what the probe does with the transfers it runs beside the loop. Nothing here
reads a real clock or sleeps: transfers finish when the test lets them (events), and the
loops are timed by scripted clocks."""

from __future__ import annotations

import importlib
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

measure_module = importlib.import_module("bb_lightning.probe.measure")

HANG = 120.0
"""Seconds after which a thread that never arrives fails the test (a hang guard only)."""

PER_FILE = 1 << 20


class _Done:
    def __init__(self, gate: threading.Event | None) -> None:
        self._gate = gate

    def wait(self) -> None:
        if self._gate is not None:
            assert self._gate.wait(HANG), "a held transfer was never let go"


class _Backend:
    """A disk that counts reads and writes; the first transfer of each kind finishes when
    ``first[kind]`` is set (None: at once), every later one at once."""

    def __init__(self, first: dict[bool, threading.Event | None] | None = None) -> None:
        self.first = first or {False: None, True: None}
        self.reads = 0
        self.writes = 0
        self.changed = threading.Condition()

    def _start(self, write: bool) -> _Done:
        with self.changed:
            if write:
                self.writes += 1
            else:
                self.reads += 1
            count = self.count(write)
            self.changed.notify_all()
        return _Done(self.first[write] if count == 1 else None)

    def count(self, write: bool) -> int:
        return self.writes if write else self.reads

    def wait_for(self, write: bool, n: int) -> None:
        """Until ``n`` transfers of the kind have started (the worker counts a finished
        one before it starts the next)."""
        with self.changed:
            assert self.changed.wait_for(lambda: self.count(write) >= n, HANG)

    def read_async(self, path: str, dst: torch.Tensor, nbytes: int) -> _Done:
        return self._start(False)

    def write_async(
        self,
        path: str,
        src: torch.Tensor,
        nbytes: int,
        *,
        fsync: bool = True,
        offset: int = 0,
        in_place: bool = False,
    ) -> _Done:
        # as the store writes its scratch tensors (optimizer state): over the file, no fsync
        assert in_place and not fsync and offset == 0
        return self._start(True)


def _files(tmp_path: Path, n: int) -> tuple[list[str], list[torch.Tensor]]:
    paths = [str(tmp_path / f"f{i}") for i in range(n)]
    return paths, [torch.empty(PER_FILE, dtype=torch.uint8) for _ in paths]


def test_reads_then_writes_run_beside_the_loop(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    backend = _Backend()
    phases: list[bool] = []
    real = measure_module._loop_beside

    def loop_beside(*args: Any, **kwargs: Any) -> tuple[float, int, int]:
        phases.append(args[4])  # write
        return real(*args, **kwargs)  # type: ignore[no-any-return]

    monkeypatch.setattr(measure_module, "_loop_beside", loop_beside)
    ticks = [0.0]

    def clock() -> float:
        """One second a call; a loop beside transfers ends once two of its kind started."""
        if phases:
            backend.wait_for(phases[-1], 2)
        ticks[0] += 1.0
        return ticks[0]

    paths, buffers = _files(tmp_path, 2)
    per_byte = measure_module._compute_lost_per_byte(backend, paths, buffers, PER_FILE, 0.2, clock)
    assert phases == [False, True]  # reads, then writes
    assert backend.reads >= 2 and backend.writes >= 2  # both kinds, over and over
    assert per_byte == 0.0  # every loop took its one second, beside transfers or alone


@pytest.mark.parametrize("write", [False, True])
def test_the_loop_runs_again_until_a_transfer_has_finished(tmp_path: Path, write: bool) -> None:
    held = threading.Event()
    backend = _Backend({write: held, not write: None})
    calls = [0]

    def loop() -> float:  # stands for the products: 10 ms a loop
        calls[0] += 1
        if calls[0] == 3:  # the first transfer outlasts two loops and ends in the third
            held.set()
            backend.wait_for(write, 2)
        return 0.01

    paths, buffers = _files(tmp_path, 1)
    took, loops, done = measure_module._loop_beside(backend, paths, buffers, PER_FILE, write, loop)
    assert loops == 3 and took == pytest.approx(0.03, rel=1e-12)
    assert done >= PER_FILE and done % PER_FILE == 0
    assert backend.count(not write) == 0 and backend.count(write) >= 2


@pytest.mark.parametrize("write", [False, True])
def test_no_transfer_finished_during_the_loops_counts_nothing(tmp_path: Path, write: bool) -> None:
    stop = threading.Event()  # the transfer lasts until the loops are over
    backend = _Backend({write: stop, not write: None})
    paths, buffers = _files(tmp_path, 1)
    took, loops, done = measure_module._loop_beside(
        backend, paths, buffers, PER_FILE, write, lambda: 0.01, stop=stop
    )
    assert loops == measure_module.BESIDE_MAX_LOOPS and done == 0
    assert took == pytest.approx(0.01 * loops, rel=1e-12)
    assert backend.count(write) == 1


def _priced(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, beside: dict[bool, tuple[float, int, int]]
) -> float:
    """``_compute_lost_per_byte`` where the loops alone take 1 s each (a scripted clock)
    and the loops beside reads and writes report ``beside[write]``."""

    def loop_beside(
        backend: Any, paths: Any, buffers: Any, per_file: int, write: bool, loop: Callable[..., Any]
    ) -> tuple[float, int, int]:
        return beside[write]

    monkeypatch.setattr(measure_module, "_loop_beside", loop_beside)
    ticks = [0.0]

    def clock() -> float:
        ticks[0] += 0.5
        return ticks[0]

    paths, buffers = _files(tmp_path, 1)
    return float(
        measure_module._compute_lost_per_byte(_Backend(), paths, buffers, PER_FILE, 0.01, clock)
    )


def test_the_loss_is_the_mean_over_reads_and_writes_of_the_time_lost_per_byte(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # alone: 0.5 s a loop; beside reads 3 loops took 2.5 s for 4 MB, writes 2 took 1.0 s
    got = _priced(monkeypatch, tmp_path, {False: (2.5, 3, 4_000_000), True: (1.0, 2, 1_000)})
    assert got == pytest.approx(((2.5 - 1.5) / 4e6 + 0.0) / 2, rel=1e-12)  # writes lost none


def test_no_transfer_finished_during_the_loops_prices_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert _priced(monkeypatch, tmp_path, {False: (9.0, 8, 0), True: (9.0, 2, 10**6)}) == 0.0
    assert _priced(monkeypatch, tmp_path, {False: (9.0, 2, 10**6), True: (9.0, 8, 0)}) == 0.0
