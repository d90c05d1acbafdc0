"""A predict dry run of a plan with decode attention on the host holds the KV cache in
host memory, as the engine does, not on the device, and counts the rows it copies there
and back."""

from __future__ import annotations

import pytest

from bb_lightning.planner import PlanOverrides, PredictJob, make_plan, preset
from bb_lightning.planner.cost import kv_cache_bytes
from bb_lightning.planner.models import builtin_config
from bb_lightning.probe import model_profile_from_config
from bb_lightning.strategy.dryrun import dry_predict
from storage.tiers import Link, Tier


def test_a_host_attention_dry_run_keeps_the_kv_cache_on_the_host() -> None:
    config = builtin_config("llama-370m")
    profile = model_profile_from_config(config)
    hw = preset("a100-80gb").replace(device_memory=int(1.6 * 2**30), host_memory=8 << 30)
    job = PredictJob(prompt_len=128, new_tokens=8, num_prompts=64)
    plan = make_plan(profile, hw, job, overrides=PlanOverrides(decode_attention=Tier.HOST))
    assert plan.placement.decode_attention is Tier.HOST
    kv = kv_cache_bytes(profile, plan.concurrent_seqs, job.total_len)
    report = dry_predict(plan, config)
    assert report.peaks[Tier.HOST].bytes >= kv
    assert report.peaks[Tier.DEVICE].bytes < kv
    assert Tier.DEVICE not in report.over
    # the prompts' keys and values, then each decode step's new key, value and query rows,
    # cross to the host; the prefill's keys and values come back to the device, where each
    # block's prefill attends, and each decode step's attention output comes back
    c, steps = plan.concurrent_seqs, job.new_tokens - 1
    rows = kv_cache_bytes(profile, c, job.prompt_len + steps)
    queries = steps * c * config["num_hidden_layers"] * config["hidden_size"] * 2  # bf16
    assert report.links[Link.DEVICE_TO_HOST] == pytest.approx(rows + queries, rel=0.01)
    back = kv_cache_bytes(profile, c, job.prompt_len) + queries  # outputs: queries' size
    assert report.outside[Link.HOST_TO_DEVICE] == pytest.approx(back, rel=0.01)
    for link in (Link.HOST_TO_DEVICE, Link.DEVICE_TO_HOST):
        assert report.links[link] == pytest.approx(report.planned_links[link], rel=0.05)


@pytest.mark.parametrize("name", ["opt-30b", "llama-30b"])
def test_a_prefill_of_many_long_prompts_holds_the_priced_device_memory(name: str) -> None:
    # four blocks of the full-size shape, on a device whose memory the prefill's hidden
    # states of every prompt token fill: the embedding's output (and OPT's learned
    # positions') beside a block's input and output are priced, as the dry run holds them
    config = {**builtin_config(name), "num_hidden_layers": 4}
    profile = model_profile_from_config(config)
    hw = preset("t4").replace(device_memory=8 << 30, host_memory=208 << 30)
    job = PredictJob(prompt_len=512, new_tokens=4, num_prompts=4096)
    plan = make_plan(profile, hw, job, overrides=PlanOverrides(decode_attention=Tier.HOST))
    report = dry_predict(plan, config)
    peak = report.peaks[Tier.DEVICE]
    assert peak.phase == "prefill"
    assert Tier.DEVICE not in report.over
    assert peak.bytes <= report.planned[Tier.DEVICE]
