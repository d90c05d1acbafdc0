"""Bulk greedy generation with weights on the NVMe tier, against in-memory and disk-offloaded HF.

A Llama-shaped model (default about 370M parameters: hidden 1024, 24 layers,
ffn 2816, vocab 32000) with random weights is saved as a local safetensors
checkpoint. ``--prompts`` random prompts of ``--prompt-len`` tokens are each
extended by ``--new-tokens`` greedy tokens, in bf16 (``--dtype fp32`` for a CPU without
bf16 matrix instructions: every run computes in fp32 from the same bf16 checkpoint):

- ours: ``trainer.predict(CausalLMModule(checkpoint))`` under ``BalanceBeamStrategy``
  planning the predict job with every block's weights forced onto the NVMe tier
  (predict-only: compute-dtype weights, no optimizer state), at the planner's batch
  (``plan.concurrent_seqs``); the time split into prefill, decode and page-in waits;
- Hugging Face ``generate`` with the model in memory, at each ``--hf-batches``;
- Accelerate's ``disk_offload`` (weights in an offload folder) at each ``--acc-batches``,
  once with the folder dropped from the page cache before every forward (each weight
  pass reads the disk, as for a model larger than RAM; our NVMe tier reads with
  ``O_DIRECT`` and never uses the page cache), once with the page cache left warm
  (this small model then stays in RAM after its first pass).

``--hf-max-batches`` / ``--acc-max-batches`` time only the first batches of a
baseline (its tokens/s is then the rate over those batches, said in the output).
Every run (ours and the baselines) loads the checkpoint in a child process of its own
(``_common.isolated``), as a user's job does, and gets the same host allocator setting,
:func:`~bb_lightning.engine.inference.keep_host_allocations` (which our engine
applies on a CPU device), so that the comparison does not depend on the order of
the runs, and no run inherits the heap the earlier ones grew (in one process, the
fp32 runs of the default model grew it past 23 GiB). Printed: the machine, tokens/s (generated tokens per second of generation) of
each, the ratios ours / best HF and ours / best Accelerate, the share of
sequences whose tokens equal the in-memory run at the same batch shape (bf16,
and fp32 over ``--check-prompts`` prompts), the plan's predicted tokens/s (priced at
the matrix-product probe's rate, and at the rates of the model's own prefill and
decode passes from :func:`~bb_lightning.probe.calibrate.probe_predict_compute`),
and the floor of any schedule that reads the weights from NVMe on every pass
(prefill FLOPs at the matrix-product rate, then the decode passes' reads of the
checkpoint's bf16 weights at the NVMe rate; never below all FLOPs at that rate)
beside Accelerate's best, and the share of that floor the blocks' products alone reach at
the model's own shapes (:func:`_shape_bound`). With ``--busy-probe`` a process spins on one core
while the probes run and the plan is made, and stops before the runs (measured /
predicted then checks the plan made beside a busy neighbour).
With ``--decode-attention host`` the KV cache lives on the host and decode attention runs
there; ``--host-memory-gib`` / ``--device-memory-gib`` plan with that much memory, so that
the cache of the plan's batch may pass it and its last blocks home on NVMe
(``Placement.kv_cache_nvme_blocks``); ``--ram-batch`` then also runs ours at the largest
batch whose cache the plan keeps in memory, printing its measured / predicted and the
spilled run's tokens/s against it.
Run ``python bench/predict_offload.py --help``.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import shutil
import tempfile
import time
from functools import partial
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from _common import (
    PredictTimer,
    busy_neighbour,
    gib,
    hf_generate,
    isolated,
    machine,
    nvme_base,
    quiet,
    trim_heap,
    write_figures,
)
from torch.utils.data import DataLoader
from transformers import AutoModelForCausalLM, LlamaConfig

from bb_lightning.engine import host_packed
from bb_lightning.engine.inference import keep_host_allocations
from bb_lightning.module import CausalLMModule
from bb_lightning.planner import (
    HardwareProfile,
    Plan,
    PlanOverrides,
    PredictJob,
    cost,
    make_plan,
)
from bb_lightning.planner.predict_search import batches_of
from bb_lightning.probe import measure, model_profile_from_config
from bb_lightning.probe.calibrate import probe_predict_compute, product_rate
from bb_lightning.strategy.core import BalanceBeamStrategy
from storage.io import drop_cache
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
    p.add_argument("--hf-max-batches", type=int, default=0, help="time HF's first N (0: all)")
    p.add_argument("--acc-max-batches", type=int, default=1, help="time Accelerate's first N")
    p.add_argument("--check-prompts", type=int, default=8, help="prompts compared in fp32")
    p.add_argument("--batch", type=int, default=None, help="our batch (default: the plan's)")
    p.add_argument(
        "--prefetch", type=int, default=None, help="our prefetch depth (default: the plan's)"
    )
    p.add_argument("--nvme-dir", default=None, help="directory on the disk for the NVMe tier")
    p.add_argument("--measure-seconds", type=float, default=10.0)
    p.add_argument(
        "--busy-probe", action="store_true", help="a process spins on one core during the probes"
    )
    p.add_argument(
        "--dtype",
        choices=sorted(DTYPES),
        default="bf16",
        help="compute dtype of every run (fp32 for a CPU without bf16 matrix instructions)",
    )
    p.add_argument("--json", default=None, help="also write the figures to this JSON file")
    p.add_argument(
        "--decode-attention",
        choices=("device", "host"),
        default="device",
        help="host: the KV cache on the host, attended there (its blocks past host memory "
        "homed on NVMe)",
    )
    p.add_argument(
        "--host-memory-gib", type=float, default=None, help="plan with this much host memory"
    )
    p.add_argument(
        "--device-memory-gib", type=float, default=None, help="plan with this much device memory"
    )
    p.add_argument(
        "--ram-batch",
        action="store_true",
        help="also run ours at the largest batch whose KV cache the plan keeps in memory",
    )
    args = p.parse_args()
    if args.ram_batch and args.decode_attention != "host":
        p.error("--ram-batch compares the KV cache spilled to NVMe: pass --decode-attention host")
    return args


DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
"""``--dtype`` choices and the compute dtype each names."""


def _batches(n: str) -> list[int]:
    return [int(x) for x in n.split(",") if x.strip()]


def _prompts(args: argparse.Namespace) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    return torch.randint(3, args.vocab, (args.prompts, args.prompt_len), generator=g)


def _hf_run(
    ckpt: Path, dtype: str, prompts: torch.Tensor, batch: int, new: int, max_batches: int = 0
) -> tuple[float, list[list[int]]]:
    """:func:`~_common.hf_generate` of the checkpoint's model loaded in ``dtype``; run it through
    :func:`~_common.isolated`, a child process of its own."""
    quiet()
    keep_host_allocations()
    model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=DTYPES[dtype]).eval()
    return hf_generate(model, prompts, batch, new, max_batches)


def _ours(
    args: argparse.Namespace,
    ckpt: Path,
    nvme: Path,
    prompts: torch.Tensor,
    plan: Plan,
    dtype: str,
    report: bool = True,
) -> tuple[float, list[list[int]], dict[str, float]]:
    """(generated tokens/s, token ids per prompt, seconds of prefill, decode and page-in
    waits) of ``trainer.predict`` at the plan's batch, computing in ``dtype`` (``"bf16"`` or
    ``"fp32"``); ``report`` prints its phases. Run it
    through :func:`~_common.isolated`, a child process of its own: it sets the host
    allocator as every run does and silences Lightning's banners as this process does."""
    quiet()
    keep_host_allocations()
    rows = [
        {"id": str(i), "input_ids": p, "attention_mask": torch.ones_like(p), "error": None}
        for i, p in enumerate(prompts)
    ]
    batch = plan.concurrent_seqs
    loader = DataLoader(rows, batch_size=batch, collate_fn=_collate)  # type: ignore[arg-type]
    module = CausalLMModule(str(ckpt), max_new_tokens=args.new_tokens)
    strategy = BalanceBeamStrategy(
        job=plan.job, hardware=plan.hardware, overrides=plan.overrides, compute_dtype=dtype,
        nvme_path=str(nvme),
    )  # fmt: skip
    timer = PredictTimer()
    trainer = pl.Trainer(
        accelerator="cpu", devices=1, strategy=strategy, logger=False,
        enable_progress_bar=False, enable_model_summary=False, callbacks=[timer, _PageWaits()],
    )  # fmt: skip
    start = time.perf_counter()
    out = trainer.predict(module, dataloaders=loader)
    total = time.perf_counter() - start
    engine = strategy.inference
    assert engine is not None and out is not None, "predict runs on the weights-only engine"
    waits = engine.timer.end_step()
    gen = module._generator
    assert gen is not None and strategy.plan is not None
    strategy.close()
    tokens = [r["token_ids"] for b in out for r in b]  # type: ignore[union-attr]
    tok_s = sum(map(len, tokens)) / timer.seconds
    wait = waits.wait_page_in if waits is not None else 0.0
    phases = {"prefill_s": gen.seconds["prefill"], "decode_s": gen.seconds["decode"]}
    phases["page_in_wait_s"] = wait
    if report:
        print(
            f"[ours] setup + teardown {total - timer.seconds:.1f} s (weights to the NVMe tier); "
            f"generation {timer.seconds:.1f} s = prefill {gen.seconds['prefill']:.1f} s + decode "
            f"{gen.seconds['decode']:.1f} s ({args.new_tokens - 1} steps), of which waiting for "
            f"page-ins {wait:.1f} s; cores {timer.busy():.0%} busy, load average "
            f"{os.getloadavg()[0]:.1f}"
        )
        pre, dec = _predicted_phases(plan)
        print(f"[plan] predicted for the job: prefill {pre:.1f} s + decode {dec:.1f} s "
              f"({batches_of(plan.job, plan.concurrent_seqs)} batches)")  # fmt: skip
        spill = strategy.plan.placement.kv_cache_nvme_blocks
        print(f"[ours] plan in force: {strategy.plan.concurrent_seqs} concurrent sequences, "
              f"KV cache on {getattr(strategy.plan.kv_cache, 'value', 'device')}"
              + (f", the last {spill} blocks' on NVMe" if spill else ""))  # fmt: skip
    return tok_s, tokens, phases


