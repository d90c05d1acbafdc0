"""The CPU benchmarks' targets on this machine, in one command: each figure beside its target.

Runs, one after the other, each in a process of its own under its own time limit:

- ``fit-1x4``: ``train_offload.py --repeat 2 --peer deepspeed`` (micro-batch 1 x 4, then the
  planner's batch);
- ``fit-4x1``: the same at micro-batch 4 x 1 (``--skip-recommended``);
- ``fit-nvme``: ``--weights-on-nvme`` against DeepSpeed with everything on NVMe;
- ``fit-busy``: ``--busy-probe``, a process spinning on one core during the probes;
- ``predict``: ``predict_offload.py`` with its defaults;
- ``predict-busy``: ``predict_offload.py --busy-probe`` beside ``generate`` at batch 128.

Every step computes in ``--dtype`` (``auto``: bf16 where the CPU has bf16 matrix
instructions, AMX or AVX-512 bf16, fp32 elsewhere), writes its output to
``OUTDIR/steps/<step>.log`` and its figures to ``OUTDIR/steps/<step>.json``
(``--json`` of the benchmark). Then every figure is printed beside its target and
``OUTDIR/cpu-check.json`` holds the machine (CPU model, family and model, matrix kind),
each step's command, exit status and seconds, and each target with its value and whether
it is met (None where the step measured nothing, e.g. DeepSpeed not installed: the
``bench`` extra and Debian's ``libaio-dev``).

The whole check takes about an hour on a 2-core AMX machine and several on a 2-core one
without bf16 matrix instructions (fp32); ``--only`` picks steps. ``--dry-run`` runs every
step at a tiny size (seconds each; its figures say nothing about the machine).

    .venv/bin/python bench/cpu_check.py OUTDIR [--only fit-1x4,predict] [--dtype auto]
        [--nvme-dir D] [--dry-run]

The exit status is 0 when every step ran to its end (whether or not its targets are met),
1 otherwise.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import _common

BENCH = Path(__file__).resolve().parent


@dataclass(frozen=True)
class Step:
    """One benchmark run of the check."""

    name: str
    script: str
    flags: tuple[str, ...]
    limit_s: int
    """Wall-clock limit of the run, seconds (a tenth of it with ``--dry-run``)."""


@dataclass(frozen=True)
class Target:
    """A figure of a step's JSON and the bound a CPU target sets on it."""

    step: str
    figure: str
    label: str
    low: float | None = None
    """The figure must be >= this (None: no lower bound)."""
    high: float | None = None
    """The figure must be <= this (None: no upper bound)."""
    kinds: tuple[str, ...] = ()
    """Machine kinds (``_common.cpu_kind``) the target applies to; empty: every kind."""

    def bound(self) -> str:
        if self.low is not None and self.high is not None:
            return f"{self.low:g}-{self.high:g}"
        return f">= {self.low:g}" if self.low is not None else f"<= {self.high:g}"

    def met(self, value: float | None) -> bool | None:
        """Whether ``value`` meets the target; None when nothing was measured."""
        if value is None:
            return None
        return (self.low is None or value >= self.low) and (self.high is None or value <= self.high)


PEER = ("--peer", "deepspeed")
STEPS = (
    Step("fit-1x4", "train_offload.py", ("--repeat", "2", *PEER), 5400),
    Step(
        "fit-4x1",
        "train_offload.py",
        ("--micro-batch", "4", "--accumulate", "1", "--skip-recommended", "--repeat", "2", *PEER),
        5400,
    ),
    Step(
        "fit-nvme",
        "train_offload.py",
        ("--weights-on-nvme", "--skip-recommended", "--warmup", "2", "--steps", "2", *PEER),
        5400,
    ),
    Step("fit-busy", "train_offload.py", ("--busy-probe", "--skip-recommended"), 3600),
    Step("predict", "predict_offload.py", (), 5400),
    Step(
        "predict-busy",
        "predict_offload.py",
        ("--busy-probe", "--hf-batches", "128", "--acc-batches", ""),
        3600,
    ),
)
PREDICTION = (0.75, 1.25)
TARGETS = (
    Target("fit-1x4", "ratio_plain", "balance_beam / plain Lightning", low=0.95),
    Target("fit-1x4", "step_over_floor", "step / in-memory forward + backward", high=1.05),
    Target("fit-1x4", "measured_over_predicted", "measured / predicted at the start", *PREDICTION),
    Target("fit-1x4", "planned_over_plain", "the planner's batch / plain at 1 x 4", low=1.2),
    Target("fit-1x4", "over_deepspeed", "balance_beam / DeepSpeed ZeRO-3", low=2.0),
    Target("fit-4x1", "ratio_plain", "balance_beam / plain Lightning", low=0.95),
    Target("fit-4x1", "step_over_floor", "step / in-memory forward + backward", high=1.05),
    Target("fit-4x1", "measured_over_predicted", "measured / predicted at the start", *PREDICTION),
    Target("fit-4x1", "over_deepspeed", "balance_beam / DeepSpeed ZeRO-3", low=2.0),
    Target("fit-nvme", "over_deepspeed", "balance_beam / DeepSpeed, all on NVMe", low=2.0),
    Target("fit-nvme", "measured_over_predicted", "measured / predicted at the start", *PREDICTION),
    Target("fit-busy", "measured_over_predicted", "measured / predicted, busy probe", *PREDICTION),
    Target("predict", "floor_share", "share of the NVMe-streaming floor", low=0.85),
    Target("predict", "measured_over_predicted", "measured / predicted at the start", *PREDICTION),
    Target("predict", "over_generate", "ours / in-memory generate", low=1.3, kinds=("amx",)),
    Target(
        "predict", "over_accelerate_cold", "ours / Accelerate (cold cache)", low=3.5, kinds=("amx",)
    ),
    Target(
        "predict-busy", "measured_over_predicted", "measured / predicted, busy probe", *PREDICTION
    ),
)
DRY = {
    "train_offload.py": (
        "--layers", "2", "--hidden", "64", "--ffn", "128", "--heads", "4", "--vocab", "256",
        "--seq", "32", "--steps", "1", "--warmup", "1", "--measure-seconds", "1",
    ),
    "predict_offload.py": (
        "--layers", "2", "--hidden", "64", "--ffn", "128", "--heads", "4", "--vocab", "256",
        "--prompts", "4", "--prompt-len", "8", "--new-tokens", "3", "--check-prompts", "2",
        "--measure-seconds", "0.5",
    ),
}  # fmt: skip
"""Tiny sizes for ``--dry-run``, placed after the step's own flags (argparse takes the last)."""


