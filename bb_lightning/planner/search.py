"""The intensity-first search: profiles + job -> :class:`Plan`; :func:`adapt` re-plans.

Intensity first (see ``docs/architecture.md``, "Intensity first"): the search raises
tokens per pass (micro-batch in training, concurrent sequences in generation) along a
ladder of powers of two up to the job's batch; for each step of the ladder,
checkpointing choice and prefetch depth it spends the device memory left after
activations / KV cache on resident blocks, and places fp32 master weights, moments and
gradients on the host by capacity, the rest on NVMe. Every candidate is priced by the cost model
(:mod:`bb_lightning.planner.cost`); the fastest per token wins, ties going to the
fewest tokens per pass and then the least device memory, so the search stops
raising intensity once transfers hide behind compute.

Because the candidates are a fixed set (independent of memory sizes and
bandwidths) and every candidate's time is non-increasing in each bandwidth, more
device memory or a faster link never predicts a slower step.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass

from bb_lightning.planner import (
    cost,
    data_parallel,
    fit_plan,
    fit_search,
    predict_plan,
    predict_search,
)
from bb_lightning.planner.job import FitJob, PredictJob
from bb_lightning.planner.plan import LINK_FIELDS, Plan, PlanOverrides
from bb_lightning.planner.profile import HardwareProfile, ModelProfile
from storage.tiers import Link

__all__ = ["MeasuredTimes", "PlanError", "PlanOverrides", "adapt", "make_plan", "plan_differs"]

EFFICIENCY_RANGE = (0.05, 20.0)
"""Clamp of the efficiency factors :func:`adapt` learns."""


class PlanError(ValueError):
    """No plan fits the machine; the message names the shortfall and the smallest fix."""


@dataclass(frozen=True, kw_only=True)
class MeasuredTimes:
    """Seconds per step measured over warm-up steps (``None`` = not measured)."""

    compute_s: float | None = None
    """Device compute, seconds per step."""
    h2d_s: float | None = None
    """Host-to-device link busy time, seconds per step."""
    d2h_s: float | None = None
    """Device-to-host link busy time, seconds per step."""
    nvme_read_s: float | None = None
    """NVMe read busy time, seconds per step."""
    nvme_write_s: float | None = None
    """NVMe write busy time, seconds per step."""
    optimizer_s: float | None = None
    """Host AdamW arithmetic, seconds per step."""
    step_s: float | None = None
    """Whole step, seconds."""

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if value is not None and not value >= 0:
                raise ValueError(f"MeasuredTimes.{f.name} = {value} must be >= 0 seconds")

    @classmethod
    def from_links(
        cls,
        links: Mapping[Link, float],
        *,
        compute_s: float | None = None,
        optimizer_s: float | None = None,
        step_s: float | None = None,
    ) -> MeasuredTimes:
        """Times with the busy seconds per step of ``links`` (any :class:`Link`, each added
        to the link it is priced as, :attr:`Link.priced_as`); a priced link none of
        ``links`` maps to stays unmeasured (``None``)."""
        seconds: dict[Link, float] = {}
        for link, s in links.items():
            priced = Link(link).priced_as
            seconds[priced] = seconds.get(priced, 0.0) + s
        measured = {f"{LINK_FIELDS[link]}_s": s for link, s in seconds.items()}
        return cls(compute_s=compute_s, optimizer_s=optimizer_s, step_s=step_s, **measured)

    def on(self, link: Link) -> float | None:
        """Measured busy seconds of ``link`` (as the link it is priced as); None: not measured."""
        value: float | None = getattr(self, f"{LINK_FIELDS[Link(link).priced_as]}_s")
        return value


def _check_overrides(model: ModelProfile, job: FitJob | PredictJob, ov: PlanOverrides) -> None:
    n = model.num_blocks
    for name in ("micro_batch", "grad_accum", "concurrent_seqs", "prefetch_depth"):
        value = getattr(ov, name)
        if value is not None and value < 1:
            raise ValueError(f"PlanOverrides.{name} = {value} must be >= 1")
    if ov.resident_blocks is not None and not 0 <= ov.resident_blocks <= n:
        raise ValueError(
            f"PlanOverrides.resident_blocks = {ov.resident_blocks} outside 0..{n}: "
            f"{model.name} has {n} blocks"
        )
    if isinstance(job, FitJob):
        g = job.seqs_per_step
        if ov.micro_batch is not None and ov.micro_batch > g:
            raise ValueError(
                f"PlanOverrides.micro_batch = {ov.micro_batch} exceeds the global batch of "
                f"{g} sequences: use micro_batch <= {g}"
            )
        if ov.grad_accum is not None and ov.grad_accum > g:
            raise ValueError(
                f"PlanOverrides.grad_accum = {ov.grad_accum} exceeds the global batch of "
                f"{g} sequences: use grad_accum <= {g}"
            )
        if ov.micro_batch and ov.grad_accum and math.ceil(g / ov.micro_batch) != ov.grad_accum:
            raise ValueError(
                f"PlanOverrides micro_batch = {ov.micro_batch} x grad_accum = {ov.grad_accum} "
                f"does not make the global batch of {g} sequences: give one of them"
            )
        if ov.concurrent_seqs is not None:
            raise ValueError("PlanOverrides.concurrent_seqs applies to predict jobs only")
    else:
        if ov.concurrent_seqs is not None and ov.concurrent_seqs > job.num_prompts:
            raise ValueError(
                f"PlanOverrides.concurrent_seqs = {ov.concurrent_seqs} exceeds num_prompts = "
                f"{job.num_prompts}: use concurrent_seqs <= {job.num_prompts}"
            )
        for name in ("grad_accum", "checkpointing", "master_tier"):
            if getattr(ov, name) is not None:
                raise ValueError(f"PlanOverrides.{name} applies to fit jobs only")


def make_plan(
    model: ModelProfile,
    hardware: HardwareProfile,
    job: FitJob | PredictJob,
    *,
    overrides: PlanOverrides | None = None,
) -> Plan:
    """Plan ``job`` for ``model`` on ``hardware``; raise :class:`PlanError` when nothing fits.

    With data parallelism (``hardware.world_size`` > 1) the plan is one rank's: priced on
    :func:`~bb_lightning.planner.data_parallel.rank_share` of the node and
    :func:`~bb_lightning.planner.data_parallel.rank_job` of the job, returned with the
    node's profile, the whole job and the job's throughput (``world_size`` x one rank's).
    """
    job.validate(model)
    ov = overrides or PlanOverrides()
    rank_hw = data_parallel.rank_share(hardware)
    rank_job = data_parallel.rank_job(job, hardware.world_size)
    _check_overrides(model, rank_job, ov)
    budgets = cost.budgets(rank_hw)
    if isinstance(rank_job, FitJob):
        best = fit_search.search(model, rank_hw, rank_job, ov, budgets)
        if best is None:
            raise PlanError(fit_search.diagnose(model, rank_hw, rank_job, ov, budgets))
        plan = fit_plan.build_plan(model, rank_hw, rank_job, overrides, best, budgets)
    else:
        best_p = predict_search.search(model, rank_hw, rank_job, ov, budgets)
        if best_p is None:
            raise PlanError(predict_search.diagnose(model, rank_hw, rank_job, ov, budgets))
        plan = predict_plan.build_plan(model, rank_hw, rank_job, overrides, best_p, budgets)
    if hardware.world_size == 1:
        return plan
    return dataclasses.replace(
        plan, hardware=hardware, job=job, tokens_per_s=plan.tokens_per_s * hardware.world_size
    )


def _clamp(x: float) -> float:
    lo, hi = EFFICIENCY_RANGE
    return min(hi, max(lo, x))


def _ratio(predicted: float, measured: float | None) -> float | None:
    if measured is None or measured <= 0 or predicted <= 0:
        return None
    return predicted / measured


def adapt(plan: Plan, measured: MeasuredTimes) -> Plan:
    """Correct the hardware efficiencies from ``measured`` times and re-plan the same job.

    For each measured phase ``new_eff = old_eff * predicted / measured``, clamped to
    :data:`EFFICIENCY_RANGE`; both NVMe links share one factor (their byte-weighted
    ratio). The job and the overrides are kept.
    """
    p, hw = plan.predicted, plan.hardware
    changes: dict[str, float] = {}
    pairs = (
        ("compute_efficiency", p.compute, measured.compute_s),
        ("h2d_efficiency", p.h2d, measured.h2d_s),
        ("d2h_efficiency", p.d2h, measured.d2h_s),
        ("optimizer_efficiency", p.optimizer, measured.optimizer_s),
    )
    for name, pred, meas in pairs:
        r = _ratio(pred, meas)
        if r is not None:
            changes[name] = _clamp(getattr(hw, name) * r)
    nvme_pred = nvme_meas = 0.0
    for pred, meas in ((p.nvme_read, measured.nvme_read_s), (p.nvme_write, measured.nvme_write_s)):
        if meas is not None and pred > 0:
            nvme_pred += pred
            nvme_meas += meas
    r = _ratio(nvme_pred, nvme_meas)
    if r is not None:
        changes["nvme_efficiency"] = _clamp(hw.nvme_efficiency * r)
    return make_plan(plan.model, hw.replace(**changes), plan.job, overrides=plan.overrides)


def plan_differs(plan: Plan, measured: MeasuredTimes, tolerance: float = 0.25) -> bool:
    """Whether any measured phase is off its prediction by more than ``tolerance`` (relative).

    Phases under 1 ms both predicted and measured are ignored.
    """
    if tolerance < 0:
        raise ValueError(f"tolerance = {tolerance} must be >= 0 (0.25 = 25%)")
    p = plan.predicted
    pairs = (
        (p.compute, measured.compute_s),
        (p.h2d, measured.h2d_s),
        (p.d2h, measured.d2h_s),
        (p.nvme_read, measured.nvme_read_s),
        (p.nvme_write, measured.nvme_write_s),
        (p.optimizer, measured.optimizer_s),
        (p.total, measured.step_s),
    )
    for pred, meas in pairs:
        if meas is None or max(pred, meas) < 1e-3:
            continue
        if abs(meas - pred) > tolerance * max(pred, 1e-3):
            return True
    return False
