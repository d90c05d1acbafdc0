"""Train a model whose training state exceeds this machine's RAM, within a host budget.

A Llama-shaped model (default hidden 2048, 24 layers, ffn 8192, vocab 32000: about
1.74B parameters, so weights + fp32 master + two fp32 moments + fp32 gradients
take about 16 bytes/param = 28 GB, more than 24 GiB of RAM) trains with
``Trainer(strategy="balance_beam", precision="bf16-true")``: every block's bf16
weights and its fp32 master weights and AdamW moments on NVMe (``--nvme-dir``),
the store's host arena capped at ``--host-budget-gib``. Printed: the peak resident
memory of the process by kind (RssAnon, RssShmem, RssFile of ``/proc/self/status``,
sampled every 50 ms) in each phase (setup, forward, backward, optimizer, teardown),
beside the store's own accounting sampled with it (its host and device arenas' slots, the
module's resident parameters, the RssAnon beyond the last two and the free bytes glibc's
heaps keep), the sampled peak and ``ru_maxrss`` against host budget + 2 GiB (pass /
fail), where that memory is expected to go, whether the module holds its trained weights
after fit, trained tokens/s and the time per step by phase.

Building the model (``--init``): ``checkpoint`` first writes random
weights (normal, std 0.02; norms 1) as a sharded safetensors checkpoint, one
block per shard, never holding more than one block; the module then builds the
model on the meta device and the strategy streams each tensor from the
checkpoint into its tier. ``module`` lets the module's ``configure_model`` build
the whole model under Lightning's bf16-true init context (2 bytes/param at once)
before the strategy copies each block into the store. ``auto`` (default) tries
``checkpoint`` and, when that fails, prints why and runs ``module``.

With ``--plan`` the placement is the planner's for the user's batch (``--micro-batch``
x ``--accumulate``): the machine's measured profile (the model's own training pass timed
at ``--probe-micro-batch`` sequences) with its memory cut to the budget (host memory whose
plannable 95 % is ``--host-budget-gib``, a device tier of 2 GiB: on a CPU device the two
are one RAM pool of host budget + 2 GiB, the RSS limit), weights and optimizer state on
NVMe; the recomputed blocks run the micro-batch in the plan's row chunks
(``Placement.chunk_rows``) with their boundary inputs on its tier. ``--chunk-rows N``
forces N rows per chunk, ``--chunk-rows 0`` each micro-batch in one piece: where that
does not fit the budget, the chunked plan's placement runs without its chunks (its
prediction then from a plan with the machine's whole memory). Printed besides: the plan,
its predicted step time and measured / predicted.

    .venv/bin/python bench/train_large.py [--steps 3] [--warmup 1] [--host-budget-gib 8]
        [--layers 24] [--hidden 2048] [--ffn 8192] [--nvme-dir D]
        [--plan [--chunk-rows N] [--micro-batch 16 --seq 512]]
"""

from __future__ import annotations

import argparse
import ctypes
import dataclasses
import json
import math
import re
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import _common
import torch
from safetensors.torch import save_file
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig

from bb_lightning import BalanceBeamStrategy
from bb_lightning.engine.budgets import required_budgets
from bb_lightning.hf.structure import find_block_list
from bb_lightning.module import CausalLMModule
from bb_lightning.placement import Placement
from bb_lightning.planner import (
    FitJob,
    HardwareProfile,
    Plan,
    PlanError,
    PlanOverrides,
    cost,
    make_plan,
)
from bb_lightning.planner.cost import loss_chunk_tokens
from bb_lightning.probe import measure, model_profile_from_config
from bb_lightning.probe.calibrate import probe_train_compute
from bb_lightning.strategy.handback import WeightsInStoreError
from storage.io import padded
from storage.store import StoreConfig, TieredStore
from storage.tiers import Tier

SLACK = 1 << 20
"""Bytes added to the device and NVMe budgets (allocator alignment)."""


