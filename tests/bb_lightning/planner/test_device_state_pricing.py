"""Blocks whose optimizer state is homed on the device (kF) still step with host AdamW:
the planner prices that step and the state's round trip over PCIe."""

from __future__ import annotations

import numpy as np

from bb_lightning.planner import fit_price
from bb_lightning.planner.cost import ADAM_STATE_BYTES, BF16_BYTES, host_adam_seconds
from bb_lightning.planner.fit_price import FitPrice
from bb_lightning.planner.job import FitJob
from bb_lightning.planner.plan import PlanOverrides
from bb_lightning.planner.profile import HardwareProfile, ModelProfile
from bb_lightning.planner.search import make_plan
from storage.tiers import Tier


def _price(model: ModelProfile, hw: HardwareProfile, kf: int, kw: int) -> FitPrice[float]:
    budgets = {Tier.DEVICE: hw.device_memory, Tier.HOST: hw.host_memory, Tier.NVME: 0}
    out = fit_price.price(
        model, hw, FitJob(seq_len=512, global_batch_seqs=8), PlanOverrides(), budgets,
        False, 1, 8, np.array([float(kf)]), np.array([float(kw)]),
    )  # fmt: skip
    return out.at(0)


def test_device_homed_state_pays_the_host_step_and_its_round_trip(
    small_model: ModelProfile, small_gpu: HardwareProfile
) -> None:
    n, p = small_model.num_blocks, small_model.block_params
    rest = small_model.embed_params + small_model.head_params + small_model.final_params
    on_device = _price(small_model, small_gpu, kf=n, kw=0)  # weights and state resident
    on_host = _price(small_model, small_gpu, kf=0, kw=n)  # weights resident, state on host
    assert on_device.feasible and on_host.feasible
    # the same host AdamW over every parameter either way
    assert on_device.optimizer_seconds == on_host.optimizer_seconds
    assert np.isclose(on_device.optimizer_seconds, host_adam_seconds(n * p + rest, small_gpu))
    # plus 12 bytes per parameter each way; the bf16 weights go back in both cases
    extra = n * p * ADAM_STATE_BYTES
    assert np.isclose(on_device.d2h_seconds - on_host.d2h_seconds, extra / small_gpu.d2h_bandwidth)
    assert np.isclose(on_device.h2d_seconds - on_host.h2d_seconds, extra / small_gpu.h2d_bandwidth)
    weights_back = (n * p + rest) * BF16_BYTES / small_gpu.h2d_bandwidth
    assert on_host.h2d_seconds >= weights_back
    assert on_device.step_seconds >= on_host.step_seconds


def test_the_plan_keeps_state_on_the_host_when_everything_fits(
    small_model: ModelProfile, small_gpu: HardwareProfile
) -> None:
    plan = make_plan(small_model, small_gpu, FitJob(seq_len=512, global_batch_seqs=8))
    assert plan.weights == (Tier.DEVICE,) * small_model.num_blocks
    assert plan.master == (Tier.HOST,) * small_model.num_blocks
