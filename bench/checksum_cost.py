"""What the chunk checksums cost: CRC-32C rate and page-ins with and without verification.

Same run, same disk: ``--count`` tensors of ``--tensor-mib`` each are written into two
NVMe-tier stores, one of format 2 (chunks end with their CRC-32C, verified on every read)
and one of format 1 (no checksum, as plain zarr writes by default); each round drops them
from the page cache and pages them all in from both stores, alternating. Reports the
CRC-32C rate on an in-memory buffer (MB/s, 1e6 bytes/s), the page-in bandwidth of each
store (median over ``--repeats``), the CRC's CPU time as a share of a verified page-in, and
the page-in time verification adds (the CRC of a tensor's first pieces overlaps the reading of
the later ones, :data:`storage.nvme.VERIFY_PIECE_BYTES`).

    .venv/bin/python bench/checksum_cost.py [--dir D] [--count 8] [--tensor-mib 64]
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import time

import _common
import torch
import zarr

from storage.checksum import crc32c
from storage.io import IOConfig, aligned_empty, drop_cache, open_backend
from storage.nvme import NvmeTier


def crc_rate(nbytes: int, repeats: int = 5) -> float:
    """CRC-32C bytes/s of google_crc32c on an in-memory buffer (best of ``repeats``)."""
    buf = torch.randint(0, 256, (nbytes,), dtype=torch.uint8)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        crc32c(buf)
        best = min(best, time.perf_counter() - start)
    return nbytes / best


def page_in_seconds(tier: NvmeTier, names: list[str], buf: torch.Tensor) -> float:
    """Seconds to read every tensor (page cache dropped first), one at a time."""
    for name in names:
        drop_cache(tier.chunk_path(name))
    start = time.perf_counter()
    for name in names:
        tier.read_async(name, buf).wait()
    return time.perf_counter() - start


def main(argv: list[str] | None = None) -> dict[str, float]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", help="scratch directory on the disk to measure")
    parser.add_argument("--count", type=int, default=8, help="tensors per store")
    parser.add_argument("--tensor-mib", type=int, default=64, help="MiB per tensor")
    parser.add_argument("--repeats", type=int, default=3, help="rounds (median reported)")
    args = parser.parse_args(argv)
    base = _common.nvme_base(args.dir) / "checksum-cost"
    nbytes = args.tensor_mib << 20
    names = [f"t{i}" for i in range(args.count)]
    buf = aligned_empty(nbytes)
    buf.copy_(torch.randint(0, 256, (buf.numel(),), dtype=torch.uint8))
    old = zarr.open_group(base / "format1", mode="w")
    for name in names:
        old.create_array(name, shape=(nbytes,), dtype="uint8", chunks=(nbytes,), compressors=None)
    print(_common.machine(base))
    backend = open_backend(IOConfig(backend="posix"))
    try:
        with (
            NvmeTier(base / "format2", capacity=2 * len(names) * nbytes, backend=backend) as new,
            NvmeTier(base / "format1", capacity=2 * len(names) * nbytes, backend=backend) as legacy,
        ):
            for name in names:
                new.create(name, (nbytes,), torch.uint8)
            for tier in (new, legacy):
                for name in names:
                    tier.write_async(name, buf).wait()
            checked, plain = [], []
            for _ in range(args.repeats):
                checked.append(page_in_seconds(new, names, buf))
                plain.append(page_in_seconds(legacy, names, buf))
    finally:
        backend.close()
        shutil.rmtree(base, ignore_errors=True)
    total = len(names) * nbytes
    rate = crc_rate(nbytes)
    with_crc, without = total / statistics.median(checked), total / statistics.median(plain)
    share = (total / rate) / statistics.median(checked)
    added = statistics.median(checked) / statistics.median(plain) - 1
    print(f"CRC-32C (google_crc32c {'C' if rate > 1e8 else '?'}): {rate / 1e6:,.0f} MB/s")
    print(f"page-in, format 2 (verified): {with_crc / 1e9:.2f} GB/s")
    print(f"page-in, format 1 (no checksum): {without / 1e9:.2f} GB/s")
    print(f"ratio verified / unverified: {with_crc / without:.3f}")
    print(f"CRC-32C CPU time as a share of a verified page-in: {100 * share:.1f} %")
    print(
        f"page-in time added by verification (CRC overlapped with the reads): {100 * added:.1f} %"
    )
    return {"crc_mb_s": rate / 1e6, "ratio": with_crc / without, "share": share, "added": added}


if __name__ == "__main__":
    main()
