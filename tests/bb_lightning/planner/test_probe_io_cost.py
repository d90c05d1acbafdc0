"""The NVMe probe's loop of matrix products beside reads and writes: what it counts.

How much the compute loses is a timing and is reported by ``bench/io_beside_compute.py``;
here only what the probe does with the transfers it runs beside the loop."""

from __future__ import annotations

import importlib
import math
import threading
import time
from pathlib import Path

import torch

measure_module = importlib.import_module("bb_lightning.probe.measure")


class _Done:
    def __init__(self, thread: threading.Thread) -> None:
        self._thread = thread

    def wait(self) -> None:
        self._thread.join()


class _Backend:
    """A disk whose every transfer takes ``seconds`` asleep; counts reads and writes."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.reads = 0
        self.writes = 0

    def _start(self) -> _Done:
        thread = threading.Thread(target=time.sleep, args=(self.seconds,))
        thread.start()
        return _Done(thread)

    def read_async(self, path: str, dst: torch.Tensor, nbytes: int) -> _Done:
        self.reads += 1
        return self._start()

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
        self.writes += 1
        return self._start()


def _run(backend: _Backend, tmp_path: Path, seconds: float) -> float:
    paths = [str(tmp_path / f"f{i}") for i in range(2)]
    buffers = [torch.empty(1 << 20, dtype=torch.uint8) for _ in paths]
    return measure_module._compute_lost_per_byte(backend, paths, buffers, 1 << 20, seconds)


def test_reads_then_writes_run_beside_the_loop(tmp_path: Path) -> None:
    backend = _Backend(0.005)
    per_byte = _run(backend, tmp_path, 0.2)
    assert backend.reads >= 2 and backend.writes >= 2  # both kinds, over and over
    assert math.isfinite(per_byte) and per_byte >= 0.0


def test_the_loop_runs_again_until_a_transfer_has_finished(tmp_path: Path) -> None:
    def loop() -> float:  # stands for the products: a loop of 10 ms
        time.sleep(0.01)
        return 0.01

    backend = _Backend(0.03)  # a transfer outlasts about three loops
    paths = [str(tmp_path / "f0")]
    buffers = [torch.empty(1 << 20, dtype=torch.uint8)]
    for write in (False, True):
        took, loops, done = measure_module._loop_beside(
            backend, paths, buffers, 1 << 20, write, loop
        )
        assert done >= 1 << 20 and 1 < loops <= measure_module.BESIDE_MAX_LOOPS, (loops, done)
        assert took > 0.0
    assert backend.reads >= 1 and backend.writes >= 1


def test_no_transfer_finished_during_the_loops_prices_nothing(tmp_path: Path) -> None:
    backend = _Backend(3.0)  # each transfer outlasts BESIDE_MAX_LOOPS loops (about 0.05 s)
    assert _run(backend, tmp_path, 0.05) == 0.0
    assert backend.reads == 1 and backend.writes == 1
