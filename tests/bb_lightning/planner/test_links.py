"""The planner's links are :class:`storage.tiers.Link`s: priced per link, keyed by Link in
memory, by their PredictedTime field names in the plan's JSON; budgets per tier."""

from __future__ import annotations

import json

import pytest

from bb_lightning.planner import cost
from bb_lightning.planner.job import FitJob, PredictJob
from bb_lightning.planner.plan import LINK_FIELDS, LINKS, Plan, PlanOverrides
from bb_lightning.planner.profile import HardwareProfile, ModelProfile
from bb_lightning.planner.search import MeasuredTimes, make_plan
from storage.tiers import Link, Tier


@pytest.mark.parametrize("task", ["fit", "predict"])
def test_plan_json_keeps_its_link_names_and_round_trips_to_links(
    task: str, small_model: ModelProfile, small_gpu: HardwareProfile
) -> None:
    job = FitJob(seq_len=512, global_batch_seqs=8) if task == "fit" else PredictJob(
        prompt_len=64, new_tokens=16, num_prompts=8
    )  # fmt: skip
    plan = make_plan(small_model, small_gpu, job, overrides=PlanOverrides(weights_tier=Tier.NVME))
    roof = plan.roofline
    assert roof.bandwidth and all(isinstance(k, Link) for k in roof.bandwidth)
    assert roof.bandwidth[Link.HOST_TO_DEVICE] == small_gpu.h2d_bandwidth
    assert roof.bytes_per_pass[Link.NVME_TO_HOST] > 0  # the weights come off the disk
    raw = json.loads(plan.to_json())["roofline"]
    for key in ("bytes_per_pass", "bytes_per_token", "bandwidth"):
        assert set(raw[key]) <= {"nvme_read", "nvme_write", "h2d", "d2h"}
    assert raw["bandwidth"]["nvme_read"] == small_gpu.nvme_read_bandwidth
    back = Plan.from_json(plan.to_json())
    assert back.roofline == roof and all(isinstance(k, Link) for k in back.roofline.bandwidth)
    assert back.to_json() == plan.to_json()
    p = plan.predicted
    assert p.transfer == {
        Link.NVME_TO_HOST: p.nvme_read,
        Link.HOST_TO_NVME: p.nvme_write,
        Link.HOST_TO_DEVICE: p.h2d,
        Link.DEVICE_TO_HOST: p.d2h,
    }
    assert p.on(Link.NVME_TO_DEVICE) == p.nvme_read and p.on(Link.DEVICE_TO_NVME) == p.nvme_write
    assert p.bottleneck in {"compute", "optimizer", *LINK_FIELDS.values()}
    # budgets per tier: the profile's memory less the planner's margins
    assert (
        {m.tier: m.budget for m in plan.memory}
        == cost.budgets(small_gpu)
        == {
            Tier.DEVICE: int(small_gpu.device_memory * 0.9 - cost.GIB),
            Tier.HOST: int(small_gpu.host_memory * 0.95),
            Tier.NVME: int(small_gpu.nvme_capacity * 0.95),
        }
    )


def test_measured_times_add_each_store_link_to_the_link_it_is_priced_as() -> None:
    stats = {
        "nvme_read": 1.0,
        "nvme_read_direct": 0.5,
        "nvme_write": 0.25,
        "nvme_write_direct": 2.0,
    }
    stats |= {"h2d": 3.0}  # as the store's stats name them, read back from JSON
    measured = MeasuredTimes.from_links({Link(k): v for k, v in stats.items()}, step_s=9.0)
    assert measured.nvme_read_s == 1.5 and measured.nvme_write_s == 2.25
    assert measured.h2d_s == 3.0 and measured.step_s == 9.0
    assert measured.d2h_s is None and measured.compute_s is None  # not given: not measured
    assert [measured.on(link) for link in LINKS] == [1.5, 2.25, 3.0, None]
    with pytest.raises(ValueError, match=r"h2d_s = -1\.0 must be >= 0"):
        MeasuredTimes.from_links({Link.HOST_TO_DEVICE: -1.0})
