"""Does paging from NVMe hide behind compute? TieredStore page-ins overlapped with bf16 matmuls.

A loop over ``--tensors`` bf16 weight matrices homed on the NVMe tier (``--total-gib``
in all). Each step multiplies a batch of ``tokens`` activations by the current
weight while the next weight is paged in (``prefetch_async`` one step ahead).
``tokens`` is calibrated so that one step's compute takes about as long as one
weight's cold read. Printed, all measured in this run:

* I/O alone: page each weight in and release it, nothing else;
* compute alone: the matmuls on weights already in memory;
* overlapped: the real loop;
* ratio = overlapped / max(compute, I/O)  (1.0 is perfect overlap; target <= 1.1).

Each phase runs ``--repeats`` times and keeps its fastest pass. The page cache is dropped (``posix_fadvise(DONTNEED)``) on every chunk file
before each pass and the POSIX backend reads with ``O_DIRECT``.

Run: ``.venv/bin/python bench/overlap.py [--total-gib 1 --tensors 32 --depth 2 --torch-threads 2]``
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import tempfile
import time
from pathlib import Path

import psutil
import torch

from storage.io import IOConfig, drop_cache
from storage.store import StoreConfig, TieredStore
from storage.tiers import Link, Tier

HIDDEN = 4096


def filesystem(path: Path) -> str:
    """Filesystem type and device of the mount holding ``path``."""
    best = ("?", "?", "")
    with open("/proc/mounts", encoding="utf-8") as f:
        for line in f:
            dev, mnt, fstype = line.split()[:3]
            if str(path.resolve()).startswith(mnt) and len(mnt) >= len(best[2]):
                best = (fstype, dev, mnt)
    return f"{best[0]} on {best[1]} (mounted at {best[2]})"


def machine(path: Path) -> str:
    cpu = platform.processor() or "?"
    with open("/proc/cpuinfo", encoding="utf-8") as f:
        for line in f:
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    ram = psutil.virtual_memory().total / 2**30
    return (
        f"CPU {cpu}, {os.cpu_count()} cores, {ram:.1f} GiB RAM, torch {torch.__version__} "
        f"with {torch.get_num_threads()} intra-op threads; store dir {path} on {filesystem(path)}"
    )


def default_dir() -> Path:
    """A directory on a disk-backed filesystem (not tmpfs)."""
    tmp = Path(tempfile.gettempdir())
    base = tmp if "tmpfs" not in filesystem(tmp) else Path(__file__).resolve().parent
    return Path(tempfile.mkdtemp(prefix="bb-overlap-", dir=base))


def drop_store_cache(store_dir: Path) -> None:
    """Evict every chunk file under ``store_dir`` from the page cache."""
    for chunk in store_dir.rglob("c*"):
        if chunk.is_file():
            drop_cache(chunk)


def io_alone(store: TieredStore, names: list[str]) -> float:
    start = time.perf_counter()
    for name in names:
        store.prefetch_async(name).wait()
        store.release(name)
    return time.perf_counter() - start


def compute_alone(x: torch.Tensor, weight: torch.Tensor, steps: int) -> float:
    start = time.perf_counter()
    for _ in range(steps):
        torch.matmul(x, weight)
    return time.perf_counter() - start


def calibrate(weight: torch.Tensor, target: float) -> int:
    """Tokens per step whose matmul with ``weight`` takes about ``target`` seconds."""
    tokens, previous = 32, (0, 0.0)
    while True:
        x = torch.randn(tokens, HIDDEN).to(torch.bfloat16)
        torch.matmul(x, weight)
        seconds = compute_alone(x, weight, 2) / 2
        if seconds >= target or tokens >= 1 << 16:
            break
        previous, tokens = (tokens, seconds), tokens * 2
    lo, t_lo = previous
    share = (target - t_lo) / (seconds - t_lo) if seconds > t_lo else 1.0
    return max(16, int(lo + share * (tokens - lo)) // 16 * 16)


def overlapped(store: TieredStore, names: list[str], x: torch.Tensor, depth: int) -> float:
    """The loop: ``depth`` weights paged in ahead of the one being multiplied."""
    start = time.perf_counter()
    tickets = [store.prefetch_async(name) for name in names[:depth]]
    for i, name in enumerate(names):
        weight = tickets.pop(0).wait()[name]
        if i + depth < len(names):
            tickets.append(store.prefetch_async(names[i + depth]))
        torch.matmul(x, weight)
        store.release(name)
    return time.perf_counter() - start


def main(argv: list[str] | None = None) -> dict[str, float]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--total-gib", type=float, default=1.0, help="GiB of weights on NVMe")
    parser.add_argument("--tensors", type=int, default=32, help="number of weight matrices")
    parser.add_argument("--depth", type=int, default=2, help="weights paged in ahead")
    parser.add_argument(
        "--torch-threads",
        type=int,
        default=max(1, (os.cpu_count() or 1) - 1),
        help="intra-op threads (default: one core left to the I/O path)",
    )
    parser.add_argument("--repeats", type=int, default=3, help="passes; the fastest is kept")
    parser.add_argument("--io-threads", type=int, default=4, help="POSIX backend threads")
    parser.add_argument("--dir", type=Path, default=None, help="store directory (default: temp)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.torch_threads)
    root = args.dir or default_dir()
    root.mkdir(parents=True, exist_ok=True)
    per = int(args.total_gib * 2**30) // args.tensors // (HIDDEN * 2) * (HIDDEN * 2)
    cols = per // (HIDDEN * 2)
    config = StoreConfig(
        device_budget=(args.depth + 1) * per + (1 << 20),
        host_budget=0,
        nvme_path=str(root / "nvme"),
        nvme_budget=args.tensors * per,
        staging_buffers=1,
        staging_bytes=1 << 20,
        io=IOConfig(backend="posix", threads=args.io_threads),
        device="cpu",
    )
    print(machine(root))
    try:
        with TieredStore(config) as store:
            names = [f"w{i}" for i in range(args.tensors)]
            sample = torch.randn(HIDDEN, cols).to(torch.bfloat16)
            for name in names:
                store.register(name, shape=(HIDDEN, cols), dtype=torch.bfloat16, home=Tier.NVME)
                store.write_back_async(name, sample)
            for name in names:  # waits for each write (operations on a tensor are ordered)
                store.read(name, out=sample)
            drop_store_cache(root / "nvme")
            t_io = io_alone(store, names)
            tokens = calibrate(sample, t_io / args.tensors)
            x = torch.randn(tokens, HIDDEN).to(torch.bfloat16)
            t_compute, t_wall = compute_alone(x, sample, args.tensors), float("inf")
            for _ in range(args.repeats):  # each phase's fastest pass: the machine may be shared
                drop_store_cache(root / "nvme")
                t_io = min(t_io, io_alone(store, names))
                t_compute = min(t_compute, compute_alone(x, sample, args.tensors))
                drop_store_cache(root / "nvme")
                t_wall = min(t_wall, overlapped(store, names, x, args.depth))
            stats = store.stats()[Link.NVME_TO_DEVICE]
    finally:
        if args.dir is None:
            shutil.rmtree(root, ignore_errors=True)
    gib = args.tensors * per / 2**30
    flops = 2.0 * tokens * HIDDEN * cols * args.tensors
    ratio = t_wall / max(t_compute, t_io)
    print(
        f"{args.tensors} bf16 weights of {per / 2**20:.0f} MiB ({gib:.2f} GiB), {tokens} tokens "
        f"per step, {args.depth} paged in ahead, {args.io_threads} I/O threads"
    )
    print(f"I/O alone      {t_io:7.3f} s   {gib * 2**30 / t_io / 1e9:6.2f} GB/s (cold, O_DIRECT)")
    print(f"compute alone  {t_compute:7.3f} s   {flops / t_compute / 1e12:6.2f} TFLOP/s bf16")
    print(f"overlapped     {t_wall:7.3f} s")
    print(f"ratio overlapped / max(compute, I/O) = {ratio:.3f}   (target <= 1.1)")
    print(f"ratio overlapped / (compute + I/O)   = {t_wall / (t_compute + t_io):.3f}")
    print(
        f"{Link.NVME_TO_DEVICE} link, all passes: {stats.bytes / 2**30:.2f} GiB in {stats.count} reads"
    )
    return {"io": t_io, "compute": t_compute, "wall": t_wall, "ratio": ratio}


if __name__ == "__main__":
    main()
