"""Offloaded training throughput: ``balance_beam`` against plain Lightning, same run.

A Llama-shaped model (default about 370M parameters: hidden 1024, 24 layers,
ffn 2816, 16 heads, vocab 32000) with random weights from its config trains on
random tokens, bf16 compute (``--dtype fp32`` for a CPU without bf16 matrix
instructions), sequence 512, with AdamW:

1. plain Lightning: ``Trainer(accelerator="cpu", precision="bf16-true")``, everything
   in memory, torch AdamW;
2. ``balance_beam`` with the same micro-batch and accumulation: a quarter of the
   blocks (``--resident``, default 6 of 24) resident on the device tier, the other
   blocks' bf16 weights homed on the host (or NVMe with ``--weights-on-nvme``), every
   block's fp32 master weights and AdamW moments on NVMe (``--nvme-dir``, a real disk);
3. ``balance_beam`` at the micro-batch, accumulation and placement the planner
   recommends for a global batch of ``--plan-global-seqs`` sequences (default: the
   same as 1 and 2), optimizer state on NVMe (and the blocks' weights, with
   ``--weights-on-nvme``).

In bf16 on a CPU with matrix tiles or AVX-512's bf16 products, one more plain run after 1 and 2 computes its attention's
and RMS norms' backward as balance_beam does (:func:`~bb_lightning.engine.train_kernels.
install`, faster than torch's): the step is printed against its forward + backward
too, the floor with balance_beam's own kernels beside the one with plain Lightning's.

With ``--peer deepspeed`` a further run, last: DeepSpeed ZeRO-3 on the same
model, micro-batch, accumulation and data, parameters offloaded to the CPU (to NVMe
with ``--weights-on-nvme``) and the optimizer state to NVMe (see ``bench/_deepspeed.py``;
needs the ``bench`` extra and libaio; skipped with a line saying why where it cannot run),
printing balance_beam / DeepSpeed. With ``--busy-probe`` a process spins on one core
while the hardware and model-shaped probes run and the plan is made, and stops before
the runs: measured / predicted then says whether the plan survives a busy neighbour
during the probe.

Each run takes ``--warmup`` optimizer steps, then ``--steps`` timed ones. Printed:
trained tokens/s of each (tokens = micro-batch x sequence x accumulation per step),
the ratio balance_beam / plain (target >= 0.95), the planner's predicted step time
next to the measured one (target within +-25%) from the hardware probe with the
model-shaped compute probe (what the strategy plans with at the start of fit) and from
the compute rate the plain run sustained in this same benchmark, and where each step's time went
(forward, backward, gradient hand-off, optimizer; link busy times of the store).
Every run trains in a child process of its own (``_common.isolated``), as a user's job
does, so that the comparison does not depend on the order of the runs (in one process,
an earlier run's heap and page faults moved the next one's step time by 10-25 % on the
2-core VMs), and every run gets the same host allocator setting,
:func:`~bb_lightning.engine.inference.keep_host_allocations` (which ``balance_beam``
applies on a CPU device).
With ``--repeat R`` runs 1 and 2 alternate R times (plain, balance_beam, plain, ...) and
the ratios take each side's fastest run (a busy neighbour on a shared machine only ever
slows a run down), with each alternating pair's ratio printed beside them; the planner's
own micro-batch (run 3) then runs R times too, its fastest run taken alike.

    .venv/bin/python bench/train_offload.py [--steps 3] [--warmup 3] [--micro-batch 1]
        [--accumulate 4] [--layers 24] [--hidden 1024] [--weights-on-nvme] [--nvme-dir D]
        [--peer deepspeed] [--busy-probe] [--repeat 1]
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import pstats
import tempfile
import time
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import _common
import lightning.pytorch as pl
import psutil
import torch

from bb_lightning import BalanceBeamStrategy
from bb_lightning.engine import host_linear, train_kernels
from bb_lightning.engine.inference import keep_host_allocations
from bb_lightning.module import CausalLMModule
from bb_lightning.placement import Placement
from bb_lightning.planner import (
    FitJob,
    HardwareProfile,
    ModelProfile,
    Plan,
    PlanOverrides,
    cost,
    make_plan,
)
from bb_lightning.planner.plan import placement_tiers
from bb_lightning.probe import measure, model_profile_from_config
from bb_lightning.probe.calibrate import probe_train_compute
from storage.tiers import Tier

SEED = 0


@dataclass
class Result:
    """One timed run."""

    name: str
    tokens_per_s: float
    """Trained tokens per second over the timed steps."""
    step_s: float
    """Mean seconds per optimizer step."""
    phases: str
    """Where each step's time went."""
    micro_batch: int
    accumulate: int
    links: str = ""
    """Store link traffic over the whole run (balance_beam only)."""
    forward_backward_s: float = 0.0
    """Mean seconds per optimizer step spent in forward and backward (0: not timed)."""


