"""Balance Beam: fine-tune and bulk-run LLMs larger than accelerator memory with Lightning.

Importing the package registers ``Trainer(strategy="balance_beam")`` (see
:mod:`bb_lightning.strategy.register`) without importing Lightning: the classes below are
imported when first used, so that ``bb-lightning plan`` and the probes start in the time
torch takes, not Lightning's.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from bb_lightning.strategy.register import register

if TYPE_CHECKING:
    from bb_lightning.data import PromptsDataModule, TextDataModule
    from bb_lightning.module import CausalLMModule
    from bb_lightning.strategy import BalanceBeamStrategy

__all__ = ["BalanceBeamStrategy", "CausalLMModule", "PromptsDataModule", "TextDataModule"]

_HOMES = {
    "BalanceBeamStrategy": "bb_lightning.strategy",
    "CausalLMModule": "bb_lightning.module",
    "PromptsDataModule": "bb_lightning.data",
    "TextDataModule": "bb_lightning.data",
}
"""Public name -> the module that defines it."""


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'bb_lightning' has no attribute {name!r}")
    value = getattr(importlib.import_module(home), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})


register()
