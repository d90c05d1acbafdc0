"""The intensity-first planner: profiles + job -> Plan (pure data; no engine, no probes).

The profiles come from presets or from :mod:`bb_lightning.probe` (``measure``,
``model_profile_from_config``, ``model_profile_from_module``); see
``docs/architecture.md``, "Layers".
"""

from bb_lightning.planner.job import FitJob, PredictJob
from bb_lightning.planner.plan import Plan, PlanOverrides, PredictedTime, Roofline, TierMemory
from bb_lightning.planner.profile import (
    HardwareProfile,
    ModelProfile,
    preset,
    preset_names,
)
from bb_lightning.planner.search import (
    MeasuredTimes,
    PlanError,
    adapt,
    make_plan,
    plan_differs,
)

__all__ = [
    "FitJob",
    "HardwareProfile",
    "MeasuredTimes",
    "ModelProfile",
    "Plan",
    "PlanError",
    "PlanOverrides",
    "PredictJob",
    "PredictedTime",
    "Roofline",
    "TierMemory",
    "adapt",
    "make_plan",
    "plan_differs",
    "preset",
    "preset_names",
]
