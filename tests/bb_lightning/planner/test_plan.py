"""Known cases (30B fine-tuning, OPT-30B generation), JSON round trip, adapt, explain."""

from __future__ import annotations

import dataclasses

import pytest

from bb_lightning.planner import (
    FitJob,
    MeasuredTimes,
    ModelProfile,
    Plan,
    PlanError,
    PlanOverrides,
    PredictJob,
    adapt,
    make_plan,
    plan_differs,
    preset,
)
from bb_lightning.planner.cost import model_flops_per_token
from bb_lightning.planner.models import builtin_config
from bb_lightning.probe import model_profile_from_config
from storage.tiers import Tier

from ..tiny import cpu_profile

TIB = 2**40
GIB = 2**30


@pytest.fixture(scope="module")
def llama30b() -> ModelProfile:
    # hidden 6656, 60 layers, 52 heads, ffn 17920, vocab 32000 (LLaMA-30B)
    return model_profile_from_config(builtin_config("llama-30b"))


@pytest.fixture(scope="module")
def opt30b() -> ModelProfile:
    return model_profile_from_config(builtin_config("opt-30b"))


JOB_30B = FitJob(seq_len=2048, global_batch_seqs=512)


def test_30b_full_finetune_on_a100_80gb_with_1tib_host(llama30b: ModelProfile) -> None:
    hw = preset("a100-80gb").replace(host_memory=TIB)
    assert hw.nvme_capacity > 0
    plan = make_plan(llama30b, hw, JOB_30B)
    print(plan.explain())
    print(f"predicted tokens/s: {plan.tokens_per_s:.1f}")
    assert 30e9 < llama30b.total_params < 35e9
    # Roofline: at most device FLOP/s / (6 N) tokens/s (8 N for recomputed blocks).
    ceiling = hw.device_flops / (6 * llama30b.total_params)
    assert 0.3 * ceiling < plan.tokens_per_s <= ceiling
    assert plan.checkpointing
    assert plan.micro_batch * plan.grad_accum == 512
    for mem in plan.memory:
        assert mem.used <= mem.budget
    # Optimizer state for 32.5 B params (12 B/param) cannot sit in 80 GB: mostly off device.
    assert plan.master.count(Tier.DEVICE) < 10


def test_30b_without_nvme_and_128gib_host_names_the_shortfall(llama30b: ModelProfile) -> None:
    hw = preset("a100-80gb").replace(
        host_memory=128 * GIB, nvme_capacity=0, nvme_read_bandwidth=0.0, nvme_write_bandwidth=0.0
    )
    with pytest.raises(PlanError) as err:
        make_plan(llama30b, hw, JOB_30B)
    msg = str(err.value)
    print(msg)
    assert "host+NVMe" in msg and "no NVMe path" in msg and "--nvme-capacity" in msg
    assert "GiB" in msg


def test_sequence_too_long_for_the_device_suggests_a_shorter_one(llama30b: ModelProfile) -> None:
    hw = preset("a100-80gb").replace(device_memory=24 * GIB)
    long = dataclasses.replace(llama30b, max_positions=65536)
    with pytest.raises(PlanError, match=r"use a shorter sequence \(<= \d+ fits\)"):
        make_plan(long, hw, FitJob(seq_len=65536, global_batch_seqs=1))


def test_opt30b_bulk_generation_on_t4(opt30b: ModelProfile) -> None:
    hw = preset("t4").replace(host_memory=208 * 10**9)
    job = PredictJob(prompt_len=512, new_tokens=32, num_prompts=4096)
    plan = make_plan(opt30b, hw, job)
    print(plan.explain())
    kv_one_seq = 544 * opt30b.kv_bytes_per_token * opt30b.num_blocks
    # One sequence's KV (about 0.75 GB) is a large share of a T4: many sequences only fit
    # with the cache on the host, and many sequences are what hides the weight stream.
    assert plan.kv_cache is Tier.HOST
    assert plan.concurrent_seqs * kv_one_seq > plan.memory[0].budget
    assert plan.concurrent_seqs >= 32
    assert plan.memory[1].used >= plan.concurrent_seqs * kv_one_seq
    assert plan.weights.count(Tier.DEVICE) < opt30b.num_blocks
    assert 0.1 < plan.tokens_per_s < hw.device_flops / (2 * opt30b.total_params)


def test_small_kv_stays_on_device(opt30b: ModelProfile) -> None:
    hw = preset("h200").replace(host_memory=512 * GIB)
    plan = make_plan(opt30b, hw, PredictJob(prompt_len=32, new_tokens=8, num_prompts=16))
    assert plan.kv_cache is Tier.DEVICE
    assert plan.concurrent_seqs == 16


def test_json_round_trip(llama30b: ModelProfile) -> None:
    hw = preset("a100-80gb").replace(host_memory=TIB)
    for plan in (
        make_plan(llama30b, hw, JOB_30B, overrides=PlanOverrides(master_tier=Tier.HOST)),
        make_plan(llama30b, hw, PredictJob(prompt_len=128, new_tokens=16, num_prompts=64)),
    ):
        again = Plan.from_json(plan.to_json())
        assert again == plan
        assert again.to_json() == plan.to_json()


