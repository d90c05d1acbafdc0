"""The decode-step attention against attention written out in float64, and its installation."""

from __future__ import annotations

import math
import multiprocessing
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from torch import Tensor, nn
from transformers import AutoConfig, AutoModelForCausalLM
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from bb_lightning.engine import attention
from bb_lightning.engine.attention import attended_prefix, decode_attention, decode_attention_for

from ..tiny import hf_config, tiny_llama_config


def _reference(q: Tensor, k: Tensor, v: Tensor, keep: Tensor, scale: float) -> Tensor:
    """softmax(q·Kᵀ·scale, masked) · V in float64, heads repeated per group; [b, 1, h, d]."""
    group = q.shape[1] // k.shape[1]
    k = k.double().repeat_interleave(group, dim=1)
    v = v.double().repeat_interleave(group, dim=1)
    s = (q.double() @ k.transpose(-1, -2)) * scale
    s = s.masked_fill(~keep, -math.inf)
    return (s.softmax(-1) @ v).transpose(1, 2)


@pytest.mark.parametrize(("heads", "kv_heads"), [(4, 4), (8, 2), (6, 1)])
@pytest.mark.parametrize("kind", ["bool", "additive", "none"])
def test_decode_attention_equals_reference(heads: int, kv_heads: int, kind: str) -> None:
    g = torch.Generator().manual_seed(heads * 10 + kv_heads)
    b, length, d = 3, 11, 16
    q = torch.randn(b, heads, 1, d, generator=g)
    k = torch.randn(b, kv_heads, length, d, generator=g)
    v = torch.randn(b, kv_heads, length, d, generator=g)
    keep = torch.ones(b, 1, 1, length, dtype=torch.bool)
    keep[0, ..., :4] = False  # left padding
    keep[1, ..., 9:] = False  # cache positions not written yet
    mask: Tensor | None = keep
    if kind == "additive":
        mask = torch.zeros(b, 1, 1, length).masked_fill(~keep, torch.finfo(torch.float32).min)
    elif kind == "none":
        keep, mask = torch.ones_like(keep), None
    out, weights = decode_attention(nn.Module(), q, k, v, mask, scaling=0.3)
    assert weights is None
    assert out.shape == (b, 1, heads, d)
    torch.testing.assert_close(out.double(), _reference(q, k, v, keep, 0.3), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("rows", [1, 4])
@pytest.mark.parametrize("kind", ["bool", "additive"])
def test_cache_positions_no_query_attends_to_are_not_read(rows: int, kind: str) -> None:
    """A static cache longer than what is written: positions past the last one any
    query attends to hold NaN (memory never written), which attention over the whole
    cache would spread into every output (a masked score still meets its NaN value).
    Decode steps (one query row) and prefill chunks (several, through sdpa) alike."""
    g = torch.Generator().manual_seed(rows)
    b, heads, kv_heads, d, length, written = 3, 4, 2, 8, 24, 9
    q = torch.randn(b, heads, rows, d, generator=g)
    k = torch.randn(b, kv_heads, length, d, generator=g)
    v = torch.randn(b, kv_heads, length, d, generator=g)
    k[:, :, written:] = math.nan
    v[:, :, written:] = math.nan
    pos = torch.arange(length)
    # query i of a chunk sits at position written - rows + i; row 0 is left-padded by 2
    at = written - rows + torch.arange(rows)
    keep = (pos[None, :] <= at[:, None])[None, None].repeat(b, 1, 1, 1)
    keep[0, ..., :2] = False
    mask: Tensor = keep
    if kind == "additive":
        mask = torch.zeros(keep.shape).masked_fill(~keep, torch.finfo(torch.float32).min)
    module = nn.Module()
    module.num_key_value_groups = heads // kv_heads  # type: ignore[assignment]
    out, _ = decode_attention(module, q, k, v, mask, scaling=0.3)
    assert out.shape == (b, rows, heads, d)
    ref = torch.cat(
        [_reference(q[:, :, i : i + 1], k[:, :, :written], v[:, :, :written],
                    keep[..., i : i + 1, :written], 0.3) for i in range(rows)],
        dim=1,
    )  # fmt: skip
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)


