"""Data-parallel training throughput on one CPU machine: 2 ranks of one core each against
one process on both cores, same global batch, same run.

The Llama of ``bench/train_offload.py`` (default about 370M parameters: hidden 1024, 24
layers, ffn 2816, 16 heads, vocab 32000, sequence 512) with random weights trains under
``balance_beam``, bf16 compute, every block's weights and optimizer state on the host:

1. one process, ``torch.set_num_threads(2)``, pinned to both cores, accumulation A;
2. ``devices=2``: two processes started by Lightning's popen launcher, one thread and
   one core each, accumulation A / 2 per rank (the same global batch), the weights and
   the optimizer state sharded, gradients reduce-scattered on the device and each block
   assembled on the device from the ranks' shards at its page-in, over gloo.

Each run takes ``--warmup`` optimizer steps, then ``--steps`` timed ones, in a process
of its own (this script again with ``--worker``). Printed: the machine; trained tokens/s
of each and the ratio; the bytes one rank sends over the network per step, from the
model's sizes (the ring's ``(N - 1) / N`` of each reduce-scattered gradient buffer and
each all-gathered block, :func:`ring_bytes_per_step`) and as handed to the collectives
(``ShardComm.bytes_sent``); a gloo all-reduce probe's bandwidth between the ranks; and
the planner's predicted step time of each run next to the measured one, priced with
that bandwidth and the compute rate of the model's own training pass timed on the
run's threads; each run's bytes per rank per optimizer step on each copy link of its
store (``TieredStore.stats``, rank 0's). ``--cuda-double`` runs the store's CPU double
(``BB_CUDA_DOUBLE``): the device's memory is kept apart from the host's and every copy
between them is made and counted as on CUDA, so host-to-device and device-to-host bytes
are those a GPU's PCIe would carry. ``--smoke`` runs a tiny model for a few seconds (the
test suite's check).

    .venv/bin/python bench/data_parallel.py [--steps 3] [--warmup 2] [--micro-batch 1]
        [--accumulate 4] [--layers 24] [--hidden 1024] [--nvme-dir D] [--cuda-double] [--smoke]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import _common
import lightning.pytorch as pl
import torch
import torch.distributed as dist

from bb_lightning import BalanceBeamStrategy
from bb_lightning.module import CausalLMModule
from bb_lightning.placement import Placement
from bb_lightning.planner import (
    FitJob,
    HardwareProfile,
    ModelProfile,
    PlanOverrides,
    cost,
    make_plan,
)
from bb_lightning.planner.data_parallel import REDUCE_BYTES
from bb_lightning.probe import measure, model_profile_from_config
from bb_lightning.probe.calibrate import probe_train_compute
from storage.tiers import Tier

SEED = 0
SMOKE = {"layers": 2, "hidden": 64, "ffn": 128, "heads": 4, "vocab": 256, "seq": 32}
SMOKE_RUN = {"steps": 2, "warmup": 1, "measure_seconds": 1.0}
PROBE_BYTES = 32 << 20
"""Bytes of the all-reduce that measures the ranks' bandwidth."""


def ring_bytes_per_step(
    model: ModelProfile, world_size: int, accumulate: int, page_ins: int
) -> float:
    """Bytes one rank sends per optimizer step in the engine's ring collectives.

    Per micro-batch every block's trained gradients (and those of the parameters outside
    the blocks) are reduce-scattered on the device as one padded fp32 buffer of
    ``N * ceil(n / N)`` elements, and each block is assembled from the ranks' bf16 shards
    (an all-gather) at each of its ``page_ins`` page-ins (forward, and the backward's
    recompute where the block is recomputed); per step the parameters outside the blocks
    are assembled once from their stepped shards. A ring sends ``(N - 1) / N`` of each
    buffer (:func:`bb_lightning.planner.cost.ring_seconds`).
    """
    n = world_size
    if n == 1:
        return 0.0
    blocks = model.num_blocks * n * cost.shard_numel(model.block_train, n)
    rest = n * cost.shard_numel(model.rest_train, n)
    per_micro = (blocks + rest) * REDUCE_BYTES + blocks * 2 * page_ins
    return (n - 1) / n * (accumulate * per_micro + rest * 2)