def _predicted_phases(plan: Plan) -> tuple[float, float]:
    """(prefill, decode) seconds the plan prices for the whole job (a last, partial batch
    priced for its own prompts): the prefill is the price of the same plan generating one
    token, the decode passes the rest."""
    job = plan.job
    assert isinstance(job, PredictJob) and plan.predicted is not None
    ov = dataclasses.replace(
        plan.overrides or PlanOverrides(), concurrent_seqs=plan.concurrent_seqs,
        prefetch_depth=plan.placement.prefetch_depth,
    )  # fmt: skip
    one = make_plan(plan.model, plan.hardware, dataclasses.replace(job, new_tokens=1), overrides=ov)
    assert one.predicted is not None
    pre = job.num_prompts / one.tokens_per_s  # one token per prompt: the job's prefill
    return pre, job.num_prompts * job.new_tokens / plan.tokens_per_s - pre


class _PageWaits(pl.Callback):
    """Starts the weights-only engine's phase timer when predict begins."""

    def on_predict_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        engine = getattr(trainer.strategy, "inference", None)
        if engine is not None:
            engine.timer.begin_step()


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
    quiet()
    base = nvme_base(args.nvme_dir)
    print(machine(base))
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    print(f"host allocator keeps freed memory (all runs): {keep_host_allocations()}")
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
        del model  # every run loads the checkpoint in a child process of its own
        print(
            f"model: llama {params / 1e6:.0f}M parameters, bf16 checkpoint {ckpt}, "
            f"{args.dtype} compute"
        )
        print(
            f"job: {args.prompts} prompts x {args.prompt_len} tokens, {args.new_tokens} new "
            "tokens each, greedy"
        )
        with busy_neighbour(args.busy_probe) as core:
            if core is not None:
                print(f"busy neighbour: a process spins on core {core} during the probes and plan")
            matmul_hw = _memory(
                args, measure(nvme_path=str(base), max_seconds=args.measure_seconds)
            )
            hw = _probed(args, config, matmul_hw)
            plan = _plan(args, config, hw)
        if core is not None:
            print("busy neighbour stopped: the runs below have the cores to themselves")
        print(f"this process holds {gib(trim_heap())} during the runs (heap trimmed)")
        print(plan.explain())
        batch = plan.concurrent_seqs
        prompts = _prompts(args)
        ours, ours_tokens, phases = isolated(
            _ours, args, ckpt, work / "nvme", prompts, plan, args.dtype
        )
        print(f"[ours] NVMe weights, batch {batch}: {ours:.1f} tokens/s")
        figures: dict[str, Any] = {"dtype": args.dtype, "batch": batch, "ours_tokens_per_s": ours}
        figures.update(phases)
        for key, label, p in (
            ("matrix_probe_measured_over_predicted", "matrix-product probe",
             _plan(args, config, matmul_hw)),
            ("measured_over_predicted", "model-shaped probe", plan),
        ):  # fmt: skip
            print(f"[plan] predicted ({label}): {p.tokens_per_s:.1f} tokens/s; measured / "
                  f"predicted = {ours / p.tokens_per_s:.2f}")  # fmt: skip
            figures[key] = ours / p.tokens_per_s

        if args.ram_batch:
            figures.update(_ram_batch_run(args, config, hw, ckpt, work / "nvme-ram", prompts, ours))
        hf: dict[int, float] = {}
        same_shape: list[list[int]] | None = None
        cap = args.hf_max_batches
        for b in sorted({*_batches(args.hf_batches), batch}):
            hf[b], tokens = isolated(_hf_run, ckpt, args.dtype, prompts, b, args.new_tokens, cap)
            part = f" (first {len(tokens)} prompts)" if len(tokens) < len(prompts) else ""
            print(f"[hf generate] in memory, batch {b}: {hf[b]:.1f} tokens/s{part}")
            if b == batch:
                same_shape = tokens
        tried = [b for b in hf if b in _batches(args.hf_batches)] or list(hf)
        best_hf = max(tried, key=lambda b: hf[b])
        print(f"ratio ours / hf generate (best, batch {best_hf}) = {ours / hf[best_hf]:.2f}")
        figures["generate_tokens_per_s"] = {str(b): v for b, v in hf.items()}
        figures["over_generate"] = ours / hf[best_hf]
        assert same_shape is not None
        share = _same(ours_tokens[: len(same_shape)], same_shape)
        print(f"identical sequences vs in-memory generate at batch {batch} ({args.dtype}): "
              f"{share:.1%} of {len(same_shape)}")  # fmt: skip
        figures["identical_share"] = share
        if args.dtype != "fp32":
            figures["identical_share_fp32"] = _fp32_check(
                args, config, hw, ckpt, work / "nvme32", prompts
            )

        best_cold = 0.0
        for cold in (True, False):
            acc = _accelerate(args, ckpt, work / "offload", prompts, cold=cold)
            if acc:
                best_acc = max(acc, key=lambda b: acc[b])
                best_cold = best_cold or acc[best_acc]
                print(f"ratio ours / accelerate disk offload ({'cold' if cold else 'warm'} page "
                      f"cache; best, batch {best_acc}) = {ours / acc[best_acc]:.2f}")  # fmt: skip
                figures[f"over_accelerate_{'cold' if cold else 'warm'}"] = ours / acc[best_acc]
        floor = _floor(args, config, matmul_hw, ours, best_cold)
        figures.update(floor_tokens_per_s=floor, floor_share=ours / floor)
        rows = ((plan.micro_batch or 1) * args.prompt_len, batch)
        figures["shape_bound_share"] = _shape_bound(args, config, matmul_hw, rows, ours, floor)
        figures["floor_over_accelerate_cold"] = floor / best_cold if best_cold else None
        write_figures(args.json, "predict_offload", figures)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(
        "load average at the end (1/5/15 min): " + " / ".join(f"{x:.2f}" for x in os.getloadavg())
    )


