"""Decode attention on the host: its byte counts against a real model's tensors, its
pricing, the search's choice of it (by default beside a GPU whose profile prices the
host's memory reads), and the placement's refusals."""

from __future__ import annotations

import importlib
import re
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, BloomConfig, LlamaConfig

from bb_lightning.cli import main
from bb_lightning.placement import Placement
from bb_lightning.planner import cost, host_attention
from bb_lightning.planner.job import PredictJob
from bb_lightning.planner.models import builtin_config
from bb_lightning.planner.plan import PlanOverrides
from bb_lightning.planner.predict_search import price
from bb_lightning.planner.profile import HardwareProfile, ModelProfile, preset
from bb_lightning.planner.search import make_plan
from bb_lightning.probe import contention, model_profile_from_config
from bb_lightning.probe.host_memory import (
    HOST_ATTENTION_LABEL,
    HOST_READ_LABEL,
    probe_host_attention,
    probe_host_read,
)
from storage.tiers import Tier

measure_module = importlib.import_module("bb_lightning.probe.measure")
JOB = PredictJob(prompt_len=64, new_tokens=17, num_prompts=32)
HOST = PlanOverrides(decode_attention=Tier.HOST)
DEVICE = PlanOverrides(decode_attention=Tier.DEVICE)


def _gqa_config() -> LlamaConfig:
    return LlamaConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=100, max_position_embeddings=128,
    )  # fmt: skip


@pytest.mark.parametrize(("dtype", "elem"), [(torch.bfloat16, 2), (torch.float32, 4)])
def test_cache_and_row_bytes_are_the_models_own(dtype: torch.dtype, elem: int) -> None:
    torch.manual_seed(0)
    config = _gqa_config()
    model = AutoModelForCausalLM.from_config(config).to(dtype).eval()
    profile = model_profile_from_config(config)
    seqs, ctx = 3, 11
    with torch.no_grad():
        out = model(torch.randint(0, 100, (seqs, ctx)), use_cache=True)
    cache = out.past_key_values
    held = sum(
        layer.keys.numel() * layer.keys.element_size()
        + layer.values.numel() * layer.values.element_size()
        for layer in cache.layers
    )
    # a decode step reads the ctx cached positions and the new one of every layer
    read = host_attention.host_cache_read_bytes(profile, seqs, ctx - 1, elem)
    assert read == held
    attn = model.model.layers[0].self_attn
    rows = sum(p.out_features for p in (attn.q_proj, attn.k_proj, attn.v_proj)) * elem
    assert host_attention.qkv_row_bytes(profile, elem) == (rows, attn.o_proj.in_features * elem)


def _budgets(hw: HardwareProfile) -> dict[Tier, int]:
    return {Tier.DEVICE: hw.device_memory, Tier.HOST: hw.host_memory, Tier.NVME: hw.nvme_capacity}


def test_host_attention_moves_rows_not_the_cache(
    small_model: ModelProfile, small_gpu: HardwareProfile
) -> None:
    hw = small_gpu.replace(host_memory_bandwidth=5e10)
    kw, c, n = np.array([0.0]), 32, small_model.num_blocks
    on_host = price(small_model, hw, JOB, PlanOverrides(), _budgets(hw), 1, c, Tier.HOST, kw,
                    host_attn=True).at(0)  # fmt: skip
    steps = JOB.new_tokens - 1
    q_kv = (small_model.num_heads + 2 * small_model.num_kv_heads) * small_model.head_dim * 2
    out = small_model.num_heads * small_model.head_dim * 2
    prompt_cache = c * JOB.prompt_len * small_model.kv_bytes_per_token * n
    assert on_host.d2h_seconds == pytest.approx((prompt_cache + steps * c * n * q_kv) / 2e10)
    weights = n * small_model.block_params * 2
    # the prefill attends on the device: the prompts' cache comes back from the host
    assert on_host.h2d_seconds == pytest.approx(
        (JOB.new_tokens * weights + prompt_cache + steps * c * n * out) / 2e10
    )
    # the whole cache lies on the host; the device holds none of it
    kv_all = c * JOB.total_len * small_model.kv_bytes_per_token * n
    streamed = price(small_model, hw, JOB, PlanOverrides(), _budgets(hw), 1, c, Tier.HOST, kw).at(0)
    assert on_host.mandatory_host_bytes >= kv_all
    assert streamed.device_bytes - on_host.device_bytes > 1.9 * kv_all / n - 0.1 * kv_all / n
    cache_read = c * (JOB.mean_context + 1) * small_model.kv_bytes_per_token * n
    assert on_host.host_attention_seconds == pytest.approx(steps * cache_read / 5e10)


