"""``bb-lightning plan``'s choices forced on the planner (its ``PlanOverrides``)."""

from __future__ import annotations

import argparse
import dataclasses
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from bb_lightning.planner import PlanOverrides

__all__ = ["add_activation_args", "plan_overrides", "recipe_overrides"]


def add_activation_args(p: argparse.ArgumentParser) -> None:
    """``--swap-activations`` / ``--no-swap-activations`` (``PlanOverrides.swap_activations``)."""
    p.add_argument(
        "--swap-activations",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="fit: price each paged block keeping its saved activations on the host (fetched "
        "back in backward) against recomputing them and keep the cheaper (default); "
        "--no-swap-activations: every paged block recomputes",
    )


def plan_overrides(args: argparse.Namespace) -> PlanOverrides:
    """The ``PlanOverrides`` of ``plan``'s arguments: where decode attention runs, and
    whether blocks may swap their saved activations."""
    from bb_lightning.planner import PlanOverrides

    return PlanOverrides(
        decode_attention=args.decode_attention, swap_activations=args.swap_activations
    )


def recipe_overrides(strategy: Any, **batch: int) -> PlanOverrides:
    """The ``PlanOverrides`` a recipe's strategy settings (parsed ``init_args``) give, flat
    or in ``planning``, with ``batch`` (the recipe's micro-batch and accumulation) forced:
    what a dry run of the recipe plans with."""
    from bb_lightning.planner import PlanOverrides

    given = getattr(strategy, "overrides", None)
    if given is None:
        given = getattr(getattr(strategy, "planning", None), "overrides", None)
    values: dict[str, Any] = {}
    if isinstance(given, PlanOverrides):
        values = dataclasses.asdict(given)
    elif given is not None:
        values = dict(vars(given))
    fields = {f.name for f in dataclasses.fields(PlanOverrides)}
    return PlanOverrides(**{**{k: v for k, v in values.items() if k in fields}, **batch})
