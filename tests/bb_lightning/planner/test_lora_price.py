"""LoRA pricing: optimizer state, gradients and write-back for the trained parameters
only; every weight (frozen ones included) is still paged in forward and backward."""

from __future__ import annotations

import pytest

from bb_lightning.planner.job import FitJob
from bb_lightning.planner.plan import PlanOverrides
from bb_lightning.planner.profile import HardwareProfile, ModelProfile
from bb_lightning.planner.search import make_plan
from storage.tiers import Tier

TRAINED = 8_000
"""Trained (adapter) parameters per block; nothing outside the blocks trains."""

ON_NVME = PlanOverrides(
    micro_batch=1, grad_accum=1, prefetch_depth=1, checkpointing=True,
    weights_tier=Tier.NVME, master_tier=Tier.NVME,
)  # fmt: skip


def test_lora_plan_prices_state_for_trained_params_and_weights_for_all(
    small_model: ModelProfile, small_gpu: HardwareProfile
) -> None:
    lora = small_model.with_trainable(TRAINED, 0)
    hw, n, w = small_gpu, lora.num_blocks, lora.block_params
    plan = make_plan(lora, hw, FitJob(seq_len=256, global_batch_seqs=1), overrides=ON_NVME)
    assert plan.weights == (Tier.NVME,) * n and plan.master == (Tier.NVME,) * n
    assert plan.grads == (Tier.HOST,) * n  # small accumulators fit the host

    p = plan.predicted
    # Forward and backward page all the bf16 weights: 2 passes x 2 bytes x every weight.
    assert p.h2d == pytest.approx(2 * n * w * 2 / (hw.h2d_bandwidth * hw.h2d_efficiency))
    # Reads: the weights twice, plus the 12 bytes of optimizer state per trained param.
    reads = 2 * n * w * 2 + n * 12 * TRAINED
    assert p.nvme_read == pytest.approx(reads / (hw.nvme_read_bandwidth * hw.nvme_efficiency))
    # Writes: optimizer state and the bf16 weights of the trained params; frozen ones never.
    writes = n * 12 * TRAINED + n * 2 * TRAINED
    assert p.nvme_write == pytest.approx(writes / (hw.nvme_write_bandwidth * hw.nvme_efficiency))
    # Gradients leave the device and AdamW runs for the trained params only.
    assert p.d2h == pytest.approx(n * TRAINED * 2 / (hw.d2h_bandwidth * hw.d2h_efficiency))
    adam_rate = hw.host_adam_params_per_s * hw.optimizer_efficiency
    assert p.optimizer == pytest.approx(n * TRAINED / adam_rate)
    nvme_used = next(m.used for m in plan.memory if m.tier is Tier.NVME)
    assert nvme_used == n * w * 2 + n * 12 * TRAINED

    trains = lora.trainable_params
    assert (
        trains == n * TRAINED and f"trains: {trains:,} of {lora.total_params:,}" in plan.explain()
    )


def test_full_fine_tuning_prices_every_param(
    small_model: ModelProfile, small_gpu: HardwareProfile
) -> None:
    """The same formulas with every parameter trained (the profile's default)."""
    hw, n, w = small_gpu, small_model.num_blocks, small_model.block_params
    rest = small_model.rest_params
    plan = make_plan(small_model, hw, FitJob(seq_len=256, global_batch_seqs=1), overrides=ON_NVME)
    writes = n * 12 * w + n * 2 * w
    assert plan.predicted.nvme_write == pytest.approx(
        writes / (hw.nvme_write_bandwidth * hw.nvme_efficiency)
    )
    adam_rate = hw.host_adam_params_per_s * hw.optimizer_efficiency
    assert plan.predicted.optimizer == pytest.approx((n * w + rest) / adam_rate)
    assert small_model.full_fine_tune and "(the others frozen" not in plan.explain()


def test_trainable_counts_are_checked(small_model: ModelProfile) -> None:
    with pytest.raises(ValueError, match="block_trainable_params = 900000 exceeds"):
        small_model.with_trainable(900_000, 0)


def test_frozen_weights_skip_their_weight_gradient_flops(small_model: ModelProfile) -> None:
    """Training FLOPs per token: forward 2 per matrix weight, backward 2 for the input
    gradient plus 2 for the weight gradient of trained weights only, recompute 2 more."""
    from bb_lightning.planner import cost

    lora, seq = small_model.with_trainable(TRAINED, 0), 256
    n, m = lora.num_blocks, lora.block_matmul_params
    attn = 4.0 * lora.num_heads * lora.head_dim * seq  # QK^T and AV forward, per block
    head = 2.0 * lora.hidden_size * lora.vocab_size
    for ckpt, runs in ((False, 3.0), (True, 4.0)):  # forward(s) + backward (2x a forward)
        full = n * runs * (2.0 * m + attn) + 3.0 * head
        assert cost.train_flops_per_token(small_model, seq, ckpt) == pytest.approx(full)
        lora_flops = full - n * 2.0 * (m - TRAINED) - head  # nothing outside trains
        assert cost.train_flops_per_token(lora, seq, ckpt) == pytest.approx(lora_flops)
