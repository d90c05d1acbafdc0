"""The NVMe probe prices a transfer by what the compute beside it loses, not only by the
process's CPU time: a disk whose transfers take the cores' time costs the compute."""

from __future__ import annotations

import importlib
import threading
import time
from pathlib import Path

import torch

measure_module = importlib.import_module("bb_lightning.probe.measure")

TRANSFER_S = 0.02
"""Seconds each fake transfer takes."""


class _Done:
    def __init__(self, thread: threading.Thread) -> None:
        self._thread = thread

    def wait(self) -> None:
        self._thread.join()


class _Backend:
    """A disk whose every transfer takes TRANSFER_S: spinning on a core (``burn``, as a
    hypervisor emulating the disk on the guest's cores does) or asleep (DMA)."""

    def __init__(self, burn: bool) -> None:
        self.burn = burn
        self.transfers = 0

    def _run(self) -> None:
        end = time.perf_counter() + TRANSFER_S
        if not self.burn:
            time.sleep(TRANSFER_S)
            return
        while time.perf_counter() < end:  # holds a core (and the GIL between checks)
            pass

    def _start(self) -> _Done:
        self.transfers += 1
        thread = threading.Thread(target=self._run)
        thread.start()
        return _Done(thread)

    def read_async(self, path: str, dst: torch.Tensor, nbytes: int) -> _Done:
        return self._start()

    def write_async(self, path: str, src: torch.Tensor, nbytes: int) -> _Done:
        return self._start()


def _lost(burn: bool, tmp_path: Path) -> tuple[float, int]:
    backend = _Backend(burn)
    paths = [str(tmp_path / f"f{i}") for i in range(2)]
    buffers = [torch.empty(1 << 20, dtype=torch.uint8) for _ in paths]
    per_byte = measure_module._compute_lost_per_byte(backend, paths, buffers, 1 << 20, 0.3)
    return per_byte, backend.transfers


def test_transfers_that_take_the_cores_cost_the_compute(tmp_path: Path) -> None:
    burning, transfers = _lost(True, tmp_path)
    assert transfers >= 4  # transfers ran beside both loops
    # each MiB moved took 20 ms of a core: the loop on every core lost a share of that
    assert burning > 1e-3 / (1 << 20), burning * (1 << 20)
    asleep, _ = _lost(False, tmp_path)
    assert asleep < burning, (asleep * (1 << 20), burning * (1 << 20))
