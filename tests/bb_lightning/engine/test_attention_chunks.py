"""The CPU decode attention's chunks on its workers against attention written out in float64:
ragged prompts, a static cache cut after its written positions, GQA, a sliding window, fp32
and bf16 caches; chunks of whole sequences or of one sequence's key/value heads; each with
the compiled kernel (:mod:`bb_lightning.engine.native`) and with torch's products."""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from torch import Tensor, nn
from torch.profiler import profile

from bb_lightning.engine import attention
from bb_lightning.engine.attention import decode_attention
from storage.threads import limit_torch_threads


@pytest.fixture(params=["native", "torch"])
def ran_on(
    request: pytest.FixtureRequest, record_chunks: Callable[[str], list[str]]
) -> Iterator[list[str]]:
    """Two intra-op threads (so the workers run the chunks); yields the names of the threads
    each chunk ran on, with the compiled kernel or torch's products."""
    names = record_chunks(request.param)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    yield names
    torch.set_num_threads(threads)


def _reference(q: Tensor, k: Tensor, v: Tensor, keep: Tensor, scale: float) -> Tensor:
    """softmax(q·Kᵀ·scale, masked) · V in float64, each key/value head repeated for its
    group of query heads; ``[batch, 1, heads, v_dim]``."""
    group = q.shape[1] // k.shape[1]
    k = k.double().repeat_interleave(group, dim=1)
    v = v.double().repeat_interleave(group, dim=1)
    s = (q.double() @ k.transpose(-1, -2)) * scale
    return (s.masked_fill(~keep, -math.inf).softmax(-1) @ v).transpose(1, 2)


def _step(dtype: torch.dtype, window: int | None) -> tuple[Tensor, ...]:
    """One decode step of 6 ragged sequences over a static cache of 48 positions, 41 of
    them written (NaN beyond: never to be read), 8 query heads over 2 key/value heads:
    (q, k, v, keep) with ``keep`` ``[6, 1, 1, 48]`` True where a query attends."""
    g = torch.Generator().manual_seed(11)
    b, heads, kv_heads, length, d, written = 6, 8, 2, 48, 32, 41
    q = torch.randn(b, heads, 1, d, generator=g).to(dtype)
    k = torch.randn(b, kv_heads, length, d, generator=g).to(dtype)
    v = torch.randn(b, kv_heads, length, d, generator=g).to(dtype)
    k[:, :, written:] = math.nan
    v[:, :, written:] = math.nan
    pos = torch.arange(length)
    keep = (pos < written).repeat(b, 1)
    for row in range(b):
        keep[row, : 3 * row] = False  # each prompt left-padded to the longest
    if window is not None:
        keep &= pos > written - 1 - window  # the last `window` positions only
    return q, k, v, keep[:, None, None, :]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [None, 16])
@pytest.mark.parametrize("chunk", ["sequences", "heads"])
def test_chunks_equal_a_float64_reference(
    ran_on: list[str], monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype,
    window: int | None, chunk: str,
) -> None:  # fmt: skip
    q, k, v, keep = _step(dtype, window)
    per_head = 41 * 2 * 32 * k.element_size()  # one key/value head's written positions
    # two sequences a chunk, or one key/value head of one sequence
    monkeypatch.setattr(attention, "CHUNK_BYTES", 4 * per_head if chunk == "sequences" else 1)
    mask = torch.zeros(keep.shape).masked_fill(~keep, torch.finfo(torch.float32).min)
    with torch.inference_mode():
        got, _ = decode_attention(nn.Module(), q, k, v, keep, scaling=0.2)
        additive, _ = decode_attention(nn.Module(), q, k, v, mask, scaling=0.2)
    assert len(ran_on) == 2 * (3 if chunk == "sequences" else 12), ran_on
    assert all(name.startswith("bb-decode-attention") for name in ran_on), ran_on
    assert got.shape == (6, 1, 8, 32) and got.dtype == dtype
    ref = _reference(q, k[:, :, :41], v[:, :, :41], keep[..., :41], 0.2)
    # bf16: the scores and the probabilities are rounded to bf16 before their products
    tol = 1e-6 if dtype == torch.float32 else 1.5e-2
    torch.testing.assert_close(got.double(), ref, atol=tol, rtol=tol)
    torch.testing.assert_close(additive, got, atol=0, rtol=0)