def train(
    args: argparse.Namespace,
    config: dict[str, Any],
    name: str,
    strategy: Any,
    micro_batch: int,
    accumulate: int,
) -> Result:
    """Fit ``--warmup + --steps`` optimizer steps; time the last ``--steps`` (as
    :data:`SAME_KERNELS`, plain, with balance_beam's host kernels over the module)."""
    torch.manual_seed(SEED)
    module = CausalLMModule(config, learning_rate=1e-4, seed=SEED)
    timer = _common.StepTimer()
    steps = args.warmup + args.steps
    trainer = _common.quiet_trainer(
        strategy,
        steps=steps,
        accumulate=accumulate,
        callbacks=[timer, _HostKernels()] if name == SAME_KERNELS else [timer],
        precision=PRECISION[args.dtype],
    )
    data = _common.token_loader(micro_batch, steps * accumulate, args.seq, args.vocab)
    profiler = cProfile.Profile() if args.profile else None
    start = time.perf_counter()
    if profiler is not None:
        profiler.enable()
    trainer.fit(module, data)
    if profiler is not None:
        profiler.disable()
    wall = time.perf_counter() - start
    tokens = micro_batch * args.seq * accumulate
    timed = timer.timed(args.warmup)
    tps, step_s, phases = _common.summarize(timed, tokens)
    fwd_bwd = sum(r.phases["forward"] + r.phases["backward"] for r in timed) / len(timed)
    links = ""
    if isinstance(strategy, BalanceBeamStrategy) and strategy.store is not None:
        parts = []
        for link, s in strategy.store.stats().items():
            if s.count:
                parts.append(
                    f"{link} {s.bytes / 1e9:.2f} GB in {s.seconds:.1f} s busy "
                    f"({s.bandwidth / 1e9:.2f} GB/s)"
                )
        links = f"store traffic over all {steps} steps: " + "; ".join(parts)
        strategy.close()
    print(
        f"[{name}] micro-batch {micro_batch} x accumulation {accumulate} x seq {args.seq}: "
        f"{tps:.1f} tokens/s, {step_s:.2f} s/step (fit wall {wall:.1f} s incl. setup), "
        f"RSS now {_common.gib(psutil.Process().memory_info().rss)}",
        flush=True,
    )
    print(f"[{name}] per step: {phases}", flush=True)
    if links:
        print(f"[{name}] {links}", flush=True)
    if profiler is not None:
        print(f"[{name}] cProfile (main thread), top {args.profile} by own time:")
        pstats.Stats(profiler).sort_stats("tottime").print_stats(args.profile)
    del trainer, module
    gc.collect()
    return Result(name, tps, step_s, phases, micro_batch, accumulate, links, fwd_bwd)


def train_alone(
    args: argparse.Namespace,
    config: dict[str, Any],
    name: str,
    placement: Placement | None,
    base: Path,
    micro_batch: int | None = None,
    accumulate: int | None = None,
) -> Result:
    """:func:`train` in a child process of its own (``_common.isolated``): plain Lightning
    with ``placement`` None, else balance_beam with that placement and its NVMe tier in a
    fresh directory under ``base``; at ``--micro-batch`` x ``--accumulate`` unless given."""
    return _common.isolated(
        _train_child,
        args,
        config,
        name,
        placement,
        base,
        args.micro_batch if micro_batch is None else micro_batch,
        args.accumulate if accumulate is None else accumulate,
    )


