"""Row-chunked block calls against the whole call: outputs and the shared static cache."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from transformers import DynamicCache, LlamaConfig, StaticCache
from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

from bb_lightning.engine.rows import call_in_row_chunks

from ..tiny import hf_config, tiny_llama_config

ROWS, PROMPT = 5, 6


def _layer() -> tuple[LlamaDecoderLayer, LlamaConfig]:
    cfg = hf_config(
        tiny_llama_config(
            1, hidden_size=32, intermediate_size=64, vocab_size=32000, max_position_embeddings=32
        )
    )
    assert isinstance(cfg, LlamaConfig)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return LlamaDecoderLayer(cfg, 0).eval(), cfg


def _inputs(cfg: LlamaConfig, start: int, length: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(start)
    hidden = torch.randn(ROWS, length, cfg.hidden_size, generator=g)
    pos = torch.arange(start, start + length).expand(ROWS, length)
    cos_sin = LlamaRotaryEmbedding(cfg)(hidden, pos)
    # left padding: row r starts at position r (its earlier keys are masked)
    keys = torch.arange(16)
    mask = (keys[None, None, None, :] >= torch.arange(ROWS)[:, None, None, None]) & (
        keys[None, None, None, :] <= pos[:, None, :, None]
    )
    return {
        "hidden_states": hidden, "attention_mask": mask, "position_ids": pos,
        "position_embeddings": cos_sin, "cache_position": torch.arange(start, start + length),
        "use_cache": True,
    }  # fmt: skip


def _run(max_tokens: int | None) -> tuple[list[torch.Tensor], StaticCache]:
    layer, cfg = _layer()
    cache = StaticCache(config=cfg, max_cache_len=16)
    outs = []
    with torch.inference_mode():
        for start, length in ((0, PROMPT), (PROMPT, 1), (PROMPT + 1, 1)):  # prefill, 2 decodes
            kw = dict(_inputs(cfg, start, length), cache=cache)
            if max_tokens is None:
                outs.append(layer(**kw))
            else:
                outs.append(call_in_row_chunks(layer, (), kw, max_tokens))
    return outs, cache


@pytest.mark.parametrize("max_tokens", [1, 7, 12, 2 * PROMPT])
def test_chunks_equal_the_whole_call_and_share_the_cache(max_tokens: int) -> None:
    whole, cache = _run(None)
    chunked, shared = _run(max_tokens)
    for got, want in zip(chunked, whole, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    layer, ref = shared.layers[0], cache.layers[0]
    assert layer.keys.shape[0] == ROWS  # allocated for every row, not a chunk's
    torch.testing.assert_close(layer.keys, ref.keys, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(layer.values, ref.values, rtol=1e-5, atol=1e-6)
    assert int(layer.cumulative_length) == int(ref.cumulative_length) == PROMPT + 2


def test_calls_that_fit_or_cannot_share_their_cache_run_whole() -> None:
    calls: list[int] = []

    def forward(hidden: torch.Tensor, **kw: Any) -> torch.Tensor:
        calls.append(hidden.shape[0])
        return hidden * 2

    x = torch.ones(4, 3, 2)
    assert torch.equal(call_in_row_chunks(forward, (x,), {}, 6), x * 2) and calls == [2, 2]
    calls.clear()
    call_in_row_chunks(forward, (x,), {}, 12)  # fits
    with pytest.warns(UserWarning, match="cannot be shared by rows"):
        call_in_row_chunks(forward, (x,), {"past_key_values": DynamicCache()}, 3)  # grows by cat
    call_in_row_chunks(forward, (torch.ones(4, 2),), {}, 1)  # not [rows, tokens, hidden]
    assert calls == [4, 4, 4]
    # a tuple output joins its tensors by rows and keeps the rest
    out = call_in_row_chunks(lambda h: (h, None, "x"), (x,), {}, 3)
    assert out[0].shape == (4, 3, 2) and out[1:] == (None, "x")
    with pytest.raises(TypeError, match="cannot join"):
        call_in_row_chunks(lambda h: {"h": h}, (x,), {}, 3)
    with pytest.raises(ValueError, match="max_tokens=0"):
        call_in_row_chunks(forward, (x,), {}, 0)


def test_layers_of_other_widths_share_one_cache_in_chunks() -> None:
    """The first chunked update allocates every layer like itself; a layer with other
    key/value heads gets buffers of its own shape and the same results as a whole call."""
    layer0, cfg = _layer()
    narrow = LlamaConfig(**{**cfg.to_dict(), "num_key_value_heads": 1})
    narrow._attn_implementation = "sdpa"
    torch.manual_seed(1)
    layer1 = LlamaDecoderLayer(narrow, 1).eval()
    two = LlamaConfig(**{**cfg.to_dict(), "num_hidden_layers": 2})

    def run(max_tokens: int | None) -> tuple[list[torch.Tensor], StaticCache]:
        cache = StaticCache(config=two, max_cache_len=16)
        outs = []
        with torch.inference_mode():
            for start, length in ((0, PROMPT), (PROMPT, 1)):
                kw = dict(_inputs(cfg, start, length), cache=cache)
                for layer in (layer0, layer1):
                    if max_tokens is None:
                        outs.append(layer(**kw))
                    else:
                        outs.append(call_in_row_chunks(layer, (), kw, max_tokens))
        return outs, cache

    whole, cache = run(None)
    chunked, shared = run(7)
    for got, want in zip(chunked, whole, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert [tuple(x.keys.shape) for x in shared.layers] == [(ROWS, 2, 16, 8), (ROWS, 1, 16, 8)]
    for got_layer, want_layer in zip(shared.layers, cache.layers, strict=True):
        torch.testing.assert_close(got_layer.keys, want_layer.keys, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(got_layer.values, want_layer.values, rtol=1e-5, atol=1e-6)
