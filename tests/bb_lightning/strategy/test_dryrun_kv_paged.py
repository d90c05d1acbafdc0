"""A predict dry run of a plan that keeps the KV cache on the host beside the device's
attention pages the cache through the store, as the engine does: the store's host tier
holds it, the device only two layers, and each pass moves the whole cache each way on the
store's links, as the plan prices it."""

from __future__ import annotations

import pytest

from bb_lightning.planner import PlanOverrides, PredictJob, make_plan, preset
from bb_lightning.planner.cost import kv_cache_bytes
from bb_lightning.planner.models import builtin_config
from bb_lightning.probe import model_profile_from_config
from bb_lightning.strategy.dryrun import dry_predict
from storage.tiers import Link, Tier


def test_a_kv_cache_on_the_host_is_paged_through_the_store_as_priced() -> None:
    # four blocks of OPT-30B's shape on a T4 whose device memory leaves the cache on the host
    config = {**builtin_config("opt-30b"), "num_hidden_layers": 4}
    profile = model_profile_from_config(config)
    hw = preset("t4").replace(device_memory=6 << 30, host_memory=208 << 30)
    job = PredictJob(prompt_len=512, new_tokens=4, num_prompts=4096)
    plan = make_plan(profile, hw, job, overrides=PlanOverrides(decode_attention=Tier.DEVICE))
    assert plan.placement.kv_cache is Tier.HOST and plan.placement.decode_attention is None
    kv = kv_cache_bytes(profile, plan.concurrent_seqs, job.cache_len)
    report = dry_predict(plan, config)
    assert not report.over
    assert report.peaks[Tier.DEVICE].bytes <= report.planned[Tier.DEVICE]
    assert report.peaks[Tier.HOST].bytes >= kv  # in the store's host arena
    # the prefill and every decode pass write the whole cache back, in the store
    assert report.links[Link.DEVICE_TO_HOST] == pytest.approx(job.new_tokens * kv, rel=1e-3)
    assert report.links[Link.DEVICE_TO_HOST] == pytest.approx(
        report.planned_links[Link.DEVICE_TO_HOST], rel=0.01
    )
    assert report.outside.get(Link.DEVICE_TO_HOST, 0) == 0
