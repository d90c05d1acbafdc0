"""The package's public surface: what ``import bb_lightning`` gives a user."""

from __future__ import annotations

import importlib

import lightning.pytorch as pl


def test_top_level_exports_are_the_real_classes() -> None:
    bb = importlib.import_module("bb_lightning")
    module = importlib.import_module("bb_lightning.module")
    data = importlib.import_module("bb_lightning.data")
    strategy = importlib.import_module("bb_lightning.strategy")
    assert bb.CausalLMModule is module.CausalLMModule
    assert bb.TextDataModule is data.TextDataModule
    assert bb.PromptsDataModule is data.PromptsDataModule
    assert bb.BalanceBeamStrategy is strategy.BalanceBeamStrategy
    assert issubclass(bb.CausalLMModule, pl.LightningModule)
    assert issubclass(bb.TextDataModule, pl.LightningDataModule)
    assert set(bb.__all__) >= {"BalanceBeamStrategy", "CausalLMModule", "TextDataModule"}