def _train_child(
    args: argparse.Namespace,
    config: dict[str, Any],
    name: str,
    placement: Placement | None,
    base: Path,
    micro_batch: int,
    accumulate: int,
) -> Result:
    keep_host_allocations()
    _common.quiet()
    if placement is None:  # plain Lightning
        return train(args, config, name, "auto", micro_batch, accumulate)
    with tempfile.TemporaryDirectory(prefix="run-", dir=base) as run_dir:
        strategy = strategy_for(args, placement, Path(run_dir))
        return train(args, config, name, strategy, micro_batch, accumulate)


SAME_KERNELS = "plain, balance_beam's backward kernels"
"""The name of the plain run whose attention's and RMS norms' backward are balance_beam's
(:func:`~bb_lightning.engine.train_kernels.install`): its forward + backward is the
floor of an offloading schedule with balance_beam's own kernels."""


class _HostKernels(pl.Callback):
    """balance_beam's kernels with their own backward over a plain run's module, from the
    start of its fit (the model built) to the end."""

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.restore = train_kernels.install(torch.device("cpu"), pl_module)

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.restore()


DTYPES = {"bf16": "bfloat16", "fp32": "float32"}
"""``--dtype`` choices and the compute dtype each names."""
PRECISION = {"bf16": "bf16-true", "fp32": "32-true"}
"""The plain Trainer's precision for each ``--dtype``."""


def offload_tiers(args: argparse.Namespace) -> tuple[Tier, Tier]:
    """(home of the non-resident blocks' weights, home of the optimizer state)."""
    return (Tier.NVME if args.weights_on_nvme else Tier.HOST), Tier.NVME


def strategy_for(args: argparse.Namespace, placement: Placement, run_dir: Path) -> Any:
    """A balance_beam strategy with ``placement``, its NVMe tier under ``run_dir``."""
    return BalanceBeamStrategy(
        placement=placement, nvme_path=str(run_dir), compute_dtype=args.dtype
    )


def forced_plan(
    args: argparse.Namespace, model: ModelProfile, hw: HardwareProfile
) -> tuple[Plan, Placement]:
    """The planner's prediction for the forced configuration, and that placement.

    ``resident_blocks`` blocks stay on the device and the others are homed on the
    weights tier; the gradient accumulators go where the plan puts them, and the run
    recomputes exactly the blocks the plan priced as recomputed and swaps those it priced
    as swapped (on a CPU device the host-homed blocks are used in place and keep their
    activations, and the NVMe-homed ones, paged in by copy, keep theirs while their
    weights are paged out: swapped).
    """
    weights, master = offload_tiers(args)
    overrides = PlanOverrides(
        micro_batch=args.micro_batch,
        grad_accum=args.accumulate,
        resident_blocks=args.resident,
        weights_tier=weights,
        master_tier=master,
        prefetch_depth=args.prefetch,
    )
    job = FitJob(
        seq_len=args.seq,
        global_batch_seqs=args.micro_batch * args.accumulate,
        compute_dtype=DTYPES[args.dtype],
    )
    plan = make_plan(model, hw, job, overrides=overrides)
    n = args.layers
    placement = Placement(
        weights=placement_tiers(n, args.resident, n - args.resident if weights is Tier.HOST else 0),
        master=(master,) * n,
        prefetch_depth=args.prefetch,
        grads=plan.grads,
        read_ahead=plan.read_ahead,
        recomputed=plan.recomputed_blocks(),
        swapped=plan.placement.swapped,
        hold_grads=plan.placement.hold_grads,
    )
    if plan.weights != placement.weights:
        print(
            "note: the planner homes the paged blocks on "
            + ", ".join(sorted({t.value for t in plan.weights if t is not Tier.DEVICE}))
            + f", the run on {weights.value}: its prediction is for its own placement"
        )
    return plan, placement


