"""NVMe tier bandwidth against ``dd`` with direct I/O on the same filesystem, same run.

Writes ``--total-gib`` of tensors (``--tensor-mib`` each) through
:class:`storage.nvme.NvmeTier`, drops them from the page cache
(``posix_fadvise(DONTNEED)``; the POSIX backend also uses ``O_DIRECT``) and
reads them back; then ``dd`` writes and reads a file of the same size with
``oflag=direct conv=fsync`` / ``iflag=direct``. The two alternate for
``--repeats`` rounds; the median of each is reported, in GB/s (1e9 bytes/s),
with the ratio ours / dd.

    .venv/bin/python bench/nvme_bandwidth.py [--dir D] [--total-gib 2] [--tensor-mib 128]
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import _common
import torch

from storage.io import POSIX_TASK_SIZE, IOConfig, aligned_empty, drop_cache, open_backend
from storage.nvme import NvmeTier

DD_BLOCK = 4 << 20  # bytes per dd block


def default_dir() -> Path:
    """A scratch directory on a real disk: the temp dir unless it is tmpfs, else the repo's."""
    tmp = Path(tempfile.gettempdir())
    base = _common.REPO if _common.mount_of(tmp)[1] in ("tmpfs", "ramfs") else tmp
    return Path(tempfile.mkdtemp(prefix="bb-nvme-bench-", dir=base))


def run_ours(tier: NvmeTier, names: list[str], buffers: list[torch.Tensor]) -> tuple[float, float]:
    """Seconds to write then read every tensor, ``len(buffers)`` transfers in flight."""
    start = time.perf_counter()
    pending = [
        tier.write_async(n, buffers[i % len(buffers)]) for i, n in enumerate(names[: len(buffers)])
    ]
    for i, name in enumerate(names[len(buffers) :], start=len(buffers)):
        pending[i % len(buffers)].wait()
        pending[i % len(buffers)] = tier.write_async(name, buffers[i % len(buffers)])
    for fut in pending:
        fut.wait()
    write_s = time.perf_counter() - start
    for name in names:
        drop_cache(tier.chunk_path(name))
    start = time.perf_counter()
    pending = [tier.read_async(n, buffers[i]) for i, n in enumerate(names[: len(buffers)])]
    for i, name in enumerate(names[len(buffers) :], start=len(buffers)):
        pending[i % len(buffers)].wait()
        pending[i % len(buffers)] = tier.read_async(name, buffers[i % len(buffers)])
    for fut in pending:
        fut.wait()
    return write_s, time.perf_counter() - start


def run_dd(path: Path, total: int) -> tuple[float, float]:
    """Seconds for ``dd`` to write then read ``total`` bytes with direct I/O."""
    count = f"count={total // DD_BLOCK}"
    start = time.perf_counter()
    subprocess.run(
        ["dd", "if=/dev/zero", f"of={path}", "bs=4M", count, "oflag=direct", "conv=fsync"],
        check=True,
        capture_output=True,
    )
    write_s = time.perf_counter() - start
    drop_cache(path)
    start = time.perf_counter()
    subprocess.run(
        ["dd", f"if={path}", "of=/dev/null", "bs=4M", "iflag=direct"],
        check=True,
        capture_output=True,
    )
    read_s = time.perf_counter() - start
    path.unlink()
    return write_s, read_s


def main(argv: list[str] | None = None) -> dict[str, float]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dir", type=Path, default=None, help="scratch directory (real disk)")
    parser.add_argument("--total-gib", type=float, default=2.0, help="GiB written and read")
    parser.add_argument("--tensor-mib", type=float, default=128.0, help="MiB per tensor")
    parser.add_argument("--threads", type=int, default=IOConfig().threads)
    parser.add_argument("--task-mib", type=float, default=POSIX_TASK_SIZE / 2**20)
    parser.add_argument("--in-flight", type=int, default=4, help="tensor transfers in flight")
    parser.add_argument("--repeats", type=int, default=3, help="alternating rounds; median kept")
    args = parser.parse_args(argv)

    tensor_bytes = max(DD_BLOCK, int(args.tensor_mib * 2**20) // DD_BLOCK * DD_BLOCK)
    count = max(1, round(args.total_gib * 2**30 / tensor_bytes))
    total = count * tensor_bytes
    own_dir = args.dir is None
    root = default_dir() if own_dir else Path(args.dir)
    root.mkdir(parents=True, exist_ok=True)
    if shutil.disk_usage(root).free < 2 * total + (1 << 30):
        raise SystemExit(f"{root}: need {2 * total / 1e9:.1f} GB free plus 1 GiB headroom")
    config = IOConfig(backend="posix", threads=args.threads, task_size=int(args.task_mib * 2**20))
    print(_common.machine(root))
    print(
        f"{count} tensors x {tensor_bytes / 2**20:.0f} MiB = {total / 2**30:.2f} GiB; posix backend "
        f"threads={config.threads} task_size={int(args.task_mib * 1024)} KiB, "
        f"{args.in_flight} tensors in flight; dd bs=4M"
    )
    gen = torch.Generator().manual_seed(0)
    buffers = []
    for _ in range(min(args.in_flight, count)):
        buf = aligned_empty(tensor_bytes)
        buf.copy_(torch.randint(0, 256, (buf.numel(),), dtype=torch.uint8, generator=gen))
        buffers.append(buf)
    names = [f"layers.{i}.weight" for i in range(count)]
    keys = ("ours_write", "ours_read", "dd_write", "dd_read")
    rounds: dict[str, list[float]] = {k: [] for k in keys}
    try:
        with open_backend(config) as backend:
            for round_ in range(args.repeats):
                store = root / f"store{round_}"
                with NvmeTier(store, capacity=total, backend=backend) as tier:
                    for name in names:
                        tier.create(name, (tensor_bytes,), torch.uint8)
                    ours = run_ours(tier, names, buffers)
                shutil.rmtree(store)
                dd = run_dd(root / "dd.bin", total)
                rates = dict(zip(keys, [total / s / 1e9 for s in (*ours, *dd)], strict=True))
                print(
                    f"round {round_}: " + ", ".join(f"{k} {v:.2f} GB/s" for k, v in rates.items())
                )
                for k in keys:
                    rounds[k].append(rates[k])
    finally:
        if own_dir:
            shutil.rmtree(root, ignore_errors=True)
    best = {k: statistics.median(v) for k, v in rounds.items()}
    ratios = {
        "write_ratio": best["ours_write"] / best["dd_write"],
        "read_ratio": best["ours_read"] / best["dd_read"],
    }
    for op in ("write", "read"):
        print(
            f"{op:5s} (median): NvmeTier {best['ours_' + op]:.2f} GB/s, dd direct {best['dd_' + op]:.2f} "
            f"GB/s, ratio {ratios[op + '_ratio']:.2f}x (target >= 0.90x)"
        )
    return {**best, **ratios}


if __name__ == "__main__":
    main()
