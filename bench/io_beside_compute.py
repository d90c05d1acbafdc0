"""What NVMe-tier transfers cost the compute that runs beside them, on this machine.

On a CPU device the store's disk traffic shares the machine with the training
thread's matrix products. The process's own CPU time per byte (the kernel's share of
``O_DIRECT``, the I/O threads') is what the hardware probe measures
(``nvme_cpu_seconds_per_byte``); on a virtual machine the hypervisor may also charge
the disk's emulation to the guest's cores, which the guest sees as steal time and no
process accounts for. This benchmark measures the whole cost: a fixed loop of fp32
matrix products on every core

1. alone;
2. beside reads: a thread reads ``--gib`` of files on the NVMe tier over and over
   through the I/O backend (``O_DIRECT`` where the filesystem accepts it) until the loop
   ends;
3. beside writes: the same with writes (no ``fsync`` per file);

beside transfers the loop runs again until at least one transfer has finished (a slow
disk's first file may take longer than one loop), and the figures are per loop;

and prints, for 2 and 3, the loop's extra seconds per GB moved (the compute lost to the
transfers, ratio to 1 in the same round), the steal time the machine's cores reported
meanwhile and the process's CPU time beyond the loop's, per GB. Each phase runs
``--repeat`` times, alternating; the figures use each phase's fastest loop.

    .venv/bin/python bench/io_beside_compute.py [--gib 2] [--seconds 8] [--repeat 3]
        [--nvme-dir D]
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import _common
import psutil
import torch

from storage.io import IOBackend, aligned_empty, open_backend

FILE_BYTES = 256 << 20
"""Bytes per file of the I/O loop (the size of a few blocks' optimizer state)."""
SIZE = 1024
"""Side of the fp32 matrices of the compute loop."""
MAX_LOOPS = 20
"""Loops beside transfers at most while waiting for one to finish."""


@dataclass
class Phase:
    seconds: float
    """Wall time of the compute loops."""
    loops: int = 1
    """Times the compute loop ran (beside transfers: until one finished)."""
    moved: int = 0
    """Bytes the I/O thread moved while the loop ran."""
    steal: float = 0.0
    """CPU seconds the machine's cores reported as stolen meanwhile."""
    cpu: float = 0.0
    """CPU seconds of this process meanwhile (every thread)."""

    @property
    def per_loop(self) -> float:
        """Wall seconds of one compute loop."""
        return self.seconds / self.loops


def _steal() -> float:
    return sum(getattr(t, "steal", 0.0) for t in psutil.cpu_times(percpu=True))


def _own_cpu() -> float:
    t = psutil.Process().cpu_times()
    return t.user + t.system


def _calibrate(seconds: float) -> int:
    """Products of SIZE x SIZE fp32 matrices that take about ``seconds`` here."""
    a = torch.randn(SIZE, SIZE)
    start = time.perf_counter()
    n = 0
    while time.perf_counter() - start < 0.5:
        torch.mm(a, a)
        n += 1
    per = (time.perf_counter() - start) / n
    return max(1, round(seconds / per))


def _loop(n: int, a: torch.Tensor, out: torch.Tensor) -> None:
    for _ in range(n):
        torch.mm(a, a, out=out)


def _io_loop(
    backend: IOBackend, paths: list[Path], buf: torch.Tensor, write: bool, stop: threading.Event
) -> list[int]:
    """Start a thread that reads (or writes) ``paths`` in turn until ``stop``; the list it
    adds the bytes of every finished transfer to."""
    moved = [0]

    def run() -> None:
        k = 0
        while not stop.is_set():
            path = paths[k % len(paths)]
            if write:
                backend.write_async(path, buf, FILE_BYTES, fsync=False).wait()
            else:
                backend.read_async(path, buf, FILE_BYTES).wait()
            moved[0] += FILE_BYTES
            k += 1

    threading.Thread(target=run, name="bb-bench-io", daemon=True).start()
    return moved


def _phase(
    n: int, backend: IOBackend | None, paths: list[Path], buf: torch.Tensor, write: bool
) -> Phase:
    a = torch.randn(SIZE, SIZE)
    out = torch.empty(SIZE, SIZE)
    stop = threading.Event()
    moved = _io_loop(backend, paths, buf, write, stop) if backend is not None else [0]
    if backend is not None:
        time.sleep(0.2)  # the transfers under way before the loop starts
    steal, cpu = _steal(), _own_cpu()
    start = time.perf_counter()
    before = moved[0]
    loops = 0
    while True:
        _loop(n, a, out)
        loops += 1
        if backend is None or moved[0] > before or loops >= MAX_LOOPS:
            break
    seconds = time.perf_counter() - start
    phase = Phase(seconds, loops, moved[0] - before, _steal() - steal, _own_cpu() - cpu)
    stop.set()
    time.sleep(0.5)  # the last transfer ends before the next phase
    return phase


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--gib", type=float, default=2.0, help="GiB of files the I/O loop uses")
    parser.add_argument("--seconds", type=float, default=8.0, help="compute loop alone, about")
    parser.add_argument("--repeat", type=int, default=3, help="rounds of the three phases")
    parser.add_argument("--nvme-dir", default=None, help="directory on the disk under test")
    args = parser.parse_args(argv)
    if args.gib <= 0 or args.seconds <= 0 or args.repeat < 1:
        raise ValueError(
            f"--gib {args.gib} and --seconds {args.seconds} must be > 0 and --repeat "
            f"{args.repeat} >= 1"
        )
    base = _common.nvme_base(args.nvme_dir)
    print(_common.machine(base), flush=True)
    files = max(1, round(args.gib * (1 << 30) / FILE_BYTES))
    work = Path(tempfile.mkdtemp(prefix="bb-io-beside-", dir=base))
    try:
        with open_backend() as backend:
            buf = aligned_empty(FILE_BYTES)
            buf.fill_(7)
            paths = [work / f"f{i}.bin" for i in range(files)]
            for p in paths:
                backend.write_async(p, buf, FILE_BYTES).wait()
            n = _calibrate(args.seconds)
            print(
                f"compute loop: {n} fp32 products {SIZE} x {SIZE} on {torch.get_num_threads()} "
                f"threads; I/O loop: {files} files of {FILE_BYTES >> 20} MiB through the "
                f"{backend.name} backend",
                flush=True,
            )
            runs: dict[str, list[Phase]] = {"alone": [], "reads": [], "writes": []}
            for k in range(args.repeat):
                runs["alone"].append(_phase(n, None, paths, buf, False))
                runs["reads"].append(_phase(n, backend, paths, buf, False))
                runs["writes"].append(_phase(n, backend, paths, buf, True))
                line = ", ".join(
                    f"{name} {r[-1].per_loop:.3f} s ({r[-1].moved / 1e9:.2f} GB in {r[-1].loops} "
                    f"loop{'s' if r[-1].loops > 1 else ''}, steal "
                    f"{r[-1].steal:.2f} CPU-s)"
                    for name, r in runs.items()
                )
                print(f"round {k + 1}: {line}", flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    alone = min(runs["alone"], key=lambda p: p.per_loop)
    print(f"compute alone: {alone.seconds:.3f} s (steal {alone.steal:.2f} CPU-s)")
    for name in ("reads", "writes"):
        moving = [p for p in runs[name] if p.moved > 0]
        if not moving:
            print(
                f"beside {name}: no transfer finished in {MAX_LOOPS} loops: raise --seconds "
                "or lower --gib"
            )
            continue
        best = min(moving, key=lambda p: p.per_loop)
        gb = best.moved / 1e9
        lost = best.seconds - best.loops * alone.per_loop
        extra_cpu = best.cpu - best.loops * alone.cpu
        print(
            f"beside {name}: {best.per_loop:.3f} s = {best.per_loop / alone.per_loop:.3f} x "
            f"alone while {gb:.2f} GB moved at {gb / best.seconds:.2f} GB/s; compute lost "
            f"{lost / gb:.3f} s per GB; steal {best.steal / gb:.3f} CPU-s per GB; this "
            f"process's CPU beyond the loop's {extra_cpu / gb:.3f} CPU-s per GB",
            flush=True,
        )
    print(
        "load average at the end (1/5/15 min): " + " / ".join(f"{x:.2f}" for x in os.getloadavg())
    )


if __name__ == "__main__":
    main()
