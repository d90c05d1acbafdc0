"""Pricing of generation plans: decode rate, KV cache on a CPU, the hide threshold."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from bb_lightning.planner import cost
from bb_lightning.planner.job import PredictJob
from bb_lightning.planner.plan import PlanOverrides
from bb_lightning.planner.predict_search import PredictPrice, price
from bb_lightning.planner.profile import HardwareProfile, ModelProfile
from bb_lightning.planner.search import make_plan
from storage.tiers import Tier

from ..tiny import cpu_profile

JOB = PredictJob(prompt_len=64, new_tokens=17, num_prompts=32)


def test_decode_efficiency_scales_only_the_decode_passes(
    small_model: ModelProfile, small_gpu: HardwareProfile
) -> None:
    # every block resident: no links, the plan is compute only
    ov = PlanOverrides(weights_tier=Tier.DEVICE, concurrent_seqs=32)
    full = make_plan(small_model, small_gpu, JOB, overrides=ov)
    slow = make_plan(small_model, small_gpu.replace(decode_efficiency=0.25), JOB, overrides=ov)
    decode_pass = cost.compute_seconds(
        32 * cost.forward_flops_per_token(small_model, 64 + 17 / 2), small_gpu
    )
    steps = JOB.new_tokens - 1
    assert full.predicted.compute == pytest.approx(slow.predicted.compute - 3 * steps * decode_pass)
    assert slow.predicted.total == pytest.approx(slow.predicted.compute)
    assert slow.tokens_per_s < full.tokens_per_s
    # the roofline draws decode passes at their own rate
    assert slow.roofline.device_flops == pytest.approx(0.25 * full.roofline.device_flops)


def _kv_on_host(model: ModelProfile, hw: HardwareProfile) -> PredictPrice[float]:
    budgets = {
        Tier.DEVICE: hw.device_memory,
        Tier.HOST: hw.host_memory,
        Tier.NVME: hw.nvme_capacity,
    }
    a = price(model, hw, JOB, PlanOverrides(), budgets, 1, 32, Tier.HOST, np.array([0.0]))
    return a.at(0)


def test_a_host_kv_cache_streams_to_a_cuda_device_but_not_to_a_cpu(
    small_model: ModelProfile, small_gpu: HardwareProfile
) -> None:
    cpu = small_gpu.replace(device_type="cpu")
    gpu, host = _kv_on_host(small_model, small_gpu), _kv_on_host(small_model, cpu)
    kv_tok = small_model.kv_bytes_per_token * small_model.num_blocks
    steps = JOB.new_tokens - 1
    # the cache paged through the store: the whole static cache (128 positions) each way
    # per pass, the prefill's too (its layers paged in before their update)
    whole = 32 * JOB.cache_len * kv_tok
    streamed = (steps + 1) * whole / small_gpu.h2d_bandwidth
    assert gpu.h2d_seconds - host.h2d_seconds == pytest.approx(streamed)
    assert host.d2h_seconds == 0.0
    assert gpu.d2h_seconds == pytest.approx((steps + 1) * whole / small_gpu.d2h_bandwidth)
    kv = cost.kv_cache_bytes(small_model, 32, JOB.total_len)
    # on the device: two blocks' share while streamed (CUDA), none on a CPU (read in place)
    assert gpu.device_bytes - host.device_bytes == pytest.approx(2 * kv / small_model.num_blocks)
    assert gpu.host_bytes == host.host_bytes


def test_a_streamed_cache_prefills_the_whole_batch_at_once(
    small_model: ModelProfile, small_gpu: HardwareProfile
) -> None:
    # rows of an offloading cache cannot be shared by prefill micro-batches (engine/rows.py)
    long = PredictJob(prompt_len=2048, new_tokens=8, num_prompts=32)
    budgets = {
        Tier.DEVICE: small_gpu.device_memory,
        Tier.HOST: small_gpu.host_memory,
        Tier.NVME: small_gpu.nvme_capacity,
    }
    kw = np.array([0.0])
    host = price(small_model, small_gpu, long, PlanOverrides(), budgets, 1, 32, Tier.HOST, kw)
    dev = price(small_model, small_gpu, long, PlanOverrides(), budgets, 1, 32, Tier.DEVICE, kw)
    assert float(host.prefill_micro_batch[0]) == 32 and float(dev.prefill_micro_batch[0]) == 4
    acts = (32 - 4) * 2048 * small_model.act_bytes_per_token_full
    kv = cost.kv_cache_bytes(small_model, 32, long.total_len)
    streamed_share = 2 * kv / small_model.num_blocks
    assert host.device_bytes[0] - dev.device_bytes[0] == pytest.approx(acts + streamed_share - kv)


def test_the_hide_threshold_names_the_link_the_paged_weights_cross(
    small_model: ModelProfile, small_gpu: HardwareProfile
) -> None:
    hw = small_gpu.replace(decode_efficiency=0.5)
    for tier, link, bw in ((Tier.NVME, "nvme read", 5e9), (Tier.HOST, "h2d", 2e10)):
        plan = make_plan(small_model, hw, JOB, overrides=PlanOverrides(weights_tier=tier))
        # bf16 weights (2 bytes per parameter), 2 FLOPs per parameter and token
        tokens = 1e14 * 0.5 / bw
        assert f"({link}) hides behind compute from about {tokens:,.0f} tokens" in plan.explain()


@pytest.mark.parametrize(
    ("device", "read"),
    [
        ("cuda", 96.0),  # JOB's 81 tokens in a cache of a multiple of 32 positions: all of it
        ("cpu", JOB.mean_context),  # the decode step reads the positions cached so far
    ],
)
def test_a_decode_pass_is_no_faster_than_the_device_streams_weights_and_cache(
    small_model: ModelProfile, small_gpu: HardwareProfile, device: str, read: float
) -> None:
    hw = small_gpu.replace(device_type=device)
    ov = PlanOverrides(weights_tier=Tier.DEVICE, concurrent_seqs=32)
    free = make_plan(small_model, hw, JOB, overrides=ov)
    slow = hw.replace(device_memory_bandwidth=1e8)  # the pass is bound by it
    bound = make_plan(small_model, slow, JOB, overrides=ov)
    m = small_model
    kv_tok = m.kv_bytes_per_token * m.num_blocks
    pass_bytes = m.num_blocks * m.block_bytes + m.head_params * 2 + 32 * (read + 1) * kv_tok
    prefill = free.predicted.compute - (JOB.new_tokens - 1) * cost.compute_seconds(
        32 * cost.forward_flops_per_token(m, JOB.mean_context), hw
    )
    want = prefill + (JOB.new_tokens - 1) * pass_bytes / 1e8
    assert bound.predicted.compute == pytest.approx(want)
    # a fast memory changes nothing: the pass stays bound by its FLOPs
    fast = make_plan(small_model, hw.replace(device_memory_bandwidth=1e15), JOB, overrides=ov)
    assert fast.predicted.compute == pytest.approx(free.predicted.compute)


def test_an_offloaded_cache_is_priced_as_transformers_moves_it(
    small_model: ModelProfile, small_gpu: HardwareProfile
) -> None:
    """Every block resident: the only copies are the cache's, the ones to the host exposed."""
    m, n, c = small_model, small_model.num_blocks, 32
    hw = small_gpu.replace(h2d_bandwidth=1e9, d2h_bandwidth=5e8, d2h_efficiency=0.8)
    budgets = {
        Tier.DEVICE: hw.device_memory,
        Tier.HOST: hw.host_memory,
        Tier.NVME: hw.nvme_capacity,
    }
    kw = np.array([float(n)])
    a = price(m, hw, JOB, PlanOverrides(), budgets, 1, c, Tier.HOST, kw)
    whole = c * JOB.cache_len * m.kv_bytes_per_token * n  # [c, kv heads, 128, dim] x 2 x n
    assert cost.offloaded_kv_bytes(m, c, JOB.cache_len) == (whole, whole)
    d2h_s = whole / (5e8 * 0.8)  # per pass, prefill and decode alike
    h2d_pre = h2d_dec = whole / 1e9
    head = cost.forward_flops_per_token(m, JOB.prompt_len) - m.head_flops_per_token()
    pre = cost.compute_seconds(c * JOB.prompt_len * head + c * m.head_flops_per_token(), hw)
    dec = cost.compute_seconds(c * cost.forward_flops_per_token(m, JOB.mean_context), hw)
    steps = JOB.new_tokens - 1
    exposed_pre = max(pre, h2d_pre) - pre + d2h_s
    exposed_dec = max(dec, h2d_dec) - dec + d2h_s
    assert h2d_dec > dec  # the prefetch is not hidden either at these rates
    assert float(a.batch_seconds[0]) == pytest.approx(
        pre + steps * dec + exposed_pre + steps * exposed_dec
    )
    assert float(a.d2h_seconds[0]) == pytest.approx((1 + steps) * d2h_s)
    assert float(a.h2d_seconds[0]) == pytest.approx(h2d_pre + steps * h2d_dec)
    # a cache on the device moves nothing
    d = price(m, hw, JOB, PlanOverrides(), budgets, 1, c, Tier.DEVICE, kw)
    assert float(d.batch_seconds[0]) == pytest.approx(pre + steps * dec)