def hf_config(config: dict[str, Any]) -> PretrainedConfig:
    """The Hugging Face config of a config dict with ``model_type``."""
    cfg = dict(config)
    return AutoConfig.for_model(cfg.pop("model_type"), **cfg)


def sizes(config: dict[str, Any]) -> tuple[list[int], int]:
    """(parameters per block, parameters outside the blocks), from a meta-device build."""
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf_config(config))
    _, blocks = find_block_list(model)
    numels = [sum(p.numel() for p in b.parameters()) for b in blocks]
    return numels, sum(p.numel() for p in model.parameters()) - sum(numels)


def write_random_checkpoint(config: dict[str, Any], directory: Path, seed: int = 0) -> int:
    """Write random bf16 weights as a sharded safetensors checkpoint, one block at a time.

    Matrices and embeddings ~ N(0, 0.02^2), 1-D weights (norms) = 1. Shard ``k`` holds
    block ``k``'s tensors; the last shard holds the rest. Returns bytes written.
    """
    hf = hf_config(config)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf)
    shapes = {k: tuple(p.shape) for k, p in model.named_parameters()}
    groups: dict[str, list[str]] = {}
    for key in shapes:
        match = re.search(r"\.layers\.(\d+)\.", key)
        groups.setdefault(f"block{int(match.group(1)):03d}" if match else "rest", []).append(key)
    g = torch.Generator().manual_seed(seed)
    weight_map: dict[str, str] = {}
    total = 0
    for shard, keys in groups.items():
        tensors = {}
        for key in keys:
            shape = shapes[key]
            if len(shape) == 1:
                tensors[key] = torch.ones(shape, dtype=torch.bfloat16)
            else:
                tensors[key] = (torch.randn(shape, generator=g) * 0.02).to(torch.bfloat16)
            total += tensors[key].numel() * 2
        name = f"model-{shard}.safetensors"
        save_file(tensors, str(directory / name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(keys, name))
        del tensors
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (directory / "model.safetensors.index.json").write_text(json.dumps(index, indent=1))
    hf.save_pretrained(directory)
    return total


def held_weights(module: CausalLMModule) -> str:
    """Whether the module holds its trained weights after fit, or stays hollow and why."""
    try:
        state = module.state_dict()
    except WeightsInStoreError as exc:
        reason = str(exc).partition("lazily (")[2].removesuffix(")")  # the guard's reason
        return f"the module stays hollow, its weights in the store ({reason})"
    held = sum(t.numel() * t.element_size() for t in state.values())
    return f"the module holds its trained weights ({_common.gib(held)})"


ACCOUNTS = ("host arena", "device tier", "resident params", "RssAnon beyond", "heap free")
"""The store's own accounting sampled beside RSS: bytes in the host arena's slots, in the
device arena's slots (host RAM on this CPU; both private mappings, so counted in RssAnon),
in the module's parameters and buffers that hold storage (the resident ones outside the
store), and the RssAnon beyond the first three: the runtime, activations, the engine's buffers outside the
store and freed heap kept for reuse; of which ``heap free``: the bytes glibc's heaps hold
free for reuse (``mallinfo2``'s ``fordblks``, all arenas)."""


class _MallInfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost".split()
    ]


def heap_free() -> int:
    """Bytes free in this process's glibc heaps (kept for reuse), 0 without ``mallinfo2``."""
    mallinfo2 = getattr(ctypes.CDLL(None), "mallinfo2", None)
    if mallinfo2 is None:
        return 0
    mallinfo2.restype = _MallInfo2
    return int(mallinfo2().fordblks)


def resident_bytes(module: torch.nn.Module, store: TieredStore | None) -> int:
    """Bytes of the distinct storages behind ``module``'s parameters and buffers, those on
    the meta device or in ``store``'s arenas (a block's paged-in weights) aside."""
    seen: dict[int, int] = {}
    for t in (*module.parameters(), *module.buffers()):
        if t.device.type != "meta" and (store is None or not store.holds(t)):
            storage = t.untyped_storage()
            seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


