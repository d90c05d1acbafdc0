"""The package's public surface: what ``import bb_lightning`` gives a user."""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
from pathlib import Path

import lightning.pytorch as pl
import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_top_level_exports_are_the_real_classes() -> None:
    bb = importlib.import_module("bb_lightning")
    module = importlib.import_module("bb_lightning.module")
    data = importlib.import_module("bb_lightning.data")
    strategy = importlib.import_module("bb_lightning.strategy.core")
    assert bb.CausalLMModule is module.CausalLMModule
    assert bb.TextDataModule is data.TextDataModule
    assert bb.PromptsDataModule is data.PromptsDataModule
    assert bb.BalanceBeamStrategy is strategy.BalanceBeamStrategy
    assert issubclass(bb.CausalLMModule, pl.LightningModule)
    assert issubclass(bb.TextDataModule, pl.LightningDataModule)
    assert set(bb.__all__) >= {"BalanceBeamStrategy", "CausalLMModule", "TextDataModule"}


IMPORT_THEN_TRAINER = """
import sys
import bb_lightning
from bb_lightning.cli import main
assert "lightning" not in sys.modules, "import bb_lightning imported Lightning"
main(["plan", "--model", "tiny-llama", "--hardware", "a100-80gb"])
assert "lightning" not in sys.modules, "bb-lightning plan imported Lightning"
import lightning.pytorch as pl
trainer = pl.Trainer(strategy="balance_beam", accelerator="cpu", devices=1, logger=False)
from bb_lightning.strategy.core import BalanceBeamStrategy
assert type(trainer.strategy) is BalanceBeamStrategy, type(trainer.strategy)
import pytorch_lightning
assert "balance_beam" in pytorch_lightning.strategies.StrategyRegistry
print("registered without importing Lightning first")
"""


@pytest.mark.slow
def test_import_registers_the_name_before_lightning_is_imported() -> None:
    pytest.importorskip("pytorch_lightning")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"} | {"PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [sys.executable, "-c", IMPORT_THEN_TRAINER],
        capture_output=True, text=True, env=env, timeout=300, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    assert "plan: fit" in done.stdout and "registered without importing" in done.stdout


def test_import_registers_the_name_after_lightning_is_imported() -> None:
    from lightning.pytorch.strategies import StrategyRegistry

    bb = importlib.import_module("bb_lightning")
    StrategyRegistry.remove("balance_beam")
    try:
        importlib.reload(bb)
        trainer = pl.Trainer(strategy="balance_beam", accelerator="cpu", devices=1, logger=False)
        assert type(trainer.strategy) is bb.BalanceBeamStrategy
    finally:
        bb.register()
