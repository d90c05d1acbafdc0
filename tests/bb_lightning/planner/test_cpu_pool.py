"""On a CPU device the device and host tiers are one RAM pool in the fit search."""

from __future__ import annotations

import dataclasses

import pytest

from bb_lightning.planner import (
    FitJob,
    HardwareProfile,
    PlanError,
    PlanOverrides,
    PredictJob,
    cost,
    make_plan,
)
from bb_lightning.probe import model_profile_from_config
from storage.tiers import Tier

# a 374M Llama (24 x hidden 1024): micro-batch 4 x 512 tokens keeps about 2.2 GiB of
# activations without checkpointing
CONFIG = {
    "model_type": "llama", "hidden_size": 1024, "intermediate_size": 2816,
    "num_hidden_layers": 24, "num_attention_heads": 16, "num_key_value_heads": 16,
    "vocab_size": 32000, "max_position_embeddings": 1024, "torch_dtype": "bfloat16",
}  # fmt: skip
GIB = 1 << 30


def _hw(device_type: str, device_gib: float, host_gib: float) -> HardwareProfile:
    return HardwareProfile(
        name=f"test {device_type}", device_type=device_type, device_memory=int(device_gib * GIB),
        device_flops=2.5e12, h2d_bandwidth=12e9, d2h_bandwidth=12e9,
        host_memory=int(host_gib * GIB), nvme_read_bandwidth=1.9e9, nvme_write_bandwidth=1.9e9,
        nvme_capacity=64 * GIB, host_adam_params_per_s=1.8e9, cores=2,
    )  # fmt: skip


def test_activations_that_outgrow_the_device_share_take_host_ram_on_a_cpu() -> None:
    model = model_profile_from_config(CONFIG)
    job = FitJob(seq_len=512, global_batch_seqs=4)
    cpu = _hw("cpu", 3.0, 14.0)  # device budget 1.7 GiB: micro-batch 4's activations overflow it
    pool = cost.device_budget(cpu) + cost.host_budget(cpu)
    plan = make_plan(model, cpu, job, overrides=PlanOverrides(micro_batch=4))
    used = {m.tier: m for m in plan.memory}
    assert not plan.checkpointing and not plan.recomputed_blocks()
    assert used[Tier.DEVICE].used > cost.device_budget(cpu)  # more than the device's share
    assert used[Tier.DEVICE].used + used[Tier.HOST].used <= pool
    for tier in (Tier.DEVICE, Tier.HOST):  # each tier's budget: what the other leaves
        other = used[Tier.HOST if tier is Tier.DEVICE else Tier.DEVICE].used
        assert used[tier].budget == pool - other
    assert "one pool of" in plan.explain()

    # the same memory as an accelerator beside its host: the device share is a hard limit
    gpu = dataclasses.replace(cpu, name="test cuda", device_type="cuda")
    split = make_plan(model, gpu, job, overrides=PlanOverrides(micro_batch=4))
    device = next(m for m in split.memory if m.tier is Tier.DEVICE)
    assert device.used <= cost.device_budget(gpu)
    assert split.checkpointing


def test_a_cpu_pool_too_small_for_the_activations_names_the_pool() -> None:
    model = model_profile_from_config({**CONFIG, "max_position_embeddings": 16384})
    job = FitJob(seq_len=16384, global_batch_seqs=1)
    cpu = _hw("cpu", 1.2, 3.0)
    with pytest.raises(PlanError, match=r"RAM pool of the CPU device and host, [\d.]+ GiB"):
        make_plan(model, cpu, job)


def test_a_kv_cache_past_the_device_share_stays_in_ram_on_a_cpu() -> None:
    """Generation: the batch's KV cache takes what the host leaves of the pool, so a CPU
    device keeps as many sequences going as the RAM holds; an accelerator with the same
    figures is held to its device budget."""
    model = model_profile_from_config(CONFIG)
    job = PredictJob(prompt_len=256, new_tokens=64, num_prompts=128)
    cpu = _hw("cpu", 3.0, 14.0)
    kv = cost.kv_cache_bytes(model, 128, job.total_len)  # 128 sequences: above the device share
    assert kv > cost.device_budget(cpu)
    plan = make_plan(model, cpu, job, overrides=PlanOverrides(concurrent_seqs=128))
    used = {m.tier: m.used for m in plan.memory}
    assert plan.concurrent_seqs == 128 and plan.kv_cache is Tier.DEVICE
    assert used[Tier.DEVICE] > cost.device_budget(cpu)
    assert used[Tier.DEVICE] + used[Tier.HOST] <= cost.device_budget(cpu) + cost.host_budget(cpu)
    gpu = dataclasses.replace(cpu, name="test cuda", device_type="cuda")
    with pytest.raises(PlanError, match=r"device budget is 1\.70 GiB"):
        make_plan(model, gpu, job, overrides=PlanOverrides(concurrent_seqs=128))


def test_generation_past_the_cpu_pool_names_the_ram_it_needs() -> None:
    model = model_profile_from_config(CONFIG)
    job = PredictJob(prompt_len=512, new_tokens=128, num_prompts=256)
    with pytest.raises(PlanError, match=r"of RAM .* RAM pool of the CPU device and host is"):
        make_plan(model, _hw("cpu", 3.0, 14.0), job, overrides=PlanOverrides(concurrent_seqs=256))