def store_accounts(
    strategy: BalanceBeamStrategy, module: torch.nn.Module
) -> Callable[[], dict[str, int]]:
    """A sampler of :data:`ACCOUNTS` (bytes) of ``strategy``'s store and ``module``."""

    def sample() -> dict[str, int]:
        store = strategy.store
        out = {"resident params": resident_bytes(module, store), "host arena": 0, "device tier": 0}
        if store is not None:
            usage = store.usage()
            out["host arena"], out["device tier"] = usage[Tier.HOST][0], usage[Tier.DEVICE][0]
        anon = _common.rss_by_kind()["RssAnon"]
        held = out["host arena"] + out["device tier"] + out["resident params"]
        out["RssAnon beyond"] = max(0, anon - held)
        out["heap free"] = heap_free()
        return out

    return sample


def accounts_line(sample: dict[str, int]) -> str:
    """``host arena a, device tier d, resident params r, RssAnon beyond b`` of a sample, GiB."""
    return ", ".join(f"{k} {sample.get(k, 0) / _common.GIB:.2f}" for k in ACCOUNTS)


def fixed_strategy(
    args: argparse.Namespace, placement: Placement, need: dict[Tier, int]
) -> Callable[[Path], BalanceBeamStrategy]:
    """A maker of the strategy that runs ``placement`` in a store of ``need`` bytes per tier
    (the host arena capped at ``--host-budget-gib``), its NVMe tier under a run directory."""

    def make(run_dir: Path) -> BalanceBeamStrategy:
        store = StoreConfig(
            device_budget=need[Tier.DEVICE] + SLACK,
            host_budget=int(args.host_budget_gib * _common.GIB),
            nvme_path=str(run_dir / "store"),
            nvme_budget=need[Tier.NVME] + SLACK,
            device="cpu",
        )
        print(f"placement in force (no plan): {chunking(placement)}")
        return BalanceBeamStrategy(store=store, placement=placement, compute_dtype="bf16")

    return make


def chunking(placement: Placement) -> str:
    """How ``placement`` runs a micro-batch through its recomputed blocks, in words."""
    if placement.chunk_rows is None:
        return "each micro-batch in one piece through every block"
    where = placement.boundaries.value if placement.boundaries is not None else "device"
    return (
        f"recomputed blocks run {placement.chunk_rows} rows per chunk, their boundary inputs "
        f"on the {where}"
    )


def planned_strategy(plan: Plan) -> Callable[[Path], BalanceBeamStrategy]:
    """A maker of the strategy that plans as ``plan`` was made (its job, hardware profile and
    overrides: the same plan) and sizes its store from it, its NVMe tier under a run
    directory; no re-plan after warm-up, and the module left hollow after fit."""

    def make(run_dir: Path) -> BalanceBeamStrategy:
        return BalanceBeamStrategy(
            job=plan.job, hardware=plan.hardware, overrides=plan.overrides,
            nvme_path=str(run_dir / "store"), compute_dtype="bf16", adapt_tolerance=None,
            gather_on_teardown=False,
        )  # fmt: skip

    return make


