"""``bb-lightning fit``, ``validate`` and ``predict``: :class:`BalanceBeamCLI`, a
LightningCLI with ``balance_beam`` as the default strategy,
:class:`~bb_lightning.module.CausalLMModule` as the default model and any
LightningDataModule as data; :func:`parse_recipe` validates a recipe without running it.

Recipe strings may hold ``{stdlib}``, replaced by the directory of the Python
standard library (``sysconfig.get_paths()["stdlib"]``), so that a recipe can
train on text that every machine has. :mod:`bb_lightning.cli.commands` dispatches here and
imports this module (and Lightning) only for these subcommands.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import sys
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from lightning.pytorch.cli import LightningArgumentParser, LightningCLI, SaveConfigCallback

from bb_lightning.cli.errors import (
    UsageError,
    explain_instantiation,
    explain_jsonargparse,
    first_line,
    parser_keys,
    with_key,
)
from bb_lightning.strategy.world import prepare_nvme_dir

__all__ = ["BalanceBeamCLI", "parse_recipe", "run_lightning_cli"]


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


def _check_recipe_files(words: list[str], command: str) -> None:
    """Raise :class:`UsageError` naming a ``--config`` recipe file that is not UTF-8 YAML
    holding a mapping (jsonargparse names only ``"<unicode string>"``, or fails outside its
    own errors); a file that does not exist is left to jsonargparse."""
    import yaml

    recipes = [words[i + 1] for i, w in enumerate(words[:-1]) if w in ("-c", "--config")]
    recipes += [w.split("=", 1)[1] for w in words if w.startswith("--config=")]
    fix = f"fix the file (bb-lightning {command} --help lists the keys)"
    for recipe in recipes:
        try:
            text = Path(recipe).read_text(encoding="utf-8")
        except FileNotFoundError:
            continue
        except (OSError, UnicodeDecodeError) as err:
            raise UsageError(
                f"recipe {recipe} cannot be read as UTF-8 text ({err}): {fix}"
            ) from None
        try:
            doc = yaml.safe_load(text)
        except (yaml.YAMLError, RecursionError) as err:
            reason = " ".join(str(err).split())[:200] or type(err).__name__
            raise UsageError(f"recipe {recipe} is not readable YAML ({reason}): {fix}") from None
        if not isinstance(doc, dict):
            raise UsageError(
                f"recipe {recipe} holds a YAML {type(doc).__name__}, not a mapping of keys "
                f"(model:, data:, trainer:, ...): {fix}"
            )
        empty = _empty_key(doc, "")
        if empty is not None:
            place = f"under {empty!r}" if empty else "at the top"
            raise UsageError(
                f"recipe {recipe} has an empty key {place}: give it a name or remove it; {fix}"
            )


def _empty_key(doc: Any, where: str) -> str | None:
    """The dotted key under which ``doc`` (a parsed recipe) holds an empty or null key
    ("" for the top level); None when it holds none."""
    if isinstance(doc, list):
        found = (_empty_key(item, where) for item in doc)
        return next((f for f in found if f is not None), None)
    if not isinstance(doc, dict):
        return None
    for key, value in doc.items():
        if key is None or str(key).strip() == "":
            return where
        inner = _empty_key(value, f"{where}.{key}" if where else str(key))
        if inner is not None:
            return inner
    return None


def _check_sections(cfg: Any, command: str) -> None:
    """Raise :class:`UsageError` for a ``model``, ``data`` or ``trainer`` that is not a mapping
    (jsonargparse lets ``trainer: [1]`` through to the build)."""
    from jsonargparse import Namespace

    for key in ("model", "data", "trainer"):
        value = cfg.get(key)
        if value is not None and not isinstance(value, (Namespace, dict)):
            raise UsageError(
                f"recipe key {key!r} is {value!r}, not a mapping of its arguments: write it as "
                f"'{key}:' followed by indented keys (see bb-lightning {command} --help)"
            )


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
            """Only the classes' own range checks, without building them."""
            _check_parsed_values(self._config(), self.subcommand or "fit")

        def after_instantiate_classes(self) -> None:
            """Nothing."""

        def _run_subcommand(self, subcommand: str) -> None:
            """Nothing."""

    try:
        with _argv(sys.argv[:1]):
            cli = _build_lightning_cli(list(args), cls=_ParseOnly)
    except ArgumentError as err:
        raise UsageError(first_line(err)) from None
    return cli._config()


def _check_parsed_values(cfg: Any, command: str) -> None:
    """Run the range checks of the module, data module, strategy and plan overrides that a
    parsed recipe names (where they are ours) on its values without building anything: no
    model config, tokenizer or machine is read. Raises :class:`UsageError` naming the key."""
    from bb_lightning import module
    from bb_lightning.data import modules as data
    from bb_lightning.planner import PlanOverrides
    from bb_lightning.strategy import session, settings
    from bb_lightning.strategy.adapt import AdaptController

    def strategy_checks(**kw: Any) -> None:
        settings.check_once(kw)  # a setting given flat and in its group (checked when built)
        session.check_settings(kw["compute_dtype"], kw["gather_limit"], None, None,
                               hardware=kw["hardware"])  # fmt: skip
        AdaptController(warmup_steps=kw["warmup_steps"], tolerance=kw["adapt_tolerance"])
        overrides = kw["overrides"]
        if overrides is not None and not isinstance(overrides, PlanOverrides):
            fields = {f.name for f in dataclasses.fields(PlanOverrides)}
            PlanOverrides(**{k: v for k, v in vars(overrides).items() if k in fields})

    checks: dict[str, tuple[str, Callable[..., None]]] = {
        "CausalLMModule": ("model", module.check_module_settings),
        "TextDataModule": ("data", data.check_text_settings),
        "PromptsDataModule": ("data", data.check_prompts_settings),
        "BalanceBeamStrategy": ("trainer.strategy", strategy_checks),
    }
    for key in ("model", "data", "trainer.strategy"):
        node = cfg.get(key)
        path = str(getattr(node, "class_path", ""))
        group, check = checks.get(path.rpartition(".")[2], ("", None))
        init = getattr(node, "init_args", None)
        if check is None or group != key or not path.startswith("bb_lightning") or init is None:
            continue
        values = dict(vars(init))
        names = inspect.signature(check).parameters
        if names and any(n not in values for n in names if n != "kw"):
            continue  # not the signature these checks know
        try:
            check(**{k: v for k, v in values.items() if k in names or "kw" in names})
        except ValueError as err:
            text = first_line(err).removeprefix("PlanOverrides.")
            where = "overrides." if str(err).startswith("PlanOverrides.") else ""
            line = with_key(f"{key}.init_args.{where}", text)
            raise UsageError(f"{line} (see bb-lightning {command} --help)") from None


