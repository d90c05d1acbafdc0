"""The Lightning side of Balance Beam: the strategy and what it runs on each call.

``BalanceBeamStrategy`` (:mod:`~bb_lightning.strategy.core`) keeps Lightning's
``ParallelStrategy`` contract; devices and ranks are in :mod:`~bb_lightning.strategy.ranks`,
data parallelism in :mod:`~bb_lightning.strategy.world`, each call's start and end in
:mod:`~bb_lightning.strategy.calls`, the plan-to-engine wiring in
:mod:`~bb_lightning.strategy.session` and :mod:`~bb_lightning.strategy.assembly`, the
hand-back of trained weights in :mod:`~bb_lightning.strategy.handback`, the dry run in
:mod:`~bb_lightning.strategy.dryrun`, and the callbacks users add (throughput, progress bar,
trace) in :mod:`~bb_lightning.strategy.callbacks`, :mod:`~bb_lightning.strategy.summary` and
:mod:`~bb_lightning.strategy.trace`.

The names below are imported when first used, so that ``bb_lightning.strategy.register``
(imported by ``import bb_lightning``) does not import Lightning.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from bb_lightning.strategy.callbacks import ThroughputCallback
    from bb_lightning.strategy.core import BalanceBeamStrategy
    from bb_lightning.strategy.settings import HandBackConfig, PlanningConfig
    from bb_lightning.strategy.summary import BalanceBeamProgressBar
    from bb_lightning.strategy.trace import TraceCallback

__all__ = [
    "BalanceBeamProgressBar",
    "BalanceBeamStrategy",
    "HandBackConfig",
    "PlanningConfig",
    "ThroughputCallback",
    "TraceCallback",
]

_HOMES = {
    "BalanceBeamProgressBar": "bb_lightning.strategy.summary",
    "BalanceBeamStrategy": "bb_lightning.strategy.core",
    "HandBackConfig": "bb_lightning.strategy.settings",
    "PlanningConfig": "bb_lightning.strategy.settings",
    "ThroughputCallback": "bb_lightning.strategy.callbacks",
    "TraceCallback": "bb_lightning.strategy.trace",
}
"""Public name -> the module that defines it."""


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'bb_lightning.strategy' has no attribute {name!r}")
    value = getattr(importlib.import_module(home), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