@pytest.mark.parametrize("path", ["native", "torch"])
def test_a_cut_bf16_cache_is_not_copied_into_fresh_memory(
    record_chunks: Callable[[str], list[str]], path: str
) -> None:
    """A bf16 cache cut after its written positions is not contiguous: a batched product
    over it would clone the keys and values (every step, every layer). The kernel reads it
    in place; torch's chunks copy it into a buffer each thread keeps instead; either way a
    step clones nothing."""
    names = record_chunks(path)
    q, k, v, keep = _step(torch.bfloat16, None)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the calling thread runs the chunks: the profiler sees them
    try:
        with torch.inference_mode(), profile() as prof:
            decode_attention(nn.Module(), q, k, v, keep)
    finally:
        torch.set_num_threads(threads)
    clones = [e.key for e in prof.key_averages() if e.key in ("aten::clone", "aten::contiguous")]
    assert clones == [], clones
    assert names == [threading.current_thread().name], names


def test_one_long_sequence_is_split_over_the_workers(
    ran_on: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A sequence whose cache exceeds a chunk runs as chunks of its key/value heads on every
    worker, not as one product on the calling thread."""
    g = torch.Generator().manual_seed(5)
    q = torch.randn(1, 8, 1, 16, generator=g)
    k, v = (torch.randn(1, 4, 64, 16, generator=g) for _ in range(2))
    monkeypatch.setattr(attention, "CHUNK_BYTES", 64 * 2 * 16 * 4)  # one head's keys and values
    with torch.inference_mode():
        got, _ = decode_attention(nn.Module(), q, k, v, None)
    assert len(ran_on) == 4 and all(n.startswith("bb-decode-attention") for n in ran_on), ran_on
    keep = torch.ones(1, 1, 1, 64, dtype=torch.bool)
    torch.testing.assert_close(got.double(), _reference(q, k, v, keep, 0.25), atol=1e-6, rtol=0)


def test_one_thread_runs_the_chunks_one_after_another(
    monkeypatch: pytest.MonkeyPatch, record_chunks: Callable[[str], list[str]]
) -> None:
    """On one intra-op thread a batch above a chunk still runs chunk by chunk (on the calling
    thread), so torch's products make a cut bf16 cache dense a chunk at a time, never the
    whole layer."""
    names = record_chunks("torch")
    q, k, v, keep = _step(torch.bfloat16, None)
    per_seq = 2 * 41 * 2 * 32 * 2  # 2 key/value heads' written keys and values, bf16
    monkeypatch.setattr(attention, "CHUNK_BYTES", per_seq)
    out: dict[str, Any] = {}

    def decode() -> None:  # a fresh thread: its scratch buffer is this step's alone
        limit_torch_threads(1)  # this thread's team only
        with torch.inference_mode():
            out["got"], _ = decode_attention(nn.Module(), q, k, v, keep, scaling=0.2)
        out["scratch"] = attention._scratch.buf.numel()

    thread = threading.Thread(target=decode, name="single")
    thread.start()
    thread.join()
    assert names == ["single"] * 6, names
    ref = _reference(q, k[:, :, :41], v[:, :, :41], keep[..., :41], 0.2)
    torch.testing.assert_close(out["got"].double(), ref, atol=1.5e-2, rtol=1.5e-2)
    # the buffer a cut chunk is made dense in holds one chunk's keys, not the layer's
    assert out["scratch"] * 2 <= per_seq // 2, out["scratch"]
