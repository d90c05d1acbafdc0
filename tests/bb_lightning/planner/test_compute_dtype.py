"""The compute dtype belongs to the job: the planner prices the weights and their copies in it."""

from __future__ import annotations

import dataclasses

import pytest

from bb_lightning.planner import FitJob, PlanOverrides, PredictJob, make_plan
from bb_lightning.planner.profile import HardwareProfile, ModelProfile
from storage.tiers import Tier


def _nvme(plan: object) -> int:
    return {m.tier: m.used for m in plan.memory}[Tier.NVME]  # type: ignore[attr-defined]


def test_a_float32_job_plans_twice_the_weight_bytes_of_a_bfloat16_one(
    small_model: ModelProfile, small_gpu: HardwareProfile
) -> None:
    n = small_model.num_blocks
    fit = FitJob(seq_len=128, global_batch_seqs=4)
    ov = PlanOverrides(weights_tier=Tier.NVME, master_tier=Tier.HOST, micro_batch=4)
    plans = {d: make_plan(small_model, small_gpu, dataclasses.replace(fit, compute_dtype=d), overrides=ov)
             for d in ("bfloat16", "float32")}  # fmt: skip
    for dtype, plan in plans.items():  # NVMe holds the weights only (state fits the host)
        assert plan.placement.compute_dtype == dtype
        assert plan.grads == plan.master == (Tier.HOST,) * n
    assert _nvme(plans["bfloat16"]) == n * small_model.block_params * 2
    assert _nvme(plans["float32"]) == 2 * _nvme(plans["bfloat16"])

    job = PredictJob(prompt_len=64, new_tokens=9, num_prompts=8)
    ov = PlanOverrides(weights_tier=Tier.NVME, concurrent_seqs=8)
    gen = {d: make_plan(small_model, small_gpu, dataclasses.replace(job, compute_dtype=d), overrides=ov)
           for d in ("bfloat16", "float32")}  # fmt: skip
    assert gen["float32"].placement.kv_cache is gen["bfloat16"].placement.kv_cache is Tier.DEVICE
    assert _nvme(gen["float32"]) == 2 * _nvme(gen["bfloat16"]) == n * small_model.block_params * 4
    # the paged weights' copies carry twice the bytes: twice the busy time of each link
    for link in ("h2d", "nvme_read"):
        assert getattr(gen["float32"].predicted, link) == pytest.approx(
            2 * getattr(gen["bfloat16"].predicted, link)
        )


def test_a_job_rejects_an_unknown_dtype() -> None:
    with pytest.raises(ValueError, match="compute_dtype = 'fp8'"):
        FitJob(seq_len=8, global_batch_seqs=1, compute_dtype="fp8")