def recommended_plan(
    args: argparse.Namespace, model: ModelProfile, hw: HardwareProfile
) -> tuple[Plan, Placement]:
    """The planner's micro-batch, accumulation, placement, checkpointing and prefetch
    (optimizer state on NVMe, as in run 2; with ``--weights-on-nvme`` the blocks' weights
    homed on NVMe too)."""
    weights, master = offload_tiers(args)
    ram = psutil.virtual_memory().available
    job = FitJob(
        seq_len=args.seq, global_batch_seqs=args.plan_global_seqs, compute_dtype=DTYPES[args.dtype]
    )
    nvme = weights if weights is Tier.NVME else None
    overrides = PlanOverrides(master_tier=master, weights_tier=nvme)
    plan = make_plan(model, hw, job, overrides=overrides)
    used = sum(m.used for m in plan.memory if m.tier is not Tier.NVME)
    if plan.micro_batch > args.max_micro_batch or used > ram:
        cap = min(args.max_micro_batch, plan.micro_batch // 2 if used > ram else plan.micro_batch)
        print(f"capping the planner's micro-batch {plan.micro_batch} to {cap} (RAM / option)")
        overrides = PlanOverrides(micro_batch=max(1, cap), master_tier=master, weights_tier=nvme)
        plan = make_plan(model, hw, job, overrides=overrides)
    return plan, plan.placement


def calibrated(
    args: argparse.Namespace, model: ModelProfile, hw: HardwareProfile, plain: Result
) -> HardwareProfile:
    """``hw`` with its compute efficiency taken from the plain run of this same process
    (the one with balance_beam's backward kernels where there is one).

    The probe times bare matrix products; a training step also runs attention,
    norms, activations and the loss, and on a shared machine other processes take
    cores. The plain run's forward and backward (no offload, no recompute: ``6N`` FLOPs
    per token plus attention) measure what the device sustains now, as the strategy's
    own ``adapt`` does after warm-up; the offloaded run is then predicted from it. Its
    optimizer step is left out: that is plain Lightning's own AdamW (the plan prices
    balance_beam's), not compute the offloaded run repeats.
    """
    tokens = plain.micro_batch * plain.accumulate * args.seq
    flops = tokens * cost.train_flops_per_token(model, args.seq, False)
    seconds = plain.forward_backward_s or plain.step_s
    efficiency = flops / (hw.device_flops * seconds)
    print(
        f"calibration: the {plain.name} run's forward + backward sustained "
        f"{flops / seconds / 1e12:.3f} TFLOP/s = "
        f"{efficiency:.2f} x the probe's {hw.device_flops / 1e12:.3f} TFLOP/s"
    )
    return hw.replace(compute_efficiency=efficiency)


def deepspeed_run(args: argparse.Namespace, config: dict[str, Any], base: Path) -> Result | None:
    """The DeepSpeed ZeRO-3 offload peer (see ``bench/_deepspeed.py``); None, said in one line,
    where it cannot run here."""
    import _deepspeed

    why = _deepspeed.unavailable()
    if why is not None:
        print(f"[deepspeed] skipped: {why}", flush=True)
        return None
    loader = _common.token_loader(
        args.micro_batch, (args.warmup + args.steps) * args.accumulate, args.seq, args.vocab
    )
    batches = [batch["input_ids"] for batch in loader]
    where = "NVMe" if args.weights_on_nvme else "CPU"
    with tempfile.TemporaryDirectory(prefix="ds-", dir=base) as run_dir:
        seconds, on_disk = _deepspeed.train_deepspeed(
            config, batches, micro_batch=args.micro_batch, accumulate=args.accumulate,
            warmup=args.warmup, nvme_dir=Path(run_dir), weights_on_nvme=args.weights_on_nvme,
            seed=SEED, dtype=getattr(torch, DTYPES[args.dtype]),
        )  # fmt: skip
    step_s = sum(seconds) / len(seconds)
    tps = args.micro_batch * args.seq * args.accumulate / step_s
    print(
        f"[deepspeed] ZeRO-3, parameters on {where}, optimizer state on NVMe, micro-batch "
        f"{args.micro_batch} x accumulation {args.accumulate} x seq {args.seq}: {tps:.1f} "
        f"tokens/s, {step_s:.2f} s/step; its NVMe swap files {on_disk / 1e6:.1f} MB; RSS now "
        f"{_common.gib(psutil.Process().memory_info().rss)}",
        flush=True,
    )
    return Result("deepspeed", tps, step_s, "", args.micro_batch, args.accumulate)


def predicted_line(name: str, plan: Plan, result: Result) -> str:
    """Predicted against measured step time, with the ratio."""
    p = plan.predicted
    return (
        f"[{name}] planner predicted {p.total:.2f} s/step (compute {p.compute:.2f} s, exposed "
        f"{p.exposed:.2f} s, optimizer busy {p.optimizer:.2f} s, bottleneck {p.bottleneck}); "
        f"measured {result.step_s:.2f} s/step; measured / predicted = "
        f"{result.step_s / p.total:.2f} (target 0.75-1.25)"
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=3, help="timed optimizer steps")
    parser.add_argument("--warmup", type=int, default=3, help="untimed optimizer steps first")
    parser.add_argument("--micro-batch", type=int, default=1, help="sequences per pass")
    parser.add_argument("--accumulate", type=int, default=4, help="micro-batches per step")
    parser.add_argument("--seq", type=int, default=512, help="tokens per sequence")
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--ffn", type=int, default=2816)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--resident", type=int, default=None, help="blocks kept on the device")
    parser.add_argument("--prefetch", type=int, default=1, help="prefetch depth (blocks)")
    parser.add_argument("--weights-on-nvme", action="store_true", help="page weights from NVMe")
    parser.add_argument("--nvme-dir", default=None, help="directory on the disk under test")
    parser.add_argument(
        "--plan-global-seqs",
        type=int,
        default=None,
        help="global batch (sequences) the planner splits; default micro-batch x accumulate",
    )
    parser.add_argument("--max-micro-batch", type=int, default=8, help="cap on the planner's")
    parser.add_argument("--measure-seconds", type=float, default=20.0, help="hardware probe")
    parser.add_argument("--skip-recommended", action="store_true", help="only runs 1 and 2")
    parser.add_argument("--profile", type=int, default=0, help="print top N cProfile rows")
    parser.add_argument(
        "--repeat",
        type=int,
        default=1,
        help="alternate the plain and balance_beam runs this many times; ratios use each "
        "side's fastest run",
    )
    parser.add_argument(
        "--peer", choices=["deepspeed"], default=None, help="also run DeepSpeed ZeRO-3 offload"
    )
    parser.add_argument(
        "--busy-probe", action="store_true", help="a process spins on one core during the probes"
    )
    parser.add_argument(
        "--dtype",
        choices=sorted(DTYPES),
        default="bf16",
        help="compute dtype of every run (fp32 for a CPU without bf16 matrix instructions)",
    )
    parser.add_argument(
        "--json", default=None, help="also write the figures to this JSON file (cpu_check.py)"
    )
    args = parser.parse_args(argv)
    _common.quiet()
    if args.resident is None:
        args.resident = args.layers // 4
    if args.plan_global_seqs is None:
        args.plan_global_seqs = args.micro_batch * args.accumulate
    if not 0 <= args.resident <= args.layers:
        raise ValueError(f"--resident {args.resident} outside 0..{args.layers}: pass fewer")
    if args.steps < 1 or args.warmup < 0:
        raise ValueError(f"--steps {args.steps} must be >= 1 and --warmup {args.warmup} >= 0")
    if args.repeat < 1:
        raise ValueError(f"--repeat {args.repeat} must be >= 1 (alternating pairs of runs)")

    base = _common.nvme_base(args.nvme_dir)
    print(_common.machine(base), flush=True)
    print(f"host allocator keeps freed memory (all runs): {keep_host_allocations()}")
    print("each run below trains in a fresh child process of its own", flush=True)
    config = _common.llama_config(args)
    model = model_profile_from_config(config)
    print(
        f"model: Llama {model.total_params / 1e6:.0f}M params ({args.layers} x hidden "
        f"{args.hidden}, ffn {args.ffn}, {args.heads} heads, vocab {args.vocab}), seq {args.seq}, "
        f"{args.dtype} compute, AdamW; {args.warmup} warm-up + {args.steps} timed optimizer steps"
    )
    with _common.busy_neighbour(args.busy_probe) as core:
        if core is not None:
            print(f"busy neighbour: a process spins on core {core} during the probes and plan")
        hw = measure(nvme_path=str(base), max_seconds=args.measure_seconds)
        print(
            f"hardware profile: {hw.device_flops / 1e12:.2f} TFLOP/s, NVMe read "
            f"{hw.nvme_read_bandwidth / 1e9:.2f} / write {hw.nvme_write_bandwidth / 1e9:.2f} "
            f"GB/s, host AdamW {hw.host_adam_params_per_s / 1e6:.0f} M params/s, NVMe "
            f"transfers cost {hw.nvme_cpu_seconds_per_byte * 1e9:.3f} s of compute per GB",
            flush=True,
        )
        matmul_hw = hw
        probe = probe_train_compute(
            config,
            hw,
            seq_len=args.seq,
            micro_batch=args.micro_batch,
            dtype=getattr(torch, DTYPES[args.dtype]),
        )
        if probe is not None:
            print(probe.describe(hw), flush=True)
            hw = probe.applied_to(hw)
        plan, placement = forced_plan(args, model, hw)
    if core is not None:
        print("busy neighbour stopped: the runs below have the cores to themselves")
    print(f"this process holds {_common.gib(_common.trim_heap())} during the runs (heap trimmed)")
    weights, _ = offload_tiers(args)
    print(
        f"offloaded placement: {args.resident} of {args.layers} blocks resident, the other "
        f"{args.layers - args.resident} on {weights.value}, master + moments on NVMe "
        f"(read ahead through {placement.read_ahead} host buffer sets), prefetch depth "
        f"{args.prefetch}, {len(plan.recomputed_blocks())} blocks recomputed in backward, "
        f"{len(placement.swapped or ())} keeping their activations while their weights are "
        "paged out (swapped)",
        flush=True,
    )

    plains: list[Result] = []
    bbs: list[Result] = []
    for k in range(args.repeat):
        if args.repeat > 1:
            print(f"alternating runs: pair {k + 1} of {args.repeat}", flush=True)
        plains.append(train_alone(args, config, "plain", None, base))
        bbs.append(train_alone(args, config, "balance_beam", placement, base))
    same = None
    if args.dtype == "bf16" and host_linear.attention_kernel() is not None:
        same = train_alone(args, config, SAME_KERNELS, None, base)
    # each side's least disturbed run: a busy neighbour only ever slows a run down
    plain = min(plains, key=lambda r: r.step_s)
    bb = min(bbs, key=lambda r: r.step_s)
    results = {"plain": plain, "balance_beam": bb}
    # what the strategy predicts at the start of fit: the hardware probe with the
    # model-shaped compute probe; then, as adapt() does after warm-up, from a measured run
    print(predicted_line("balance_beam", plan, bb))
    figures: dict[str, Any] = {"measured_over_predicted": bb.step_s / plan.predicted.total}
    hw = calibrated(args, model, matmul_hw, same or plain)  # with the kernels balance_beam runs
    plan, _ = forced_plan(args, model, hw)
    print(predicted_line("balance_beam, calibrated", plan, bb))
    figures["calibrated_measured_over_predicted"] = bb.step_s / plan.predicted.total
    if not args.skip_recommended:
        rec_plan, rec_placement = recommended_plan(args, model, hw)
        print(rec_plan.explain())
        recs = [
            train_alone(
                args, config, "planned", rec_placement, base, rec_plan.micro_batch,
                rec_plan.grad_accum,
            )
            for _ in range(args.repeat)
        ]  # fmt: skip
        rec = min(recs, key=lambda r: r.step_s)  # taken as plain's and balance_beam's are
        results["planned"] = rec
        print(predicted_line("planned", rec_plan, rec))
        figures["planned_measured_over_predicted"] = rec.step_s / rec_plan.predicted.total

    if args.peer == "deepspeed":
        try:
            peer = _common.isolated(deepspeed_run, args, config, base)
        except BrokenProcessPool:
            print(
                "[deepspeed] its process was killed by the system (out of memory: a smaller "
                "--micro-batch needs less); no DeepSpeed ratio",
                flush=True,
            )
            peer = None
            figures["deepspeed_missing"] = "killed by the system (out of memory)"
        if peer is not None:
            results["deepspeed"] = peer
        else:
            figures.setdefault("deepspeed_missing", "skipped: see the [deepspeed] line")

    print("\nsummary (trained tokens/s):")
    for r in results.values():
        print(
            f"  {r.name:<13} micro-batch {r.micro_batch} x accum {r.accumulate}: "
            f"{r.tokens_per_s:9.1f} tokens/s  ({r.step_s:.2f} s/step)"
        )
    best = f", the fastest of {args.repeat} alternating runs each" if args.repeat > 1 else ""
    print(
        f"ratio balance_beam / plain = {bb.tokens_per_s / plain.tokens_per_s:.2f} "
        f"(target >= 0.95, same micro-batch and accumulation{best})"
    )
    if args.repeat > 1:
        pairs = ", ".join(
            f"{b.tokens_per_s / p.tokens_per_s:.2f}" for p, b in zip(plains, bbs, strict=True)
        )
        print(f"ratio balance_beam / plain of each alternating pair: {pairs}")
    # The compute floor: forward + backward of the in-memory run at the same shape, what an
    # offloading schedule reaches at best with these kernels (no optimizer, no copies); in bf16
    # on matrix tiles or AVX-512's bf16 products balance_beam's backward kernels are faster
    # than torch's, and the floor with them is printed after.
    floor = min(r.forward_backward_s for r in plains)
    print(
        f"[floor] plain Lightning's in-memory forward + backward at micro-batch "
        f"{plain.micro_batch} x accumulation {plain.accumulate}: {floor:.4g} s/step; "
        f"balance_beam step {bb.step_s:.4g} s / floor = {bb.step_s / floor:.3f} (target <= 1.05)"
    )
    if same is not None:
        print(
            f"[floor] with balance_beam's backward kernels (plain "
            f"Lightning otherwise): {same.forward_backward_s:.4g} s/step; balance_beam step / "
            f"it = {bb.step_s / same.forward_backward_s:.3f}"
        )
        figures["same_kernels_floor_s"] = same.forward_backward_s
        figures["step_over_same_kernels_floor"] = bb.step_s / same.forward_backward_s
    if "planned" in results:
        runs = f" (the fastest of {args.repeat} runs each)" if args.repeat > 1 else ""
        print(
            f"ratio planned / plain = {results['planned'].tokens_per_s / plain.tokens_per_s:.2f}"
            f"{runs}"
        )
    if "deepspeed" in results:
        where = "NVMe" if args.weights_on_nvme else "CPU"
        print(
            f"ratio balance_beam / DeepSpeed = {bb.tokens_per_s / results['deepspeed'].tokens_per_s:.2f} "
            f"(ZeRO-3, parameters on {where}, optimizer state on NVMe; same micro-batch and "
            "accumulation)"
        )
    figures.update(
        dtype=args.dtype,
        micro_batch=args.micro_batch,
        accumulate=args.accumulate,
        tokens_per_s={name: r.tokens_per_s for name, r in results.items()},
        step_s={name: r.step_s for name, r in results.items()},
        ratio_plain=bb.tokens_per_s / plain.tokens_per_s,
        pairs=[b.tokens_per_s / p.tokens_per_s for p, b in zip(plains, bbs, strict=True)],
        floor_s=floor,
        step_over_floor=bb.step_s / floor,
        planned_over_plain=(
            results["planned"].tokens_per_s / plain.tokens_per_s if "planned" in results else None
        ),
        over_deepspeed=(
            bb.tokens_per_s / results["deepspeed"].tokens_per_s if "deepspeed" in results else None
        ),
    )
    _common.write_figures(args.json, "train_offload", figures)


if __name__ == "__main__":
    main()
