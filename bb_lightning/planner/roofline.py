"""Roofline plot of a Plan, per step: tokens per pass (log) against tokens/s (log).

Every phase that is busy during a step (fit: one optimizer step; predict: one batch of
prompts) bounds the step's throughput: ``tokens_per_s * total / busy`` tokens/s, what the
step would reach were that phase the only one (the compute, each copy link's busy time,
gradient and optimizer-state traffic included, the host AdamW arithmetic, the network).
:func:`roofline_data` prices those bounds, and the predicted throughput, for the plan and
for the same job re-planned at other tokens per pass (the search's own prices, so a curve
passes through the plan's point); :func:`plot_roofline` draws exactly that data.
"""

from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass

from bb_lightning.planner.job import FitJob
from bb_lightning.planner.plan import LINK_FIELDS, Plan, PlanOverrides, PredictedTime
from bb_lightning.planner.search import PlanError, make_plan
from storage.tiers import PRICED_LINKS

__all__ = ["RooflineData", "StepPoint", "plot_roofline", "roofline_data", "step_point"]

PHASE_LABELS = {
    "compute": "compute",
    "nvme_read": "NVMe read",
    "nvme_write": "NVMe write",
    "h2d": "host->device",
    "d2h": "device->host",
    "optimizer": "host AdamW",
    "net": "network",
}
"""Legend name of each phase of :class:`~bb_lightning.planner.plan.PredictedTime`."""

SWEEP_FACTOR = 16
"""A predict plan's curve reaches this many times its concurrent sequences."""


def _busy(predicted: PredictedTime) -> dict[str, float]:
    """Busy seconds per step of each phase (those above zero), by :data:`PHASE_LABELS` key."""
    busy = {"compute": predicted.compute}
    busy.update({LINK_FIELDS[link]: predicted.on(link) for link in PRICED_LINKS})
    busy.update(optimizer=predicted.optimizer, net=predicted.net)
    return {k: float(v) for k, v in busy.items() if v > 0}


@dataclass(frozen=True, kw_only=True)
class StepPoint:
    """One plan's place on the plot: its tokens per pass and the throughput of its step."""

    tokens_per_pass: int
    """Tokens each weight pass serves (x)."""
    tokens_per_s: float
    """The plan's predicted throughput, every phase of the step counted (y)."""
    step_seconds: float
    """Predicted seconds per step (``PredictedTime.total``)."""
    busy: dict[str, float]
    """Busy seconds per step of each phase that is busy (:data:`PHASE_LABELS` keys)."""

    @property
    def bounds(self) -> dict[str, float]:
        """Tokens/s each phase alone allows: ``tokens_per_s * step_seconds / busy``."""
        return {k: self.tokens_per_s * self.step_seconds / v for k, v in self.busy.items()}


def step_point(plan: Plan) -> StepPoint:
    """The plan's :class:`StepPoint` (its predicted throughput and busy times, unchanged)."""
    return StepPoint(
        tokens_per_pass=int(plan.tokens_per_pass),
        tokens_per_s=float(plan.tokens_per_s),
        step_seconds=float(plan.predicted.total),
        busy=_busy(plan.predicted),
    )


@dataclass(frozen=True, kw_only=True)
class RooflineData:
    """What :func:`plot_roofline` draws."""

    title: str
    """The plot's title (task, model, machine)."""
    chosen: StepPoint
    """The plan's own point."""
    curve: tuple[StepPoint, ...]
    """The job re-planned at each tokens per pass that fits, ascending (the chosen included)."""
    unplanned: tuple[int, ...]
    """Tokens per pass of the sweep that do not fit (memory): no point drawn."""


def _replanned(plan: Plan, size: int) -> Plan:
    """``plan``'s job planned again with ``size`` sequences per pass (fit: the micro-batch,
    accumulation following; predict: the sequences generated together)."""
    base = plan.overrides or PlanOverrides()
    if isinstance(plan.job, FitJob):
        forced = dataclasses.replace(base, micro_batch=size, grad_accum=None)
    else:
        forced = dataclasses.replace(base, concurrent_seqs=size)
    return make_plan(plan.model, plan.hardware, plan.job, overrides=forced)


def _sizes(plan: Plan) -> list[int]:
    """Sequences per pass of the sweep: powers of two up to the global batch (fit) or
    :data:`SWEEP_FACTOR` times the plan's (predict), and the plan's own."""
    if isinstance(plan.job, FitJob):
        own, top = plan.micro_batch, plan.job.seqs_per_step // max(1, plan.hardware.world_size)
    else:
        own = plan.concurrent_seqs
        top = own * SWEEP_FACTOR
    top = max(top, own, 1)
    sizes = {2**k for k in range(int(math.log2(top)) + 1)} | {own, top}
    return sorted(s for s in sizes if s >= 1)


def roofline_data(plan: Plan) -> RooflineData:
    """The plan's point and the curves through the same job re-planned at other sizes."""
    chosen = step_point(plan)
    points: list[StepPoint] = []
    unplanned: list[int] = []
    seq = plan.job.seq_len if isinstance(plan.job, FitJob) else 1
    for size in _sizes(plan):
        own = size == (plan.micro_batch if isinstance(plan.job, FitJob) else plan.concurrent_seqs)
        if own:
            points.append(chosen)
            continue
        try:
            points.append(step_point(_replanned(plan, size)))
        except (PlanError, ValueError):
            unplanned.append(size * seq)
    points.sort(key=lambda p: p.tokens_per_pass)
    title = f"{plan.task} {plan.model.name} on {plan.hardware.name}"
    return RooflineData(title=title, chosen=chosen, curve=tuple(points), unplanned=tuple(unplanned))


def plot_roofline(plan: Plan, path: str | os.PathLike[str]) -> RooflineData:
    """Draw :func:`roofline_data` of ``plan`` into ``path`` and return it: a dashed bound per
    busy phase of the step, the predicted throughput through the re-planned sizes, the
    chosen point at the plan's predicted tokens/s, and where larger passes stop fitting."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    data = roofline_data(plan)
    xs = [p.tokens_per_pass for p in data.curve]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    ax.plot(xs, [p.tokens_per_s for p in data.curve], "b-", linewidth=3, alpha=0.5,
            label="predicted")  # fmt: skip
    phases = [k for k in PHASE_LABELS if any(k in p.busy for p in data.curve)]
    for phase in phases:
        pts = [(p.tokens_per_pass, p.bounds[phase]) for p in data.curve if phase in p.busy]
        style = "k-" if phase == "compute" else "--"
        ax.plot(*zip(*pts, strict=True), style, label=f"{PHASE_LABELS[phase]} bound")
    c = data.chosen
    ax.plot([c.tokens_per_pass], [c.tokens_per_s], "ro", markersize=8,
            label=f"chosen: {c.tokens_per_s:,.4g} tokens/s")  # fmt: skip
    if data.unplanned:
        ax.axvline(min(data.unplanned), color="grey", linestyle=":", label="does not fit")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("tokens per pass")
    ax.set_ylabel("tokens/s (whole step: transfers, optimizer)")
    ax.set_title(data.title, fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(os.fspath(path), dpi=100)
    plt.close(fig)
    return data
