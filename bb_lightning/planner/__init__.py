"""The intensity-first planner: profiles + job -> Plan (pure; no engine code)."""

from bb_lightning.planner.job import FitJob, PredictJob
from bb_lightning.planner.plan import Plan, PlanOverrides, PredictedTime, Roofline, TierMemory
from bb_lightning.planner.profile import (
    HardwareProfile,
    ModelProfile,
    measure,
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
    "measure",
    "plan_differs",
    "preset",
    "preset_names",
]
