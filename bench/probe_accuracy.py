"""How well the compute probes predict the whole model's passes, timed in the same run.

The training probe times one- and three-block copies and predicts the forward + backward
pass of the whole model; the predict probe does the same for a prefill and a decode pass.
Each prediction is printed beside the fastest of three timed passes of the whole model
(forward + backward; the layer-major generator's prefill and decode steps), with the ratio.
On an idle CPU the ratios fall within 0.5-2 (training, prefill) and 0.33-3 (decode).

    .venv/bin/python bench/probe_accuracy.py [--layers 6] [--seq 128]
"""

from __future__ import annotations

import argparse
import dataclasses
import time

import _common
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from bb_lightning.engine.generate import GenerationConfig, LayerMajorGenerator
from bb_lightning.planner.profile import HardwareProfile, preset
from bb_lightning.probe import calibrate


def whole_pass_seconds(cfg: LlamaConfig, micro: int, seq: int) -> float:
    """Fastest of three forward + backward passes of the full model (after a warm-up)."""
    torch.manual_seed(0)
    net = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    tokens = torch.randint(0, cfg.vocab_size, (micro, seq))
    best = float("inf")
    for k in range(4):
        start = time.perf_counter()
        net(input_ids=tokens, labels=tokens).loss.backward()
        if k:
            best = min(best, time.perf_counter() - start)
        net.zero_grad(set_to_none=True)
    return best


def generator_seconds(cfg: LlamaConfig, rows: int, plen: int, new: int) -> tuple[float, float]:
    """(prefill, one decode step) seconds of the layer-major generator, fastest of three."""
    torch.manual_seed(0)
    gen = LayerMajorGenerator(AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).eval())
    ids = torch.randint(0, cfg.vocab_size, (rows, plen))
    prefill = decode = float("inf")
    for k in range(4):
        gen.seconds = {"prefill": 0.0, "decode": 0.0}
        gen.generate(ids, torch.ones_like(ids), GenerationConfig(max_new_tokens=new))
        if k:
            prefill = min(prefill, gen.seconds["prefill"])
            decode = min(decode, gen.seconds["decode"] / (new - 1))
    return prefill, decode


def main(argv: list[str] | None = None) -> dict[str, float]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=6, help="blocks of the model")
    parser.add_argument("--seq", type=int, default=128, help="tokens per training sequence")
    args = parser.parse_args(argv)
    cfg = LlamaConfig(
        hidden_size=256, intermediate_size=704, num_hidden_layers=args.layers,
        num_attention_heads=4, num_key_value_heads=2, vocab_size=2048,
        max_position_embeddings=max(args.seq, 64), tie_word_embeddings=False,
    )  # fmt: skip
    # the probes read only the device type and the FLOP/s their efficiencies refer to
    hw: HardwareProfile = dataclasses.replace(preset("t4"), device_type="cpu", device_flops=1e12)
    print(_common.machine(None))
    train = calibrate.probe_train_compute(cfg, hw, seq_len=args.seq, micro_batch=2, repeats=3)
    plen, new, rows = 32, 9, 16
    pred = calibrate.probe_predict_compute(
        cfg, hw, prompt_len=plen, concurrent=rows, cache_len=64, context=plen + new / 2
    )
    assert train is not None and pred is not None
    measured = whole_pass_seconds(cfg, 2, args.seq)
    prefill, decode = generator_seconds(cfg, rows, plen, new)
    out = {
        "train": train.pass_s / measured,
        "prefill": pred.prefill_s / prefill,
        "decode": pred.decode_s / decode,
    }
    for name, (ours, ref) in {
        "train pass": (train.pass_s, measured),
        "prefill": (pred.prefill_s, prefill),
        "decode step": (pred.decode_s, decode),
    }.items():
        print(
            f"{name}: predicted {ours * 1e3:.2f} ms, timed {ref * 1e3:.2f} ms, ratio {ours / ref:.2f}"
        )
    return out


if __name__ == "__main__":
    main()
