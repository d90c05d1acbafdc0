"""Bulk greedy generation of an MoE model with weights on the NVMe tier, against in-memory HF.

A Mixtral-shaped model (default about 1B parameters: hidden 1024, 12 layers, 8
experts of ffn 2816 with top-2 routing, vocab 32000) with random weights is saved
with ``save_pretrained`` (per-expert tensors on disk; the module fuses them, and the
strategy streams them through transformers' conversion). ``--prompts`` random
prompts of ``--prompt-len`` tokens are each extended by ``--new-tokens`` greedy
tokens, in bf16:

- ours: ``trainer.predict(CausalLMModule(checkpoint))`` under ``BalanceBeamStrategy``
  with every block (router and all experts) on the NVMe tier, at the planner's batch;
- Hugging Face ``generate`` with the model in memory, at each ``--hf-batches``.

Printed: the machine, the plan (its MoE line: compute by the top-k experts, bytes by
all of them), tokens/s (generated tokens per second of generation) of each, the ratio
ours / best HF, the planner's predicted tokens/s and measured / predicted, and the
share of sequences whose tokens equal in-memory generate's at the same batch.
Run ``python bench/predict_moe.py --help``.
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from _common import PredictTimer, hf_generate, machine, nvme_base, quiet
from torch.utils.data import DataLoader
from transformers import AutoModelForCausalLM, MixtralConfig

from bb_lightning.engine.inference import keep_host_allocations
from bb_lightning.module import CausalLMModule
from bb_lightning.planner import Plan, PlanOverrides, PredictJob, make_plan
from bb_lightning.probe import measure, model_profile_from_config
from bb_lightning.strategy.core import BalanceBeamStrategy
from storage.tiers import Tier


def _args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--ffn", type=int, default=2816, help="width of one expert")
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--top-k", type=int, default=2, help="experts per token")
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--prompts", type=int, default=128, help="number of prompts")
    p.add_argument("--prompt-len", type=int, default=128, help="tokens per prompt")
    p.add_argument("--new-tokens", type=int, default=32, help="tokens generated per prompt")
    p.add_argument("--hf-batches", default="8,32,128", help="HF generate batch sizes to try")
    p.add_argument("--batch", type=int, default=None, help="our batch (default: the plan's)")
    p.add_argument("--nvme-dir", default=None, help="directory on the disk for the NVMe tier")
    p.add_argument("--measure-seconds", type=float, default=10.0)
    return p.parse_args()


def _config(args: argparse.Namespace) -> MixtralConfig:
    return MixtralConfig(
        hidden_size=args.hidden, intermediate_size=args.ffn, num_hidden_layers=args.layers,
        num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
        num_local_experts=args.experts, num_experts_per_tok=args.top_k, vocab_size=args.vocab,
        max_position_embeddings=max(2048, args.prompt_len + args.new_tokens),
        eos_token_id=None, bos_token_id=None, pad_token_id=0, tie_word_embeddings=False,
    )  # fmt: skip


def _collate(rows: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "id": [r["id"] for r in rows],
        "input_ids": torch.stack([r["input_ids"] for r in rows]),
        "attention_mask": torch.stack([torch.ones_like(r["input_ids"]) for r in rows]),
    }


def _ours(
    args: argparse.Namespace, ckpt: Path, nvme: Path, prompts: torch.Tensor, plan: Plan
) -> tuple[float, list[list[int]]]:
    """(generated tokens/s, token ids per prompt) of ``trainer.predict`` at the plan's batch."""
    rows = [{"id": str(i), "input_ids": p} for i, p in enumerate(prompts)]
    loader = DataLoader(rows, batch_size=plan.concurrent_seqs, collate_fn=_collate)  # type: ignore[arg-type]
    module = CausalLMModule(str(ckpt), max_new_tokens=args.new_tokens)
    strategy = BalanceBeamStrategy(
        job=plan.job, hardware=plan.hardware, overrides=plan.overrides, compute_dtype="bf16",
        nvme_path=str(nvme),
    )  # fmt: skip
    timer = PredictTimer()
    trainer = pl.Trainer(
        accelerator="cpu", devices=1, strategy=strategy, logger=False,
        enable_progress_bar=False, enable_model_summary=False, callbacks=[timer],
    )  # fmt: skip
    start = time.perf_counter()
    out = trainer.predict(module, dataloaders=loader)
    total = time.perf_counter() - start
    assert out is not None and strategy.plan is not None
    used = strategy.store.usage()[Tier.NVME][0] if strategy.store is not None else 0
    strategy.close()
    tokens = [r["token_ids"] for b in out for r in b]  # type: ignore[union-attr]
    print(
        f"[ours] setup + teardown {total - timer.seconds:.1f} s (weights streamed to the NVMe "
        f"tier: {used / 1e6:.2f} MB); generation {timer.seconds:.1f} s"
    )
    return sum(map(len, tokens)) / timer.seconds, tokens


