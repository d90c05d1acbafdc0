"""A bf16 prefill's attention on the CPU's matrix tiles (``host_linear``'s
``prefill_attention``, served through the engine's attention function) against transformers'
``sdpa`` function and float64, and the calls it leaves to ``sdpa``.

Skipped where the CPU or the operating system gives no bf16 matrix tiles."""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from transformers.integrations.sdpa_attention import repeat_kv, sdpa_attention_forward

from bb_lightning.engine import host_linear
from bb_lightning.engine.attention import decode_attention


@pytest.fixture(autouse=True)
def tiles() -> None:
    if shutil.which(os.environ.get("CC", "cc")) is None:
        pytest.skip("no C compiler on PATH")
    if host_linear.attention_kernel() is None:
        pytest.skip(
            "neither bf16 matrix tiles (granted) nor AVX-512's bf16 products on this "
            "CPU: sdpa runs a prefill"
        )


class _Attention(nn.Module):
    """What ``sdpa_attention_forward`` reads of an attention module."""

    def __init__(self, groups: int) -> None:
        super().__init__()
        self.is_causal, self.num_key_value_groups = True, groups


def _qkv(
    batch: int, heads: int, kv_heads: int, q_len: int, kv_len: int, dim: int, seed: int
) -> tuple[Tensor, Tensor, Tensor]:
    """Queries as a model makes them (``[batch, q_len, heads, dim]`` transposed) and keys and
    values as the first ``kv_len`` positions of a longer cache."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, q_len, heads, dim, generator=g).mul(2).bfloat16().transpose(1, 2)
    k, v = (torch.randn(batch, kv_heads, kv_len + 9, dim, generator=g).bfloat16()[:, :, :kv_len]
            for _ in range(2))  # fmt: skip
    return q, k, v


def _float64(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, causal: bool) -> Tensor:
    groups = q.shape[1] // k.shape[1]
    k, v = (repeat_kv(t, groups).double() for t in (k, v))
    if causal:
        k, v = k[:, :, : q.shape[2]], v[:, :, : q.shape[2]]
    m = None
    if mask is not None:
        m = mask if mask.dtype == torch.bool else mask.double()
    out = F.scaled_dot_product_attention(q.double(), k, v, attn_mask=m, is_causal=causal)
    return out.transpose(1, 2)


CASES = {
    "causal": (2, 4, 4, 37, 37, 64, "causal"),
    "causal-longer-cache": (2, 4, 2, 33, 60, 32, "causal"),  # sdpa keeps the first 33 keys
    "gqa-padding": (3, 8, 2, 50, 70, 128, "bool"),
    "float-mask": (2, 4, 4, 20, 45, 64, "float"),
    "left-padded": (2, 4, 4, 30, 30, 64, "bool"),
}


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("case", CASES)
def test_a_prefill_on_the_tiles_is_sdpa_to_its_rounding(
    case: str, threads: int, count_host_kernel: Callable[..., list[int]]
) -> None:
    calls = count_host_kernel("prefill_attention", host_linear._Kernel)
    batch, heads, kv_heads, q_len, kv_len, dim, kind = CASES[case]
    q, k, v = _qkv(batch, heads, kv_heads, q_len, kv_len, dim, seed=len(case))
    module, mask = _Attention(heads // kv_heads), None
    if kind != "causal":  # a causal band ending at the last key; row 0 padded on the left,
        keep = torch.ones(batch, 1, q_len, kv_len, dtype=torch.bool).tril(kv_len - q_len)
        keep[0, :, :, :4] = False  # its first queries attending no key (zeros, as sdpa's)
        mask = keep
        if kind == "float":
            mask = torch.zeros(keep.shape).masked_fill(~keep, float("-inf")).bfloat16()
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        with torch.no_grad():
            got, _ = decode_attention(module, q, k, v, mask)
            theirs, _ = sdpa_attention_forward(module, q, k, v, mask)
    finally:
        torch.set_num_threads(before)
    assert len(calls) == 1 and got.shape == theirs.shape == (batch, q_len, heads, dim)
    exact = _float64(q, k, v, mask, kind == "causal")
    # both round the weights and the output to bf16 (the kernel's e^x and sums differ from
    # torch's in the last bits): the same error against float64, most outputs identical
    err, err_sdpa = ((t.double() - exact).abs().max().item() for t in (got, theirs))
    assert err <= 1.25 * err_sdpa + 2**-12, (err, err_sdpa)
    assert (got == theirs).float().mean().item() >= 0.9
    if mask is not None and kv_len - q_len < 4:
        assert not got[0, : 4 - (kv_len - q_len)].any() and got[0, 4:].abs().sum() > 0


@pytest.mark.parametrize("lowest", [float("-inf"), torch.finfo(torch.bfloat16).min])
def test_a_query_masked_from_every_key_gets_what_sdpa_gives(
    lowest: float, count_host_kernel: Callable[..., list[int]]
) -> None:
    """Zeros where its keys are masked with -inf; the values' mean where with a finite lowest
    value (each score then lowered alike)."""
    calls = count_host_kernel("prefill_attention", host_linear._Kernel)
    q, k, v = _qkv(2, 4, 4, 12, 12, 32, seed=5)
    keep = torch.ones(2, 1, 12, 12, dtype=torch.bool).tril()
    keep[1, :, 3] = False  # query 3 of row 1 attends no key
    mask = torch.zeros(keep.shape).masked_fill(~keep, lowest).bfloat16()
    module = _Attention(1)
    with torch.no_grad():
        got, _ = decode_attention(module, q, k, v, mask)
        theirs, _ = sdpa_attention_forward(module, q, k, v, mask)
    assert len(calls) == 1
    want = torch.zeros(4, 32) if lowest == float("-inf") else v[1].double().mean(1)
    torch.testing.assert_close(got[1, 3].double(), want.double(), rtol=0, atol=2**-7)
    torch.testing.assert_close(got[1, 3], theirs[1, 3], rtol=0, atol=2**-7)
    assert (got == theirs).float().mean().item() >= 0.9


def test_calls_it_cannot_take_go_to_sdpa(count_host_kernel: Callable[..., list[int]]) -> None:
    calls = count_host_kernel("prefill_attention", host_linear._Kernel)
    q, k, v = _qkv(2, 4, 4, 24, 24, 64, seed=3)
    module = _Attention(1)
    cases: list[tuple[tuple[Tensor, Tensor, Tensor, None], dict[str, Any]]] = [
        ((q.float(), k.float(), v.float(), None), {}),  # fp32
        ((q[..., :16], k[..., :16], v[..., :16], None), {}),  # a head of 16
        ((q, k, v, None), {"softcap": 30.0}),
        ((q, k, v, None), {"dropout": 0.1}),
    ]
    with torch.no_grad():
        for args, kwargs in cases:
            if "softcap" in kwargs:  # sdpa refuses it, as the model would see
                with pytest.raises(ValueError, match="softcap"):
                    decode_attention(module, *args, **kwargs)
                continue
            decode_attention(module, *args, **kwargs)
    qg = q.clone().requires_grad_()
    out, _ = decode_attention(module, qg, k, v, None)
    out.float().sum().backward()  # sdpa's, with its backward
    assert qg.grad is not None and not calls
    with torch.no_grad():
        decode_attention(module, q, k, v, None)
    assert len(calls) == 1