def _probed(args: argparse.Namespace, config: LlamaConfig, hw: HardwareProfile) -> HardwareProfile:
    """``hw`` with the prefill and decode rates of the model's own passes at the plan's batch."""
    rows = args.batch or _plan(args, config, hw).concurrent_seqs
    job = _job(args)
    probe = probe_predict_compute(
        config, hw, prompt_len=args.prompt_len, concurrent=rows,
        cache_len=job.cache_len, context=job.mean_context, dtype=DTYPES[args.dtype],
    )  # fmt: skip
    if probe is None:
        print("[plan] model too large for the predict probe: planning at the matrix-product rate")
        return hw
    print(f"[plan] {probe.describe(hw)}")
    return probe.applied_to(hw)


def _floor(
    args: argparse.Namespace, config: LlamaConfig, hw: HardwareProfile, ours: float, acc: float
) -> float:
    """The fastest any schedule can be that reads every block's weights from NVMe each pass
    (tokens/s, printed beside ``ours`` and Accelerate's best ``acc``).

    The sequences whose prefill ends last still need ``new_tokens - 1`` decode passes
    after it, with no prefill left to hide their weight reads behind: those passes take
    at least their reads of the checkpoint's bf16 weights at the NVMe probe's rate.
    Before them, all prefill runs: at least its FLOPs at the matrix-product rate of the
    compute dtype (the hardware probe's bf16 rate; in fp32 the fastest fp32 product,
    :func:`_product_rate`). Nor can the whole job take less than all its block FLOPs,
    prefill and decode, at that rate.
    """
    model = model_profile_from_config(config)
    head = model.head_flops_per_token()
    job = _job(args)
    dtype = DTYPES[args.dtype]
    rate = hw.device_flops if dtype == torch.bfloat16 else _product_rate(dtype)
    prefill_flops = (
        args.prompts
        * args.prompt_len
        * (cost.forward_flops_per_token(model, args.prompt_len) - head)
    )
    decode_flops = (
        args.prompts
        * (args.new_tokens - 1)
        * (cost.forward_flops_per_token(model, job.mean_context) - head)
    )
    prefill = prefill_flops / rate
    pass_bytes = model.num_blocks * model.block_params * 2  # the checkpoint's bf16 weights
    decode = (args.new_tokens - 1) * pass_bytes / hw.nvme_read_bandwidth
    compute = (prefill_flops + decode_flops) / rate
    floor = max(prefill + decode, compute)
    best = args.prompts * args.new_tokens / floor
    print(
        f"[floor] any schedule reading the weights from NVMe each pass: prefill >= "
        f"{prefill:.1f} s (its block FLOPs at {rate / 1e12:.3g} TFLOP/s in {args.dtype}) + "
        f"{args.new_tokens - 1} decode passes after it >= {decode:.1f} s "
        f"({pass_bytes / 1e6:.0f} MB each at {hw.nvme_read_bandwidth / 1e9:.2f} GB/s) = "
        f"{prefill + decode:.1f} s; all block FLOPs >= {compute:.1f} s -> at most "
        f"{best:.1f} tokens/s; ours reaches {ours / best:.0%} of it"
    )
    if acc > 0:
        print(f"[floor] = {best / acc:.2f} x Accelerate's best (cold page cache); "
              f"3 x would need {3 * acc:.1f} tokens/s")  # fmt: skip
    return best


