"""Prefill micro-batches: the probe's size on a CPU device, larger on an accelerator."""

from __future__ import annotations

import dataclasses

from bb_lightning.planner import HardwareProfile, PlanOverrides, PredictJob, make_plan
from bb_lightning.planner.predict_search import CPU_PREFILL_TOKENS, PREFILL_TOKENS
from bb_lightning.probe import model_profile_from_config
from bb_lightning.probe.calibrate import PREFILL_PROBE_TOKENS

from .test_cpu_pool import CONFIG, GIB


def _hw(device_type: str) -> HardwareProfile:
    return HardwareProfile(
        name=f"test {device_type}", device_type=device_type, device_memory=80 * GIB,
        device_flops=2.5e12, h2d_bandwidth=12e9, d2h_bandwidth=12e9,
        host_memory=20 * GIB, nvme_read_bandwidth=1.9e9, nvme_write_bandwidth=1.9e9,
        nvme_capacity=64 * GIB, host_adam_params_per_s=1.8e9, cores=2,
    )  # fmt: skip


def test_a_cpu_plan_prefills_in_the_chunks_its_probe_timed() -> None:
    model = model_profile_from_config(CONFIG)
    job = PredictJob(prompt_len=128, new_tokens=32, num_prompts=128)
    cpu = make_plan(model, _hw("cpu"), job, overrides=PlanOverrides(concurrent_seqs=128))
    assert CPU_PREFILL_TOKENS == PREFILL_PROBE_TOKENS
    assert cpu.placement.prefill_tokens == CPU_PREFILL_TOKENS  # 16 prompts of 128 tokens
    cuda = make_plan(
        model, dataclasses.replace(_hw("cpu"), device_type="cuda"), job,
        overrides=PlanOverrides(concurrent_seqs=128),
    )  # fmt: skip
    assert cuda.placement.prefill_tokens == PREFILL_TOKENS
    mine = make_plan(
        model, _hw("cpu"), job, overrides=PlanOverrides(concurrent_seqs=128, micro_batch=32)
    )
    assert mine.placement.prefill_tokens == 32 * 128  # the user's prefill micro-batch holds
