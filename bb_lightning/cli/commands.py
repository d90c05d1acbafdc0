"""The ``bb-lightning`` command's subcommands and its entry point, :func:`main`.

``fit``, ``validate`` and ``predict`` run :class:`~bb_lightning.cli.lightning.BalanceBeamCLI`,
a LightningCLI with ``balance_beam`` as the default strategy,
:class:`~bb_lightning.module.CausalLMModule` as the default model and
:class:`~bb_lightning.data.TextDataModule` / :class:`~bb_lightning.data.PromptsDataModule`
as data (any subclass may be named); Lightning is imported for those only.
``plan``, ``convert``, ``export`` and ``verify`` are argparse subcommands; every subcommand is
dispatched from :data:`COMMANDS`.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import os
import re
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from bb_lightning.cli.errors import OneLineArgumentParser, UsageError, first_line
from bb_lightning.cli.plan_args import add_activation_args, plan_overrides, recipe_overrides

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


def parse_size(text: str, flag: str | None = None) -> int:
    """Bytes from ``"24GiB"``, ``"1.5 TB"``, ``"4096"`` (binary KiB..TiB, decimal KB..TB).

    With ``flag`` (``"--host-memory"``) the size must be at least one byte, and a bad
    one is refused naming the flag.
    """
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*", text)
    unit = m.group(2).upper() if m else ""
    where = f" for {flag}" if flag else ""
    if m is None or unit not in _UNITS:
        raise UsageError(
            f"bad size {text!r}{where}: write a number with an optional unit, e.g. 24GiB, "
            "512MB, 2TiB (binary KiB MiB GiB TiB or decimal KB MB GB TB)"
        )
    size = int(float(m.group(1)) * _UNITS[unit])
    if flag is not None and size < 1:
        raise UsageError(
            f"{flag} {text!r} is {size} bytes: give a size of at least 1 byte, e.g. 24GiB"
        )
    return size


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


DESCRIPTION = (
    "Balance Beam: fine-tune and bulk-run LLMs larger than accelerator memory. "
    "'plan' prints the intensity-first plan of a job on a machine."
)
"""Top-level ``--help`` text (plain text: argparse prints it verbatim)."""


def _build_parser() -> argparse.ArgumentParser:
    parser: argparse.ArgumentParser = OneLineArgumentParser(
        prog="bb-lightning", description=DESCRIPTION
    )
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
        help="built-in name (tiny-llama, llama-370m/1.5b/8b/30b/70b, opt-30b, mixtral-8x7b), "
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
        type=_positive_int,
        default=None,
        help="fit: tokens per sequence (default: min(2048, model context))",
    )
    p.add_argument(
        "--global-batch",
        default="1048576",
        help="fit: tokens per optimizer step, or sequences with an s suffix "
        "(e.g. 512s); default 1048576 tokens",
    )
    p.add_argument(
        "--prompt-len", type=_positive_int, default=512, help="predict: tokens per prompt"
    )
    p.add_argument(
        "--new-tokens", type=_positive_int, default=32, help="predict: tokens generated per prompt"
    )
    p.add_argument(
        "--num-prompts", type=_positive_int, default=4096, help="predict: prompts in the job"
    )
    p.add_argument(
        "--decode-attention",
        choices=("device", "host"),
        default=None,
        help="predict: 'host' forces the KV cache on the host with decode attention on the "
        "host's cores beside a GPU (two groups of sequences in flight, the host attending for "
        "one while the device computes the other), 'device' keeps attention on the device; "
        "default: the faster, where the profile prices the host's memory reads",
    )
    p.add_argument("--device-memory", help="device tier size, e.g. 24GiB (overrides the profile)")
    p.add_argument("--host-memory", help="host tier size, e.g. 128GiB (overrides the profile)")
    nv = p.add_mutually_exclusive_group()
    nv.add_argument("--nvme-capacity", help="NVMe tier size, e.g. 2TiB (overrides the profile)")
    nv.add_argument("--no-nvme", action="store_true", help="plan without an NVMe tier")
    p.add_argument("--nvme-path", help="directory on the NVMe to measure (with --hardware measure)")
    _add_layout_args(p)
    p.add_argument(
        "--loss-chunk-tokens",
        type=_count,
        default=None,
        help="fit: price the loss's logits for this many tokens at once, as CausalLMModule's "
        "loss_chunk_tokens computes it; default: its default for the model's vocabulary "
        "(2796 tokens at 32k, 697 at 128k); 0: the whole pass's, as transformers' loss holds "
        "them for a module that calls the model with labels",
    )
    add_activation_args(p)
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    p.add_argument(
        "--dry-run",
        action="store_true",
        help="run one optimizer step (fit) or one batch (predict) of the plan on meta tensors "
        "(the real model size, no data, no I/O) and print each tier's peak against its budget "
        "and the bytes per link against the plan's; exit 1 when a peak exceeds its budget",
    )
    p.add_argument("--plot", metavar="FILE.png", help="write a roofline plot of the plan")
    _add_convert_parser(sub)
    _add_export_parser(sub)
    _add_verify_parser(sub)
    for name, what in _LIGHTNING_HELP.items():
        sub.add_parser(name, help=f"{what} (LightningCLI: bb-lightning {name} --help)")
    return parser


def _add_layout_args(p: argparse.ArgumentParser) -> None:
    """``plan``'s data-parallel layout: ranks per node, nodes, the collectives' rates."""
    p.add_argument(
        "--devices",
        type=_positive_int,
        default=1,
        help="data-parallel ranks per node (the Trainer's devices; default 1): the plan is "
        "one rank's, on its share of the node",
    )
    p.add_argument(
        "--num-nodes", type=_positive_int, default=1, help="nodes (the Trainer's num_nodes)"
    )
    for level, where in (("intra", "between two GPUs of a node"), ("inter", "between nodes")):
        h = f"collective GB/s {where}, per direction per GPU (default: the profile's)"
        p.add_argument(f"--{level}-node-bandwidth", type=_positive_float, metavar="GB/S", help=h)


_LIGHTNING_HELP = {
    "fit": "fine-tune a model from a recipe (--config recipe.yaml)",
    "validate": "compute the validation loss (nats per token) of a model",
    "predict": "bulk-generate completions for a .jsonl of prompts",
}


def _add_convert_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "convert",
        help="convert a Hugging Face safetensors checkpoint into an NVMe-tier zarr store",
        description="Stream a local Hugging Face checkpoint (model.safetensors, or shards with "
        "model.safetensors.index.json) tensor by tensor into a zarr v3 group laid out for the "
        "NVMe tier (one uncompressed chunk per tensor). Resumable: tensors already complete "
        "in the target with the same shape and dtype are skipped.",
    )
    p.add_argument("source", help="local checkpoint directory holding *.safetensors")
    p.add_argument("target", help="directory of the zarr store (created; its parent must exist)")
    p.add_argument(
        "--dtype",
        choices=("keep", "bf16", "fp16", "fp32"),
        default="keep",
        help="dtype of the stored floating-point tensors (default: keep the checkpoint's)",
    )
    p.add_argument(
        "--capacity",
        help="bytes the store may hold, e.g. 80GiB (default: the converted tensors' total)",
    )
    p.add_argument(
        "--io-backend",
        choices=("auto", "posix", "kvikio"),
        default="auto",
        help="file I/O backend (default: auto = kvikio where a CUDA driver exists)",
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def _add_export_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "export",
        help="export a balance_beam checkpoint directory as a Hugging Face model directory",
        description="Write the weights of a balance_beam checkpoint directory (from "
        "ModelCheckpoint or trainer.save_checkpoint) as a Hugging Face directory "
        "(config.json + safetensors) that AutoModelForCausalLM.from_pretrained loads.",
    )
    p.add_argument("checkpoint", help="balance_beam checkpoint directory")
    p.add_argument("target", help="output directory (created)")
    p.add_argument(
        "--dtype",
        choices=("bf16", "fp16", "fp32"),
        default="bf16",
        help="dtype of the written floating-point weights (default: bf16)",
    )
    p.add_argument(
        "--max-shard-size",
        default="5GB",
        help="largest safetensors shard, e.g. 5GB or 2GiB (bytes; default 5GB)",
    )


def _add_verify_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "verify",
        help="check every chunk (length, CRC-32C) of an NVMe-tier store or a checkpoint",
        description="Check a zarr store written by the NVMe tier or convert, or a balance_beam "
        "checkpoint directory: every array's metadata, chunk length and CRC-32C checksum (and, "
        "for a checkpoint, that every parameter has its arrays and the trainer state loads "
        "without running code). Prints one line per problem and exits 1 if there is any; "
        "else prints a one-line summary and exits 0.",
    )
    p.add_argument("path", help="store directory (zarr.json) or checkpoint directory (meta.json)")


def _load_model(spec: str) -> ModelProfile:
    from bb_lightning.planner.models import BUILTIN_MODELS, builtin_config
    from bb_lightning.probe import model_profile_from_config

    if spec.lower() in BUILTIN_MODELS:
        profile = model_profile_from_config(builtin_config(spec))
        return dataclasses.replace(profile, name=spec.lower())
    path = Path(spec)
    if path.exists():
        return model_profile_from_config(path)
    if re.fullmatch(r"[\w.-]+/[\w.-]+", spec) and not spec.startswith((".", "/")):
        try:
            return model_profile_from_config(spec)
        except OSError as err:
            raise UsageError(
                f"--model {spec!r}: its config cannot be loaded from the hub or the local cache "
                f"({first_line(err)}): pass a local model directory or config.json, or run "
                "where the hub is reachable"
            ) from err
    raise UsageError(
        f"--model {spec!r} is not a built-in name, an existing path or a hub id (org/name): "
        f"use one of {sorted(BUILTIN_MODELS)}, a local directory or a config.json"
    )


def _check_plot_path(text: str) -> None:
    """Raise :class:`UsageError` unless a PNG can be written at ``text`` (checked before planning)."""
    target = Path(text)
    folder = target.parent if str(target.parent) else Path(".")
    if target.is_dir():
        raise UsageError(
            f"--plot {text!r} is a directory: give a file name such as {text}/roof.png"
        )
    if not folder.is_dir():
        raise UsageError(
            f"--plot {text!r}: directory {str(folder)!r} does not exist: create it or pick "
            "another path"
        )
    if not os.access(folder, os.W_OK | os.X_OK):
        raise UsageError(
            f"--plot {text!r}: directory {str(folder)!r} is not writable: pick a writable directory"
        )


def _positive_int(text: str) -> int:
    """An argparse type: an integer >= 1."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer >= 1, e.g. 512")
    return value