def test_overrides_force_tiers_and_are_validated(llama30b: ModelProfile) -> None:
    hw = preset("a100-80gb").replace(host_memory=TIB)
    plan = make_plan(
        llama30b, hw, JOB_30B, overrides=PlanOverrides(weights_tier=Tier.NVME, micro_batch=8)
    )
    assert set(plan.weights) == {Tier.NVME}
    assert plan.micro_batch == 8 and plan.grad_accum == 64
    assert plan.predicted.nvme_read > 0
    with pytest.raises(ValueError, match="micro_batch = 1024 exceeds the global batch of 512"):
        make_plan(llama30b, hw, JOB_30B, overrides=PlanOverrides(micro_batch=1024))
    with pytest.raises(PlanError):
        make_plan(llama30b, hw, JOB_30B, overrides=PlanOverrides(weights_tier=Tier.DEVICE))


def test_adapt_to_twice_slower_compute(llama30b: ModelProfile) -> None:
    hw = preset("a100-80gb").replace(host_memory=TIB)
    forced = make_plan(llama30b, hw, JOB_30B, overrides=PlanOverrides(checkpointing=True))
    new_forced = adapt(forced, MeasuredTimes(compute_s=2 * forced.predicted.compute))
    assert new_forced.overrides == forced.overrides
    # At the same resident count (resident blocks are not recomputed), compute doubles.
    kept = new_forced.weights.count(Tier.DEVICE)
    ov = PlanOverrides(checkpointing=True, resident_blocks=kept)
    at_kept = make_plan(llama30b, hw, JOB_30B, overrides=ov)
    assert new_forced.predicted.compute == pytest.approx(2 * at_kept.predicted.compute)

    plan = make_plan(llama30b, hw, JOB_30B)
    slow = MeasuredTimes(compute_s=2 * plan.predicted.compute)
    assert plan_differs(plan, slow)
    assert not plan_differs(plan, MeasuredTimes(compute_s=1.1 * plan.predicted.compute))
    new = adapt(plan, slow)
    assert new.hardware.compute_efficiency == pytest.approx(0.5)
    # The re-plan may drop recompute (compute is now dearer); at its choice, compute doubles.
    resident = new.weights.count(Tier.DEVICE)  # resident blocks are never recomputed
    same = make_plan(
        llama30b,
        hw,
        JOB_30B,
        overrides=PlanOverrides(checkpointing=new.checkpointing, resident_blocks=resident),
    )
    assert new.predicted.compute == pytest.approx(2 * same.predicted.compute)
    # Slower compute hides transfers at fewer tokens per pass, never more.
    assert new.tokens_per_pass <= plan.tokens_per_pass
    assert new.tokens_per_s < plan.tokens_per_s
    assert not plan_differs(new, MeasuredTimes(compute_s=new.predicted.compute))


def test_explain_names_placement_memory_and_bottleneck(llama30b: ModelProfile) -> None:
    hw = preset("a100-80gb").replace(host_memory=TIB)
    text = make_plan(llama30b, hw, JOB_30B).explain()
    for needle in (
        "micro-batch",
        "blocks 0-",
        "weights device (resident)",
        "headroom",
        "bottleneck",
        "tokens/s",
        "MFU",
        "why:",
    ):
        assert needle in text


def test_explain_gives_a_cpu_the_model_flop_rate_not_mfu() -> None:
    # MFU is against the bf16 product rate; an fp32 job on a CPU without bf16 matrix
    # instructions runs far above it, so a CPU's plan prints the model's FLOP/s
    model = model_profile_from_config(builtin_config("tiny-llama"))
    cpu = cpu_profile(nvme=8 << 30)
    plan = make_plan(model, cpu, FitJob(seq_len=64, global_batch_seqs=4))
    line = next(ln for ln in plan.explain().splitlines() if ln.startswith("throughput:"))
    flops = plan.tokens_per_s * model_flops_per_token(model, "fit", 64)
    assert plan.mfu == 0.0 and plan.model_flops == pytest.approx(flops)
    assert f", {flops / 1e9:.3g} GFLOP/s model FLOP/s (" in line, line
    assert f"{flops / 5e10:.1%} of the 50 GFLOP/s priced matrix-product rate" in line, line
    assert "MFU" not in plan.explain()


@pytest.mark.parametrize("devices", [1, 8])
def test_mfu_is_against_the_datasheet_peak_of_one_device(
    llama30b: ModelProfile, devices: int
) -> None:
    # PaLM's MFU: model FLOP/s (6N + 12 L H Q T per token) of one device over its datasheet
    # peak, 312 TFLOP/s for an A100, not the 0.6 x derated rate plans are priced at
    hw = preset("a100-80gb")
    if devices > 1:
        hw = hw.replace(world_size=devices, ranks_per_node=devices, intra_node_bandwidth=1e11)
    plan = make_plan(llama30b, hw, JOB_30B)
    m = llama30b
    n = m.num_blocks * m.block_active_matmul_params + m.hidden_size * m.vocab_size
    per_token = 6 * n + 12 * m.num_blocks * m.num_heads * m.head_dim * JOB_30B.seq_len
    flops = plan.tokens_per_s / devices * per_token
    assert plan.mfu == pytest.approx(flops / 312e12)
    line = next(ln for ln in plan.explain().splitlines() if ln.startswith("throughput:"))
    assert f"MFU {flops / 312e12:.1%} of the 312 TFLOP/s datasheet peak" in line, line
    assert f"({flops / (312e12 * 0.6):.1%} of the 187 TFLOP/s priced" in line, line