def test_attended_prefix_keeps_every_row_s_last_position_and_the_padding() -> None:
    k = torch.zeros(2, 1, 10, 4)
    keep = torch.zeros(2, 1, 1, 10, dtype=torch.bool)
    keep[0, ..., 3:6] = True  # left padding 0-2, written up to 5
    keep[1, ..., :7] = True  # a longer row: written up to 6
    key, value, mask = attended_prefix(k, k + 1, keep)
    assert key.shape[2] == value.shape[2] == mask.shape[-1] == 7
    assert key.data_ptr() == k.data_ptr() and torch.equal(value, k[:, :, :7] + 1)
    assert torch.equal(mask, keep[..., :7])  # row 0 still masked at 0-2 and 6
    everything = torch.ones_like(keep)
    assert attended_prefix(k, k, everything)[0] is k  # nothing to cut: the cache itself
    nothing = torch.zeros_like(keep)
    assert attended_prefix(k, k, nothing)[0] is k


@pytest.mark.parametrize("rows", [1, 4])
def test_one_forward_derives_each_mask_once_and_keeps_masks_apart(
    rows: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Inside one forward, the layers given the same mask tensor share what the first one
    derived from it (one scan for its attended prefix); another mask tensor gets its own,
    and a mask changed in place between two forwards is read again. Every call's output is
    the reference's for its own mask: decode steps and bf16 prefill chunks (the compiled
    kernels' path where the CPU has one) alike."""
    scans: list[int] = []
    real = attention._attended
    monkeypatch.setattr(attention, "_attended", lambda m, n: scans.append(n) or real(m, n))
    g = torch.Generator().manual_seed(rows)
    b, heads, kv_heads, d, length = 3, 4, 2, 32, 40
    at = torch.arange(length)[None, :] <= 8 + torch.arange(rows)[:, None]  # query i at 8 + i
    short = at[None, None].repeat(b, 1, 1, 1)
    short[0, ..., :2] = False  # left padding
    long = short.clone()
    long[..., 9 + rows : 21] = True
    module = nn.Module()
    module.num_key_value_groups = heads // kv_heads  # type: ignore[assignment]

    def check(keep: Tensor) -> None:
        q = torch.randn(b, heads, rows, d, generator=g).bfloat16()
        k, v = (torch.randn(b, kv_heads, length, d, generator=g).bfloat16() for _ in "kv")
        out, _ = decode_attention(module, q, k, v, keep, scaling=0.3)
        ref = torch.cat([_reference(q[:, :, i : i + 1], k, v, keep[..., i : i + 1, :], 0.3)
                         for i in range(rows)], dim=1)  # fmt: skip
        torch.testing.assert_close(out.double(), ref, atol=2e-2, rtol=2e-2)

    with attention.one_forward():
        for _layer in range(3):
            for keep in (short, long):
                check(keep)
    assert len(scans) == 2
    short[..., 9 + rows : 30] = True  # the same tensor, more positions written
    with attention.one_forward():
        check(short)
        check(short)
    assert len(scans) == 3
    check(short)  # outside a forward: each call scans
    assert len(scans) == 4


def test_decode_attention_bf16_close_to_reference() -> None:
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(2, 4, n, 64, generator=g).bfloat16() for n in (1, 40, 40))
    keep = torch.ones(2, 1, 1, 40, dtype=torch.bool)
    out, _ = decode_attention(nn.Module(), q, k, v, keep)
    assert out.dtype == torch.bfloat16
    ref = _reference(q, k, v, keep, 64**-0.5)
    torch.testing.assert_close(out.double(), ref, atol=2e-2, rtol=2e-2)


def test_prefill_and_dropout_go_to_sdpa() -> None:
    """Several query rows (prefill) use sdpa's causal path: equal to the reference with a causal mask."""
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(1, 2, 5, 8, generator=g) for _ in range(3))
    module = nn.Module()
    module.is_causal = True  # type: ignore[assignment]
    out, _ = decode_attention(module, q, k, v, None)
    causal = torch.ones(5, 5, dtype=torch.bool).tril()[None, None]
    ref = torch.cat([_reference(q[:, :, i : i + 1], k, v, causal[..., i : i + 1, :], 8**-0.5)
                     for i in range(5)], dim=1)  # fmt: skip
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)


def _tiny(attn: str) -> nn.Module:
    config = hf_config(tiny_llama_config(2, hidden_size=32, intermediate_size=64, vocab_size=64))
    return AutoModelForCausalLM.from_config(config, attn_implementation=attn)  # unseeded


