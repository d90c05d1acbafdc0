"""The GPU check's compile step: one block's forward eager against compiled.

The block is a Hugging Face ``LlamaDecoderLayer`` of Llama-7B's shape (hidden 4,096,
FFN 11,008, 32 heads) in bf16 over 2,048 tokens, its forward compiled exactly as the
strategy's ``compile_blocks`` compiles a paged block's
(:func:`bb_lightning.engine.compiled.compiled_forward`, inductor); each call runs the
forward and a backward to the input and weights, as a recomputed block's backward does.
A dry run uses a tiny fp32 block on the CPU under ``aot_eager`` (inductor compiles for
tens of seconds on a CPU). What the CPU says about speed is nothing: only the GPU's
ratio decides whether compiling is worth turning on.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

from bb_lightning.engine.compiled import compiled_forward

__all__ = ["eager_and_compiled"]

CALLS = 3
"""Timed calls each way (after the first, compiling, call)."""


def eager_and_compiled(
    device: torch.device, *, dry: bool, sync: Callable[[], None]
) -> dict[str, Any]:
    """Milliseconds per forward and backward of one block eager and compiled, their ratio
    (eager / compiled), the first compiled call's seconds (the compile), and the largest
    difference of the outputs and input gradients. ``sync`` waits for the device."""
    dtype = torch.float32 if dry else torch.bfloat16
    hidden, ffn, heads, tokens = (64, 128, 4, 32) if dry else (4096, 11008, 32, 2048)
    cfg = LlamaConfig(
        hidden_size=hidden, intermediate_size=ffn, num_attention_heads=heads,
        num_key_value_heads=heads,
    )  # fmt: skip
    cfg._attn_implementation = "sdpa"
    block = LlamaDecoderLayer(cfg, layer_idx=0).to(device, dtype)
    x = torch.randn(1, tokens, hidden, device=device, dtype=dtype, requires_grad=True)
    positions = torch.arange(tokens, device=device)[None]
    pos = LlamaRotaryEmbedding(cfg).to(device)(x, positions)
    compiled = compiled_forward(block, "aot_eager" if dry else "inductor")

    def call(forward: Callable[..., Any]) -> tuple[torch.Tensor, torch.Tensor]:
        x.grad = None
        out = forward(x, position_embeddings=pos)
        out.float().square().mean().backward()
        assert x.grad is not None
        return out.detach(), x.grad

    def timed(forward: Callable[..., Any]) -> float:
        sync()
        t0 = time.perf_counter()
        for _ in range(CALLS):
            call(forward)
        sync()
        return (time.perf_counter() - t0) / CALLS

    sync()
    t0 = time.perf_counter()
    out, grad = call(compiled)
    sync()
    first = time.perf_counter() - t0
    want, want_grad = call(block)
    diff = max(float((out - want).abs().max()), float((grad - want_grad).abs().max()))
    eager, fast = timed(block), timed(compiled)
    return {
        "shape": {"hidden": hidden, "ffn": ffn, "heads": heads, "tokens": tokens},
        "dtype": str(dtype),
        "backend": "aot_eager" if dry else "inductor",
        "eager_ms": eager * 1e3,
        "compiled_ms": fast * 1e3,
        "eager_over_compiled": eager / fast,
        "first_compiled_call_s": first,
        "max_abs_diff": diff,
    }
