"""The ``bb-lightning`` command.

``fit``, ``validate`` and ``predict`` run :class:`BalanceBeamCLI`, a LightningCLI with
``balance_beam`` as the default strategy, :class:`~bb_lightning.module.CausalLMModule`
as the default model and :class:`~bb_lightning.data.TextDataModule` /
:class:`~bb_lightning.data.PromptsDataModule` as data (any subclass may be named).
``plan``, ``convert``, ``export`` and ``verify`` are argparse subcommands; every subcommand is
dispatched from :data:`COMMANDS`.

Recipe strings may hold ``{stdlib}``, replaced by the directory of the Python
standard library (``sysconfig.get_paths()["stdlib"]``), so that a recipe can
train on text that every machine has.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import re
import sys
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lightning.pytorch.cli import LightningArgumentParser, LightningCLI, SaveConfigCallback

from bb_lightning.cli_errors import OneLineArgumentParser, explain_jsonargparse, parser_keys
from storage.nvme import NvmeError

if TYPE_CHECKING:
    from bb_lightning.planner.profile import ModelProfile

__all__ = ["COMMANDS", "BalanceBeamCLI", "main", "parse_size", "run_lightning_cli"]

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
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    p.add_argument("--plot", metavar="FILE.png", help="write a roofline plot of the plan")
    _add_convert_parser(sub)
    _add_export_parser(sub)
    _add_verify_parser(sub)
    for name, what in _LIGHTNING_HELP.items():
        sub.add_parser(name, help=f"{what} (LightningCLI: bb-lightning {name} --help)")
    return parser


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
                f"({_first_line(err)}): pass a local model directory or config.json, or run "
                "where the hub is reachable"
            ) from err
    raise UsageError(
        f"--model {spec!r} is not a built-in name, an existing path or a hub id (org/name): "
        f"use one of {sorted(BUILTIN_MODELS)}, a local directory or a config.json"
    )


def _first_line(err: BaseException) -> str:
    """The first non-empty line of ``err``'s message (library errors can span many lines)."""
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    return lines[0] if lines else type(err).__name__


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
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer >= 1")
    return value


def _plan(args: argparse.Namespace) -> int:
    from bb_lightning import world
    from bb_lightning.planner import FitJob, PredictJob, make_plan, preset
    from bb_lightning.probe import measure

    if args.plot:
        _check_plot_path(args.plot)
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
    hw = world.with_world(hw.replace(**changes), args.devices * args.num_nodes, args.devices)
    job: FitJob | PredictJob
    if args.task == "fit":
        seq = args.seq_len
        if seq is None:
            seq = min(2048, model.max_positions or 2048)
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


