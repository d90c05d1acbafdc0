"""Held micro-batch gradients against fp32 accumulation, same engine, same process.

A Llama (default 12 blocks of width 1024, sequence 512) trains on the CPU under the
training engine with every block's weights and optimizer state homed on the host,
micro-batch 1 x ``--accumulate`` 4, the optimizer step overlapped with the last
backward. Two engines from the same start alternate steps, each summing the
micro-batches' gradients in its own way (the order swapped every step):

1. ``hold_grads=False``: every micro-batch's gradient is added to an fp32 accumulator
   on the gradient worker as it arrives (``compute bytes + 8`` bytes of memory traffic
   per parameter and micro-batch, beside the compute's threads);
2. ``hold_grads=True``: the earlier micro-batches' gradients are kept as the backward
   made them and summed once, tile by tile, in the last backward.

Prints the machine, each step's seconds, the fastest step of each way, their ratio,
and the largest difference between the two ways' trained weights (they must agree:
the same sums in the same order). ``--dtype float32`` suits a CPU without bf16 matrix
instructions (AVX2 only), where bf16 products run about 8 x slower than fp32.

    .venv/bin/python bench/grad_hold.py [--layers 12] [--accumulate 4] [--repeat 3]
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import time

import _common
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from bb_lightning.engine.optim import AdamWConfig
from bb_lightning.engine.trainer_engine import TrainingEngine
from bb_lightning.placement import Placement
from storage.tiers import Tier


def build(args: argparse.Namespace) -> torch.nn.Module:
    cfg = LlamaConfig(**{k: v for k, v in _common.llama_config(args).items() if k != "model_type"})
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(cfg)


def step(engine: TrainingEngine, batches: list[torch.Tensor], adamw: AdamWConfig) -> float:
    """One optimizer step over ``batches`` (one per micro-batch); its seconds."""
    start = time.perf_counter()
    for k, ids in enumerate(batches):
        if k == len(batches) - 1:
            engine.begin_overlapped_step(adamw)
        loss = engine.model(input_ids=ids, labels=ids).loss / len(batches)
        loss.backward()
        engine.after_backward()
    engine.optimizer_step(adamw)
    return time.perf_counter() - start


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--ffn", type=int, default=2816)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--seq", type=int, default=512, help="tokens per sequence")
    parser.add_argument("--accumulate", type=int, default=4, help="micro-batches per step")
    parser.add_argument("--repeat", type=int, default=3, help="timed steps of each way")
    parser.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    parser.add_argument("--nvme-dir", default=None, help="directory for the store's NVMe tier")
    args = parser.parse_args(argv)
    _common.quiet()
    base = _common.nvme_base(args.nvme_dir)
    print(_common.machine(base))
    print(
        f"model: Llama {args.layers} x {args.hidden} (ffn {args.ffn}), seq {args.seq}, "
        f"{args.dtype} compute, micro-batch 1 x {args.accumulate}, every block homed on the host"
    )
    placement = Placement.uniform(args.layers, weights=Tier.HOST, compute_dtype=args.dtype)
    adamw = AdamWConfig(lr=1e-4)
    gen = torch.Generator().manual_seed(0)
    steps = args.repeat + 1  # the first step of each way is a warm-up
    data = [
        [torch.randint(0, args.vocab, (1, args.seq), generator=gen) for _ in range(args.accumulate)]
        for _ in range(steps)
    ]
    model = build(args)
    times: dict[bool, list[float]] = {False: [], True: []}
    weights: dict[bool, dict[str, torch.Tensor]] = {}
    with contextlib.ExitStack() as stack:
        engines = {}
        for hold in (False, True):  # each trains the same steps from the same start
            engine, store = _common.cpu_training_engine(
                copy.deepcopy(model),
                dataclasses.replace(placement, hold_grads=hold),
                base / f"grad-hold-{int(hold)}",
            )
            stack.enter_context(store)
            engines[hold] = engine
        for s in range(steps):
            for hold in (False, True) if s % 2 == 0 else (True, False):
                seconds = step(engines[hold], data[s], adamw)
                label = "warm-up" if s == 0 else f"step {s}"
                print(f"hold_grads={hold!s:5}: {label}: {seconds:.2f} s", flush=True)
                if s > 0:
                    times[hold].append(seconds)
        for hold, engine in engines.items():
            weights[hold] = {k: v.float() for k, v in engine.state_dict().items()}
            engine.close()
    fp32, held = min(times[False]), min(times[True])
    diff = max(float((weights[True][k] - v).abs().max()) for k, v in weights[False].items())
    print(
        f"fastest step: fp32 accumulation {fp32:.2f} s, held gradients {held:.2f} s; "
        f"held / accumulated step time = {held / fp32:.3f}; "
        f"largest weight difference between the two {diff:.3g}"
    )


if __name__ == "__main__":
    main()