def test_installed_only_on_sdpa_models_and_restored() -> None:
    model = _tiny("sdpa")
    sdpa = ALL_ATTENTION_FUNCTIONS["sdpa"]
    with decode_attention_for(model) as on:
        assert on
        assert model.config._attn_implementation == "sdpa"  # the name the model branches on
        assert ALL_ATTENTION_FUNCTIONS["sdpa"] is not sdpa
    assert ALL_ATTENTION_FUNCTIONS["sdpa"] is sdpa
    with pytest.raises(RuntimeError, match="boom"), decode_attention_for(model):
        raise RuntimeError("boom")
    assert ALL_ATTENTION_FUNCTIONS["sdpa"] is sdpa
    eager = _tiny("eager")
    with decode_attention_for(eager) as on:
        assert not on
        assert ALL_ATTENTION_FUNCTIONS["sdpa"] is sdpa


def test_model_decode_step_logits_unchanged(monkeypatch: pytest.MonkeyPatch) -> None:
    """A cached decode step of a GQA Llama gives the same logits with either attention."""
    calls: list[int] = []

    def counted(*args: Any, **kwargs: Any) -> Any:
        calls.append(args[1].shape[2])  # query rows
        return decode_attention(*args, **kwargs)

    monkeypatch.setattr(attention, "decode_attention", counted)
    torch.manual_seed(0)
    model = _tiny("sdpa").eval()
    ids = torch.randint(1, 64, (3, 7))
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    with torch.inference_mode():
        out = model(input_ids=ids, attention_mask=mask, use_cache=True)
        nxt = out.logits[:, -1].argmax(-1, keepdim=True)
        full = torch.cat([mask, torch.ones_like(nxt)], dim=1)
        pos = (full.cumsum(-1) - 1)[:, -1:]
        ref = model(input_ids=nxt, attention_mask=full, position_ids=pos,
                    cache=out.past_key_values).logits  # fmt: skip
        out = model(input_ids=ids, attention_mask=mask, use_cache=True)
        with decode_attention_for(model):
            got = model(input_ids=nxt, attention_mask=full, position_ids=pos,
                        cache=out.past_key_values).logits  # fmt: skip
    assert calls == [1, 1], "each layer's decode step went through decode_attention"
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)


def test_left_to_sdpa_off_the_cpu() -> None:
    # the CPU-tuned decode step is for the CPU only; a model elsewhere keeps sdpa
    model = _tiny("sdpa").to("meta")
    sdpa = ALL_ATTENTION_FUNCTIONS["sdpa"]
    with decode_attention_for(model) as on:
        assert not on
        assert ALL_ATTENTION_FUNCTIONS["sdpa"] is sdpa


def test_a_model_branching_on_the_attention_name_decodes_as_with_sdpa() -> None:
    """DOTS3's indexer folds its top-k key selection into the mask only when the
    implementation is named ``eager`` or ``sdpa``: under :func:`decode_attention_for` the
    model still takes its ``sdpa`` branch, and a cached decode step's logits are sdpa's."""
    config = AutoConfig.for_model(
        "dots3_note_text", vocab_size=64, hidden_size=32, intermediate_size=64,
        moe_intermediate_size=32, shared_experts_intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, head_dim=8, kv_lora_rank=16,
        q_lora_rank=16, qk_rope_head_dim=4, qk_nope_head_dim=8, v_head_dim=8,
        n_routed_experts=4, num_experts_per_tok=2, n_group=1, topk_group=1, index_topk=4,
        index_head_dim=8, index_n_heads=2, mlp_layer_types=["dense", "dense"],
        layer_types=["indexed_attention", "full_attention"], per_layer_config={},
        max_position_embeddings=64, pad_token_id=0, bos_token_id=1, eos_token_id=2,
    )  # fmt: skip
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").eval()
    ids = torch.randint(1, 64, (2, 12), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    with torch.inference_mode():
        out = model(input_ids=ids, attention_mask=mask, use_cache=True)
        nxt = out.logits[:, -1].argmax(-1, keepdim=True)
        full = torch.cat([mask, torch.ones_like(nxt)], dim=1)
        ref = model(input_ids=nxt, attention_mask=full, cache=out.past_key_values).logits
        out = model(input_ids=ids, attention_mask=mask, use_cache=True)
        with decode_attention_for(model) as on:
            got = model(input_ids=nxt, attention_mask=full, cache=out.past_key_values).logits
    assert on
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)