def _convert(args: argparse.Namespace) -> int:
    from bb_lightning.convert import convert_checkpoint
    from storage.io import IOConfig

    dtypes = {"keep": None, "bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}
    report = convert_checkpoint(
        args.source,
        args.target,
        dtype=dtypes[args.dtype],
        capacity=parse_size(args.capacity) if args.capacity else None,
        io=IOConfig(backend=args.io_backend),
        progress=not args.no_progress,
    )
    print(report.summary())
    return 0


def _export(args: argparse.Namespace) -> int:
    try:
        from bb_lightning.export import export_hf
    except ImportError:
        raise UsageError(
            "export is not available: bb_lightning.export is missing from this installation; "
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
        max_shard_bytes=parse_size(args.max_shard_size),
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
    return run_lightning_cli([args.command, *args.lightning_args])


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
    try:
        return COMMANDS[args.command](args)
    except (ValueError, OSError, NvmeError) as err:
        print(f"bb-lightning {args.command}: {_first_line(err)}", file=sys.stderr)
        return 2


# -- fit / validate / predict: LightningCLI ------------------------------------------------

_STDLIB = "{stdlib}"


def _resolve_placeholders(value: Any) -> Any:
    """``value`` with ``{stdlib}`` replaced in every string (nested namespaces, lists, dicts)."""
    if isinstance(value, str):
        if _STDLIB not in value:
            return value
        import sysconfig

        return value.replace(_STDLIB, sysconfig.get_paths()["stdlib"])
    if isinstance(value, list):
        return [_resolve_placeholders(v) for v in value]
    if isinstance(value, dict):
        return {k: _resolve_placeholders(v) for k, v in value.items()}
    if hasattr(value, "items") and hasattr(value, "__setitem__"):  # a jsonargparse Namespace
        for key, item in list(value.items(branches=True)):
            value[key] = _resolve_placeholders(item)
    return value


def _mapping_from_text(text: str) -> dict[str, Any] | None:
    """A model config given inline (YAML mapping or JSON object) that the parser made a string."""
    import ast
    import json

    if not text.lstrip().startswith("{"):
        return None
    for parse in (json.loads, ast.literal_eval):
        try:
            value = parse(text)
        except (ValueError, SyntaxError):
            continue
        if isinstance(value, dict):
            return value
    return None


def _write_model_config(config: dict[str, Any], root: Path) -> str:
    """Write an inline model config as ``root/model-<hash>.json``; its path.

    The parser turns a mapping given for the module's ``model`` argument into a
    string (its type also accepts paths and names), so the mapping travels as the
    path of a ``config.json``, which the module reads like any other.
    """
    import hashlib
    import json

    text = json.dumps(config, sort_keys=True, indent=1)
    path = root / f"model-{hashlib.sha256(text.encode()).hexdigest()[:12]}.json"
    if not path.is_file():
        root.mkdir(parents=True, exist_ok=True)
        path.write_text(text + "\n", encoding="utf-8")
    return str(path)


class _SaveConfigWhenRunning(SaveConfigCallback):
    """Writes ``config.yaml`` when the loop starts, so a run that fails in setup writes nothing."""

    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        """Nothing yet (see :meth:`_save`)."""

    def _save(self, trainer: Any, pl_module: Any) -> None:
        stage = trainer.state.stage
        super().setup(trainer, pl_module, stage.value if stage is not None else "fit")

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        self._save(trainer, pl_module)

    def on_validation_start(self, trainer: Any, pl_module: Any) -> None:
        self._save(trainer, pl_module)

    def on_predict_start(self, trainer: Any, pl_module: Any) -> None:
        self._save(trainer, pl_module)


def _build_lightning_cli(args: list[str], *, cls: type | None = None) -> Any:
    """Run a :class:`BalanceBeamCLI` (or ``cls``) on ``args`` (the subcommand first)."""
    from lightning.pytorch import LightningDataModule

    from bb_lightning.module import CausalLMModule

    defaults: dict[str, Any] = {"strategy": {"class_path": "bb_lightning.BalanceBeamStrategy"}}
    return (cls or BalanceBeamCLI)(
        CausalLMModule,
        LightningDataModule,
        subclass_mode_model=True,
        subclass_mode_data=True,
        trainer_defaults=defaults,
        save_config_kwargs={"overwrite": True},
        save_config_callback=_SaveConfigWhenRunning,
        parser_kwargs={"exit_on_error": False},
        args=args,
    )


@contextlib.contextmanager
def _argv(argv: list[str]) -> Iterator[None]:
    saved, sys.argv = sys.argv, argv
    try:
        yield
    finally:
        sys.argv = saved


def parse_recipe(args: Sequence[str]) -> Any:
    """Parse and validate ``bb-lightning fit|validate|predict ARGS`` without building anything.

    Every key of the recipe and the overrides is checked against the signatures of
    the classes it names (jsonargparse); returns the subcommand's config namespace.
    Raises :class:`UsageError` naming the bad key.
    """
    from jsonargparse import ArgumentError

    class _ParseOnly(BalanceBeamCLI):
        def before_instantiate_classes(self) -> None:
            _resolve_placeholders(self._config())

        def instantiate_classes(self) -> None:
            """Nothing: only the parse and validation are wanted."""

        def after_instantiate_classes(self) -> None:
            """Nothing."""

        def _run_subcommand(self, subcommand: str) -> None:
            """Nothing."""

    try:
        with _argv(sys.argv[:1]):
            cli = _build_lightning_cli(list(args), cls=_ParseOnly)
    except ArgumentError as err:
        raise UsageError(_first_line(err)) from None
    return cli._config()


def run_lightning_cli(args: Sequence[str]) -> int:
    """Run ``bb-lightning fit|validate|predict ARGS``; returns the exit code (2 on bad input)."""
    from jsonargparse import ArgumentError

    try:
        with _argv(sys.argv[:1]):  # the arguments come from ``args`` only
            _build_lightning_cli(list(args))
    except ArgumentError as err:
        raise UsageError(
            f"{_first_line(err)} (see bb-lightning {args[0] if args else 'fit'} --help)"
        ) from None
    return 0


class BalanceBeamCLI(LightningCLI):
    """LightningCLI with ``--trace``, ``--throughput``, ``--samples`` and ``{stdlib}`` in recipes."""

    @staticmethod
    def subcommands() -> dict[str, set[str]]:
        keep = ("fit", "validate", "predict")
        return {k: v for k, v in LightningCLI.subcommands().items() if k in keep}

    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        parser.add_argument(
            "--trace",
            type=str | None,
            default=None,
            help="write a Chrome/Perfetto trace (JSON; timestamps in microseconds) of "
            "compute and copies per block and per thread to this file",
        )
        parser.add_argument(
            "--throughput",
            type=bool,
            default=True,
            help="show tokens/s, FLOP/s (MFU on GPUs) and bytes/s per copy link in the "
            "progress bar and the loggers",
        )
        parser.add_argument(
            "--samples",
            type=list[str],
            default=[],
            help="fit: prompts to complete with the trained model at the end (greedy)",
        )
        parser.add_argument(
            "--sample_tokens",
            type=int,
            default=64,
            help="fit: tokens generated per sample prompt",
        )

    def _config(self) -> Any:
        return self.config[self.subcommand] if self.subcommand else self.config

    def parse_arguments(self, parser: LightningArgumentParser, args: Any) -> None:
        """Parse as LightningCLI does; a bad key or value becomes one :class:`UsageError` line."""
        from jsonargparse import ArgumentError

        self._args = [a for a in (args or []) if isinstance(a, str)]
        try:
            super().parse_arguments(parser, args)
        except ArgumentError as err:
            words = [a for a in (args or []) if isinstance(a, str)]
            command = next((a for a in words if a in _LIGHTNING_HELP), "fit")
            sub = getattr(self, "_subcommand_parsers", {}).get(command, parser)
            raise UsageError(explain_jsonargparse(str(err), parser_keys(sub), command)) from None

    def _run_subcommand(self, subcommand: str) -> None:
        """Run it with ``sys.argv`` saying the command: Lightning's launcher of several
        ranks (``--trainer.devices 2``) starts each rank's process with ``sys.argv``."""
        with _argv([*sys.argv[:1], *getattr(self, "_args", [])]):
            super()._run_subcommand(subcommand)

    def before_instantiate_classes(self) -> None:
        cfg = self._config()
        _resolve_placeholders(cfg)
        model = cfg.get("model")
        init = getattr(model, "init_args", None)
        if init is not None and isinstance(init.get("model"), str):
            inline = _mapping_from_text(init["model"])
            if inline is not None:
                root = cfg.get("trainer", {}).get("default_root_dir") or "."
                init["model"] = _write_model_config(inline, Path(root))
        strategy = cfg.get("trainer", {}).get("strategy")
        nvme = getattr(getattr(strategy, "init_args", None), "nvme_path", None)
        if isinstance(nvme, str):
            Path(nvme).mkdir(parents=True, exist_ok=True)

    def instantiate_trainer(self, **kwargs: Any) -> Any:
        from lightning.pytorch.callbacks import ProgressBar, RichProgressBar

        from bb_lightning.callbacks import ThroughputCallback
        from bb_lightning.summary import BalanceBeamProgressBar
        from bb_lightning.trace import TraceCallback

        trainer = super().instantiate_trainer(**kwargs)
        cfg = self._config()
        callbacks: list[Any] = trainer.callbacks  # type: ignore[attr-defined]
        for i, cb in enumerate(callbacks):  # Lightning's default bar: the epochs, tokens/s
            if type(cb) is RichProgressBar and not self._progress_bar_configured():
                callbacks[i] = BalanceBeamProgressBar()
        if cfg.get("throughput", True):  # before the progress bar: it shows this batch's rates
            bar = next((i for i, cb in enumerate(callbacks) if isinstance(cb, ProgressBar)), None)
            callbacks.insert(len(callbacks) if bar is None else bar, ThroughputCallback())
        if cfg.get("trace"):
            callbacks.append(TraceCallback(cfg["trace"]))
        return trainer

    def _progress_bar_configured(self) -> bool:
        """Whether the recipe or the command line gave the Trainer a progress bar callback."""
        import importlib

        from lightning.pytorch.callbacks import ProgressBar

        given = self._config().get("trainer", {}).get("callbacks") or []
        for spec in given if isinstance(given, list) else [given]:
            module, _, name = str(getattr(spec, "class_path", "")).rpartition(".")
            cls = getattr(importlib.import_module(module), name, None) if module else None
            if isinstance(cls, type) and issubclass(cls, ProgressBar):
                return True
        return False

    def after_fit(self) -> None:
        from bb_lightning.summary import describe_placement

        strategy = self.trainer.strategy
        plan = getattr(strategy, "plan", None)
        engine = getattr(strategy, "engine", None)
        if not self.trainer.is_global_zero:  # every rank ran the same plan: said once
            plan = engine = None
        if plan is not None:
            print("plan used:\n" + plan.explain())
        elif engine is not None:
            print(f"placement used: {describe_placement(engine.pager.placement)}")
        prompts = self._config().get("samples") or []
        if prompts:
            _print_samples(self, list(prompts), int(self._config()["sample_tokens"]))


def _print_samples(cli: Any, prompts: list[str], new_tokens: int) -> None:
    """Greedy completions of ``prompts`` by the trained model (weights gathered on the host)."""
    import torch

    from bb_lightning.tokenizer import decode_ids, encode_text, load_tokenizer

    gather = getattr(cli.trainer.strategy, "gather_full_model", None)
    module = gather() if callable(gather) else cli.model  # on every rank (collective reads)
    net = getattr(module, "model", None)
    if net is None or not cli.trainer.is_global_zero:
        return
    data = cli.datamodule
    tokenizer = getattr(data, "tokenizer", None) or load_tokenizer(None)
    net = net.to("cpu").float().eval()
    print(f"samples ({new_tokens} new tokens each, greedy):")
    for prompt in prompts:
        ids = torch.tensor([encode_text(tokenizer, prompt)], dtype=torch.long)
        with torch.no_grad():
            out = net.generate(
                input_ids=ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=new_tokens,
                do_sample=False,
                pad_token_id=0,
            )
        text = decode_ids(tokenizer, out[0, ids.shape[1] :].tolist())
        print(f"--- {prompt!r}\n{prompt}{text}")