def _shape_bound(
    args: argparse.Namespace, config: LlamaConfig, hw: HardwareProfile, rows: tuple[int, int],
    ours: float, floor: float,
) -> float:  # fmt: skip
    """The share of the ``floor`` (tokens/s) a run can reach whose blocks take no time beyond
    their projections' products at the rates of the model's own shapes, printed beside
    ``ours``: each block's products (``[rows, in] x [in, out]`` in the compute dtype) timed at
    the prefill chunk's rows and at the decode pass's (``rows``), best of six, on four
    weights of each shape in turn, as the engine runs them (a bf16 prefill in more than one
    chunk on weights laid out once, :mod:`~bb_lightning.engine.host_packed`; else
    ``F.linear``); a decode pass takes at least its reads of
    the weights at the NVMe probe's rate, as in :func:`_floor`. The floor prices every FLOP
    at the fastest square product's rate; the model's shapes run below it, the decode's few
    rows most."""
    heads, kv = config.num_attention_heads, config.num_key_value_heads
    head_dim = config.hidden_size // heads
    h, f = config.hidden_size, config.intermediate_size
    shapes = [(h, heads * head_dim), (h, kv * head_dim), (h, kv * head_dim),
              (heads * head_dim, h), (h, f), (h, f), (f, h)]  # fmt: skip
    dtype = DTYPES[args.dtype]
    chunked = args.prompts * args.prompt_len > rows[0]  # the prefill's weights laid out once
    packed = chunked and dtype == torch.bfloat16 and host_packed.available()
    seconds, rates = [], []
    for n, pack in ((rows[0], packed), (rows[1], False)):
        per_row = 0.0
        for k, m in shapes:
            x = torch.randn(n, k, dtype=dtype)
            ws = [torch.randn(m, k, dtype=dtype) for _ in range(4)]
            calls = [
                partial(host_packed.packed_product, x, host_packed.pack_weight(w, n), None)
                if pack
                else partial(torch.nn.functional.linear, x, w)
                for w in ws
            ]
            for call in calls:
                call()
            best = float("inf")
            for _ in range(6):
                start = time.perf_counter()
                for call in calls:
                    call()
                best = min(best, (time.perf_counter() - start) / len(calls))
            per_row += best / n
        flops = 2 * sum(k * m for k, m in shapes)
        rates.append(flops / per_row)
        seconds.append(per_row * config.num_hidden_layers)
    prefill = seconds[0] * args.prompts * args.prompt_len
    model = model_profile_from_config(config)
    reads = model.num_blocks * model.block_params * 2 / hw.nvme_read_bandwidth
    passes = args.new_tokens - 1  # every prompt's products; the last batch's reads
    decode = max(passes * seconds[1] * args.prompts, passes * reads)
    share = args.prompts * args.new_tokens / (prefill + decode) / floor
    print(
        f"[bound] the blocks' products alone at the model's shapes: prefill {prefill:.1f} s "
        f"({rates[0] / 1e12:.3g} TFLOP/s at {rows[0]} rows{', packed' if packed else ''}) + "
        f"decode {decode:.1f} s "
        f"({rates[1] / 1e12:.3g} TFLOP/s at {rows[1]} rows; a pass >= its {reads:.3f} s of "
        f"reads) = {prefill + decode:.3g} s: "
        f"{share:.0%} of the floor with nothing else in the blocks; ours "
        f"{args.prompts * args.new_tokens / ours:.1f} s"
    )
    return share


