"""The planner's read-ahead depth for optimizer state on NVMe, against a simulated disk."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from bb_lightning.planner import cost, fit_price
from bb_lightning.planner.cost import ADAM_STATE_BYTES
from bb_lightning.planner.fit_price import MIN_READ_AHEAD, MIXED_IO_EFFICIENCY, _state_reads
from bb_lightning.planner.job import FitJob
from bb_lightning.planner.plan import PlanOverrides
from bb_lightning.planner.profile import HardwareProfile, ModelProfile
from bb_lightning.planner.search import make_plan
from bb_lightning.probe import model_profile_from_config
from storage.tiers import Tier, format_bytes

LLAMA_370M = {
    "model_type": "llama",
    "hidden_size": 1024,
    "intermediate_size": 2816,
    "num_hidden_layers": 24,
    "num_attention_heads": 16,
    "vocab_size": 32000,
    "tie_word_embeddings": False,
}


def model() -> ModelProfile:
    """The benchmark's 370M Llama (24 blocks of 12.6M parameters)."""
    return model_profile_from_config(LLAMA_370M)


def cpu(read_bw: float, write_bw: float) -> HardwareProfile:
    """A 2-core CPU machine of the order measured here, with the given NVMe bandwidths."""
    return HardwareProfile.from_dict(
        {**CPU, "nvme_read_bandwidth": read_bw, "nvme_write_bandwidth": write_bw}
    )


CPU = {
    "name": "cpu",
    "device_type": "cpu",
    "device_memory": 4 << 30,
    "device_flops": 3e11,
    "h2d_bandwidth": 1e10,
    "d2h_bandwidth": 1e10,
    "host_memory": 12 << 30,
    "nvme_read_bandwidth": 1e9,
    "nvme_write_bandwidth": 1e9,
    "nvme_capacity": 1 << 40,
    "host_adam_params_per_s": 1e9,
    "cores": 2,
}


def seconds_by_hand(blocks: int, k: int, read: float, write: float, ahead: float, bwd: float,
                    clipping: bool) -> float:  # fmt: skip
    """The disk time the docstring of ``_state_reads`` describes, written out per case."""
    rest = max(blocks - k, 0)
    if clipping:
        return blocks * read + rest * write
    spill = max(min(k, blocks) * read - ahead, 0.0)
    return spill + (bwd / blocks if rest else 0.0) + rest * (read + write)


@pytest.mark.parametrize("clipping", [False, True])
@pytest.mark.parametrize(
    ("blocks", "ahead", "bwd", "read_bw", "write_bw"),
    [
        (24, 12.0, 3.0, 1.3e9, 1.5e9),  # the 370M benchmark's shape: 4 micro-batches
        (24, 1.0, 3.0, 1.3e9, 1.5e9),  # one micro-batch: the reads spill into backward
        (40, 6.0, 2.0, 3e9, 2e9),
        (8, 4.0, 10.0, 1e9, 1e9),  # a slow step hides everything with the minimum
    ],
)
def test_chosen_depth_is_the_fewest_sets_that_hide_the_traffic(
    blocks: int, ahead: float, bwd: float, read_bw: float, write_bw: float, clipping: bool
) -> None:
    m, hw = model(), cpu(read_bw, write_bw)
    job = FitJob(seq_len=512, global_batch_seqs=4, grad_clipping=clipping)
    state = ADAM_STATE_BYTES * m.block_params
    read = state / (read_bw * MIXED_IO_EFFICIENCY)
    write = state / (write_bw * MIXED_IO_EFFICIENCY)

    def run(room_sets: float) -> tuple[int, float]:
        k, t = _state_reads(
            m, hw, job, np.array([float(blocks)]), np.array([room_sets * state]),
            np.array([ahead]), np.array([bwd]),
        )  # fmt: skip
        return int(k[0]), float(t[0])

    k, priced = run(1e6)
    assert MIN_READ_AHEAD <= k <= max(blocks, MIN_READ_AHEAD)
    assert priced == pytest.approx(seconds_by_hand(blocks, k, read, write, ahead, bwd, clipping))
    times = [seconds_by_hand(blocks, j, read, write, ahead, bwd, clipping)
             for j in range(MIN_READ_AHEAD, blocks + 1)]  # fmt: skip
    assert all(b <= a + 1e-12 for a, b in itertools.pairwise(times))  # never slower
    fitting = [j for j, t in zip(range(MIN_READ_AHEAD, blocks + 1), times, strict=True) if t <= bwd]
    assert k == (fitting[0] if fitting else blocks)  # the fewest that fit, else all
    if k > MIN_READ_AHEAD:  # a host with room for fewer sets gets fewer, and waits longer
        k_less, t_less = run(k - 1)
        assert k_less == k - 1 and t_less >= priced


def test_host_room_caps_the_depth_and_the_price_shows_it() -> None:
    m, hw = model(), cpu(1.3e9, 1.5e9)
    job = FitJob(seq_len=512, global_batch_seqs=4)
    state = ADAM_STATE_BYTES * m.block_params
    blocks, ahead, bwd = np.array([24.0]), np.array([12.0]), np.array([3.0])
    k_free, t_free = _state_reads(m, hw, job, blocks, np.array([1e15]), ahead, bwd)
    k_tight, t_tight = _state_reads(m, hw, job, blocks, np.array([5.5 * state]), ahead, bwd)
    assert int(k_tight[0]) == 5 < int(k_free[0])
    assert float(t_tight[0]) > float(t_free[0])
    k_none, t_none = _state_reads(m, hw, job, np.array([0.0]), np.array([1e15]), ahead, bwd)
    assert int(k_none[0]) == MIN_READ_AHEAD and float(t_none[0]) == 0.0


