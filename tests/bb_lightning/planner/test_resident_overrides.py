"""resident_blocks with weights_tier: that many resident, the other blocks on weights_tier."""

from __future__ import annotations

import pytest

from bb_lightning.planner.job import FitJob
from bb_lightning.planner.plan import PlanOverrides
from bb_lightning.planner.profile import HardwareProfile, ModelProfile
from bb_lightning.planner.search import PlanError, make_plan
from storage.tiers import Tier

GIB = 1 << 30

HW = HardwareProfile(
    name="small-gpu",
    device_type="cuda",
    device_memory=4 * GIB,
    device_flops=1e13,
    h2d_bandwidth=1e10,
    d2h_bandwidth=1e10,
    host_memory=16 * GIB,
    nvme_read_bandwidth=2e9,
    nvme_write_bandwidth=1e9,
    nvme_capacity=100 * GIB,
    host_adam_params_per_s=1e9,
    cores=8,
)


@pytest.mark.parametrize("tier", [Tier.HOST, Tier.NVME])
def test_resident_blocks_with_weights_tier(tier: Tier, small_model: ModelProfile) -> None:
    ov = PlanOverrides(resident_blocks=1, weights_tier=tier)
    plan = make_plan(small_model, HW, FitJob(seq_len=256, global_batch_seqs=4), overrides=ov)
    assert sorted(plan.weights, key=lambda t: t.value) == sorted(
        (Tier.DEVICE, tier, tier, tier), key=lambda t: t.value
    )


def test_weights_tier_alone_still_pages_every_block(small_model: ModelProfile) -> None:
    plan = make_plan(
        small_model, HW, FitJob(seq_len=256, global_batch_seqs=4),
        overrides=PlanOverrides(weights_tier=Tier.NVME),
    )  # fmt: skip
    assert plan.weights == (Tier.NVME,) * 4
    with pytest.raises(PlanError):  # contradictory: all on the device, yet one resident
        make_plan(
            small_model, HW, FitJob(seq_len=256, global_batch_seqs=4),
            overrides=PlanOverrides(resident_blocks=1, weights_tier=Tier.DEVICE),
        )  # fmt: skip