def _product_rate(dtype: torch.dtype, sizes: tuple[int, ...] = (1024, 2048, 4096)) -> float:
    """FLOP/s of the fastest ``n``-square product in ``dtype`` over ``sizes`` (the sizes of
    the hardware probe's bf16 products; :func:`~bb_lightning.probe.calibrate.product_rate`
    each). A 1024-square fp32 product runs well below what a model's larger ones sustain."""
    return max(product_rate(dtype, torch.device("cpu"), n) for n in sizes)


def _job(args: argparse.Namespace) -> PredictJob:
    return PredictJob(
        prompt_len=args.prompt_len,
        new_tokens=args.new_tokens,
        num_prompts=args.prompts,
        compute_dtype=str(DTYPES[args.dtype]).removeprefix("torch."),
    )


def _plan(args: argparse.Namespace, config: LlamaConfig, hw: HardwareProfile) -> Plan:
    """The predict plan with every block's weights on the NVMe tier (``--batch`` forced;
    ``--decode-attention host``: the KV cache on the host, attended there)."""
    ov = PlanOverrides(
        weights_tier=Tier.NVME,
        concurrent_seqs=args.batch,
        prefetch_depth=args.prefetch,
        decode_attention=Tier.HOST if args.decode_attention == "host" else None,
    )
    return make_plan(model_profile_from_config(config), hw, _job(args), overrides=ov)


