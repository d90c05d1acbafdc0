"""Bulk greedy generation with weights on the NVMe tier, against in-memory and disk-offloaded HF.

A Llama-shaped model (default about 370M parameters: hidden 1024, 24 layers,
ffn 2816, vocab 32000) with random weights is saved as a local safetensors
checkpoint. ``--prompts`` random prompts of ``--prompt-len`` tokens are each
extended by ``--new-tokens`` greedy tokens, in bf16:

- ours: ``trainer.predict(CausalLMModule(checkpoint))`` under ``BalanceBeamStrategy``
  with every block's weights on the NVMe tier, at the planner's batch
  (``plan.concurrent_seqs``);
- Hugging Face ``generate`` with the model in memory, at each ``--hf-batches``;
- Accelerate's ``disk_offload`` (weights in an offload folder) at each ``--acc-batches``.

Printed: the machine, tokens/s (generated tokens per second of generation) of
each, the ratios ours / best HF and ours / best Accelerate, the share of
sequences whose tokens equal the in-memory run at the same batch shape, and the
plan's predicted tokens/s. Run ``python bench/predict_offload.py --help``.
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from _common import machine, nvme_base
from torch.utils.data import DataLoader
from transformers import AutoModelForCausalLM, LlamaConfig

from bb_lightning.engine.pager import Placement
from bb_lightning.module import CausalLMModule
from bb_lightning.planner import ModelProfile, PredictJob, make_plan, measure
from bb_lightning.strategy import BalanceBeamStrategy
from storage.tiers import Tier


def _args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--layers", type=int, default=24)
    p.add_argument("--ffn", type=int, default=2816)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--prompts", type=int, default=128, help="number of prompts")
    p.add_argument("--prompt-len", type=int, default=128, help="tokens per prompt")
    p.add_argument("--new-tokens", type=int, default=32, help="tokens generated per prompt")
    p.add_argument("--hf-batches", default="8,32,128", help="HF generate batch sizes to try")
    p.add_argument("--acc-batches", default="32,128", help="Accelerate batch sizes ('' skips)")
    p.add_argument("--batch", type=int, default=None, help="our batch (default: the plan's)")
    p.add_argument("--nvme-dir", default=None, help="directory on the disk for the NVMe tier")
    p.add_argument("--measure-seconds", type=float, default=10.0)
    return p.parse_args()


def _batches(n: str) -> list[int]:
    return [int(x) for x in n.split(",") if x.strip()]


def _prompts(args: argparse.Namespace) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    return torch.randint(3, args.vocab, (args.prompts, args.prompt_len), generator=g)


def _hf_generate(model: Any, prompts: torch.Tensor, batch: int, new: int) -> tuple[float, list]:
    """(generated tokens/s, token ids per prompt) of ``generate`` at ``batch``."""
    out: list[list[int]] = []
    start = time.perf_counter()
    with torch.inference_mode():
        for i in range(0, len(prompts), batch):
            ids = prompts[i : i + batch]
            gen = model.generate(
                input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=new,
                do_sample=False, pad_token_id=0, eos_token_id=None,
            )  # fmt: skip
            out += gen[:, ids.shape[1] :].tolist()
    seconds = time.perf_counter() - start
    return sum(map(len, out)) / seconds, out


class _Timer(pl.Callback):
    """Seconds spent in predict batches (setup and teardown excluded)."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self._t = 0.0

    def on_predict_batch_start(self, *args: Any) -> None:
        self._t = time.perf_counter()

    def on_predict_batch_end(self, *args: Any) -> None:
        self.seconds += time.perf_counter() - self._t


def _ours(args: argparse.Namespace, ckpt: Path, nvme: Path, batch: int) -> tuple[float, list]:
    prompts = _prompts(args)
    rows = [
        {"id": str(i), "input_ids": p, "attention_mask": torch.ones_like(p), "error": None}
        for i, p in enumerate(prompts)
    ]
    loader = DataLoader(rows, batch_size=batch, collate_fn=_collate)  # type: ignore[arg-type]
    module = CausalLMModule(str(ckpt), max_new_tokens=args.new_tokens)
    strategy = BalanceBeamStrategy(
        placement=Placement.uniform(args.layers, weights=Tier.NVME, master=Tier.NVME),
        compute_dtype="bf16",
        nvme_path=str(nvme),
    )
    timer = _Timer()
    trainer = pl.Trainer(
        accelerator="cpu", devices=1, strategy=strategy, logger=False,
        enable_progress_bar=False, enable_model_summary=False, callbacks=[timer],
    )  # fmt: skip
    start = time.perf_counter()
    out = trainer.predict(module, dataloaders=loader)
    total = time.perf_counter() - start
    strategy.close()
    assert out is not None
    tokens = [r["token_ids"] for b in out for r in b]  # type: ignore[union-attr]
    print(f"[ours] setup + teardown {total - timer.seconds:.1f} s (paging weights to NVMe)")
    return sum(map(len, tokens)) / timer.seconds, tokens


