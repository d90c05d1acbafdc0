"""The model-shaped compute probe: the passes it runs, and what it makes of their times.

A scripted clock stands in for ``time.perf_counter`` inside the probe: every pass of a
copy with ``L`` blocks advances it by ``L * block + rest`` seconds, so the probe's split
into per-block and outside-the-blocks times is checked exactly, on any machine and load.
How close the prediction comes to timing the whole model is a benchmark
(``bench/probe_accuracy.py``), not a test.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers
from transformers import AutoModelForCausalLM, LlamaConfig
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from bb_lightning.engine import host_linear
from bb_lightning.planner import cost
from bb_lightning.planner.profile import HardwareProfile
from bb_lightning.probe import calibrate, contention, model_profile_from_config, rate_cache
from bb_lightning.probe.calibrate import probe_train_compute

from .test_read_ahead import CPU

LAYERS, SEQ = 6, 128


def config() -> LlamaConfig:
    """Small: the tests that read the probe's times script its clock (``clock``)."""
    return LlamaConfig(
        hidden_size=64,
        intermediate_size=176,
        num_hidden_layers=LAYERS,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=256,
        max_position_embeddings=SEQ,
        tie_word_embeddings=False,
    )


def cpu(flops: float = 1e11) -> HardwareProfile:
    """A CPU profile; the probe reads only its device type and FLOP/s (which also sizes the
    reference product it times between passes: 1e10 FLOP/s, 512 square)."""
    return HardwareProfile.from_dict({**CPU, "device_flops": flops})


@dataclass
class ScriptedClock:
    """Passes seen by the probe's models, each advancing a fake clock by its scripted cost."""

    prefill: tuple[float, float] = (0.010, 0.004)
    """(per block, rest) seconds of a pass over whole prompts (training passes too)."""
    decode: tuple[float, float] = (0.002, 0.0015)
    """(per block, rest) seconds of a one-token pass with a cache."""
    now: float = 0.0
    passes: list[tuple[int, tuple[int, ...], bool]] = field(default_factory=list)
    """(blocks, input_ids shape, whether a cache was passed) of each forward pass off the
    meta device."""

    def hook(self, net: Any, args: Any, kwargs: dict[str, Any], output: Any) -> None:
        ids = kwargs["input_ids"]
        if ids.device.type == "meta":  # the structure trace (ModelProfile), not a timed pass
            return
        cached = any(isinstance(v, transformers.Cache) for v in kwargs.values())
        layers = net.config.num_hidden_layers
        self.passes.append((layers, tuple(ids.shape), cached))
        block, rest = self.decode if cached else self.prefill
        self.now += layers * block + rest


@pytest.fixture(autouse=True)
def own_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The probes' rate records go to the test's own directory, not the user's cache."""
    monkeypatch.setenv("BB_CACHE_DIR", str(tmp_path / "cache"))


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> ScriptedClock:
    script = ScriptedClock()
    build = AutoModelForCausalLM.from_config

    def from_config(*args: Any, **kwargs: Any) -> Any:
        net = build(*args, **kwargs)
        net.register_forward_hook(script.hook, with_kwargs=True)
        return net

    monkeypatch.setattr(AutoModelForCausalLM, "from_config", from_config)
    monkeypatch.setattr(contention, "SYSTEM", _ScriptedTiming(script))
    return script


class _ScriptedTiming(contention.Timing):
    """Times a pass by the scripted clock; no other process is ever busy."""

    def __init__(self, script: ScriptedClock) -> None:
        self.script = script

    def seconds(self, label: str, run: Callable[[], None]) -> float:
        if label.startswith("matmul"):  # the reference product: takes no scripted time
            return 0.0
        t0 = self.script.now
        run()
        return self.script.now - t0

    def watch(self) -> Callable[[], float]:
        return lambda: 0.0


def test_probe_times_a_one_and_a_wider_block_copy_and_splits_their_times(
    clock: ScriptedClock,
) -> None:
    cfg, hw = config(), cpu()
    probe = probe_train_compute(cfg, hw, seq_len=SEQ, micro_batch=2, repeats=3)
    assert probe is not None
    # a warm-up and three timed passes of each copy, alternating, at the batch's shape; the
    # wider copy has as many blocks as the model (no more than TRAIN_SPANS[0] + 1)
    wide = min(calibrate.TRAIN_SPANS[0] + 1, LAYERS)
    assert clock.passes == [(1, (2, SEQ), False), (wide, (2, SEQ), False)] * 4
    block, rest = clock.prefill
    assert probe.block_s == pytest.approx(block) and probe.rest_s == pytest.approx(rest)
    assert probe.pass_s == pytest.approx(LAYERS * block + rest)
    flops = 2 * SEQ * cost.train_flops_per_token(model_profile_from_config(cfg), SEQ, False)
    assert probe.tflops == pytest.approx(flops / probe.pass_s / 1e12)
    raw = probe.tflops * 1e12 / hw.device_flops
    clipped = min(max(raw, calibrate.MIN_EFFICIENCY), calibrate.MAX_EFFICIENCY)
    assert probe.efficiency == pytest.approx(clipped)
    assert "TFLOP/s" in probe.describe(hw)


