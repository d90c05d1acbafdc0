"""MoE profiles: compute counts the top-k experts a token uses, bytes count every expert."""

from __future__ import annotations

import dataclasses
import re

import pytest

from bb_lightning.planner import PredictJob, make_plan, preset
from bb_lightning.planner.cost import forward_flops_per_token
from bb_lightning.planner.models import builtin_config
from bb_lightning.probe import model_profile_from_config

H, FFN, EXPERTS, TOP_K, LAYERS, HEADS, KV_HEADS, VOCAB = 64, 96, 8, 2, 2, 4, 2, 128
MIXTRAL = {
    "model_type": "mixtral",
    "hidden_size": H,
    "intermediate_size": FFN,
    "num_hidden_layers": LAYERS,
    "num_attention_heads": HEADS,
    "num_key_value_heads": KV_HEADS,
    "num_local_experts": EXPERTS,
    "num_experts_per_tok": TOP_K,
    "vocab_size": VOCAB,
    "max_position_embeddings": 64,
}
QWEN3_MOE = {
    **{k: v for k, v in MIXTRAL.items() if k not in ("num_local_experts", "model_type")},
    "model_type": "qwen3_moe",
    "num_experts": EXPERTS,
    "moe_intermediate_size": FFN,
    "head_dim": H // HEADS,
}
HEAD_DIM = H // HEADS
ATTENTION = 2 * H * H + 2 * H * KV_HEADS * HEAD_DIM  # q, o; k, v
ROUTER = H * EXPERTS
EXPERT = 3 * H * FFN  # gate, up, down


def test_mixtral_profile_counts_active_flops_and_all_bytes() -> None:
    m = model_profile_from_config(MIXTRAL)
    assert (m.num_experts, m.experts_per_token) == (EXPERTS, TOP_K)
    assert m.block_expert_params == EXPERTS * EXPERT
    assert m.block_matmul_params == ATTENTION + ROUTER + EXPERTS * EXPERT
    assert m.block_params == ATTENTION + ROUTER + EXPERTS * EXPERT + 2 * H  # two norms
    assert m.block_bytes == 2 * m.block_params  # every expert moves
    active = ATTENTION + ROUTER + TOP_K * EXPERT
    assert m.block_active_matmul_params == active
    ctx = 40
    assert m.block_flops_per_token(ctx) == 2 * active + 4 * HEADS * HEAD_DIM * ctx
    assert (
        forward_flops_per_token(m, ctx)
        == LAYERS * (2 * active + 4 * HEADS * HEAD_DIM * ctx) + 2 * H * VOCAB
    )
    assert m.active_fraction == pytest.approx(active / m.block_matmul_params)


def test_dense_profile_has_no_experts() -> None:
    dense = {k: v for k, v in MIXTRAL.items() if "expert" not in k} | {"model_type": "llama"}
    m = model_profile_from_config(dense)
    assert (m.num_experts, m.experts_per_token, m.block_expert_params) == (0, 0, 0)
    assert m.block_active_matmul_params == m.block_matmul_params and m.moe_summary() is None


def _hide(plan_text: str) -> float:
    found = re.search(r"hides behind compute from about ([\d,]+) tokens", plan_text)
    assert found is not None, plan_text
    return float(found.group(1).replace(",", ""))


def test_plan_explains_moe_and_needs_more_tokens_to_hide_a_weight_pass() -> None:
    moe = model_profile_from_config(MIXTRAL)
    # the same bytes priced as if every expert ran for every token
    dense = dataclasses.replace(moe, num_experts=0, experts_per_token=0, block_expert_params=0)
    hw = preset("a100-80gb")
    job = PredictJob(prompt_len=32, new_tokens=16, num_prompts=512)
    text_moe = make_plan(moe, hw, job).explain()
    text_dense = make_plan(dense, hw, job).explain()
    lines = [line for line in text_moe.splitlines() if line.startswith("MoE:")]
    assert len(lines) == 1 and f"top-{TOP_K} of {EXPERTS} experts" in lines[0]
    assert not any(line.startswith("MoE:") for line in text_dense.splitlines())
    # the hide threshold divides by active FLOPs: all bytes over the top-k experts' FLOPs
    ratio = _hide(text_moe) / _hide(text_dense)
    assert ratio == pytest.approx(
        moe.block_matmul_params / moe.block_active_matmul_params, rel=1e-3
    )


def test_dense_first_layers_are_priced_as_the_moe_blocks() -> None:
    """An MoE model whose first block is dense: the largest (MoE) block stands for all."""
    mixed = model_profile_from_config({**QWEN3_MOE, "mlp_only_layers": [0]})
    moe = model_profile_from_config(QWEN3_MOE)
    assert mixed.block_params == moe.block_params and mixed.num_experts == EXPERTS
    assert mixed.block_active_matmul_params == moe.block_active_matmul_params


def test_builtin_mixtral_8x7b_matches_its_published_sizes() -> None:
    """Mixtral 8x7B (Jiang et al. 2024): 47 B parameters, 13 B of them used per token."""
    m = model_profile_from_config(builtin_config("mixtral-8x7b"))
    h, ffn, kv, layers, vocab = 4096, 14336, 8 * 128, 32, 32000
    attention, router, expert = 2 * h * h + 2 * h * kv, h * 8, 3 * h * ffn
    assert m.block_params == attention + router + 8 * expert + 2 * h
    assert m.block_active_matmul_params == attention + router + 2 * expert
    assert m.total_params == layers * m.block_params + 2 * h * vocab + h
    active = layers * m.block_active_matmul_params + 2 * h * vocab
    assert round(m.total_params / 1e9) == 47 and round(active / 1e9) == 13
    plan = make_plan(m, preset("h100"), PredictJob(prompt_len=512, new_tokens=64, num_prompts=4096))
    assert "MoE: top-2 of 8 experts per block" in plan.explain()
