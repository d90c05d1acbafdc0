"""Soak: thousands of optimizer steps; memory, file descriptors and bookkeeping stay flat.

The tiny recipe's model (``recipes/tiny-cpu.yaml``: Llama, hidden 256, 4 blocks, ffn 688,
vocab 264) trains under ``balance_beam`` with every block's weights, fp32 master weights
and AdamW moments homed on the NVMe tier, on random tokens (``--seq`` 64 tokens x
``--batch`` 4 rows per step by default, shorter than the recipe's 256 x 8 so that
2,000 steps fit in minutes). Every ``--every`` steps it samples this process's
resident memory (RSS), open file descriptors and threads, and the length of every
list, dict, set and deque reachable from the strategy's store and engine (the
store's statistics, the pager's and the timer's records, ...).

Printed: the samples at the end of warm-up (``--warmup``, default 100) and at the
last step, their growth, and every container that grew after warm-up (a growth that
is proportional to the steps is unbounded; a deque with a maximum length is bounded).
Verdicts: file descriptors (not counting store files open for an I/O in flight) equal
after warm-up and at the end; no container of the store grew; no container without a
maximum grew; RSS within ``--rss-slack-mib`` (default 64 MiB) of its warm-up value.

    .venv/bin/python bench/soak.py [--steps 2000] [--warmup 100] [--every 100] [--nvme-dir D]
"""

from __future__ import annotations

import argparse
import collections
import os
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import _common
import lightning.pytorch as pl
import psutil
import torch

from bb_lightning import BalanceBeamStrategy
from bb_lightning.module import CausalLMModule

MIB = 1 << 20
CONTAINERS = (list, dict, set, collections.deque)


def recipe_model(layers: int) -> dict[str, Any]:
    """The tiny-cpu recipe's network (``recipes/tiny-cpu.yaml``)."""
    return {
        "model_type": "llama",
        "hidden_size": 256,
        "num_hidden_layers": layers,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "intermediate_size": 688,
        "vocab_size": 264,
        "max_position_embeddings": 1024,
        "tie_word_embeddings": False,
    }


def open_fds(store_dir: Path | None = None) -> tuple[int, int]:
    """(file descriptors open in this process, of them files under ``store_dir``).

    Files of the store (but its lock file) are open only while a read or write of theirs is
    in flight.
    """
    total = inside = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:  # the descriptor listing the folder, closed since
            continue
        total += 1
        in_store = store_dir is not None and target.startswith(f"{store_dir}/")
        inside += in_store and not target.endswith("/.bb-lock")  # the lock stays open
    return total, inside


def container_sizes(root: object, name: str, depth: int = 5) -> dict[str, int]:
    """``path -> len`` of every list/dict/set/deque reachable from ``root`` through the
    attributes of ``storage`` and ``bb_lightning`` objects (not through modules or tensors)."""
    found: dict[str, int] = {}
    seen: set[int] = set()

    def walk(obj: object, path: str, left: int) -> None:
        if id(obj) in seen or isinstance(obj, torch.nn.Module | torch.Tensor | pl.Trainer):
            return
        seen.add(id(obj))
        if isinstance(obj, CONTAINERS):
            bounded = isinstance(obj, collections.deque) and obj.maxlen is not None
            found[path + (f" (at most {obj.maxlen})" if bounded else "")] = len(obj)
            if left > 0 and isinstance(obj, dict):
                for key, value in list(obj.items())[:64]:
                    walk(value, f"{path}[{key!r}]", left - 1)
            return
        module = type(obj).__module__
        if left <= 0 or not module.startswith(("storage", "bb_lightning")):
            return
        attrs = getattr(obj, "__dict__", None) or {
            s: getattr(obj, s) for s in getattr(type(obj), "__slots__", ()) if hasattr(obj, s)
        }
        for key, value in list(attrs.items()):
            walk(value, f"{path}.{key}", left - 1)

    walk(root, name, depth)
    return found