def test_a_slow_host_bounds_each_decode_pass(
    small_model: ModelProfile, small_gpu: HardwareProfile
) -> None:
    # every block resident: the device computes, the host attends; the host is the slower
    hw = small_gpu.replace(host_memory_bandwidth=1e8)
    ov = PlanOverrides(weights_tier=Tier.DEVICE, concurrent_seqs=32, decode_attention=Tier.HOST)
    plan = make_plan(small_model, hw, JOB, overrides=ov)
    c, n, steps = 32, small_model.num_blocks, JOB.new_tokens - 1
    host_s = c * (JOB.mean_context + 1) * small_model.kv_bytes_per_token * n / 1e8
    head = small_model.head_flops_per_token()  # the prefill's head: the last position only
    blocks = cost.forward_flops_per_token(small_model, JOB.prompt_len) - head
    device_pre = cost.compute_seconds(c * JOB.prompt_len * blocks + c * head, hw)
    device_dec = cost.compute_seconds(c * cost.forward_flops_per_token(small_model, 0), hw)
    # the second group launches each block's ~20 kernels again; each group's block copies
    # its key, value and query rows and mask to the host and the output back, a launch each
    groups = host_attention.GROUPS_IN_FLIGHT
    device_dec += n * ((groups - 1) * 20 + groups * 5) * hw.kernel_launch_seconds
    fill = (device_dec + host_s) / (host_attention.GROUPS_IN_FLIGHT * n)
    assert host_s > 10 * device_dec
    # the prefill writes the prompts' cache to the host beside its compute
    prompt_cache = c * JOB.prompt_len * small_model.kv_bytes_per_token * n
    prefill = max(device_pre, prompt_cache / hw.d2h_bandwidth)
    assert plan.predicted.total == pytest.approx(prefill + steps * (host_s + fill), rel=1e-6)
    assert plan.placement.decode_attention is Tier.HOST and plan.kv_cache is Tier.HOST
    assert "attention on host" in plan.explain()


def test_the_default_search_chooses_host_attention_beside_a_gpu() -> None:
    model = model_profile_from_config(builtin_config("opt-30b"))
    job = PredictJob(prompt_len=512, new_tokens=32, num_prompts=4096)
    t4 = preset("t4").replace(host_memory=208 * 2**30)
    plan = make_plan(model, t4, job)
    assert plan.placement.decode_attention is Tier.HOST and plan.kv_cache is Tier.HOST
    # FlexGen's setting (Sheng et al. 2023, Table 2: 7.32 tokens/s): twice as fast, planned
    assert plan.tokens_per_s >= 2 * 7.32
    device = make_plan(model, t4, job, overrides=DEVICE)
    assert device.placement.decode_attention is None
    assert plan.concurrent_seqs >= 4 * device.concurrent_seqs
    # the plan forced on the host prices the same; the why line names both sides' figures
    asked = make_plan(model, t4, job, overrides=HOST)
    assert plan.tokens_per_s == pytest.approx(asked.tokens_per_s, rel=1e-12)
    why = next(r for r in plan.reasons if r.startswith("decode attention on the host:"))
    assert f"{plan.tokens_per_s:.4g} generated tokens/s at {plan.concurrent_seqs} sequences" in why
    assert f"vs {device.tokens_per_s:.4g} with attention on the device" in why
    assert f"its best: {device.concurrent_seqs} sequences" in why
    # ZeRO-Inference's A6000 setting (21.84 tokens/s published)
    a6000 = make_plan(model, preset("a6000"), job)
    assert a6000.placement.decode_attention is Tier.HOST
    assert a6000.tokens_per_s >= 2 * 21.84


def test_a_small_job_keeps_attention_on_the_device(
    small_model: ModelProfile, small_gpu: HardwareProfile
) -> None:
    """The cache of every prompt fits the device: its attention there beats the host's."""
    hw = small_gpu.replace(host_memory_bandwidth=5e10)
    plan = make_plan(small_model, hw, JOB)
    assert plan.placement.decode_attention is None and plan.kv_cache is Tier.DEVICE
    host = make_plan(small_model, hw, JOB, overrides=HOST)
    assert host.tokens_per_s < plan.tokens_per_s
    why = next(r for r in plan.reasons if r.startswith("decode attention on the device:"))
    found = re.search(
        r"([\d,.]+) generated tokens/s .* vs ([\d,.]+) with attention on the host", why
    )
    assert found is not None, why
    figures = [float(x.replace(",", "")) for x in found.groups()]
    assert figures == pytest.approx([plan.tokens_per_s, host.tokens_per_s], rel=1e-3)