def _positive_float(text: str) -> float:
    """An argparse type: a number > 0."""
    value = float(text) if re.fullmatch(r"\s*[0-9]*\.?[0-9]+\s*", text) else 0.0
    if not value > 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number > 0, e.g. 50")
    return value


def _count(text: str) -> int:
    """An argparse type: an integer >= 0."""
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer >= 0, e.g. 1024")
    return value


def module_loss_chunk(chunk: int | None, vocab_size: int) -> int | None:
    """The loss chunk a :class:`~bb_lightning.module.CausalLMModule` given ``loss_chunk_tokens
    = chunk`` computes in, as a :class:`~bb_lightning.planner.FitJob` takes it (None: whole)."""
    from bb_lightning.planner.cost import loss_chunk_tokens

    return loss_chunk_tokens(vocab_size) if chunk is None else (chunk or None)


def _plan(args: argparse.Namespace) -> int:
    from bb_lightning.planner import FitJob, PredictJob, make_plan, preset
    from bb_lightning.probe import measure
    from bb_lightning.strategy import world

    if args.plot:
        _check_plot_path(args.plot)
    sizes = {  # every value checked before the model is read or the machine measured
        name: parse_size(text, f"--{name.replace('_', '-')}")
        for name, text in (
            ("device_memory", args.device_memory),
            ("host_memory", args.host_memory),
            ("nvme_capacity", args.nvme_capacity),
        )
        if text
    }
    tokens, seqs = parse_global_batch(args.global_batch) if args.task == "fit" else (None, None)
    model = _load_model(args.model)
    if args.hardware == "measure":
        hw = measure(nvme_path=args.nvme_path)
    else:
        hw = preset(args.hardware, gpus=args.devices)
    changes: dict[str, object] = {k: v for k, v in sizes.items() if k != "nvme_capacity"}
    if args.no_nvme:
        changes.update(nvme_capacity=0, nvme_read_bandwidth=0.0, nvme_write_bandwidth=0.0)
    elif "nvme_capacity" in sizes:
        if hw.nvme_read_bandwidth <= 0:
            raise UsageError(
                "--nvme-capacity given but the profile has no NVMe bandwidth: use a preset with "
                "NVMe or --hardware measure --nvme-path DIR"
            )
        changes["nvme_capacity"] = sizes["nvme_capacity"]
    for level in ("intra", "inter"):  # the collectives' GB/s, where given
        if (rate := getattr(args, f"{level}_node_bandwidth")) is not None:
            changes[f"{level}_node_bandwidth"] = rate * 1e9
    hw = world.with_world(hw.replace(**changes), args.devices * args.num_nodes, args.devices)
    if args.decode_attention is not None and args.task != "predict":
        raise UsageError(
            f"--decode-attention {args.decode_attention} plans generation: use it with "
            "--task predict"
        )
    job: FitJob | PredictJob
    if args.task == "fit":
        seq = args.seq_len
        if seq is None:
            seq = min(2048, model.max_positions or 2048)
        job = FitJob(
            seq_len=seq,
            global_batch_tokens=tokens,
            global_batch_seqs=seqs,
            loss_chunk_tokens=module_loss_chunk(args.loss_chunk_tokens, model.vocab_size),
        )
    else:
        job = PredictJob(
            prompt_len=args.prompt_len, new_tokens=args.new_tokens, num_prompts=args.num_prompts
        )
    plan = make_plan(model, hw, job, overrides=plan_overrides(args))
    print(plan.to_json() if args.json else plan.explain())
    if args.plot:
        from bb_lightning.planner.roofline import plot_roofline

        plot_roofline(plan, args.plot)
    if args.dry_run:
        from bb_lightning.planner.models import BUILTIN_MODELS, builtin_config

        spec = args.model
        return _dry_run(plan, builtin_config(spec) if spec.lower() in BUILTIN_MODELS else spec)
    return 0