def _collate(rows: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "id": [r["id"] for r in rows],
        "input_ids": torch.stack([r["input_ids"] for r in rows]),
        "attention_mask": torch.stack([r["attention_mask"] for r in rows]),
        "error": [None] * len(rows),
    }


def _same(a: list[list[int]], b: list[list[int]]) -> float:
    return sum(x == y for x, y in zip(a, b, strict=True)) / len(a)


def main() -> None:
    args = _args()
    base = nvme_base(args.nvme_dir)
    print(machine(base))
    config = LlamaConfig(
        hidden_size=args.hidden, intermediate_size=args.ffn, num_hidden_layers=args.layers,
        num_attention_heads=args.heads, num_key_value_heads=args.heads, vocab_size=args.vocab,
        max_position_embeddings=max(2048, args.prompt_len + args.new_tokens),
        eos_token_id=None, bos_token_id=None, pad_token_id=0, tie_word_embeddings=False,
    )  # fmt: skip
    work = Path(tempfile.mkdtemp(prefix="bb-predict-", dir=base))
    try:
        ckpt = work / "checkpoint"
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
        model.generation_config.eos_token_id = None
        model.save_pretrained(ckpt, safe_serialization=True)
        params = sum(p.numel() for p in model.parameters())
        print(f"model: llama {params / 1e6:.0f}M parameters, bf16, checkpoint {ckpt}")
        print(
            f"job: {args.prompts} prompts x {args.prompt_len} tokens, {args.new_tokens} new "
            "tokens each, greedy"
        )

        hw = measure(nvme_path=str(base), max_seconds=args.measure_seconds)
        job = PredictJob(
            prompt_len=args.prompt_len, new_tokens=args.new_tokens, num_prompts=args.prompts
        )
        plan = make_plan(ModelProfile.from_config(config), hw, job)
        print(plan.explain())
        batch = args.batch or plan.concurrent_seqs
        ours, ours_tokens = _ours(args, ckpt, work / "nvme", batch)
        print(f"[ours] NVMe weights, batch {batch}: {ours:.1f} tokens/s")
        print(f"[plan] predicted: {plan.tokens_per_s:.1f} tokens/s; measured / predicted = "
              f"{ours / plan.tokens_per_s:.2f}")  # fmt: skip

        prompts = _prompts(args)
        model.eval()
        hf: dict[int, float] = {}
        same_shape: list[list[int]] | None = None
        for b in sorted({*_batches(args.hf_batches), batch}):
            hf[b], tokens = _hf_generate(model, prompts, b, args.new_tokens)
            print(f"[hf generate] in memory, batch {b}: {hf[b]:.1f} tokens/s")
            if b == batch:
                same_shape = tokens
        tried = [b for b in hf if str(b) in args.hf_batches.split(",")] or list(hf)
        best_hf = max(tried, key=lambda b: hf[b])
        print(f"ratio ours / hf generate (best, batch {best_hf}) = {ours / hf[best_hf]:.2f}")
        assert same_shape is not None
        print(f"identical sequences vs in-memory generate at batch {batch} (bf16): "
              f"{_same(ours_tokens, same_shape):.1%}")  # fmt: skip
        del model

        acc = _accelerate(args, ckpt, work / "offload", prompts)
        if acc:
            best_acc = max(acc, key=lambda b: acc[b])
            print(f"ratio ours / accelerate disk offload (best, batch {best_acc}) = "
                  f"{ours / acc[best_acc]:.2f}")  # fmt: skip
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _accelerate(
    args: argparse.Namespace, ckpt: Path, folder: Path, prompts: torch.Tensor
) -> dict[int, float]:
    from accelerate import disk_offload

    out: dict[int, float] = {}
    for b in _batches(args.acc_batches):
        model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.bfloat16).eval()
        disk_offload(model, offload_dir=str(folder), execution_device=torch.device("cpu"))
        out[b], _ = _hf_generate(model, prompts, b, args.new_tokens)
        print(f"[accelerate] disk offload, batch {b}: {out[b]:.1f} tokens/s")
        del model
        shutil.rmtree(folder, ignore_errors=True)
    return out


if __name__ == "__main__":
    main()