def test_a_profile_without_host_bandwidth_plans_the_devices_attention(
    small_model: ModelProfile, small_gpu: HardwareProfile
) -> None:
    """host_memory_bandwidth 0 (not measured): the host's attention cannot be priced, so the
    default search leaves it out and says why (priced, it is weighed); asked for, it is
    refused (below)."""
    job = PredictJob(prompt_len=512, new_tokens=17, num_prompts=4096)
    hw = small_gpu.replace(device_memory=2 * 2**30)
    plan = make_plan(small_model, hw, job)
    assert plan.placement.decode_attention is None
    assert f"decode attention on the device: {hw.name} has no host_memory_bandwidth" in (
        plan.explain()
    )
    measured = make_plan(small_model, hw.replace(host_memory_bandwidth=5e10), job)
    assert "with attention on the host (its best: " in measured.explain()


def test_host_attention_needs_a_host_bandwidth(
    small_model: ModelProfile, small_gpu: HardwareProfile
) -> None:
    with pytest.raises(ValueError, match=r"host_memory_bandwidth = 0 .*measure the machine"):
        make_plan(small_model, small_gpu, JOB, overrides=HOST)
    with pytest.raises(ValueError, match=r"decode_attention='nvme'.*'device', 'host' or null"):
        PlanOverrides(decode_attention="nvme")  # type: ignore[arg-type]
    assert PlanOverrides.from_dict(HOST.to_dict()) == HOST


def test_on_a_cpu_device_host_attention_is_the_cache_read_in_place(
    small_model: ModelProfile, small_gpu: HardwareProfile
) -> None:
    cpu = small_gpu.replace(device_type="cpu")
    plan = make_plan(small_model, cpu, JOB, overrides=HOST)
    assert plan.kv_cache is Tier.HOST and plan.placement.decode_attention is Tier.HOST
    same = make_plan(
        small_model, cpu, JOB, overrides=PlanOverrides(concurrent_seqs=plan.concurrent_seqs)
    )
    if same.kv_cache is Tier.HOST:
        assert plan.predicted.total == pytest.approx(same.predicted.total)


def test_the_placement_carries_and_checks_host_attention() -> None:
    base = {"weights": (Tier.HOST,) * 2, "master": ()}
    p = Placement(**base, kv_cache=Tier.HOST, decode_attention=Tier.HOST)
    assert Placement.from_dict(p.to_dict()) == p
    old = p.to_dict()
    del old["decode_attention"]  # a placement written before the field
    assert Placement.from_dict(old).decode_attention is None
    with pytest.raises(ValueError, match=r"decode_attention=host with kv_cache=.*Tier.HOST"):
        Placement(**base, kv_cache=Tier.DEVICE, decode_attention=Tier.HOST)


class _Fixed(contention.Timing):
    """Every pass takes ``seconds``; counts the passes by label."""

    def __init__(self, seconds: float) -> None:
        self.seconds_each, self.labels = seconds, Counter[str]()

    def seconds(self, label: str, run: Callable[[], None]) -> float:
        run()
        self.labels[label] += 1
        return self.seconds_each


def test_the_probe_times_a_read_of_host_memory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("BB_CACHE_DIR", str(tmp_path / "cache"))
    for name in ("SPREAD", "BUSY_SHARE"):  # a shared machine: the rounds count as steady
        monkeypatch.setattr(contention, name, float("inf"))
    timing = _Fixed(0.01)
    assert probe_host_read(0.0, 4 << 20, timing) == pytest.approx((4 << 20) / 0.01)
    assert timing.labels[HOST_READ_LABEL] >= 2
    rounds = [{"flops": 1e10, "h2d": 1e10, "d2h": 1e10, "memory": 2e10, "adam": 1e8,
               "host_read": bw} for bw in (3e10, 4e10)]  # fmt: skip
    monkeypatch.setattr(measure_module, "_probe_round", lambda *args: rounds.pop(0))
    profile = measure_module.measure(max_seconds=0.5, timing=timing)
    assert profile.host_memory_bandwidth == 4e10  # the best round, as every rate


