"""Measure, then adapt: the first optimizer steps against the plan, and the re-plan.

After ``warmup_steps`` optimizer steps (the first left out of the mean when there are
several: it pays for first touches) the :class:`AdaptController` compares measured with
predicted phase times (:attr:`AdaptController.metrics`, ``self.log``-able) and, when they
differ by more than ``tolerance``, re-plans with :func:`~bb_lightning.planner.adapt`; the
blocks' homes move to the new placement where the open store has room for it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from lightning.pytorch.utilities import rank_zero_info

from bb_lightning.engine.budgets import required_budgets
from bb_lightning.engine.timing import StepTimes
from bb_lightning.engine.trainer_engine import TrainingEngine
from bb_lightning.planner import MeasuredTimes, Plan, adapt, plan_differs
from bb_lightning.strategy.world import Reducer, slowest_times
from storage.tiers import Link, Tier

__all__ = ["AdaptController", "MetricsSink", "apply_plan"]

MetricsSink = Callable[[Mapping[str, float]], None]
"""Where the metrics go after each comparison (the Trainer's logger), or nowhere."""


class AdaptController:
    """Times the optimizer steps of a run and re-plans once, after the warm-up."""

    def __init__(self, *, warmup_steps: int = 3, tolerance: float | None = 0.25) -> None:
        """``warmup_steps`` (>= 1) steps are measured; ``tolerance`` is the relative
        difference of measured and predicted phase times that triggers a re-plan (None:
        only report)."""
        if warmup_steps < 1:
            raise ValueError(f"warmup_steps={warmup_steps} must be >= 1 optimizer steps")
        if tolerance is not None and not tolerance >= 0:
            raise ValueError(f"adapt_tolerance={tolerance} must be >= 0 (0.25 = 25%) or None")
        self.warmup_steps = warmup_steps
        self.tolerance = tolerance
        self.metrics: dict[str, float] = {}
        """Predicted and measured seconds per step after warm-up."""
        self._links0: dict[Link, float] = {}
        self._busy0 = 0.0

    @property
    def skip(self) -> int:
        """Steps left out of the mean (the first, when more than one is measured)."""
        return 1 if self.warmup_steps > 1 else 0

    def begin_step(self, engine: TrainingEngine) -> None:
        """Start timing an optimizer step (and, at the first measured one, its links)."""
        if len(engine.timer.steps) == self.skip:
            self._links0 = _link_seconds(engine)
            self._busy0 = engine.optimizer_busy_s
        engine.timer.begin_step()

    def end_step(
        self,
        engine: TrainingEngine,
        plan: Plan | None,
        log: MetricsSink | None = None,
        reduce_max: Reducer | None = None,
    ) -> Plan | None:
        """End timing a step; after the last warm-up step compare with ``plan`` and return
        the new plan (its placement applied where the store has room), else None.

        With several ranks ``reduce_max`` (an all-reduce with MAX) makes the measured
        times the slowest rank's, so that every rank takes the same decision at the
        same step (every rank must then call this at every step)."""
        engine.timer.end_step()
        if plan is None or len(engine.timer.steps) != self.warmup_steps:
            return None
        measured = self.measured(engine)
        if reduce_max is not None:
            measured = slowest_times(measured, reduce_max)
        new = self.review(plan, measured, log)
        if new is not None:
            apply_plan(engine, new)
            rank_zero_info(
                "balance_beam: measured times differ from the plan; re-planned:\n" + new.explain()
            )
            self.report(new, measured, log, prefix="replanned_")
        return new

    def measured(self, engine: TrainingEngine) -> MeasuredTimes:
        """Mean measured seconds per step over the warm-up (its first step skipped)."""
        mean = engine.timer.mean(skip=self.skip)
        assert mean is not None
        steps = self.warmup_steps - self.skip
        links = {
            k: (v - self._links0.get(k, 0.0)) / steps for k, v in _link_seconds(engine).items()
        }
        return _measured(mean, links, (engine.optimizer_busy_s - self._busy0) / steps)

    def review(
        self, plan: Plan, measured: MeasuredTimes, log: MetricsSink | None = None
    ) -> Plan | None:
        """Report ``measured`` against ``plan``; the re-plan when they differ by more than
        the tolerance (:func:`~bb_lightning.planner.plan_differs`), else None."""
        self.report(plan, measured, log)
        tol = self.tolerance
        if tol is not None and plan_differs(plan, measured, tol):
            return adapt(plan, measured)
        return None

    def report(
        self, plan: Plan, measured: MeasuredTimes, log: MetricsSink | None, prefix: str = ""
    ) -> None:
        """Put predicted and measured seconds per phase into :attr:`metrics` and the log."""
        p = plan.predicted
        pairs = {
            "step": (p.total, measured.step_s),
            "compute": (p.compute, measured.compute_s),
            "h2d": (p.h2d, measured.h2d_s),
            "optimizer": (p.optimizer, measured.optimizer_s),
        }
        for phase, (pred, meas) in pairs.items():
            self.metrics[f"bb/{prefix}predicted_{phase}_s"] = pred
            if meas is not None:
                self.metrics[f"bb/measured_{phase}_s"] = meas
            rank_zero_info(
                f"balance_beam {prefix}{phase}: predicted {pred:.4g} s, measured "
                f"{'-' if meas is None else f'{meas:.4g}'} s per step"
            )
        if log is not None:
            log(dict(self.metrics))


def apply_plan(engine: TrainingEngine, plan: Plan) -> bool:
    """Move the blocks' homes to ``plan``'s placement when the open store holds it."""
    placement = plan.placement
    numels = [s.full_numel for s in engine.pager.states]
    need = required_budgets(numels, engine.resident.full_numel, placement,
                            engine.pager.frozen_numels, shards=engine.world_size,
                            shard_numels=[s.numel for s in engine.pager.states],
                            shard_rest=engine.resident.numel)  # fmt: skip
    room = {t: cap for t, (_, cap) in engine.store.usage().items()}
    short = [t.value for t in Tier if need[t] > room[t]]
    if short:
        rank_zero_info(
            f"balance_beam: re-plan needs more {short} than the store holds; keeping the placement"
        )
        return False
    engine.apply_placement(placement)
    return True


def _link_seconds(engine: TrainingEngine) -> dict[Link, float]:
    """Busy seconds of the store's links since it opened; device-to-host is left out (not
    measured: gradients bypass the store)."""
    stats = engine.store.stats()
    return {k: v.seconds for k, v in stats.items() if k is not Link.DEVICE_TO_HOST}


def _measured(mean: StepTimes, links: Mapping[Link, float], optimizer_s: float) -> MeasuredTimes:
    """Measured seconds per step (each link added to the one the planner prices it as)."""
    return MeasuredTimes.from_links(
        links, compute_s=mean.compute, optimizer_s=optimizer_s, step_s=mean.step
    )