def test_probe_takes_a_three_block_copy_where_the_wider_one_does_not_fit(
    clock: ScriptedClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    fits = calibrate._fits
    monkeypatch.setattr(
        calibrate, "_fits", lambda *args: args[-1] <= calibrate.SPAN and fits(*args)
    )
    probe = probe_train_compute(config(), cpu(), seq_len=SEQ, repeats=1)
    assert probe is not None
    assert {blocks for blocks, _, _ in clock.passes} == {1, calibrate.SPAN + 1}
    block, rest = clock.prefill
    assert probe.block_s == pytest.approx(block) and probe.rest_s == pytest.approx(rest)


def test_probe_times_the_attention_backward_a_fit_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    """In bf16 on a CPU with matrix tiles or AVX-512's bf16 products a fit's attention
    backward runs the compiled kernel, and the probe times it so; the rate it records is kept
    apart from torch's attention's, under the kernel's kind."""
    kern = host_linear.attention_kernel()
    if kern is None:
        pytest.skip(
            "neither bf16 matrix tiles nor AVX-512's bf16 products on this CPU: a fit "
            "runs torch's attention backward"
        )
    calls: list[int] = []
    real = host_linear._Kernel.attention_backward
    monkeypatch.setattr(host_linear._Kernel, "attention_backward",
                        lambda self, *a: calls.append(1) or real(self, *a))  # fmt: skip
    keys: list[object] = []
    key = rate_cache.key
    monkeypatch.setattr(rate_cache, "key",
                        lambda *a, **k: keys.append(k.get("attention")) or key(*a, **k))  # fmt: skip
    cfg = config()
    cfg.head_dim = 32
    for dtype in (torch.bfloat16, torch.float32):
        assert probe_train_compute(cfg, cpu(), seq_len=64, dtype=dtype, repeats=1)
    assert calls  # in bf16, the wider copy's blocks on every timed pass
    assert keys == [kern.kind, "sdpa"] and kern.kind in ("tiles", "vectors")
    assert ALL_ATTENTION_FUNCTIONS["sdpa"] is sdpa_attention_forward  # restored


def test_probe_times_a_fits_host_kernels_and_takes_them_back(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """In bf16 on a CPU the probe's passes run the norms', MLPs' and rotary embeddings'
    kernels a fit runs (the rate keyed by their kinds), and the model file's rotary
    function, swapped meanwhile, is its own again after."""
    from transformers.models.llama import modeling_llama

    from bb_lightning.engine import host_norm, train_kernels

    kern = host_norm.kernel()
    if kern is None:
        pytest.skip("the host kernels did not build (BB_NATIVE=0?): a fit runs autograd's")
    rope = modeling_llama.apply_rotary_pos_emb
    calls: list[int] = []
    real = host_norm._Kernel.silu_mul_backward
    monkeypatch.setattr(host_norm._Kernel, "silu_mul_backward",
                        lambda self, *a: calls.append(1) or real(self, *a))  # fmt: skip
    keys: list[object] = []
    key = rate_cache.key
    monkeypatch.setattr(rate_cache, "key",
                        lambda *a, **k: keys.append(k.get("norm")) or key(*a, **k))  # fmt: skip
    assert probe_train_compute(config(), cpu(), seq_len=16, repeats=1)
    assert calls and keys == [train_kernels.backward_kinds(torch.device("cpu"), torch.bfloat16)]
    assert keys[0].startswith("kernel/kernel/")  # type: ignore[union-attr]
    assert modeling_llama.apply_rotary_pos_emb is rope


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


def clipped(efficiency: float) -> float:
    return min(max(efficiency, calibrate.MIN_EFFICIENCY), calibrate.MAX_EFFICIENCY)


def test_predict_probe_times_prefill_and_decode_passes_and_splits_their_times(
    clock: ScriptedClock,
) -> None:
    cfg, hw = config(), cpu(1e12)
    plen, new, rows = 32, 9, 16
    probe = calibrate.probe_predict_compute(
        cfg, hw, prompt_len=plen, concurrent=rows, cache_len=64, context=plen + new / 2
    )
    assert probe is not None
    assert probe.prefill_rows == rows  # 16 x 32 tokens is under PREFILL_PROBE_TOKENS
    # per round, each copy runs a prefill of the prompts then one decode step of every
    # sequence against its cache: a warm-up round and three timed ones
    one, more = 1, calibrate.SPAN + 1
    assert clock.passes == [
        (one, (rows, plen), False), (one, (rows, 1), True),
        (more, (rows, plen), False), (more, (rows, 1), True),
    ] * 4  # fmt: skip
    (pb, pr), (db, dr) = clock.prefill, clock.decode
    assert (probe.prefill_block_s, probe.prefill_rest_s) == (pytest.approx(pb), pytest.approx(pr))
    assert (probe.decode_block_s, probe.decode_rest_s) == (pytest.approx(db), pytest.approx(dr))
    assert probe.prefill_s == pytest.approx(LAYERS * pb + pr)
    assert probe.decode_s == pytest.approx(LAYERS * db + dr)
    assert all(math.isfinite(x) and x > 0 for x in (probe.efficiency, probe.decode_efficiency))
    model = model_profile_from_config(cfg)
    head = model.head_flops_per_token()
    flops = rows * plen * (cost.forward_flops_per_token(model, plen) - head) + rows * head
    assert probe.efficiency == pytest.approx(clipped(flops / probe.prefill_s / hw.device_flops))
    dec_flops = rows * cost.forward_flops_per_token(model, plen + new / 2)
    rate = dec_flops / probe.decode_s
    want = clipped(rate / (probe.efficiency * hw.device_flops))
    assert probe.decode_efficiency == pytest.approx(want)
    assert "decode at" in probe.describe(hw)


def test_predict_probe_runs_the_kernels_a_generation_runs_on_a_cpu(
    count_host_kernel: Callable[..., list[int]],
) -> None:
    """In bf16 on a CPU the probe's passes run what the engine's generation gives the model
    there: the norms' kernel, the prefill's compiled attention and the decode pass's
    products of few rows (where the CPU has them); the model file's attention functions are
    transformers' again after."""
    from bb_lightning.engine import host_norm

    if host_norm.kernel() is None:
        pytest.skip("the host kernels did not build (BB_NATIVE=0?): a generation runs torch's")
    norms = count_host_kernel("__call__")
    products = count_host_kernel("__call__", host_linear._Kernel)
    prefills = count_host_kernel("prefill_attention", host_linear._Kernel)
    cfg = config()
    cfg.head_dim = 32  # heads of 32: the compiled prefill attention's
    probe = calibrate.probe_predict_compute(
        cfg, cpu(), prompt_len=32, concurrent=8, cache_len=64, repeats=1
    )
    assert probe is not None and norms
    assert bool(products) == (host_linear.kernel() is not None)
    assert bool(prefills) == (host_linear.attention_kernel() is not None)
    assert ALL_ATTENTION_FUNCTIONS["sdpa"] is sdpa_attention_forward


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
        cfg, cpu(1e10), prompt_len=16, concurrent=4, cache_len=64, repeats=1
    )
    assert probe is not None and probe.prefill_s > 0 and probe.decode_s > 0


def test_predict_probe_keeps_the_decode_position_within_the_model() -> None:
    from transformers import AutoConfig

    # a 64-position cache past the model's 40 positions (the generator rounds lengths up)
    cfg = AutoConfig.for_model(
        "gpt2", vocab_size=256, n_embd=64, n_layer=2, n_head=4, n_positions=40
    )
    probe = calibrate.probe_predict_compute(
        cfg, cpu(1e10), prompt_len=16, concurrent=4, cache_len=64, repeats=1
    )
    assert probe is not None and probe.decode_s > 0


def test_a_dtype_that_multiplies_faster_than_bf16_raises_the_efficiency_ceiling(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``device_flops`` is a bf16 rate; an fp32 model on a CPU without bf16 matrix
    instructions runs far above it, and the ceiling on its efficiency follows how much
    faster fp32 products run than bf16 ones. bf16 keeps the plain ceiling, and so does a
    CPU whose bf16 products are the faster."""
    dev = torch.device("cpu")
    rates: dict[torch.dtype, float] = {}
    monkeypatch.setattr(calibrate, "product_rate", lambda dtype, device, n=1024: rates[dtype])
    assert calibrate.dtype_ceiling(torch.bfloat16, dev) == calibrate.MAX_EFFICIENCY
    rates.update({torch.bfloat16: 1e10, torch.float32: 8e10})  # AVX2 only
    assert calibrate.dtype_ceiling(torch.float32, dev) == pytest.approx(
        8 * calibrate.MAX_EFFICIENCY
    )
    rates.update({torch.bfloat16: 2.8e12, torch.float32: 4e11})  # AMX
    assert calibrate.dtype_ceiling(torch.float32, dev) == calibrate.MAX_EFFICIENCY


def test_product_rate_times_real_products() -> None:
    """Two products of a CPU's, each a positive finite FLOP/s (no ratio is asserted)."""
    for dtype in (torch.bfloat16, torch.float32):
        rate = calibrate.product_rate(dtype, torch.device("cpu"), n=256)
        assert math.isfinite(rate) and rate > 0