def main() -> None:
    args = _args()
    quiet()
    base = nvme_base(args.nvme_dir)
    print(machine(base))
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    print(f"host allocator keeps freed memory (all runs): {keep_host_allocations()}")
    config = _config(args)
    work = Path(tempfile.mkdtemp(prefix="bb-predict-moe-", dir=base))
    try:
        ckpt = work / "checkpoint"
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
        model.generation_config.eos_token_id = None
        model.save_pretrained(ckpt)
        params = sum(p.numel() for p in model.parameters())
        print(
            f"model: mixtral {params / 1e6:.0f}M parameters (top-{args.top_k} of "
            f"{args.experts} experts), bf16, checkpoint {ckpt}"
        )
        print(
            f"job: {args.prompts} prompts x {args.prompt_len} tokens, {args.new_tokens} new "
            "tokens each, greedy"
        )
        hw = measure(nvme_path=str(base), max_seconds=args.measure_seconds)
        job = PredictJob(
            prompt_len=args.prompt_len, new_tokens=args.new_tokens, num_prompts=args.prompts
        )
        overrides = PlanOverrides(weights_tier=Tier.NVME, concurrent_seqs=args.batch)
        plan = make_plan(model_profile_from_config(config), hw, job, overrides=overrides)
        print(plan.explain())
        g = torch.Generator().manual_seed(0)
        prompts = torch.randint(3, args.vocab, (args.prompts, args.prompt_len), generator=g)
        ours, ours_tokens = _ours(args, ckpt, work / "nvme", prompts, plan)
        batch = plan.concurrent_seqs
        print(f"[ours] NVMe weights, batch {batch}: {ours:.1f} tokens/s")
        print(f"[plan] predicted: {plan.tokens_per_s:.1f} tokens/s; measured / predicted = "
              f"{ours / plan.tokens_per_s:.2f}")  # fmt: skip
        model.eval()
        hf: dict[int, float] = {}
        same_shape: list[list[int]] = []
        wanted = [int(x) for x in args.hf_batches.split(",") if x.strip()]
        for b in sorted({*wanted, batch}):
            hf[b], tokens = hf_generate(model, prompts, b, args.new_tokens)
            print(f"[hf generate] in memory, batch {b}: {hf[b]:.1f} tokens/s")
            if b == batch:
                same_shape = tokens
        best = max(wanted or list(hf), key=lambda b: hf[b])
        print(f"ratio ours / hf generate (best, batch {best}) = {ours / hf[best]:.2f}")
        same = sum(x == y for x, y in zip(ours_tokens, same_shape, strict=True))
        print(f"identical sequences vs in-memory generate at batch {batch} (bf16): "
              f"{same / len(same_shape):.1%} of {len(same_shape)}")  # fmt: skip
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(
        "load average at the end (1/5/15 min): " + " / ".join(f"{x:.2f}" for x in os.getloadavg())
    )


if __name__ == "__main__":
    main()
