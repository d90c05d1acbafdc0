"""The model-shaped compute probe against a timed pass of the whole model."""

from __future__ import annotations

import time

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from bb_lightning.planner import calibrate, cost
from bb_lightning.planner.calibrate import probe_train_compute
from bb_lightning.planner.profile import HardwareProfile, ModelProfile

from .test_read_ahead import CPU

LAYERS, SEQ = 6, 128


def config() -> LlamaConfig:
    """Wide enough that a pass is matrix products, not Python overhead."""
    return LlamaConfig(
        hidden_size=256,
        intermediate_size=704,
        num_hidden_layers=LAYERS,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=2048,
        max_position_embeddings=SEQ,
        tie_word_embeddings=False,
    )


def cpu(flops: float = 1e11) -> HardwareProfile:
    """A CPU profile; the probe reads only its device type and FLOP/s."""
    return HardwareProfile.from_dict({**CPU, "device_flops": flops})


def whole_pass_seconds(cfg: LlamaConfig, micro: int) -> float:
    """Best of three forward + backward passes of the full model (independent reference)."""
    torch.manual_seed(0)
    net = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    tokens = torch.randint(0, cfg.vocab_size, (micro, SEQ))
    best = float("inf")
    for k in range(4):
        t0 = time.perf_counter()
        net(input_ids=tokens, labels=tokens).loss.backward()
        if k:
            best = min(best, time.perf_counter() - t0)
        net.zero_grad(set_to_none=True)
    return best


def test_probe_predicts_the_whole_models_pass() -> None:
    cfg, hw = config(), cpu()
    probe = probe_train_compute(cfg, hw, seq_len=SEQ, micro_batch=2, repeats=3)
    assert probe is not None
    assert probe.block_s > 0 and probe.rest_s >= 0
    assert probe.pass_s == pytest.approx(LAYERS * probe.block_s + probe.rest_s)
    measured = whole_pass_seconds(cfg, 2)
    # built from one- and three-block copies, the prediction of the six-block pass holds
    # within a factor of two of timing that pass itself
    assert measured / 2 < probe.pass_s < measured * 2
    flops = 2 * SEQ * cost.train_flops_per_token(ModelProfile.from_config(cfg), SEQ, False)
    assert probe.tflops == pytest.approx(flops / probe.pass_s / 1e12)
    raw = probe.tflops * 1e12 / hw.device_flops
    clipped = min(max(raw, calibrate.MIN_EFFICIENCY), calibrate.MAX_EFFICIENCY)
    assert probe.efficiency == pytest.approx(clipped)
    assert "TFLOP/s" in probe.describe(hw)


def test_probe_leaves_the_global_rng_alone() -> None:
    torch.manual_seed(3)
    expected = torch.rand(4)
    torch.manual_seed(3)
    probe_train_compute(config(), cpu(), seq_len=16, repeats=1)
    assert torch.equal(torch.rand(4), expected)


def test_probe_skips_models_that_do_not_fit(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(calibrate, "MEMORY_SHARE", 1e-9)
    assert probe_train_compute(config(), cpu(), seq_len=SEQ) is None


def test_probe_rejects_bad_shapes() -> None:
    with pytest.raises(ValueError, match="seq_len=0"):
        probe_train_compute(config(), cpu(), seq_len=0)
