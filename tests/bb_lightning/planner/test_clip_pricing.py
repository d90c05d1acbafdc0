"""The optimizer step with gradient clipping, priced as the engine runs it: global-norm
clipping on one rank steps the parameters outside the blocks, then each block (block 0
first) beside the next forward, whose page-in of a block waits for that block's update;
clipping by value, and clipping under data parallelism, step after backward, exposed."""

from __future__ import annotations

import numpy as np
import pytest

from bb_lightning.planner import cost, fit_price
from bb_lightning.planner.fit_price import FitPrice
from bb_lightning.planner.job import FitJob
from bb_lightning.planner.plan import PlanOverrides
from bb_lightning.planner.profile import HardwareProfile, ModelProfile
from bb_lightning.planner.search import make_plan

SEQS, SEQ_LEN, MICRO = 8, 512, 2


def _machine(small_gpu: HardwareProfile, device_flops: float) -> HardwareProfile:
    """No NVMe and a slow host AdamW: the optimizer pipeline is the AdamW arithmetic."""
    return small_gpu.replace(
        device_flops=device_flops,
        host_adam_params_per_s=1e6,
        nvme_read_bandwidth=0.0,
        nvme_write_bandwidth=0.0,
        nvme_capacity=0,
    )


def _price(model: ModelProfile, hw: HardwareProfile, job: FitJob) -> FitPrice[float]:
    """Every block paged from the host (kF = kW = 0), no checkpointing choice forced."""
    out = fit_price.price(
        model, hw, job, PlanOverrides(), cost.budgets(hw), True, 1, MICRO,
        np.array([0.0]), np.array([0.0]),
    )  # fmt: skip
    v = out.at(0)
    assert v.feasible == 1.0
    return v


def _optimizer_exposed(v: FitPrice[float]) -> float:
    """The step's seconds beyond its compute and its passes' exposed transfers."""
    return v.step_seconds - v.compute_seconds - (SEQS // MICRO) * v.exposed_pass_seconds


def _deferred_by_hand(resident: float, blocks_s: float, forward: float, n: int) -> float:
    """The deferred step written out block by block: block i's update ends at (i+1) u
    after the outside parameters' step; the forward of block i starts once that update
    and the forward of block i-1 are done."""
    u, f = blocks_s / n, forward / n
    end = 0.0
    for i in range(n):
        end = max(end, (i + 1) * u) + f
    return resident + end - forward


@pytest.mark.parametrize("device_flops", [1e14, 4.5e9, 2e8])  # updates outlast it, partly, not
def test_a_norm_clipped_step_hides_its_blocks_behind_the_next_forward(
    small_model: ModelProfile, small_gpu: HardwareProfile, device_flops: float
) -> None:
    m, hw = small_model, _machine(small_gpu, device_flops)
    job = FitJob(seq_len=SEQ_LEN, global_batch_seqs=SEQS, grad_clipping=True)
    v = _price(m, hw, job)
    n, ga = m.num_blocks, SEQS // MICRO
    # the plan's own figures: the AdamW over every parameter, split by parameters
    rest_adam = cost.host_adam_seconds(m.rest_train, hw)
    assert v.optimizer_seconds == pytest.approx(cost.host_adam_seconds(m.trainable_params, hw))
    blocks_s = v.optimizer_seconds - rest_adam
    rest_up = m.rest_train * 2 / (hw.h2d_bandwidth * hw.h2d_efficiency)  # bf16, to the device
    c_pass = v.compute_seconds / ga
    forward = c_pass * (1.0 - cost.backward_fraction(True, v.recomputed_blocks / n))
    want = rest_adam + rest_up + max(blocks_s / n, blocks_s - forward + forward / n)
    assert _optimizer_exposed(v) == pytest.approx(want, rel=1e-9)
    assert want == pytest.approx(_deferred_by_hand(rest_adam + rest_up, blocks_s, forward, n))
    assert v.optimizer_exposed_seconds == pytest.approx(want, rel=1e-9)
    # hidden: less than the whole step exposed, at least the outside and block 0's share
    assert rest_adam + blocks_s / n <= _optimizer_exposed(v) < v.optimizer_seconds


@pytest.mark.parametrize("device_flops", [1e14, 2e8])
def test_value_clipping_and_data_parallel_clipping_stay_exposed(
    small_model: ModelProfile, small_gpu: HardwareProfile, device_flops: float
) -> None:
    m, hw = small_model, _machine(small_gpu, device_flops)
    by_value = FitJob(
        seq_len=SEQ_LEN, global_batch_seqs=SEQS, grad_clipping=True, grad_clip_algorithm="value"
    )
    v = _price(m, hw, by_value)
    assert _optimizer_exposed(v) == pytest.approx(v.optimizer_seconds, rel=1e-9)
    # two ranks, each stepping its half: the step waits for every rank's norms
    two = hw.replace(world_size=2, inter_node_bandwidth=1e12)  # one rank a node
    norm = FitJob(seq_len=SEQ_LEN, global_batch_seqs=SEQS, grad_clipping=True)
    d = _price(m, two, norm)
    shard = m.num_blocks * cost.shard_numel(m.block_train, 2) + cost.shard_numel(m.rest_train, 2)
    assert d.optimizer_seconds == pytest.approx(cost.host_adam_seconds(shard, two))
    assert _optimizer_exposed(d) == pytest.approx(d.optimizer_seconds, rel=1e-6)


def test_explain_says_when_the_clipped_step_runs(
    small_model: ModelProfile, small_gpu: HardwareProfile
) -> None:
    hw = _machine(small_gpu, 1e14)

    def adamw_line(job: FitJob, machine: HardwareProfile = hw) -> str:
        plan = make_plan(small_model, machine, job)
        (line,) = [r for r in plan.reasons if r.startswith("host AdamW")]
        assert line in plan.explain()
        return line

    base = {"seq_len": SEQ_LEN, "global_batch_seqs": SEQS}
    assert "during backward" in adamw_line(FitJob(**base))
    norm = adamw_line(FitJob(**base, grad_clipping=True))
    assert "beside the next forward, block 0 first" in norm
    value = adamw_line(FitJob(**base, grad_clipping=True, grad_clip_algorithm="value"))
    assert "after backward" in value and "clipping by value" in value
    two = hw.replace(world_size=2, inter_node_bandwidth=1e11)
    ranks = adamw_line(FitJob(**base, grad_clipping=True), two)
    assert "every rank's gradient norms" in ranks and "next forward" not in ranks


def test_an_unknown_clip_algorithm_is_refused() -> None:
    with pytest.raises(ValueError, match=r"grad_clip_algorithm = 'max'.*'norm' or 'value'"):
        FitJob(
            seq_len=SEQ_LEN, global_batch_seqs=SEQS, grad_clipping=True, grad_clip_algorithm="max"
        )
