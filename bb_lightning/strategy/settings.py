"""The strategy's settings in groups: what the planner is given, and what is handed back.

:class:`~bb_lightning.strategy.BalanceBeamStrategy` takes ``planning=PlanningConfig(...)``,
``hand_back=HandBackConfig(...)`` and ``store=StoreConfig(...)``
(:class:`storage.store.StoreConfig`), or the same settings as flat keyword arguments
(``placement=``, ``compute_dtype=``, ``hardware=``, ``gather_limit=``, ... as recipes and
LightningCLI give them). :func:`merged` makes one group of the two: a flat argument left
at its default defers to the group, and a setting given both ways is refused in one line
naming both. The values are checked when the strategy is built.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

from bb_lightning.placement import Placement
from bb_lightning.planner import FitJob, HardwareProfile, PlanOverrides, PredictJob
from bb_lightning.strategy.session import ComputeDtype

__all__ = ["HandBackConfig", "PlanningConfig", "check_once", "grouped", "merged"]


@dataclass(frozen=True, kw_only=True)
class PlanningConfig:
    """How the blocks are placed and the optimizer steps run."""

    placement: Placement | None = None
    """Per-block homes and prefetch depth; None asks the planner."""
    compute_dtype: ComputeDtype | None = None
    """``"bf16"`` or ``"fp32"``; None follows the Trainer's precision (``"bf16-true"`` /
    ``"bf16-mixed"`` -> bf16, ``"32-true"`` -> fp32)."""
    overrides: PlanOverrides | None = None
    """Choices forced on the planner (tiers, prefetch depth). Where no plan can be made (no
    Hugging Face model) only ``weights_tier``, ``master_tier`` and ``prefetch_depth`` are
    read."""
    job: FitJob | PredictJob | None = None
    """The job planned; None derives it from the Trainer and the first batch (the
    DataLoader's batch size and the accumulation stay the caller's); a
    :class:`~bb_lightning.planner.PredictJob` plans ``predict``."""
    hardware: str | HardwareProfile | None = None
    """A preset name, a profile, or ``"measure"`` / None (measure this machine, cached)."""
    warmup_steps: int = 3
    """Optimizer steps measured before comparing with the plan (>= 1)."""
    adapt_tolerance: float | None = 0.25
    """Relative difference of measured and predicted phase times that triggers a re-plan
    (0.25 = 25 %); None only logs the comparison."""
    overlap_optimizer: bool = True
    """Step each block during backward when no gradient clipping is set."""
    compile_blocks: str | None = None
    """A ``torch.compile`` backend (``"inductor"``) each block's own forward runs under,
    paging outside it (:mod:`bb_lightning.engine.compiled`); None (the default): eager.
    Whether it is faster is the device's to say (``scripts/gpu-check.sh``'s ``compile``
    step); on a CPU, inductor takes tens of seconds to compile."""


@dataclass(frozen=True, kw_only=True)
class HandBackConfig:
    """What the module holds at the end of every ``trainer.*`` call."""

    gather_on_teardown: bool | None = None
    """None gives the module its trained weights back (host parameters; the store stays
    open for the next call) when they fit ``gather_limit``, else leaves them in the store
    (``state_dict()`` raises naming ``bb-lightning export``, ``save_pretrained`` streams
    from the store); True always gives them back and closes the store; False always leaves
    them in the store."""
    gather_limit: int | None = None
    """Most bytes of weights given back (in the dtype they are given back in: bf16 under
    ``"bf16-true"``); None: 80 % of the host memory available then (with several ranks, the
    rank with the least) and, with a ``StoreConfig`` given, at most what its
    ``host_budget`` leaves beside the store's host arena."""


Config = TypeVar("Config", PlanningConfig, HandBackConfig)


def merged(
    group: Config | None, flat: Mapping[str, object], *, name: str, kind: type[Config]
) -> Config:
    """``group`` (None: ``kind()``, every default) with the ``flat`` keyword arguments that
    differ from their defaults. ``ValueError`` (one line naming both) when a setting differs
    from its default both in ``flat`` and in ``group`` (the argument ``name``)."""
    defaults = kind()
    changes: dict[str, Any] = {}
    for key, value in flat.items():
        default = getattr(defaults, key)
        if _same(value, default):
            continue
        grouped = getattr(group, key, default)
        if not _same(grouped, default):
            raise ValueError(_twice(key, value, name, grouped, kind))
        changes[key] = value
    return dataclasses.replace(group if group is not None else defaults, **changes)


def check_once(values: Mapping[str, Any]) -> None:
    """Refuse, as the strategy does (:func:`merged`), a setting given both flat and in its
    group in the strategy's keyword arguments as a recipe parses them (``planning`` and
    ``hand_back`` as mappings or namespaces), before anything is built."""
    for name, kind in (("planning", PlanningConfig), ("hand_back", HandBackConfig)):
        group = values.get(name)
        if group is None:
            continue
        defaults = kind()
        items = group.items() if isinstance(group, Mapping) else vars(group).items()
        for key, grouped in items:
            default = getattr(defaults, key, None)
            value = values.get(key, default)
            if not _same(grouped, default) and not _same(value, default):
                raise ValueError(_twice(key, value, name, grouped, kind))


def _twice(key: str, value: object, name: str, grouped: object, kind: type) -> str:
    return (
        f"{key} given twice, {key}={value!r} and {name}.{key}={grouped!r}: give it once, "
        f"as {key}= or in {kind.__name__}({key}=...)"
    )


def grouped(
    planning: PlanningConfig | None, hand_back: HandBackConfig | None, **flat: object
) -> tuple[PlanningConfig, HandBackConfig]:
    """The strategy's ``planning`` and ``hand_back`` groups with its ``flat`` keyword
    arguments merged in (:func:`merged`)."""
    names = {f.name for f in dataclasses.fields(PlanningConfig)}
    plan = {k: v for k, v in flat.items() if k in names}
    back = {k: v for k, v in flat.items() if k not in names}
    return (
        merged(planning, plan, name="planning", kind=PlanningConfig),
        merged(hand_back, back, name="hand_back", kind=HandBackConfig),
    )


def _same(value: object, default: object) -> bool:
    """Whether ``value`` is the default (``None`` and booleans by identity)."""
    if default is None or isinstance(default, bool) or isinstance(value, bool):
        return value is default
    return value == default