def _dry_run(plan: Any, config: Any, *, lora: Any = None) -> int:
    """Run ``plan`` on meta tensors of the model of ``config`` (a config dict, path or hub
    id; a fit with ``lora``'s adapters over its frozen weights) and print what it found; 1
    when a tier's peak exceeds its budget."""
    from bb_lightning.strategy.dryrun import dry_fit, dry_predict

    if plan.task == "fit":
        report = dry_fit(plan, config, lora=lora)
    else:
        report = dry_predict(plan, config)
    print(report.render())
    for tier in report.over:
        peak = report.peaks.get(tier)
        where = "" if peak is None else f" during {peak.phase}"
        print(f"error: the {tier.value} tier exceeds the plan's budget{where}", file=sys.stderr)
    return 1 if report.over else 0


def _convert(args: argparse.Namespace) -> int:
    from bb_lightning.hf.convert import convert_checkpoint
    from storage.io import IOConfig

    dtypes = {"keep": None, "bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}
    report = convert_checkpoint(
        args.source,
        args.target,
        dtype=dtypes[args.dtype],
        capacity=parse_size(args.capacity, "--capacity") if args.capacity else None,
        io=IOConfig(backend=args.io_backend),
        progress=not args.no_progress,
    )
    print(report.summary())
    return 0


def _export(args: argparse.Namespace) -> int:
    try:
        from bb_lightning.hf.export import export_hf
    except ImportError:
        raise UsageError(
            "export is not available: bb_lightning.hf.export is missing from this installation; "
            "reinstall the package (pip install -e .)"
        ) from None
    import torch

    dtypes = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
    if not Path(args.checkpoint).is_dir():
        raise UsageError(
            f"checkpoint {args.checkpoint!r} is not a directory: pass a balance_beam checkpoint "
            "directory (written by ModelCheckpoint or trainer.save_checkpoint)"
        )
    out = export_hf(
        args.checkpoint,
        args.target,
        dtype=dtypes[args.dtype],
        max_shard_bytes=parse_size(args.max_shard_size, "--max-shard-size"),
    )
    print(f"exported {args.checkpoint} -> {out if out is not None else args.target}")
    return 0


def _verify(args: argparse.Namespace) -> int:
    from storage.tiers import format_bytes
    from storage.verify import verify_group

    path = Path(args.path)
    if (path / "meta.json").is_file():
        from bb_lightning.engine.checkpoint import verify_checkpoint

        what, report = "checkpoint", verify_checkpoint(path)
    elif (path / "zarr.json").is_file():
        what, report = "store", verify_group(path)
    else:
        raise UsageError(
            f"{args.path!r} is neither a store (no zarr.json) nor a checkpoint (no meta.json): "
            "pass a directory written by bb-lightning convert, the NVMe tier or "
            "trainer.save_checkpoint"
        )
    for line in report.problems:
        print(line)
    if report.problems:
        print(f"{what} {path}: {len(report.problems)} problem(s)", file=sys.stderr)
        return 1
    old = f", {len(report.unverified)} without checksum (format 1)" if report.unverified else ""
    print(
        f"{what} {path}: ok: {report.arrays} arrays, {format_bytes(report.bytes)} checksummed{old}"
    )
    return 0


def _lightning(args: argparse.Namespace) -> int:
    if "--dry-run" in args.lightning_args:
        rest = [a for a in args.lightning_args if a != "--dry-run"]
        return _recipe_dry_run(args.command, rest)
    from bb_lightning.cli.lightning import run_lightning_cli

    return run_lightning_cli([args.command, *args.lightning_args])


def _recipe_dry_run(command: str, argv: list[str]) -> int:
    """``bb-lightning fit --config RECIPE --dry-run``: plan the recipe's job on the machine
    its strategy names (a preset) and dry-run one optimizer step of the plan
    (:func:`_dry_run`), without Lightning's Trainer or the data."""
    from bb_lightning.cli.lightning import parse_recipe
    from bb_lightning.cli.recipe_dryrun import fit_recipe_profile
    from bb_lightning.module import resolve_model_config
    from bb_lightning.planner import FitJob, make_plan, preset
    from bb_lightning.strategy.session import compute_dtype

    if command not in ("fit", "predict"):
        raise UsageError(
            f"bb-lightning {command} --dry-run: only fit and predict recipes dry-run; drop "
            "--dry-run"
        )
    cfg = parse_recipe([command, *argv])
    strategy = getattr(cfg.trainer.strategy, "init_args", None)
    hardware = getattr(strategy, "hardware", None)
    if not isinstance(hardware, str) or hardware == "measure":
        raise UsageError(
            f"--dry-run plans for a named machine, but the recipe's hardware is {hardware!r}: "
            "add --trainer.strategy.init_args.hardware=PRESET (a100-80gb, h100, ...)"
        )
    if command == "predict":  # one batch of the recipe's generation job
        from bb_lightning.cli.recipe_dryrun import predict_recipe_plan

        plan, config, said = predict_recipe_plan(cfg, hardware)
        print(plan.explain())
        print(said)
        return _dry_run(plan, config)
    spec = cfg.model.init_args.model  # a path, a hub id, a built-in name, a config mapping
    if isinstance(spec, str) and spec.lstrip().startswith("{"):  # the mapping, as parsed
        try:
            spec = ast.literal_eval(spec)
        except (ValueError, SyntaxError) as err:
            raise UsageError(f"model.init_args.model={spec!r} is not a mapping: {err}") from err
    config, _ = resolve_model_config(spec)
    data = cfg.data.init_args
    accum = int(cfg.trainer.accumulate_grad_batches or 1)
    dtype = compute_dtype(getattr(strategy, "compute_dtype", None), str(cfg.trainer.precision))
    profile, lora = fit_recipe_profile(cfg, config, dtype)  # LoRA: the adapters train
    chunk = getattr(cfg.model.init_args, "loss_chunk_tokens", None)
    job = FitJob(
        seq_len=data.seq_len,
        global_batch_seqs=data.batch_size * accum,
        grad_clipping=bool(cfg.trainer.gradient_clip_val),  # None or 0: no clipping
        grad_clip_algorithm=str(
            getattr(cfg.trainer, "gradient_clip_algorithm", None) or "norm"
        ).lower(),
        compute_dtype=str(dtype).removeprefix("torch."),
        loss_chunk_tokens=module_loss_chunk(chunk, profile.vocab_size),
    )
    forced = recipe_overrides(strategy, micro_batch=data.batch_size, grad_accum=accum)
    plan = make_plan(profile, preset(hardware), job, overrides=forced)
    print(plan.explain())
    return _dry_run(plan, config, lora=lora)


COMMANDS: dict[str, Callable[[argparse.Namespace], int]] = {
    "plan": _plan,
    "convert": _convert,
    "export": _export,
    "verify": _verify,
    "fit": _lightning,
    "validate": _lightning,
    "predict": _lightning,
}
"""Subcommand name -> handler; Lightning subcommands read ``args.lightning_args``."""


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``bb-lightning``; returns the exit code (2 on bad input)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in _LIGHTNING_HELP:
        args = argparse.Namespace(command=argv[0], lightning_args=argv[1:])
    else:
        args = _build_parser().parse_args(argv)
    from storage.nvme import NvmeError  # torch: not needed for --help

    try:
        return COMMANDS[args.command](args)
    except (ValueError, OSError, NvmeError) as err:
        print(f"bb-lightning {args.command}: {first_line(err)}", file=sys.stderr)
        return 2