def train(
    args: argparse.Namespace,
    config: dict[str, Any],
    make_strategy: Callable[[Path], BalanceBeamStrategy],
    limit: int,
    base: Path,
    init: str,
    predicted: float | None = None,
) -> None:
    """Fit ``--warmup + --steps`` steps, the model built per ``init``; print the figures
    (and measured / ``predicted`` seconds per step where given)."""
    with tempfile.TemporaryDirectory(prefix="large-", dir=base) as run_dir:
        strategy = make_strategy(Path(run_dir))
        source: str | dict[str, Any] = config
        if init == "checkpoint":
            ckpt = Path(run_dir) / "checkpoint"
            ckpt.mkdir()
            t0 = time.perf_counter()
            nbytes = write_random_checkpoint(config, ckpt)
            print(
                f"wrote a random bf16 checkpoint of {_common.gib(nbytes)} block by block in "
                f"{time.perf_counter() - t0:.1f} s (RSS {_common.gib(_common.rss())})",
                flush=True,
            )
            source = str(ckpt)
        module = CausalLMModule(source, learning_rate=1e-4, seed=0)
        timer = _common.StepTimer()
        sampler = _common.RssSampler(accounts=store_accounts(strategy, module))
        steps = args.warmup + args.steps
        trainer = _common.quiet_trainer(
            strategy,
            steps=steps,
            accumulate=args.accumulate,
            callbacks=[timer, _common.PhaseMarker(sampler)],
        )
        data = _common.token_loader(args.micro_batch, steps * args.accumulate, args.seq, args.vocab)
        start = time.perf_counter()
        with sampler:
            trainer.fit(module, data)
            sampler.mark("teardown")  # the strategy gives the module its weights back
        wall = time.perf_counter() - start
        stats = strategy.store.stats() if strategy.store is not None else {}
        if strategy.plan is not None:
            print(f"plan in force: {chunking(strategy.plan.placement)}")
        print(f"after fit: {held_weights(module)}")
        strategy.close()
    tokens = args.micro_batch * args.seq * args.accumulate
    tps, step_s, phases = _common.summarize(timer.timed(args.warmup), tokens)
    peak = max(sampler.peak, _common.max_rss())
    print(
        f"trained {steps} optimizer steps ({args.warmup} untimed) of micro-batch "
        f"{args.micro_batch} x accumulation {args.accumulate} x seq {args.seq} in {wall:.1f} s "
        "(setup included)"
    )
    print(f"per step: {phases}")
    for link, s in stats.items():
        if s.count:
            print(
                f"  store {link}: {s.bytes / 1e9:.2f} GB in {s.seconds:.1f} s busy "
                f"({s.bandwidth / 1e9:.2f} GB/s) over all {steps} steps and setup"
            )
    print("RSS by kind, each kind's peak within the phase (over every step):")
    for phase in ("setup", "forward", "backward", "optimizer", "teardown"):
        if phase in sampler.phases:
            print(f"  {phase}: {_common.rss_line(sampler.phases[phase])}")
    print(f"  whole run: {_common.rss_line(sampler.peaks)}")
    print(f"  at the highest total: {_common.rss_line(sampler.at_peak)}")
    print(
        "the store's accounting, each figure's peak within the phase (GiB; RssAnon beyond: "
        "the RssAnon not in the host arena, the device tier or resident params):"
    )
    for phase in ("setup", "forward", "backward", "optimizer", "teardown"):
        if phase in sampler.phases:
            print(f"  {phase}: {accounts_line(sampler.phases[phase])}")
    print(f"  whole run: {accounts_line(sampler.peaks)}")
    print(f"  at the highest total: {accounts_line(sampler.at_peak)}")
    print(
        f"peak RSS: sampled {_common.gib(sampler.peak)}, ru_maxrss "
        f"{_common.gib(_common.max_rss())}; limit host budget + 2 GiB = "
        f"{_common.gib(limit)} -> {'PASS' if peak <= limit else 'FAIL'} "
        f"(peak / limit = {peak / limit:.2f})"
    )
    print(f"throughput: {tps:.1f} trained tokens/s, {step_s:.2f} s/step")
    if predicted is not None:
        print(
            f"measured {step_s:.4g} s/step, predicted {predicted:.4g} s/step ("
            f"{tokens / predicted:.1f} tokens/s); measured / predicted = "
            f"{step_s / predicted:.2f} (target 0.75-1.25)"
        )


