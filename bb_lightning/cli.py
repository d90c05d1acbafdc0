"""The ``bb-lightning`` command: ``plan`` here; other subcommands dispatch from :data:`COMMANDS`."""

from __future__ import annotations

import argparse
import dataclasses
import re
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from bb_lightning.planner.profile import ModelProfile

__all__ = ["COMMANDS", "main", "parse_size"]

_UNITS = {
    "": 1,
    "B": 1,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
    "KIB": 2**10,
    "MIB": 2**20,
    "GIB": 2**30,
    "TIB": 2**40,
}


class UsageError(ValueError):
    """A bad command-line argument; the message says how to fix it."""


def parse_size(text: str) -> int:
    """Bytes from ``"24GiB"``, ``"1.5 TB"``, ``"4096"`` (binary KiB..TiB, decimal KB..TB)."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*", text)
    unit = m.group(2).upper() if m else ""
    if m is None or unit not in _UNITS:
        raise UsageError(
            f"bad size {text!r}: write a number with an optional unit, e.g. 24GiB, 512MB, 2TiB "
            "(binary KiB MiB GiB TiB or decimal KB MB GB TB)"
        )
    return int(float(m.group(1)) * _UNITS[unit])


def parse_global_batch(text: str) -> tuple[int | None, int | None]:
    """``"1048576"`` -> tokens; ``"512s"`` -> sequences. Returns (tokens, seqs)."""
    m = re.fullmatch(r"\s*([0-9]+)\s*(s|seqs)?\s*", text)
    if m is None or int(m.group(1)) < 1:
        raise UsageError(
            f"bad --global-batch {text!r}: give tokens (e.g. 1048576) or sequences with an "
            "s suffix (e.g. 512s)"
        )
    n = int(m.group(1))
    return (None, n) if m.group(2) else (n, None)


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="bb-lightning", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser(
        "plan",
        help="print the intensity-first plan for a job on a machine",
        description="Plan a fine-tuning or bulk-generation job: batch shape, per-block tiers, "
        "memory per tier (bytes) and the predicted step time (seconds) and tokens/s.",
    )
    p.add_argument(
        "--model",
        default="tiny-llama",
        help="built-in name (tiny-llama, llama-370m, llama-1.5b, llama-30b, opt-30b), "
        "a local model directory, a config.json or a hub id (default: tiny-llama)",
    )
    p.add_argument(
        "--hardware",
        default="measure",
        help="a preset (a100-80gb, h100, t4, ...) or 'measure' to measure this "
        "machine (cached; default: measure)",
    )
    p.add_argument("--task", choices=("fit", "predict"), default="fit", help="default: fit")
    p.add_argument(
        "--seq-len",
        type=int,
        default=None,
        help="fit: tokens per sequence (default: min(2048, model context))",
    )
    p.add_argument(
        "--global-batch",
        default="1048576",
        help="fit: tokens per optimizer step, or sequences with an s suffix "
        "(e.g. 512s); default 1048576 tokens",
    )
    p.add_argument("--prompt-len", type=int, default=512, help="predict: tokens per prompt")
    p.add_argument(
        "--new-tokens", type=int, default=32, help="predict: tokens generated per prompt"
    )
    p.add_argument("--num-prompts", type=int, default=4096, help="predict: prompts in the job")
    p.add_argument("--device-memory", help="device tier size, e.g. 24GiB (overrides the profile)")
    p.add_argument("--host-memory", help="host tier size, e.g. 128GiB (overrides the profile)")
    nv = p.add_mutually_exclusive_group()
    nv.add_argument("--nvme-capacity", help="NVMe tier size, e.g. 2TiB (overrides the profile)")
    nv.add_argument("--no-nvme", action="store_true", help="plan without an NVMe tier")
    p.add_argument("--nvme-path", help="directory on the NVMe to measure (with --hardware measure)")
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    p.add_argument("--plot", metavar="FILE.png", help="write a roofline plot of the plan")
    for name in ("fit", "validate", "predict", "convert", "export"):
        sub.add_parser(name, help=f"{name} (not available in this build)", add_help=False)
    return parser


def _load_model(spec: str) -> ModelProfile:
    from bb_lightning.planner.models import BUILTIN_MODELS, builtin_config
    from bb_lightning.planner.profile import ModelProfile

    if spec.lower() in BUILTIN_MODELS:
        profile = ModelProfile.from_config(builtin_config(spec))
        return dataclasses.replace(profile, name=spec.lower())
    path = Path(spec)
    if path.exists():
        return ModelProfile.from_config(path)
    if re.fullmatch(r"[\w.-]+/[\w.-]+", spec) and not spec.startswith((".", "/")):
        return ModelProfile.from_config(spec)
    raise UsageError(
        f"--model {spec!r} is not a built-in name, an existing path or a hub id (org/name): "
        f"use one of {sorted(BUILTIN_MODELS)}, a local directory or a config.json"
    )


def _plan(args: argparse.Namespace) -> int:
    from bb_lightning.planner import FitJob, PredictJob, make_plan, measure, preset

    model = _load_model(args.model)
    if args.hardware == "measure":
        hw = measure(nvme_path=args.nvme_path)
    else:
        hw = preset(args.hardware)
    changes: dict[str, object] = {}
    if args.device_memory:
        changes["device_memory"] = parse_size(args.device_memory)
    if args.host_memory:
        changes["host_memory"] = parse_size(args.host_memory)
    if args.no_nvme:
        changes.update(nvme_capacity=0, nvme_read_bandwidth=0.0, nvme_write_bandwidth=0.0)
    elif args.nvme_capacity:
        if hw.nvme_read_bandwidth <= 0:
            raise UsageError(
                "--nvme-capacity given but the profile has no NVMe bandwidth: use a preset with "
                "NVMe or --hardware measure --nvme-path DIR"
            )
        changes["nvme_capacity"] = parse_size(args.nvme_capacity)
    hw = hw.replace(**changes)
    job: FitJob | PredictJob
    if args.task == "fit":
        seq = args.seq_len or min(2048, model.max_positions or 2048)
        tokens, seqs = parse_global_batch(args.global_batch)
        job = FitJob(seq_len=seq, global_batch_tokens=tokens, global_batch_seqs=seqs)
    else:
        job = PredictJob(
            prompt_len=args.prompt_len, new_tokens=args.new_tokens, num_prompts=args.num_prompts
        )
    plan = make_plan(model, hw, job)
    print(plan.to_json() if args.json else plan.explain())
    if args.plot:
        from bb_lightning.planner.roofline import plot_roofline

        plot_roofline(plan, args.plot)
    return 0


def _not_available(args: argparse.Namespace) -> int:
    print(f"bb-lightning {args.command}: not available in this build", file=sys.stderr)
    return 2


COMMANDS: dict[str, Callable[[argparse.Namespace], int]] = {
    "plan": _plan,
    "fit": _not_available,
    "validate": _not_available,
    "predict": _not_available,
    "convert": _not_available,
    "export": _not_available,
}
"""Subcommand name -> handler; other modules register their handlers here."""


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``bb-lightning``; returns the exit code (2 on bad input)."""
    parser = _build_parser()
    args, rest = parser.parse_known_args(list(sys.argv[1:] if argv is None else argv))
    if rest and args.command == "plan":
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    try:
        return COMMANDS[args.command](args)
    except (ValueError, OSError) as err:
        print(f"bb-lightning {args.command}: {err}", file=sys.stderr)
        return 2
