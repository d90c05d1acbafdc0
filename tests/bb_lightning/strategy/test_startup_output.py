"""What the README's recipes print at the start of a run, read as a person reads it.

The tiny-cpu recipes run through ``bb-lightning`` on a small Llama written with
``save_pretrained``; everything printed, logged and warned is captured and checked: the
plan in words (no raw ``Placement(...)`` repr), no LR-scheduler warning caused by the
engine's optimizer step, the model summary's real parameter count (against the
Hugging Face model's own), a real epoch count and a generation rate in the progress bar.
"""

from __future__ import annotations

import contextlib
import io
import logging
import math
import re
import sysconfig
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
from lightning.pytorch.utilities.model_summary import get_human_readable_count
from rich.console import Console
from transformers import AutoConfig, AutoModelForCausalLM

from bb_lightning.cli import main
from bb_lightning.cli.lightning import BalanceBeamCLI, _build_lightning_cli
from bb_lightning.data import TextDataModule
from bb_lightning.placement import Placement
from bb_lightning.strategy.summary import describe_placement
from storage.tiers import Tier, format_count

RECIPES = Path(__file__).parents[3] / "recipes"
TINY = {
    "model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
    "num_key_value_heads": 4, "intermediate_size": 128, "vocab_size": 264,
    "max_position_embeddings": 128, "tie_word_embeddings": False,
}  # fmt: skip
DATA = {"seq_len": 64, "batch_size": 4, "max_tokens": 1024}
MAX_STEPS = 5
UNITS = {"K": 1e3, "M": 1e6, "B": 1e9, "T": 1e12}


@dataclass
class Run:
    """What one ``bb-lightning`` command printed, logged and warned."""

    root: Path
    """The directory it ran in (the recipe's relative ``runs/`` paths land there)."""
    stdout: str
    text: str
    """stdout, stderr and every log record, joined."""
    warnings: list[str]
    first_bar: str = ""
    """The progress bar as drawn at the end of the first training batch."""


class _FirstBar(pl.Callback):
    """Renders the progress bar once it has drawn the first training batch (runs after it)."""

    text = ""

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any
    ) -> None:
        bar = trainer.progress_bar_callback
        progress = getattr(bar, "progress", None)
        if trainer.global_step == 1 and progress is not None:
            console = Console(file=io.StringIO(), width=400, record=True)
            console.print(progress.get_renderable())
            _FirstBar.text = console.export_text()


class _WatchingCLI(BalanceBeamCLI):
    """``bb-lightning`` with :class:`_FirstBar` after every other callback."""

    def before_fit(self) -> None:
        self.trainer.callbacks.append(_FirstBar())  # type: ignore[attr-defined]


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


@contextlib.contextmanager
def _logged() -> Iterator[_Records]:
    handler = _Records()
    names = ("", "lightning.pytorch", "lightning.fabric", "pytorch_lightning", "lightning_fabric")
    loggers = [logging.getLogger(n) for n in names]
    for log in loggers:
        log.addHandler(handler)
    try:
        yield handler
    finally:
        for log in loggers:
            log.removeHandler(handler)


def _run(argv: list[str], root: Path, cli: type | None = None) -> Run:
    out, err = io.StringIO(), io.StringIO()
    with (
        pytest.MonkeyPatch.context() as mp,
        _logged() as records,
        contextlib.redirect_stdout(out),
        contextlib.redirect_stderr(err),
        warnings.catch_warnings(record=True) as caught,
    ):
        mp.chdir(root)
        warnings.simplefilter("always")
        if cli is None:
            assert main(argv) == 0
        else:
            _build_lightning_cli(argv, cls=cli)
    text = "\n".join([out.getvalue(), err.getvalue(), *records.lines])
    return Run(root, out.getvalue(), text, [str(w.message) for w in caught], _FirstBar.text)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    values = dict(TINY)
    config = AutoConfig.for_model(values.pop("model_type"), **values)
    path = tmp_path_factory.mktemp("tiny-llama")
    AutoModelForCausalLM.from_config(config).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def real_params(tiny_dir: Path) -> int:
    """Parameters of the model as Hugging Face loads it."""
    return sum(p.numel() for p in AutoModelForCausalLM.from_pretrained(tiny_dir).parameters())


