"""A predict plan whose KV cache outgrows host memory with attention on the host: the last
blocks' caches home on NVMe, the budgets count them and each decode pass reads their
attended part back from the disk."""

from __future__ import annotations

import dataclasses
import math

import pytest

from bb_lightning.planner import PredictJob
from bb_lightning.planner.models import builtin_config
from bb_lightning.planner.plan import PlanOverrides
from bb_lightning.planner.profile import preset
from bb_lightning.planner.search import make_plan
from bb_lightning.probe import model_profile_from_config
from storage.tiers import Tier

JOB = PredictJob(prompt_len=512, new_tokens=32, num_prompts=4096)
GIB = 1 << 30


def test_a_kv_cache_past_host_memory_spills_whole_blocks_to_nvme() -> None:
    model = model_profile_from_config(builtin_config("opt-30b"))
    hw = dataclasses.replace(preset("t4"), host_memory=64 * GIB)
    c = 128  # as many as the T4's device holds a 512-token prefill of
    ask = PlanOverrides(decode_attention=Tier.HOST, concurrent_seqs=c)
    plan = make_plan(model, hw, JOB, overrides=ask)
    mem = {m.tier: m for m in plan.memory}
    spilled = plan.placement.kv_cache_nvme_blocks
    n = model.num_blocks
    # the cache (c x 544 tokens x every block) is 89.3 GiB: not every block's cache can stay
    per_block = c * JOB.total_len * model.kv_bytes_per_token
    assert per_block * n > 80 * GIB
    assert 0 < spilled < n
    # what stays on the host fits its budget; one block's cache more would not (the weights
    # homed on the host take what the caches leave)
    block = model.block_params * JOB.compute_bytes
    host_weights = sum(t is Tier.HOST for t in plan.placement.weights) * block
    assert mem[Tier.HOST].used <= mem[Tier.HOST].budget
    assert mem[Tier.HOST].used - host_weights + per_block > mem[Tier.HOST].budget
    assert mem[Tier.HOST].used >= (n - spilled) * per_block
    # NVMe holds the spilled caches beside the paged weights
    weights = sum(t is Tier.NVME for t in plan.placement.weights) * block
    assert mem[Tier.NVME].used == pytest.approx(weights + spilled * per_block)
    # each decode pass reads the spilled blocks' attended positions from the disk
    mean = JOB.mean_context
    kv_read = spilled * c * mean * model.kv_bytes_per_token * (JOB.new_tokens - 1)
    weight_read = (1 + (JOB.new_tokens - 1)) * weights
    want = (kv_read + weight_read) / (hw.nvme_read_bandwidth * hw.nvme_efficiency)
    assert plan.predicted.nvme_read == pytest.approx(want, rel=1e-6)
    assert f"the last {spilled} of {n} blocks' caches home on NVMe" in plan.explain()


def test_without_host_attention_the_cache_does_not_spill() -> None:
    model = model_profile_from_config(builtin_config("opt-30b"))
    hw = dataclasses.replace(preset("t4"), host_memory=208 * GIB)
    plan = make_plan(model, hw, JOB, overrides=PlanOverrides(decode_attention=Tier.DEVICE))
    assert plan.placement.kv_cache_nvme_blocks == 0
    assert math.isfinite(plan.tokens_per_s)
