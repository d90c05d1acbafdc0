"""The host memory read probes: what decode attention on the host reads at.

A decode step's attention over a KV cache homed on the host reads every cached key and
value once per step, two or four bytes per element against a few FLOPs, so its time is
at least the cache's bytes over the rate the host's cores read memory at together:
:func:`probe_host_read` sums a buffer larger than the CPU's caches with torch's intra-op
team (every core the process may use), best of repeats: ``bytes / seconds`` of the read.

The arithmetic is not free on every host, though: each cached key and value meets every
query head of its group (``2 x group`` FLOPs per element for the scores and as many for
the weighted sum), in skinny matrix products (``group`` columns) that few cores run well
below their peak. On a host of two cores the engine's
:func:`~bb_lightning.engine.attention.decode_attention` reads a 32/8-head layer's cache
at well under the rate a sum reads the same bytes at, in bf16 and in fp32 (the figures:
``docs/benchmarks.md``, host decode attention). :func:`probe_host_attention` therefore
times that function itself over a cache of the same bytes, in inference mode as the
engine decodes, and the probe prices host attention on the lesser of the two rates.
Both read buffers allocated as the engine's host KV cache is
(:func:`storage.io.mapped_zeros`: huge pages where the kernel gives them).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from bb_lightning.probe import contention
from bb_lightning.probe.contention import Timing
from storage.io import mapped_zeros

__all__ = ["HOST_ATTENTION_LABEL", "HOST_READ_LABEL", "probe_host_attention", "probe_host_read"]

HOST_READ_LABEL = "host read"
"""The label the plain read's passes are timed under."""

HOST_ATTENTION_LABEL = "host attention"
"""The label the decode attention's passes are timed under."""


def _best_rate(work: float, label: str, run: Callable[[], object], seconds: float,
               timing: Timing) -> float:  # fmt: skip
    """``work / seconds`` of the fastest of repeated ``run()`` within ``seconds`` (at least
    two, after one warm-up that faults pages in and starts the intra-op team)."""

    def once() -> None:
        run()

    once()
    return contention.best_rate(work, once, seconds, 2, timing, label)


def probe_host_read(seconds: float, nbytes: int, timing: Timing = contention.SYSTEM) -> float:
    """Bytes/s a sum over ``nbytes`` of fp32 host memory reads at, best of repeated sums
    within ``seconds`` (at least two; the buffer's pages are faulted in first)."""
    if nbytes < 4:
        raise ValueError(f"nbytes = {nbytes} is below one fp32 element: pass >= 4 bytes")
    buf = mapped_zeros((nbytes // 4,), torch.float32).fill_(1.0)  # as a host KV cache is
    return _best_rate(float(buf.numel() * 4), HOST_READ_LABEL, lambda: torch.sum(buf),
                      seconds, timing)  # fmt: skip


def probe_host_attention(
    seconds: float,
    nbytes: int,
    timing: Timing = contention.SYSTEM,
    *,
    dtype: torch.dtype = torch.bfloat16,
    heads: int = 32,
    kv_heads: int = 8,
    head_dim: int = 128,
    positions: int = 512,
) -> float:
    """Bytes/s of KV cache the engine's CPU decode attention reads, one query token per
    sequence over a cache of ``[seqs, kv_heads, positions, head_dim]`` keys and values in
    ``dtype`` (``seqs`` as many as ``nbytes`` holds, at least one), best of repeated steps
    within ``seconds`` (at least two, after a warm-up). The default shape is a 32-head
    layer with 8 key/value heads of 128 (Llama-3's grouping of 4 query heads per key/value
    head; the rate falls as the group grows, each element meeting more query heads)."""
    if heads <= 0 or kv_heads <= 0 or heads % kv_heads:
        raise ValueError(
            f"heads = {heads}, kv_heads = {kv_heads}: pass positive heads, a multiple of kv_heads"
        )
    if head_dim <= 0 or positions <= 0:
        raise ValueError(f"head_dim = {head_dim}, positions = {positions}: pass positive sizes")
    # imported here: the engine's attention imports transformers, which the read probe spares
    from bb_lightning.engine.attention import decode_attention

    elem = torch.empty((), dtype=dtype).element_size()
    per_seq = 2 * kv_heads * positions * head_dim * elem
    seqs = max(1, nbytes // per_seq)
    # the values do not change the time (no branch on them, no subnormals): filled, not
    # drawn, as drawing hundreds of MiB of normals took longer than the probe's passes
    shape = (seqs, kv_heads, positions, head_dim)
    k, v = (mapped_zeros(shape, dtype).fill_(0.5) for _ in range(2))  # as the engine's cache
    q = torch.full((seqs, heads, 1, head_dim), 0.25, dtype=dtype)
    module = nn.Module()

    def step() -> None:
        with torch.inference_mode():  # as the engine decodes
            decode_attention(module, q, k, v, None)

    return _best_rate(float(seqs * per_seq), HOST_ATTENTION_LABEL, step, seconds, timing)