class Sampler(pl.Callback):
    """Samples RSS, fds, threads and the container sizes every ``every`` optimizer steps."""

    def __init__(self, strategy: BalanceBeamStrategy, every: int, warmup: int, store: Path) -> None:
        self.strategy = strategy
        self.store_dir = store
        self.every = every
        self.warmup = warmup
        self.samples: dict[int, dict[str, Any]] = {}
        self.process = psutil.Process()
        self.t0 = time.perf_counter()

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        step = trainer.global_step
        if step != self.warmup and step % self.every and step != trainer.max_steps:
            return
        sizes = container_sizes(self.strategy.store, "store")
        sizes.update(container_sizes(self.strategy.engine, "engine"))
        fds, in_store = open_fds(self.store_dir)
        self.samples[step] = {
            "rss": self.process.memory_info().rss,
            "fds": fds - in_store,
            "store_fds": in_store,
            "threads": threading.active_count(),
            "sizes": sizes,
        }
        rss = self.samples[step]["rss"] / MIB
        print(
            f"step {step:5d}: RSS {rss:7.1f} MiB, {fds - in_store} fds (+{in_store} of store "
            "files in flight), "
            f"{self.samples[step]['threads']} threads, "
            f"{time.perf_counter() - self.t0:.0f} s",
            flush=True,
        )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=2000, help="optimizer steps")
    p.add_argument("--warmup", type=int, default=100, help="steps before the first sample")
    p.add_argument("--every", type=int, default=100, help="steps between samples")
    p.add_argument("--layers", type=int, default=4, help="blocks (the recipe has 4)")
    p.add_argument("--seq", type=int, default=64, help="tokens per row")
    p.add_argument("--batch", type=int, default=4, help="rows per optimizer step")
    p.add_argument("--rss-slack-mib", type=float, default=64.0, help="allowed RSS growth, MiB")
    p.add_argument("--threads", type=int, default=1, help="torch threads")
    p.add_argument("--nvme-dir", help="directory on the disk to test (default: tmp)")
    args = p.parse_args(argv)
    if not 0 < args.warmup < args.steps:
        p.error(f"--warmup {args.warmup} must be in (0, --steps {args.steps})")
    torch.set_num_threads(args.threads)
    _common.quiet()
    base = Path(args.nvme_dir) if args.nvme_dir else Path(tempfile.gettempdir())
    base.mkdir(parents=True, exist_ok=True)
    nvme = Path(tempfile.mkdtemp(prefix="bb-soak-", dir=base))
    print(_common.machine(nvme))
    strategy = _common.nvme_strategy(args.layers, nvme)
    sampler = Sampler(strategy, args.every, args.warmup, nvme)
    trainer = _common.quiet_trainer(
        strategy, steps=args.steps, accumulate=1, callbacks=[sampler], precision="32-true",
        max_epochs=-1,
    )  # fmt: skip
    module = CausalLMModule(recipe_model(args.layers), learning_rate=2e-3, warmup_steps=10)
    loader = _common.token_loader(args.batch, 256, args.seq, 264)  # 256 batches, repeated
    t0 = time.perf_counter()
    trainer.fit(module, loader)
    seconds = time.perf_counter() - t0
    strategy.close()
    fds_closed = open_fds()[0]
    import shutil

    shutil.rmtree(nvme, ignore_errors=True)

    first, last = sampler.samples[args.warmup], sampler.samples[args.steps]
    grew = {
        k: (first["sizes"].get(k, 0), v)
        for k, v in last["sizes"].items()
        if v > first["sizes"].get(k, 0)
    }
    rss_growth = (last["rss"] - first["rss"]) / MIB
    print(
        f"{args.steps} steps of micro-batch {args.batch} x seq {args.seq}, {args.layers} blocks "
        f"on NVMe, in {seconds:.0f} s ({seconds / args.steps * 1e3:.0f} ms per step)"
    )
    print(
        f"RSS step {args.warmup}: {first['rss'] / MIB:.1f} MiB, step {args.steps}: "
        f"{last['rss'] / MIB:.1f} MiB (growth {rss_growth:+.1f} MiB)"
    )
    print(
        f"open fds step {args.warmup}: {first['fds']}, step {args.steps}: {last['fds']} "
        f"(after close: {fds_closed}; not counted: store files open for a read or write in "
        f"flight, {first['store_fds']} and {last['store_fds']}); "
        f"threads {first['threads']} -> {last['threads']}"
    )
    store_keys = [k for k in first["sizes"] if k.startswith("store")]
    print(f"containers tracked: {len(first['sizes'])} ({len(store_keys)} in the store)")
    for key, (a, b) in sorted(grew.items()):
        print(f"  grew after warm-up: {key}: {a} -> {b}")
    unbounded = [k for k in grew if "(at most" not in k]
    verdicts = {
        "fds flat": last["fds"] == first["fds"],
        "store containers flat": not any(k.startswith("store") for k in grew),
        "no unbounded container grew": not unbounded,
        f"RSS within {args.rss_slack_mib:.0f} MiB": rss_growth <= args.rss_slack_mib,
    }
    for name, ok in verdicts.items():
        print(f"{name}: {'PASS' if ok else 'FAIL'}")
    return 0 if all(verdicts.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
