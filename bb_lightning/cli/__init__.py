"""The ``bb-lightning`` command line: the top layer, which nothing else in the package imports.

:mod:`~bb_lightning.cli.commands` parses the command line and dispatches each subcommand
(:func:`main` is the console script's entry point); ``plan``, ``convert``, ``export`` and
``verify`` are argparse subcommands there. ``fit``, ``validate`` and ``predict`` run
:class:`~bb_lightning.cli.lightning.BalanceBeamCLI`, a LightningCLI, imported (with
Lightning) for those subcommands only; their ``--dry-run`` plans a recipe through
:mod:`~bb_lightning.cli.recipe_dryrun`. :mod:`~bb_lightning.cli.errors` turns the parsers'
errors into one line naming the value and what to write.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from bb_lightning.cli.commands import COMMANDS, main, parse_size
from bb_lightning.cli.errors import UsageError

if TYPE_CHECKING:
    from bb_lightning.cli.lightning import BalanceBeamCLI, parse_recipe, run_lightning_cli

__all__ = [
    "COMMANDS",
    "BalanceBeamCLI",
    "UsageError",
    "main",
    "parse_recipe",
    "parse_size",
    "run_lightning_cli",
]

_LIGHTNING_NAMES = ("BalanceBeamCLI", "parse_recipe", "run_lightning_cli")
"""Names of :mod:`bb_lightning.cli.lightning` also reached here (imported on first use, so
that ``bb-lightning plan`` does not import Lightning)."""


def __getattr__(name: str) -> Any:
    if name not in _LIGHTNING_NAMES:
        raise AttributeError(f"module 'bb_lightning.cli' has no attribute {name!r}")
    from bb_lightning.cli import lightning

    return getattr(lightning, name)
