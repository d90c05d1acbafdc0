"""Balance Beam: fine-tune and bulk-run LLMs larger than accelerator memory with Lightning.

Importing the package registers ``Trainer(strategy="balance_beam")``.
"""

from __future__ import annotations

from bb_lightning.data import PromptsDataModule, TextDataModule
from bb_lightning.module import CausalLMModule
from bb_lightning.strategy import BalanceBeamStrategy

__all__ = ["BalanceBeamStrategy", "CausalLMModule", "PromptsDataModule", "TextDataModule"]


def _register() -> None:
    """Add ``"balance_beam"`` to Lightning's strategy registries (once)."""
    from lightning.pytorch.strategies import StrategyRegistry

    BalanceBeamStrategy.register_strategies(StrategyRegistry)
    try:
        from pytorch_lightning.strategies import StrategyRegistry as PLStrategyRegistry
    except ImportError:
        return
    BalanceBeamStrategy.register_strategies(PLStrategyRegistry)


_register()