@pytest.fixture(scope="module")
def fit_run(tiny_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Run:
    """The README's main job (recipes/tiny-cpu.yaml) on the tiny model, a few steps."""
    root = tmp_path_factory.mktemp("fit")
    argv = [
        "fit", "--config", str(RECIPES / "tiny-cpu.yaml"),
        f"--model.init_args.model={tiny_dir}",
        *(f"--data.init_args.{k}={v}" for k, v in DATA.items()),
        "--data.init_args.cache_dir=null", "--samples=[]",
        f"--trainer.max_steps={MAX_STEPS}", "--trainer.val_check_interval=1.0",
        "--trainer.limit_val_batches=1",
        "--trainer.strategy.init_args.hardware=a100-80gb",  # planned without probes
    ]  # fmt: skip
    return _run(argv, root, _WatchingCLI)


@pytest.fixture(scope="module")
def predict_run(tiny_dir: Path, fit_run: Run) -> Run:
    """recipes/tiny-cpu-predict.yaml from the main job's last checkpoint, as the README runs it."""
    argv = [
        "predict", "--config", str(RECIPES / "tiny-cpu-predict.yaml"),
        f"--model.init_args.model={tiny_dir}", "--model.init_args.max_new_tokens=4",
        f"--data.init_args.path={RECIPES / 'tiny-cpu-prompts.jsonl'}",
        "--trainer.strategy.init_args.hardware=a100-80gb",
    ]  # fmt: skip
    return _run(argv, fit_run.root)


def _planned_params(text: str, task: str) -> float:
    m = re.search(rf"^plan: {task} \S+ \(([\d.]+) ([KMBT]) params", text, re.MULTILINE)
    assert m is not None, f"no 'plan: {task} ... params' line in:\n{text}"
    return float(m.group(1)) * UNITS[m.group(2)]


@pytest.mark.slow
def test_fit_prints_no_raw_placement(fit_run: Run) -> None:
    assert "Placement(" not in fit_run.text and "<Tier." not in fit_run.text
    assert "placement:" in fit_run.text  # the plan table says it in words


@pytest.mark.slow
def test_fit_warns_nothing_about_the_optimizer_step(fit_run: Run) -> None:
    assert not [w for w in fit_run.warnings if "optimizer.step()" in w], fit_run.warnings


@pytest.mark.slow
def test_model_summary_counts_the_paged_blocks(fit_run: Run, real_params: int) -> None:
    assert f"Total params: {get_human_readable_count(real_params)}" in fit_run.stdout
    assert f"Trainable params: {get_human_readable_count(real_params)}" in fit_run.stdout


@pytest.mark.slow
def test_plan_says_the_parameter_count_in_units(
    fit_run: Run, predict_run: Run, real_params: int
) -> None:
    assert _planned_params(fit_run.text, "fit") == pytest.approx(real_params, rel=0.01)
    assert _planned_params(predict_run.text, "predict") == pytest.approx(real_params, rel=0.01)


@pytest.mark.slow
def test_progress_bar_counts_epochs_and_tokens(fit_run: Run) -> None:
    stdlib = sysconfig.get_paths()["stdlib"]  # the recipe's {stdlib}
    dm = TextDataModule(paths=f"{stdlib}/*.py", tokenizer="byte", val_fraction=0.01, **DATA)
    dm.setup("fit")
    last = math.ceil(MAX_STEPS / len(dm.train_dataloader())) - 1
    assert last >= 1  # the run spans epochs
    assert f"Epoch {last}/{last}" in fit_run.stdout, fit_run.stdout
    assert "/-" not in fit_run.stdout
    for shown in (fit_run.stdout, fit_run.first_bar):  # the end, and the first batch
        rates = [float(x) for x in re.findall(r"tokens/s: ([\d.]+)", shown)]
        assert rates and all(r > 0 for r in rates), shown


@pytest.mark.slow
def test_predict_bar_shows_generated_tokens_per_s(predict_run: Run) -> None:
    rates = [float(x) for x in re.findall(r"Predicting · ([\d.e+]+) tokens/s", predict_run.stdout)]
    assert rates and all(r > 0 for r in rates), predict_run.stdout
    assert "Placement(" not in predict_run.text


@pytest.mark.slow
def test_predict_from_the_checkpoint_warns_nothing_about_checkpointing(predict_run: Run) -> None:
    assert (predict_run.root / "runs" / "tiny-cpu" / "predictions.jsonl").is_file()
    noise = [w for w in predict_run.warnings if "dirpath" in w or "ckpt_path" in w]
    assert not noise, predict_run.warnings


def test_placement_in_words() -> None:
    placement = Placement(
        weights=(Tier.DEVICE, Tier.NVME, Tier.NVME),
        master=(Tier.HOST,) * 3,
        grads=(Tier.HOST,) * 3,
        prefetch_depth=2,
    )
    assert describe_placement(placement) == (
        "3 blocks; weights: block 0 on device, blocks 1-2 on nvme (1 resident); master "
        "weights and AdamW moments: blocks 0-2 on host; gradients: blocks 0-2 on host; "
        "prefetch depth 2, optimizer state read 2 blocks ahead"
    )


@pytest.mark.parametrize(
    ("count", "text"),
    [(264, "264"), (135_000, "135 K"), (3_299_584, "3.3 M"), (999_999, "1 M"), (32.5e9, "32.5 B")],
)
def test_counts_print_in_units(count: float, text: str) -> None:
    assert format_count(count) == text


def test_a_given_placement_is_said_in_words(
    tiny: Any, tiny_dir: Path, real_params: int, capsys: pytest.CaptureFixture[str]
) -> None:
    """A user's own Trainer with a given placement (no plan table): the placement in words,
    and the summary (Lightning's plain one) counting the paged blocks."""
    from lightning.pytorch.callbacks import ModelSummary

    from bb_lightning import BalanceBeamStrategy
    from bb_lightning.module import CausalLMModule

    strategy = BalanceBeamStrategy(
        placement=Placement.uniform(2, weights=Tier.HOST), compute_dtype="fp32"
    )
    trainer = pl.Trainer(
        accelerator="cpu", strategy=strategy, max_steps=1, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, callbacks=[ModelSummary()],
    )  # fmt: skip
    with _logged() as records:
        trainer.fit(CausalLMModule(str(tiny_dir)), tiny.loader(1))
    said = "\n".join([*records.lines, capsys.readouterr().out])
    words = describe_placement(Placement.uniform(2, weights=Tier.HOST))
    assert f"balance_beam placement: {words}" in said
    assert "Placement(" not in said and "<Tier." not in said
    count = re.escape(get_human_readable_count(real_params))
    assert re.search(rf"^{count}\s+Total params$", said, re.MULTILINE), said