def _memory(args: argparse.Namespace, hw: HardwareProfile) -> HardwareProfile:
    """``hw`` with ``--host-memory-gib`` / ``--device-memory-gib`` where given (bytes the
    planner spends less its margins; on a CPU device the two are one RAM pool)."""
    changes = {
        field: int(gib_ * (1 << 30))
        for field, gib_ in (
            ("host_memory", args.host_memory_gib),
            ("device_memory", args.device_memory_gib),
        )
        if gib_ is not None
    }
    if changes:
        print(
            "planning with "
            + ", ".join(
                f"{k.replace('_', ' ')} {v / (1 << 30):.2f} GiB" for k, v in changes.items()
            )
        )
    return hw.replace(**changes)


def _ram_batch_run(
    args: argparse.Namespace,
    config: LlamaConfig,
    hw: HardwareProfile,
    ckpt: Path,
    nvme: Path,
    prompts: torch.Tensor,
    spilled: float,
) -> dict[str, Any]:
    """Ours at the largest batch below the plan's whose KV cache the plan keeps in host
    memory (no block's cache on NVMe), against the run at the plan's batch (``spilled``
    tokens/s); its figures, keyed ``ram_batch_*``."""
    batch = _plan(args, config, hw).concurrent_seqs
    plan = None
    for rows in range(batch - 1, 0, -1):
        sub = argparse.Namespace(**{**vars(args), "batch": rows})
        plan = _plan(sub, config, hw)
        if plan.placement.kv_cache_nvme_blocks == 0:
            break
    if plan is None or plan.placement.kv_cache_nvme_blocks:
        print("[ram batch] no smaller batch keeps the whole KV cache in memory")
        return {}
    print(plan.explain())
    sub = argparse.Namespace(**{**vars(args), "batch": plan.concurrent_seqs})
    tok_s, _, _ = isolated(_ours, sub, ckpt, nvme, prompts, plan, args.dtype)
    print(
        f"[ram batch] batch {plan.concurrent_seqs}, KV cache in memory: {tok_s:.1f} tokens/s; "
        f"predicted {plan.tokens_per_s:.1f}, measured / predicted = "
        f"{tok_s / plan.tokens_per_s:.2f}; the plan's batch {batch} with the cache spilled / "
        f"this = {spilled / tok_s:.2f}"
    )
    return {
        "ram_batch": plan.concurrent_seqs,
        "ram_batch_tokens_per_s": tok_s,
        "ram_batch_measured_over_predicted": tok_s / plan.tokens_per_s,
        "spilled_over_ram_batch": spilled / tok_s,
    }


