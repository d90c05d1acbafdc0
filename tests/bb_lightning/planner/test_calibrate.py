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


def generator_seconds(cfg: LlamaConfig, rows: int, plen: int, new: int) -> tuple[float, float]:
    """(prefill, one decode step) seconds of the layer-major generator on the full model,
    fastest of three runs each (independent reference for the predict probe)."""
    from bb_lightning.engine.generate import GenerationConfig, LayerMajorGenerator

    torch.manual_seed(0)
    net = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).eval()
    gen = LayerMajorGenerator(net)
    ids = torch.randint(0, cfg.vocab_size, (rows, plen))
    prefill, decode = float("inf"), float("inf")
    for k in range(4):
        gen.seconds = {"prefill": 0.0, "decode": 0.0}
        gen.generate(ids, torch.ones_like(ids), GenerationConfig(max_new_tokens=new))
        if k:
            prefill = min(prefill, gen.seconds["prefill"])
            decode = min(decode, gen.seconds["decode"] / (new - 1))
    return prefill, decode


def clipped(efficiency: float) -> float:
    return min(max(efficiency, calibrate.MIN_EFFICIENCY), calibrate.MAX_EFFICIENCY)


def test_predict_probe_predicts_the_generators_passes() -> None:
    cfg, hw = config(), cpu(1e12)
    plen, new, rows = 32, 9, 16
    probe = calibrate.probe_predict_compute(
        cfg, hw, prompt_len=plen, concurrent=rows, cache_len=64, context=plen + new / 2
    )
    assert probe is not None
    assert probe.prefill_rows == rows  # 16 x 32 tokens is under PREFILL_PROBE_TOKENS
    assert probe.prefill_s == pytest.approx(LAYERS * probe.prefill_block_s + probe.prefill_rest_s)
    assert probe.decode_s == pytest.approx(LAYERS * probe.decode_block_s + probe.decode_rest_s)
    prefill, decode = generator_seconds(cfg, rows, plen, new)
    # from one- and three-block copies, the six-block model's passes in the generator
    # (a 64-position cache: plen + new rounded up) hold within a factor of two for the
    # prefill, three for the short decode pass (its block time is scaled up six-fold)
    assert prefill / 2 < probe.prefill_s < prefill * 2
    assert decode / 3 < probe.decode_s < decode * 3
    model = ModelProfile.from_config(cfg)
    head = model.head_flops_per_token()
    flops = rows * plen * (cost.forward_flops_per_token(model, plen) - head) + rows * head
    assert probe.efficiency == pytest.approx(clipped(flops / probe.prefill_s / hw.device_flops))
    dec_flops = rows * cost.forward_flops_per_token(model, plen + new / 2)
    rate = dec_flops / probe.decode_s
    want = clipped(rate / (probe.efficiency * hw.device_flops))
    assert probe.decode_efficiency == pytest.approx(want)
    assert "decode at" in probe.describe(hw)


def test_predict_probe_caps_the_prefill_and_skips_what_does_not_fit(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(calibrate, "PREFILL_PROBE_TOKENS", 64)
    probe = calibrate.probe_predict_compute(
        config(), cpu(), prompt_len=32, concurrent=8, cache_len=64, repeats=1
    )
    assert probe is not None and probe.prefill_rows == 2 and probe.decode_rows == 8
    monkeypatch.setattr(calibrate, "MEMORY_SHARE", 1e-9)
    args = {"prompt_len": 32, "concurrent": 8, "cache_len": 64}
    assert calibrate.probe_predict_compute(config(), cpu(), **args) is None
    with pytest.raises(ValueError, match="cache_len=0"):
        calibrate.probe_predict_compute(config(), cpu(), prompt_len=32, concurrent=8, cache_len=0)


@pytest.mark.parametrize("arch", ["gpt2", "gpt_neox", "opt"])
def test_predict_probe_runs_on_other_architectures(arch: str) -> None:
    from transformers import AutoConfig

    cfg = AutoConfig.for_model(
        arch, vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
        pad_token_id=0, max_position_embeddings=64,
    )  # fmt: skip
    probe = calibrate.probe_predict_compute(
        cfg, cpu(1e12), prompt_len=16, concurrent=4, cache_len=64, repeats=1
    )
    assert probe is not None and probe.prefill_s > 0 and probe.decode_s > 0


def test_predict_probe_keeps_the_decode_position_within_the_model() -> None:
    from transformers import AutoConfig

    # a 64-position cache past the model's 40 positions (the generator rounds lengths up)
    cfg = AutoConfig.for_model(
        "gpt2", vocab_size=256, n_embd=64, n_layer=2, n_head=4, n_positions=40
    )
    probe = calibrate.probe_predict_compute(
        cfg, cpu(1e12), prompt_len=16, concurrent=4, cache_len=64, repeats=1
    )
    assert probe is not None and probe.decode_s > 0
