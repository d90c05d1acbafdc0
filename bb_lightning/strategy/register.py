"""``Trainer(strategy="balance_beam")``: the name in Lightning's strategy registries.

Importing :mod:`bb_lightning` calls :func:`register`, which must not import Lightning
itself: ``bb-lightning plan``, ``convert`` or ``--help`` and the probes would otherwise
wait for ``import lightning.pytorch`` (seconds on a small machine) and use none of it. So the
name is added to each registry (``lightning.pytorch`` and, where installed,
``pytorch_lightning``) as soon as that registry exists: at once where its module is
imported already, else by a finder on ``sys.meta_path`` the moment its module has been
executed. What is registered is :func:`build_strategy`, which imports
:class:`~bb_lightning.strategy.BalanceBeamStrategy` when a Trainer builds one by name.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
from collections.abc import Sequence
from types import ModuleType
from typing import Any

__all__ = ["REGISTRY_MODULES", "STRATEGY_NAME", "add_to", "build_strategy", "register"]

STRATEGY_NAME = "balance_beam"
"""The name a Trainer, a recipe or the command line gives the strategy."""
REGISTRY_MODULES = ("lightning.pytorch.strategies", "pytorch_lightning.strategies")
"""Modules whose ``StrategyRegistry`` gets :data:`STRATEGY_NAME`."""
DESCRIPTION = "pages blocks through a tiered store"


def build_strategy(**kwargs: Any) -> Any:
    """A :class:`~bb_lightning.strategy.BalanceBeamStrategy` built with ``kwargs``; what the
    registries call for ``strategy="balance_beam"``."""
    from bb_lightning.strategy.core import BalanceBeamStrategy

    return BalanceBeamStrategy(**kwargs)


def add_to(registry: Any) -> None:
    """Add :data:`STRATEGY_NAME` to ``registry`` unless it holds the name already."""
    if STRATEGY_NAME not in registry:
        registry.register(STRATEGY_NAME, build_strategy, description=DESCRIPTION)


class _RegisterAfterExec(importlib.abc.Loader):
    """A module's own loader, and then :func:`add_to` on the registry it defined."""

    def __init__(self, loader: importlib.abc.Loader) -> None:
        self._loader = loader

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self._loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self._loader.exec_module(module)
        registry = getattr(module, "StrategyRegistry", None)
        if registry is not None:
            add_to(registry)

    def __getattr__(self, name: str) -> Any:  # get_filename, get_resource_reader, ...
        return getattr(self._loader, name)


class _RegistryFinder(importlib.abc.MetaPathFinder):
    """Finds a registry module with the other finders and wraps its loader (see
    :class:`_RegisterAfterExec`); every other module is left to them."""

    def __init__(self, names: Sequence[str]) -> None:
        self.names = frozenset(names)

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname not in self.names:
            return None
        for finder in sys.meta_path:
            find = getattr(finder, "find_spec", None)
            if finder is self or find is None:
                continue
            spec: importlib.machinery.ModuleSpec | None = find(fullname, path, target)
            if spec is None:
                continue
            if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                spec.loader = _RegisterAfterExec(spec.loader)
            return spec
        return None


def register(names: Sequence[str] = REGISTRY_MODULES) -> None:
    """Make :data:`STRATEGY_NAME` known to the registries of ``names``: now for those
    imported already, on their import for the others (once, however often called)."""
    later = []
    for name in names:
        module = sys.modules.get(name)
        if module is not None and hasattr(module, "StrategyRegistry"):
            add_to(module.StrategyRegistry)
        else:
            later.append(name)
    if later and not any(
        isinstance(f, _RegistryFinder) and f.names >= set(later) for f in sys.meta_path
    ):
        sys.meta_path.insert(0, _RegistryFinder(later))
