"""``bb-lightning plan``'s choices forced on the planner (its ``PlanOverrides``)."""

from __future__ import annotations

import argparse
import dataclasses
from typing import TYPE_CHECKING, Any

from bb_lightning.cli.errors import UsageError

if TYPE_CHECKING:
    from bb_lightning.planner import PlanOverrides

__all__ = ["add_activation_args", "plan_overrides", "recipe_overrides", "runs_sdpa"]


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
    whether blocks may swap their saved activations. A generation plan of a model that
    transformers builds without its ``sdpa`` attention (the engine's host attention serves
    ``sdpa`` only) keeps attention on the device, as a run plans it; ``--decode-attention
    host`` for one is a :class:`UsageError`."""
    from bb_lightning.planner import PlanOverrides
    from storage.tiers import Tier

    attention = args.decode_attention
    if args.task == "predict" and attention != "device" and not runs_sdpa(args.model):
        if attention == "host":
            raise UsageError(
                f"--decode-attention host with --model {args.model}: transformers builds it "
                "without 'sdpa' attention, which host attention serves; drop the flag (the "
                "plan attends on the device)"
            )
        attention = Tier.DEVICE
    return PlanOverrides(decode_attention=attention, swap_activations=args.swap_activations)


def runs_sdpa(model: Any) -> bool:
    """Whether transformers builds the causal LM of ``model`` (a built-in name, a config, a
    config or model directory, a hub id) with its ``sdpa`` attention, as a run loads it
    (``from_pretrained``'s default where the model class supports it)."""
    from transformers import MODEL_FOR_CAUSAL_LM_MAPPING

    from bb_lightning.hf.structure import load_config
    from bb_lightning.planner.models import BUILTIN_MODELS, builtin_config

    if isinstance(model, str) and model.lower() in BUILTIN_MODELS:
        model = builtin_config(model)
    model_class = MODEL_FOR_CAUSAL_LM_MAPPING.get(type(load_config(model)), None)
    return bool(getattr(model_class, "_supports_sdpa", False))


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