def allreduce_bandwidth() -> float:
    """Bytes/s one rank sends in a ring all-reduce of :data:`PROBE_BYTES` fp32 (gloo)."""
    buf = torch.ones(PROBE_BYTES // 4)
    dist.all_reduce(buf)  # warm the connections
    start = time.perf_counter()
    dist.all_reduce(buf)
    seconds = time.perf_counter() - start
    n = dist.get_world_size()
    return 2 * (n - 1) / n * PROBE_BYTES / seconds


def worker(args: argparse.Namespace) -> None:
    """One run (every rank of it): fit, then rank 0 writes its figures to ``--result``."""
    local = int(os.environ.get("LOCAL_RANK", "0"))
    cores = [int(c) for c in args.cores.split(",")]
    mine = set(cores) if args.devices == 1 else {cores[local % len(cores)]}
    os.sched_setaffinity(0, mine)
    threads = len(mine)
    torch.set_num_threads(threads)
    _common.quiet()
    config = _common.llama_config(args)
    accumulate = args.accumulate // args.devices
    placement = Placement.uniform(args.layers, weights=Tier.HOST, master=Tier.HOST)
    strategy = BalanceBeamStrategy(placement=placement, compute_dtype="bf16")
    timer = _common.StepTimer()
    steps = args.warmup + args.steps
    trainer = pl.Trainer(
        accelerator="cpu", devices=args.devices, strategy=strategy, precision="bf16-true",
        max_steps=steps, accumulate_grad_batches=accumulate, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        num_sanity_val_steps=0, callbacks=[timer],
    )  # fmt: skip
    module = CausalLMModule(config, learning_rate=1e-4, seed=SEED)
    batches = steps * args.accumulate  # over all ranks: Lightning gives each its share
    trainer.fit(module, _common.token_loader(args.micro_batch, batches, args.seq, args.vocab))
    global_tokens = args.micro_batch * args.accumulate * args.seq
    tps, step_s, phases = _common.summarize(timer.timed(args.warmup), global_tokens)
    engine = strategy.engine
    comm = getattr(engine, "comm", None)
    handed = getattr(comm, "bytes_sent", 0) / steps
    doubled = engine.store.copies_to_host  # the double: host blocks copied in, recomputed
    links = {link.value: s.bytes / steps for link, s in engine.store.stats().items() if s.bytes}
    bandwidth = allreduce_bandwidth() if args.devices > 1 else 0.0
    strategy.close()
    if not trainer.is_global_zero:
        return
    model = model_profile_from_config(config)
    hw = HardwareProfile.from_dict(json.loads(Path(args.hardware).read_text()))
    probe = probe_train_compute(config, hw, seq_len=args.seq, micro_batch=args.micro_batch)
    if probe is not None:
        hw = probe.applied_to(hw)
    if args.devices > 1:
        # the probe ran on this rank's one core: the node has devices x that
        hw = hw.replace(
            world_size=args.devices, ranks_per_node=args.devices, intra_node_bandwidth=bandwidth,
            device_flops=hw.device_flops * args.devices, cores=args.devices,
        )  # fmt: skip
    overrides = PlanOverrides(
        micro_batch=args.micro_batch, grad_accum=accumulate, resident_blocks=0,
        weights_tier=Tier.HOST, master_tier=Tier.HOST, prefetch_depth=1,
    )  # fmt: skip
    job = FitJob(seq_len=args.seq, global_batch_seqs=args.micro_batch * args.accumulate)
    plan = make_plan(model, hw, job, overrides=overrides)
    p = plan.predicted
    result = {
        "devices": args.devices, "threads": threads, "accumulate": accumulate,
        "tokens_per_s": tps, "step_s": step_s, "phases": phases, "handed": handed, "links": links,
        "ring": ring_bytes_per_step(model, args.devices, accumulate, 2 if doubled else 1),
        "bandwidth": bandwidth,
        "predicted": p.total, "predicted_net": p.net, "bottleneck": p.bottleneck,
        "same_placement": plan.placement.weights == placement.weights
        and plan.placement.master == placement.master,
    }  # fmt: skip
    Path(args.result).write_text(json.dumps(result))


def launch(
    args: argparse.Namespace, devices: int, cores: list[int], result: Path
) -> dict[str, Any]:
    """This script as a ``--worker`` run at ``devices`` ranks; its figures."""
    argv = [sys.executable, str(Path(__file__).resolve()), "--worker"]
    argv += ["--devices", str(devices), "--cores", ",".join(map(str, cores))]
    argv += ["--result", str(result), "--nvme-dir", str(args.nvme_dir)]
    argv += ["--hardware", str(result.with_name("hardware.json"))]
    for key in ("steps", "warmup", "micro_batch", "accumulate", "layers", "hidden", "ffn"):
        argv += [f"--{key.replace('_', '-')}", str(getattr(args, key))]
    for key in ("heads", "vocab", "seq", "measure_seconds"):
        argv += [f"--{key.replace('_', '-')}", str(getattr(args, key))]
    env = dict(os.environ, OMP_NUM_THREADS=str(len(cores) if devices == 1 else 1))
    if args.cuda_double:
        env["BB_CUDA_DOUBLE"] = "1"
    env.setdefault("MASTER_ADDR", "127.0.0.1")
    done = subprocess.run(argv, env=env, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{argv} failed:\n{done.stdout[-3000:]}\n{done.stderr[-6000:]}")
    return dict(json.loads(result.read_text()))


def report(name: str, r: dict[str, Any], micro: int, seq: int) -> None:
    per = " per rank" if r["devices"] > 1 else ""
    print(
        f"[{name}] micro-batch {micro} x accumulation {r['accumulate']}{per} x seq {seq}: "
        f"{r['tokens_per_s']:.1f} tokens/s, {r['step_s']:.3g} s/step",
        flush=True,
    )
    print(f"[{name}] per step (rank 0): {r['phases']}")
    links = ", ".join(f"{k} {v / 1e6:.4g} MB" for k, v in sorted(r["links"].items()))
    print(f"[{name}] copy links per step (rank 0): {links or 'none'}")
    note = "" if r["same_placement"] else " (the planner's placement differs from the run's)"
    print(
        f"[{name}] planner predicted {r['predicted']:.3g} s/step (network {r['predicted_net']:.3g}"
        f" s busy, bottleneck {r['bottleneck']}){note}; measured {r['step_s']:.3g} s/step; "
        f"measured / predicted = {r['step_s'] / r['predicted']:.2f}"
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=3, help="timed optimizer steps")
    parser.add_argument("--warmup", type=int, default=2, help="untimed optimizer steps first")
    parser.add_argument("--micro-batch", type=int, default=1, help="sequences per pass")
    parser.add_argument(
        "--accumulate", type=int, default=4, help="micro-batches per step, all ranks"
    )
    parser.add_argument("--seq", type=int, default=512, help="tokens per sequence")
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--ffn", type=int, default=2816)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--nvme-dir", default=None, help="directory of the hardware probe")
    parser.add_argument("--measure-seconds", type=float, default=20.0, help="hardware probe")
    parser.add_argument("--smoke", action="store_true", help="a tiny model, a few seconds")
    parser.add_argument(
        "--cuda-double", action="store_true", help="copies between device and host as on CUDA"
    )
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--devices", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--cores", default="", help=argparse.SUPPRESS)
    parser.add_argument("--result", default="", help=argparse.SUPPRESS)
    parser.add_argument("--hardware", default="", help=argparse.SUPPRESS)  # the profile's JSON
    args = parser.parse_args(argv)
    if args.worker:
        worker(args)
        return
    if args.smoke:
        for key, value in {**SMOKE, **SMOKE_RUN}.items():
            setattr(args, key, value)
    if args.accumulate % 2 or args.steps < 1 or args.warmup < 0:
        raise ValueError(
            f"--accumulate {args.accumulate} must be even (split between 2 ranks), --steps "
            f"{args.steps} >= 1 and --warmup {args.warmup} >= 0"
        )
    cores = sorted(os.sched_getaffinity(0))[:2]
    if len(cores) < 2:
        raise ValueError(f"this process may run on {len(cores)} core(s): 2 are needed")
    args.nvme_dir = str(_common.nvme_base(args.nvme_dir))
    print(_common.machine(Path(args.nvme_dir)), flush=True)
    config = _common.llama_config(args)
    model = model_profile_from_config(config)
    print(
        f"model: Llama {model.total_params / 1e6:.3g}M params ({args.layers} x hidden "
        f"{args.hidden}, ffn {args.ffn}, {args.heads} heads, vocab {args.vocab}), seq {args.seq}, "
        f"bf16 compute, weights and AdamW state on the host; global batch {args.micro_batch} x "
        f"{args.accumulate} sequences; {args.warmup} warm-up + {args.steps} timed steps; "
        f"cores {cores}",
        flush=True,
    )
    hw = measure(nvme_path=args.nvme_dir, max_seconds=args.measure_seconds)
    with tempfile.TemporaryDirectory(prefix="bb-dp-") as tmp:
        # the runs price their steps on this profile (a disturbed probe is not cached)
        (Path(tmp) / "hardware.json").write_text(json.dumps(hw.to_dict()))
        one = launch(args, 1, cores, Path(tmp) / "one.json")
        two = launch(args, 2, cores, Path(tmp) / "two.json")
    report("1 process x 2 threads", one, args.micro_batch, args.seq)
    report("2 ranks x 1 thread", two, args.micro_batch, args.seq)
    print(
        f"network per step, one rank: {two['ring'] / 1e6:.3g} MB sent in the ring (from the "
        f"model's sizes); {two['handed'] / 1e6:.3g} MB handed to the collectives "
        f"(ShardComm.bytes_sent); gloo all-reduce probe {two['bandwidth'] / 1e9:.3g} GB/s "
        "per rank"
    )
    print(f"ratio 2 ranks / 1 process = {two['tokens_per_s'] / one['tokens_per_s']:.2f} (tokens/s)")


if __name__ == "__main__":
    main()