def test_a_cpu_device_adds_the_cpu_time_of_each_pass_s_reads_from_nvme(
    small_model: ModelProfile, small_gpu: HardwareProfile
) -> None:
    """Every pass (the prefill and each of the 16 decode passes) reads every block's bf16
    weights from NVMe; on a CPU device each byte costs the profile's CPU seconds on top of
    the pass's compute, on a CUDA device nothing."""
    ov = PlanOverrides(weights_tier=Tier.NVME, concurrent_seqs=32, prefetch_depth=1)
    per_byte = 1e-9
    pass_bytes = small_model.num_blocks * small_model.block_params * 2
    for device_type, extra in (("cpu", JOB.new_tokens * pass_bytes), ("cuda", 0)):
        hw = small_gpu.replace(device_type=device_type)
        free = make_plan(small_model, hw, JOB, overrides=ov)
        costly = make_plan(
            small_model, hw.replace(nvme_cpu_seconds_per_byte=per_byte), JOB, overrides=ov
        )
        assert costly.predicted.compute - free.predicted.compute == pytest.approx(extra * per_byte)


def test_a_batch_that_does_not_divide_the_prompts_pays_for_its_last_partial_batch(
    small_model: ModelProfile, small_gpu: HardwareProfile
) -> None:
    # 32 prompts in batches of 24 are two batches: the second, of 8 sequences, streams
    # every block's weights as the first does, so the job generates 32 x 17 tokens in two
    # batches' time, not at the rate of one full batch
    job = dataclasses.replace(JOB, num_prompts=32)
    ov = PlanOverrides(weights_tier=Tier.HOST, concurrent_seqs=24)
    plan = make_plan(small_model, small_gpu, job, overrides=ov)
    assert plan.tokens_per_s == pytest.approx(32 * 17 / (2 * plan.predicted.total), rel=1e-9)
    whole = make_plan(
        small_model, small_gpu, dataclasses.replace(job, num_prompts=48), overrides=ov
    )
    assert whole.predicted.total == pytest.approx(plan.predicted.total, rel=1e-9)
    assert whole.tokens_per_s == pytest.approx(48 * 17 / (2 * whole.predicted.total), rel=1e-9)


def test_a_last_partial_batch_on_a_cpu_pays_for_its_own_rows(small_model: ModelProfile) -> None:
    # a CPU device computes for every row: 128 prompts in batches of 103 take one batch of
    # 103 and one of 25, the second priced as a job of 25 prompts alone, not as a third of
    # the first one's time or as a whole one
    hw = cpu_profile()
    job = dataclasses.replace(JOB, num_prompts=128)
    ov = PlanOverrides(concurrent_seqs=103)
    plan = make_plan(small_model, hw, job, overrides=ov)
    full = make_plan(small_model, hw, dataclasses.replace(job, num_prompts=103), overrides=ov)
    rest = make_plan(
        small_model, hw, dataclasses.replace(job, num_prompts=25),
        overrides=dataclasses.replace(ov, concurrent_seqs=25),
    )  # fmt: skip
    assert full.predicted.total == pytest.approx(plan.predicted.total, rel=1e-9)
    assert rest.predicted.total < 0.5 * full.predicted.total  # compute for a quarter the rows
    seconds = full.predicted.total + rest.predicted.total
    assert plan.tokens_per_s == pytest.approx(128 * 17 / seconds, rel=1e-6)