def run_lightning_cli(args: Sequence[str]) -> int:
    """Run ``bb-lightning fit|validate|predict ARGS``; returns the exit code (2 on bad input)."""
    from jsonargparse import ArgumentError

    try:
        with _argv(sys.argv[:1]):  # the arguments come from ``args`` only
            _build_lightning_cli(list(args))
    except ArgumentError as err:
        raise UsageError(
            f"{first_line(err)} (see bb-lightning {args[0] if args else 'fit'} --help)"
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
        _check_recipe_files(
            self._args, next((a for a in self._args if a in self.subcommands()), "fit")
        )
        try:
            super().parse_arguments(parser, args)
        except ArgumentError as err:
            words = [a for a in (args or []) if isinstance(a, str)]
            command = next((a for a in words if a in self.subcommands()), "fit")
            sub = getattr(self, "_subcommand_parsers", {}).get(command, parser)
            raise UsageError(explain_jsonargparse(str(err), parser_keys(sub), command)) from None
        self._check_values(next((a for a in self._args if a in self.subcommands()), "fit"))

    def instantiate_classes(self) -> None:
        """Build the classes as LightningCLI does; a class's own check of a value (wrapped by
        jsonargparse in a message of every type it tried) becomes one :class:`UsageError`
        line naming the recipe key, the value and what is accepted."""
        from lightning.fabric.utilities.exceptions import MisconfigurationException

        command = self.subcommand or "fit"
        try:
            super().instantiate_classes()
        except ValueError as err:
            line = explain_instantiation(str(err), self._config(), command)
            if line is None:
                raise
            raise UsageError(line) from None
        except MisconfigurationException as err:  # the Trainer's own checks
            raise UsageError(f"{first_line(err)} (see bb-lightning {command} --help)") from None

    def _check_values(self, command: str) -> None:
        """Refuse the top-level values out of range, before the seed is set."""
        cfg = self.config.get(command, self.config)
        hint = f"(see bb-lightning {command} --help)"
        sample_tokens = cfg.get("sample_tokens", 64)
        if not isinstance(sample_tokens, int) or sample_tokens < 1:
            raise UsageError(
                f"sample_tokens={sample_tokens}: must be an integer >= 1 (tokens generated per "
                f"sample prompt), e.g. 64 {hint}"
            )
        seed = cfg.get("seed_everything")
        if isinstance(seed, int) and not isinstance(seed, bool) and not 0 <= seed < 2**32:
            raise UsageError(
                f"seed_everything={seed}: must be an integer in 0..{2**32 - 1}, true (a random "
                f"seed) or false (none), e.g. 0 {hint}"
            )

    def _run_subcommand(self, subcommand: str) -> None:
        """Run it with ``sys.argv`` saying the command: Lightning's launcher of several
        ranks (``--trainer.devices 2``) starts each rank's process with ``sys.argv``."""
        with _argv([*sys.argv[:1], *getattr(self, "_args", [])]):
            super()._run_subcommand(subcommand)

    def before_instantiate_classes(self) -> None:
        cfg = self._config()
        _check_sections(cfg, self.subcommand or "fit")
        _resolve_placeholders(cfg)
        _check_parsed_values(cfg, self.subcommand or "fit")  # before anything is written
        model = cfg.get("model")
        init = getattr(model, "init_args", None)
        if init is not None and isinstance(init.get("model"), str):
            inline = _mapping_from_text(init["model"])
            if inline is not None:
                root = cfg.get("trainer", {}).get("default_root_dir") or "."
                init["model"] = _write_model_config(inline, Path(root))
        strategy = cfg.get("trainer", {}).get("strategy")
        nvme = getattr(getattr(strategy, "init_args", None), "nvme_path", None)
        if isinstance(nvme, str):  # a recipe's path under runs/: its parents are made
            parent = Path(nvme).absolute().parent
            try:
                parent.mkdir(parents=True, exist_ok=True)
            except OSError as err:
                raise UsageError(
                    f"nvme_path {nvme!r}: its parent directory {str(parent)!r} cannot be "
                    f"created ({err.strerror}): pass a directory under one you can write"
                ) from None
            prepare_nvme_dir(nvme)  # a file or a user's directory: one line, exit 2

    def instantiate_trainer(self, **kwargs: Any) -> Any:
        from lightning.pytorch.callbacks import ProgressBar, RichProgressBar

        from bb_lightning.strategy.callbacks import ThroughputCallback
        from bb_lightning.strategy.summary import BalanceBeamProgressBar
        from bb_lightning.strategy.trace import TraceCallback

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
        from bb_lightning.strategy.summary import describe_placement

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

    from bb_lightning.data.tokenizer import decode_ids, encode_text, load_tokenizer

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