@pytest.fixture(params=["native", "torch"])
def in_chunks(
    request: pytest.FixtureRequest,
    monkeypatch: pytest.MonkeyPatch,
    record_chunks: Callable[[str], list[str]],
) -> Iterator[list[str]]:
    """Decode steps in chunks of one key/value head of one sequence on two workers, with
    the compiled kernel or torch's products; yields the names of the threads each chunk ran
    on."""
    ran = record_chunks(request.param)
    monkeypatch.setattr(attention, "CHUNK_BYTES", 1)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    yield ran
    torch.set_num_threads(threads)


@pytest.mark.parametrize("kind", ["per-row", "additive", "one-row", "none"])
@pytest.mark.parametrize("mode", ["inference", "no_grad"])
def test_decode_attention_in_chunks_equals_reference(
    in_chunks: list[str], kind: str, mode: str
) -> None:
    """A batch split into chunks of sequences on the worker threads: each sequence's
    output is the reference's, whatever mask each row carries (ragged left padding and
    unwritten positions per row, or one row broadcast over the batch)."""
    g = torch.Generator().manual_seed(7)
    b, heads, kv_heads, length, d = 5, 8, 2, 13, 16
    q = torch.randn(b, heads, 1, d, generator=g)
    k = torch.randn(b, kv_heads, length, d, generator=g)
    v = torch.randn(b, kv_heads, length, d, generator=g)
    keep = torch.ones(b, 1, 1, length, dtype=torch.bool)
    for row in range(b):
        keep[row, ..., : row + 1] = False  # a different left padding per row
    keep[2, ..., 10:] = False  # positions not written yet
    mask: Tensor | None = keep
    if kind == "additive":
        mask = torch.zeros(b, 1, 1, length).masked_fill(~keep, torch.finfo(torch.float32).min)
    elif kind == "one-row":
        keep = keep[1:2].expand(b, -1, -1, -1)
        mask = keep[:1]
    elif kind == "none":
        keep, mask = torch.ones_like(keep), None
    context = torch.inference_mode() if mode == "inference" else torch.no_grad()
    with context:
        out, _ = decode_attention(nn.Module(), q, k, v, mask, scaling=0.3)
    assert len(in_chunks) == b * kv_heads, "one chunk per key/value head of each sequence"
    assert all(name.startswith("bb-decode-attention") for name in in_chunks), in_chunks
    assert out.shape == (b, 1, heads, d) and out.dtype == v.dtype
    torch.testing.assert_close(out.double(), _reference(q, k, v, keep, 0.3), atol=1e-5, rtol=1e-5)


def test_model_decode_step_in_chunks_unchanged(in_chunks: list[str]) -> None:
    """A GQA Llama's cached decode step over ragged prompts, its attention in chunks on the
    worker threads: the logits of transformers' own sdpa."""
    torch.manual_seed(0)
    model = _tiny("sdpa").eval()
    ids = torch.randint(1, 64, (3, 7))
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    mask[2, :1] = 0
    with torch.inference_mode():
        out = model(input_ids=ids, attention_mask=mask, use_cache=True)
        nxt = out.logits[:, -1].argmax(-1, keepdim=True)
        full = torch.cat([mask, torch.ones_like(nxt)], dim=1)
        pos = (full.cumsum(-1) - 1)[:, -1:]
        ref = model(input_ids=nxt, attention_mask=full, position_ids=pos,
                    cache=out.past_key_values).logits  # fmt: skip
        out = model(input_ids=ids, attention_mask=mask, use_cache=True)
        with decode_attention_for(model):
            got = model(input_ids=nxt, attention_mask=full, position_ids=pos,
                        cache=out.past_key_values).logits  # fmt: skip
    assert len(in_chunks) == 2 * 3 * 2, "each layer's step ran one chunk per sequence and head"
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)


def _attend_in_child(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    with torch.inference_mode():
        return decode_attention(nn.Module(), q, k, v, None)[0].clone()


def test_a_forked_child_decodes_in_chunks_on_workers_of_its_own(in_chunks: list[str]) -> None:
    """A child forked after the workers started (a data loader's, a launcher's) holds the
    parent's pool without its threads: its steps run on a pool of its own."""
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(4, 4, n, 8, generator=g) for n in (1, 9, 9))
    with torch.inference_mode():
        here, _ = decode_attention(nn.Module(), q, k, v, None)
    assert len(in_chunks) == 4 * 4
    with multiprocessing.get_context("fork").Pool(1) as pool:
        there = pool.apply_async(_attend_in_child, (q, k, v)).get(timeout=60)
    torch.testing.assert_close(there, here, atol=0, rtol=0)