def _fp32_check(
    args: argparse.Namespace,
    config: LlamaConfig,
    hw: HardwareProfile,
    ckpt: Path,
    nvme: Path,
    prompts: torch.Tensor,
) -> float | None:
    """Share of identical sequences against in-memory generate, both in fp32 (None: none
    compared)."""
    n = min(args.check_prompts, len(prompts))
    if n < 1:
        return None
    sub = argparse.Namespace(**{**vars(args), "prompts": n, "batch": None, "dtype": "fp32"})
    plan = _plan(sub, config, hw)
    _, ours, _ = isolated(_ours, sub, ckpt, nvme, prompts[:n], plan, "fp32", False)
    _, ref = isolated(_hf_run, ckpt, "fp32", prompts[:n], plan.concurrent_seqs, args.new_tokens)
    share = _same(ours, ref)
    print(f"identical sequences vs in-memory generate at batch {plan.concurrent_seqs} (fp32): "
          f"{share:.1%} of {n}")  # fmt: skip
    return share


def _evicting(folder: Path) -> Any:
    """A forward pre-hook dropping every file under ``folder`` from the page cache."""
    files = sorted(p for p in folder.rglob("*") if p.is_file())

    def hook(*_: Any) -> None:
        for f in files:
            drop_cache(f)

    return hook


def _accelerate(
    args: argparse.Namespace, ckpt: Path, folder: Path, prompts: torch.Tensor, *, cold: bool
) -> dict[int, float]:
    """Accelerate disk offload tokens/s per batch size.

    ``cold``: the offload folder's pages are dropped from the page cache before every
    forward, so each weight pass reads the disk, as it does when the model is larger
    than RAM (and as our NVMe tier, which reads with ``O_DIRECT``, always does). Warm,
    this 0.7 GB model stays in the page cache after the first pass: the weights then
    come from RAM, not from the disk.
    """
    out: dict[int, float] = {}
    label = "cold page cache" if cold else "warm page cache"
    for b in _batches(args.acc_batches):
        out[b], done = isolated(_accelerate_run, args, ckpt, folder, prompts, b, cold)
        part = f" (rate over the first {done} prompts)" if done < len(prompts) else ""
        print(f"[accelerate] disk offload ({label}), batch {b}: {out[b]:.1f} tokens/s{part}")
        shutil.rmtree(folder, ignore_errors=True)
    return out


def _accelerate_run(
    args: argparse.Namespace,
    ckpt: Path,
    folder: Path,
    prompts: torch.Tensor,
    batch: int,
    cold: bool,
) -> tuple[float, int]:
    """(tokens/s, prompts generated) of Accelerate's disk offload at ``batch``; run it
    through :func:`~_common.isolated`, a child process of its own."""
    from accelerate import disk_offload

    quiet()
    keep_host_allocations()
    model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=DTYPES[args.dtype]).eval()
    disk_offload(model, offload_dir=str(folder), execution_device=torch.device("cpu"))
    if cold:
        model.register_forward_pre_hook(_evicting(folder))
    rate, tokens = hf_generate(model, prompts, batch, args.new_tokens, args.acc_max_batches)
    return rate, len(tokens)


if __name__ == "__main__":
    main()