DEVICE_POOL = 2 * _common.GIB
"""Plannable bytes of the device tier with ``--plan``: on a CPU device it shares one RAM pool
with the host's, host budget + 2 GiB in all (the RSS limit)."""


def budget_hardware(hw: HardwareProfile, host_budget: int) -> HardwareProfile:
    """``hw`` with memory whose plannable bytes (:func:`~bb_lightning.planner.cost.budgets`)
    are ``host_budget`` on the host and :data:`DEVICE_POOL` on the device."""
    host = math.ceil(host_budget / (1.0 - cost.HOST_MARGIN_FRACTION))
    device = math.ceil(
        (DEVICE_POOL + cost.DEVICE_MARGIN_BYTES) / (1.0 - cost.DEVICE_MARGIN_FRACTION)
    )
    return hw.replace(host_memory=host, device_memory=device)


def plan_for_budget(
    args: argparse.Namespace, config: dict[str, Any], base: Path, counts: tuple[list[int], int]
) -> tuple[Callable[[Path], BalanceBeamStrategy], float]:
    """(maker of the strategy, predicted seconds per step) of ``--plan``: see the module doc."""
    whole = measure(nvme_path=str(base), max_seconds=args.measure_seconds)
    probe = probe_train_compute(
        config, whole, seq_len=args.seq, micro_batch=args.probe_micro_batch, dtype=torch.bfloat16
    )
    if probe is not None:
        print(probe.describe(whole), flush=True)
        whole = probe.applied_to(whole)
    hw = budget_hardware(whole, int(args.host_budget_gib * _common.GIB))
    model = model_profile_from_config(config)
    job = FitJob(
        seq_len=args.seq, global_batch_seqs=args.micro_batch * args.accumulate,
        compute_dtype="bfloat16", loss_chunk_tokens=loss_chunk_tokens(args.vocab),
    )  # fmt: skip
    ov = PlanOverrides(
        micro_batch=args.micro_batch, grad_accum=args.accumulate, weights_tier=Tier.NVME,
        master_tier=Tier.NVME, prefetch_depth=args.prefetch, chunk_rows=args.chunk_rows or None,
        chunked=args.chunk_rows != 0,
    )  # fmt: skip
    try:
        plan = make_plan(model, hw, job, overrides=ov)
    except PlanError as err:
        if args.chunk_rows != 0:
            raise
        print(f"each micro-batch in one piece does not fit the budget: {err}")
        chunked = make_plan(model, hw, job, overrides=dataclasses.replace(ov, chunked=True))
        placement = dataclasses.replace(chunked.placement, chunk_rows=None, boundaries=None)
        priced = make_plan(model, whole, job, overrides=ov)  # the machine's whole memory
        print(
            "running the budget's chunked placement without its chunks; priced with the "
            f"machine's whole memory:\n{priced.explain()}",
            flush=True,
        )
        return fixed_strategy(args, placement, required_budgets(*counts, placement)), (
            priced.predicted.total
        )
    print(plan.explain(), flush=True)
    return planned_strategy(plan), plan.predicted.total


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=3, help="timed optimizer steps")
    parser.add_argument("--warmup", type=int, default=1, help="untimed optimizer steps first")
    parser.add_argument("--micro-batch", type=int, default=1, help="sequences per pass")
    parser.add_argument("--accumulate", type=int, default=1, help="micro-batches per step")
    parser.add_argument("--seq", type=int, default=256, help="tokens per sequence")
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--ffn", type=int, default=8192)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--prefetch", type=int, default=1, help="prefetch depth (blocks)")
    parser.add_argument("--host-budget-gib", type=float, default=8.0, help="store host arena")
    parser.add_argument("--nvme-dir", default=None, help="directory on the disk under test")
    parser.add_argument(
        "--init",
        choices=("auto", "checkpoint", "module"),
        default="auto",
        help="see above; auto tries checkpoint, then module",
    )
    parser.add_argument("--plan", action="store_true", help="the planner's placement (above)")
    parser.add_argument(
        "--chunk-rows", type=int, default=None, help="with --plan: rows per chunk, 0: none"
    )
    parser.add_argument(
        "--probe-micro-batch", type=int, default=2, help="with --plan: rows the probe times"
    )
    parser.add_argument("--measure-seconds", type=float, default=20.0, help="hardware probe")
    args = parser.parse_args(argv)
    if args.steps < 1 or args.warmup < 0:
        raise ValueError(f"--steps {args.steps} must be >= 1 and --warmup {args.warmup} >= 0")
    if args.chunk_rows is not None and (args.chunk_rows < 0 or not args.plan):
        raise ValueError(
            f"--chunk-rows {args.chunk_rows}: pass it with --plan, as rows >= 1 per chunk or 0 "
            "(each micro-batch in one piece)"
        )
    _common.quiet()

    base = _common.nvme_base(args.nvme_dir)
    print(_common.machine(base), flush=True)
    config = _common.llama_config(args)
    numels, rest = sizes(config)
    params = sum(numels) + rest
    ram = _common.psutil.virtual_memory().total
    print(
        f"model: Llama {params / 1e9:.2f}B params ({args.layers} x hidden {args.hidden}, ffn "
        f"{args.ffn}, vocab {args.vocab}); full training state at 16 bytes/param "
        f"{_common.gib(16 * params)} vs RAM {_common.gib(ram)}"
        + (" (exceeds RAM)" if 16 * params > ram else " (FITS in RAM: not a large-model test)")
    )
    placement = Placement.uniform(
        args.layers, weights=Tier.NVME, master=Tier.NVME, prefetch_depth=args.prefetch
    )
    need = required_budgets(numels, rest, placement)
    host_budget = int(args.host_budget_gib * _common.GIB)
    if need[Tier.HOST] > host_budget:
        raise ValueError(
            f"the store needs {_common.gib(need[Tier.HOST])} of host arena (fp32 state of the "
            f"parameters outside the blocks) > --host-budget-gib {args.host_budget_gib}: "
            "raise the budget"
        )
    limit = host_budget + 2 * _common.GIB
    grads = sum(4 * padded(n) for n in numels)  # fp32 block accumulators, in the store
    print(
        f"expected host memory, all RssAnon: store host arena {_common.gib(need[Tier.HOST])} "
        f"(a private mapping of the budget, {args.host_budget_gib:.1f} GiB, its slots touched "
        f"in huge pages where the kernel gives them: resident fp32 state and gradients, "
        f"optimizer scratch); device tier (RAM on this CPU) "
        f"{_common.gib(need[Tier.DEVICE])} + resident bf16 params "
        f"{_common.gib(2 * rest)} + the runtime, activations and up to 1 GiB of freed heap "
        f"kept for reuse; after fit the weights in bf16 {_common.gib(2 * params)} only where "
        f"the fp32 ones ({_common.gib(4 * params)}) fit beside the arena within the budget; "
        f"block fp32 gradient accumulators {_common.gib(grads)} on NVMe (never written with "
        f"one micro-batch per step); bf16 model while built "
        f"{_common.gib(2 * params) + ' (--init module)'}; RSS limit {_common.gib(limit)}",
        flush=True,
    )
    make, predicted = fixed_strategy(args, placement, need), None
    if args.plan:
        make, predicted = plan_for_budget(args, config, base, (numels, rest))
    if args.init != "auto":
        train(args, config, make, limit, base, args.init, predicted)
        return
    try:
        train(args, config, make, limit, base, "checkpoint", predicted)
    except Exception as exc:  # report, then build the model whole instead
        print(f"streaming from a checkpoint failed: {type(exc).__name__}: {exc}")
        print("falling back to --init module (the whole model built in bf16 first)", flush=True)
        train(args, config, make, limit, base, "module", predicted)


if __name__ == "__main__":
    main()