def test_the_attention_probe_times_the_engines_decode_attention() -> None:
    timing = _Fixed(0.01)
    shape = {"heads": 4, "kv_heads": 2, "head_dim": 16, "positions": 64}
    # 2 x 2 kv heads x 64 positions x 16 x 4 bytes = 16 KiB of keys and values a sequence
    rate = probe_host_attention(0.0, 4 << 20, timing, dtype=torch.float32, **shape)
    assert rate == pytest.approx((4 << 20) / 0.01)
    assert timing.labels[HOST_ATTENTION_LABEL] >= 2
    # less than one sequence's cache: still one sequence
    assert probe_host_attention(0.0, 1, _Fixed(0.01), **shape) == pytest.approx(8192 / 0.01)
    with pytest.raises(ValueError, match=r"heads = 6, kv_heads = 4: pass positive heads"):
        probe_host_attention(0.0, 1 << 20, timing, heads=6, kv_heads=4)


@pytest.mark.parametrize(("read", "attend"), [(3e10, 1e10), (5e9, 1e10)])
def test_the_probe_prices_host_attention_on_the_lesser_rate(
    monkeypatch: pytest.MonkeyPatch, read: float, attend: float
) -> None:
    """Where the attention's arithmetic, not the memory, bounds it (a host of few cores),
    the profile's host_memory_bandwidth is the attention's rate; else the read's."""
    for name, value in (("_probe_flops", 1e12), ("_probe_memory", 2e10), ("_probe_adam", 1e8)):
        monkeypatch.setattr(measure_module, name, lambda *a, v=value: v)
    monkeypatch.setattr(measure_module, "_probe_copy", lambda *a: (1e10, 1e10))
    monkeypatch.setattr(measure_module, "probe_host_read", lambda *a: read)
    monkeypatch.setattr(measure_module, "probe_host_attention", lambda *a: attend)
    out = measure_module._probe_round(torch.device("cpu"), None, 0.5, _Fixed(0.01))
    assert out["host_read"] == min(read, attend)


def test_the_cli_plans_host_attention_for_generation_only(
    capsys: pytest.CaptureFixture[str],
) -> None:
    args = ["plan", "--model", "opt-30b", "--hardware", "a6000", "--decode-attention", "host"]
    assert main([*args, "--task", "fit"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--decode-attention host" in err[0] and "--task predict" in err[0]
    assert main([*args, "--task", "predict"]) == 0
    out = capsys.readouterr().out
    assert "KV cache on host, attention on host" in out
    assert "decode attention on the host's 32 cores" in out


def test_the_cli_chooses_where_attention_runs(capsys: pytest.CaptureFixture[str]) -> None:
    """FlexGen's setting without the flag plans the host's attention; ``--decode-attention
    device`` keeps it on the device."""
    args = ["plan", "--model", "opt-30b", "--hardware", "t4", "--task", "predict",
            "--prompt-len", "512", "--new-tokens", "32", "--host-memory", "208GiB"]  # fmt: skip
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "KV cache on host, attention on host" in out
    assert "decode attention on the host: " in out
    host = float(re.findall(r"throughput: ([\d.]+) generated tokens/s", out)[0])
    assert host >= 2 * 7.32  # FlexGen's published figure, twice
    assert main([*args, "--decode-attention", "device"]) == 0
    out = capsys.readouterr().out
    assert "attention on host" not in out
    assert "decode attention on the device, as asked (--decode-attention device" in out
    device = float(re.findall(r"throughput: ([\d.]+) generated tokens/s", out)[0])
    assert device < host / 2


def test_the_cli_plans_a_model_without_sdpa_on_the_devices_attention(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """BLOOM (ALiBi; transformers builds it with ``eager`` attention only) at OPT-30B's
    size on FlexGen's T4: its attention stays on the device, where its run would plan it;
    asked for the host's, the command refuses in one line."""
    BloomConfig(hidden_size=7168, n_layer=48, n_head=56, vocab_size=50272).save_pretrained(tmp_path)
    args = ["plan", "--model", str(tmp_path), "--hardware", "t4", "--task", "predict",
            "--host-memory", "208GiB"]  # fmt: skip
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "attention on host" not in out and "decode attention on the device" in out
    assert main([*args, "--decode-attention", "host"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "without 'sdpa' attention" in err[0] and "drop the flag" in err[0]
