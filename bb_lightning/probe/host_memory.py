"""The host memory read bandwidth probe: what decode attention on the host reads at.

A decode step's attention over a KV cache homed on the host reads every cached key and
value once per step, two or four bytes per element against a few FLOPs, so its time is
the cache's bytes over the rate the host's cores read memory at together. The probe
sums a buffer larger than the CPU's caches with torch's intra-op team (every core the
process may use), best of repeats: ``bytes / seconds`` of the read.
"""

from __future__ import annotations

import time

import torch

from bb_lightning.probe import contention
from bb_lightning.probe.contention import Timing

__all__ = ["HOST_READ_LABEL", "probe_host_read"]

HOST_READ_LABEL = "host read"
"""The label the probe's passes are timed under."""


def probe_host_read(seconds: float, nbytes: int, timing: Timing = contention.SYSTEM) -> float:
    """Bytes/s a sum over ``nbytes`` of fp32 host memory reads at, best of repeated sums
    within ``seconds`` (at least two; the buffer's pages are faulted in first)."""
    if nbytes < 4:
        raise ValueError(f"nbytes = {nbytes} is below one fp32 element: pass >= 4 bytes")
    buf = torch.ones(nbytes // 4, dtype=torch.float32)
    work = float(buf.numel() * 4)

    def read() -> None:
        torch.sum(buf)

    read()  # warm the intra-op team
    best, runs = 0.0, 0
    deadline = time.perf_counter() + seconds
    while runs < 2 or time.perf_counter() < deadline:
        best = max(best, work / max(timing.seconds(HOST_READ_LABEL, read), 1e-9))
        runs += 1
    return best