def default_dtype(kind: str) -> str:
    """bf16 on a CPU with bf16 matrix instructions (``kind`` from ``_common.cpu_kind``), else fp32."""
    return "bf16" if kind in ("amx", "avx512_bf16") else "fp32"


def evaluate(figures: dict[str, dict[str, Any] | None], kind: str) -> list[dict[str, Any]]:
    """Each target of a step that was asked for, applicable to ``kind``, with its value.

    ``figures`` maps a step's name to the figures its JSON holds (None: the step wrote
    none). A row's ``met`` is None where the figure was not measured.
    """
    rows = []
    for t in TARGETS:
        if t.step not in figures or (t.kinds and kind not in t.kinds):
            continue
        found = (figures[t.step] or {}).get(t.figure)
        value = float(found) if isinstance(found, int | float) else None
        rows.append(
            {
                "step": t.step,
                "figure": t.figure,
                "label": t.label,
                "value": value,
                "target": t.bound(),
                "met": t.met(value),
            }
        )
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    """The rows as aligned text, one target a line."""
    lines = [f"{'step':<13} {'figure':<40} {'value':>7}  {'target':<10} met"]
    for r in rows:
        value = "-" if r["value"] is None else f"{r['value']:.3f}"
        met = {True: "yes", False: "NO", None: "not measured"}[r["met"]]
        lines.append(f"{r['step']:<13} {r['label']:<40} {value:>7}  {r['target']:<10} {met}")
    return "\n".join(lines)


def run_step(step: Step, out: Path, dtype: str, nvme_dir: str | None, dry: bool) -> dict[str, Any]:
    """Run one step; its command, exit status, seconds and figures."""
    steps = out / "steps"
    steps.mkdir(parents=True, exist_ok=True)
    figures_path = steps / f"{step.name}.json"
    figures_path.unlink(missing_ok=True)
    cmd = [sys.executable, str(BENCH / step.script), *step.flags, "--dtype", dtype]
    if dry:
        cmd += DRY[step.script]
    if nvme_dir is not None:
        cmd += ["--nvme-dir", nvme_dir]
    cmd += ["--json", str(figures_path)]
    limit = step.limit_s // 10 if dry else step.limit_s
    print(f"== {step.name} (limit {limit} s): {' '.join(cmd[1:])}", flush=True)
    start = time.perf_counter()
    with open(steps / f"{step.name}.log", "w", encoding="utf-8") as log:
        # a session of its own: on a timeout its whole group goes (the benchmark's runs are
        # child processes of a fork server, and --busy-probe's neighbour another)
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            code: int | str = proc.wait(timeout=limit)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            code = f"timed out after {limit} s"
    seconds = time.perf_counter() - start
    figures = None
    if figures_path.exists():
        figures = json.loads(figures_path.read_text(encoding="utf-8"))["figures"]
    print(f"== {step.name}: exit {code} after {seconds:.0f} s", flush=True)
    return {"command": cmd[1:], "exit": code, "seconds": seconds, "figures": figures}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("outdir", help="folder for cpu-check.json and each step's log")
    names = [s.name for s in STEPS]
    parser.add_argument("--only", default=",".join(names), help="comma-separated steps to run")
    parser.add_argument("--dtype", choices=["auto", "bf16", "fp32"], default="auto")
    parser.add_argument("--nvme-dir", default=None, help="directory on the disk for NVMe tiers")
    parser.add_argument("--dry-run", action="store_true", help="every step at a tiny size")
    args = parser.parse_args(argv)
    wanted = [n for n in args.only.split(",") if n]
    unknown = sorted(set(wanted) - set(names))
    if unknown or not wanted:
        parser.error(f"--only {args.only!r}: unknown {unknown or 'nothing'}; steps are {names}")
    wanted = [n for n in names if n in wanted]  # in the order they run
    out = Path(args.outdir)
    out.mkdir(parents=True, exist_ok=True)
    kind = _common.cpu_kind()
    dtype = default_dtype(kind) if args.dtype == "auto" else args.dtype
    print(_common.machine(None), flush=True)
    print(f"cpu check: steps {', '.join(wanted)}; {dtype} compute", flush=True)
    ran = {
        s.name: run_step(s, out, dtype, args.nvme_dir, args.dry_run)
        for s in STEPS
        if s.name in wanted
    }
    rows = evaluate({name: r["figures"] for name, r in ran.items()}, kind)
    print(table(rows))
    met = sum(r["met"] is True for r in rows)
    print(f"targets met: {met} of {len(rows)} ({_common.cpu_model()}, {kind}, {dtype})")
    doc = {
        "machine": _common.machine_facts(),
        "dtype": dtype,
        "dry_run": args.dry_run,
        "steps": ran,
        "targets": rows,
        "met": met,
    }
    (out / "cpu-check.json").write_text(json.dumps(doc, indent=2) + "\n", encoding="utf-8")
    return 0 if all(r["exit"] == 0 for r in ran.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