def test_plans_carry_the_depth_into_memory_and_reasons() -> None:
    m, hw = model(), cpu(1.3e9, 1.5e9)
    ov = PlanOverrides(master_tier=Tier.NVME, checkpointing=True, micro_batch=1)
    plan = make_plan(m, hw, FitJob(seq_len=512, global_batch_seqs=4), overrides=ov)
    assert plan.read_ahead > fit_price.MIN_READ_AHEAD
    assert any(f"through {plan.read_ahead} host buffer sets" in r for r in plan.reasons)
    placement = plan.placement
    assert (placement.weights, placement.master, placement.grad_tiers) == (
        plan.weights, plan.master, plan.grads
    )  # fmt: skip
    assert (placement.prefetch_depth, placement.read_ahead) == (
        plan.prefetch_depth, plan.read_ahead
    )  # fmt: skip
    on_host = make_plan(
        m, hw, FitJob(seq_len=512, global_batch_seqs=4),
        overrides=PlanOverrides(master_tier=Tier.HOST, checkpointing=True, micro_batch=1),
    )  # fmt: skip
    host = {t.tier: t.used for t in plan.memory}[Tier.HOST]
    extra = (plan.read_ahead - MIN_READ_AHEAD) * ADAM_STATE_BYTES * m.block_params
    assert host >= extra
    assert on_host.read_ahead == MIN_READ_AHEAD


def test_cpu_device_adds_its_host_work_to_the_step() -> None:
    """On a CPU device AdamW and the fp32 gradient accumulation run on the compute's
    cores: the same plan on a CUDA-typed profile with the same numbers is faster by
    exactly those seconds."""
    m, hw = model(), cpu(1.3e9, 1.5e9)
    job = FitJob(seq_len=512, global_batch_seqs=4)
    ov = PlanOverrides(
        micro_batch=1,
        weights_tier=Tier.DEVICE,
        master_tier=Tier.NVME,
        checkpointing=True,
        hold_grads=True,
    )
    on_cpu = make_plan(m, hw, job, overrides=ov)
    on_gpu = make_plan(m, hw.replace(device_type="cuda"), job, overrides=ov)
    params = m.num_blocks * m.block_params + m.embed_params + m.head_params + m.final_params
    adam = params / hw.host_adam_params_per_s
    ga = on_cpu.grad_accum
    # memory to spare: the bf16 gradients of the first three micro-batches are held and
    # all four read once (4 x 2 bytes) into the fp32 sum (4), then the updated fp32
    # master is cast back (4 + 2)
    assert on_cpu.placement.hold_grads and not on_gpu.placement.hold_grads
    accumulate = params * (ga * 2 + 4 + 6) / hw.h2d_bandwidth
    assert ga == 4
    assert on_cpu.predicted.compute == pytest.approx(on_gpu.predicted.compute)
    assert on_cpu.predicted.total - on_gpu.predicted.total == pytest.approx(adam + accumulate)
    assert any("take the same cores" in r for r in on_cpu.reasons)
    held = format_bytes(3 * 2 * (m.num_blocks * m.block_params + m.rest_params))
    assert any(f"micro-batches are held ({held})" in r for r in on_cpu.reasons), on_cpu.reasons


def test_cpu_device_adds_the_cpu_time_of_its_nvme_traffic() -> None:
    """Master weights and both moments (12 bytes per parameter) are read from NVMe and
    written back once per step: on a CPU device each of those bytes costs the profile's
    CPU seconds per byte on top of the step; on a CUDA-typed profile nothing changes."""
    m, hw = model(), cpu(1.3e9, 1.5e9)
    job = FitJob(seq_len=512, global_batch_seqs=4)
    ov = PlanOverrides(
        micro_batch=1, weights_tier=Tier.DEVICE, master_tier=Tier.NVME, checkpointing=True
    )
    per_byte = 1e-10
    for device_type, extra in (("cpu", 2 * 12 * m.num_blocks * m.block_params), ("cuda", 0)):
        base = hw.replace(device_type=device_type)
        free = make_plan(m, base, job, overrides=ov)
        costly = make_plan(m, base.replace(nvme_cpu_seconds_per_byte=per_byte), job, overrides=ov)
        assert costly.predicted.total - free.predicted.total == pytest.approx(extra * per_byte)


def test_held_gradients_trade_memory_for_the_accumulator_s_traffic() -> None:
    """``Placement.hold_grads`` priced on a CPU device: the gradients of every micro-batch
    but the last take RAM (2 bytes per trained parameter each, in bf16), and the worker
    moves 2 x 4 + 4 bytes per parameter for the sum instead of 6 + 3 x 10."""
    m, hw = model(), cpu(1.3e9, 1.5e9)
    job = FitJob(seq_len=512, global_batch_seqs=4)
    ov = PlanOverrides(micro_batch=1, weights_tier=Tier.HOST, master_tier=Tier.NVME)
    kf, kw = np.array([0.0]), np.array([0.0])
    budgets = cost.budgets(hw)
    args = (m, hw, job, ov, budgets, True, 1, 1, kf, kw)
    summed, held = fit_price.price(*args, hold=False), fit_price.price(*args, hold=True)
    trained = m.num_blocks * m.block_train + m.rest_train
    assert float(held.device_bytes[0] - summed.device_bytes[0]) == pytest.approx(3 * 2 * trained)
    saved = trained * ((6 + 3 * 10) - (4 * 2 + 4)) / hw.h2d_bandwidth
    assert float(summed.shared_core_seconds[0] - held.shared_core_seconds[0]) == pytest.approx(
        saved
    )
    assert float(summed.step_seconds[0] - held.step_seconds[0]) == pytest.approx(saved)
