"""Measure, then adapt: the first optimizer steps against the plan, and the re-plan."""

from __future__ import annotations

from collections.abc import Mapping

from lightning.pytorch.utilities import rank_zero_info

from bb_lightning.engine.pager import Placement
from bb_lightning.engine.timing import StepTimes
from bb_lightning.engine.trainer_engine import (
    TrainingEngine,
    required_budgets,
)
from bb_lightning.planner import (
    MeasuredTimes,
    Plan,
    adapt,
    plan_differs,
)
from storage.tiers import Tier


class _AdaptMixin:
    """Methods of :class:`~bb_lightning.strategy.BalanceBeamStrategy`."""

    def _skip(self) -> int:
        return 1 if self.warmup_steps > 1 else 0

    def _after_step(self) -> None:
        engine = self.engine
        assert engine is not None
        engine.timer.end_step()
        if self.plan is None or len(engine.timer.steps) != self.warmup_steps:
            return
        mean = engine.timer.mean(skip=self._skip())
        assert mean is not None
        steps = self.warmup_steps - self._skip()
        links = {
            k: (v - self._links0.get(k, 0.0)) / steps for k, v in _link_seconds(engine).items()
        }
        measured = _measured(mean, links, (engine.optimizer_busy_s - self._busy0) / steps)
        self._report(self.plan, measured)
        tol = self.adapt_tolerance
        if tol is not None and plan_differs(self.plan, measured, tol):
            self._replan(adapt(self.plan, measured), measured)

    def _report(self, plan: Plan, measured: MeasuredTimes, prefix: str = "") -> None:
        p = plan.predicted
        pairs = {
            "step": (p.total, measured.step_s),
            "compute": (p.compute, measured.compute_s),
            "h2d": (p.h2d, measured.h2d_s),
            "optimizer": (p.optimizer, measured.optimizer_s),
        }
        for phase, (pred, meas) in pairs.items():
            self.plan_metrics[f"bb/{prefix}predicted_{phase}_s"] = pred
            if meas is not None:
                self.plan_metrics[f"bb/measured_{phase}_s"] = meas
            rank_zero_info(
                f"balance_beam {prefix}{phase}: predicted {pred:.4g} s, measured "
                f"{'-' if meas is None else f'{meas:.4g}'} s per step"
            )
        trainer = self.lightning_module.trainer if self.lightning_module else None
        if trainer is not None and trainer.logger is not None:
            trainer.logger.log_metrics(dict(self.plan_metrics), step=trainer.global_step)

    def _replan(self, plan: Plan, measured: MeasuredTimes) -> None:
        engine, store = self.engine, self.store
        assert engine is not None and store is not None
        placement = Placement.from_plan(plan)
        numels = [s.numel for s in engine.pager.states]
        need = required_budgets(numels, engine.resident.numel, placement, engine.compute_dtype,
                                engine.pager.frozen_numels)  # fmt: skip
        room = {t: cap for t, (_, cap) in store.usage().items()}
        short = [t.value for t in Tier if need[t] > room[t]]
        if short:
            rank_zero_info(
                f"balance_beam: re-plan needs more {short} than the store holds; "
                "keeping the placement"
            )
        else:
            engine.apply_placement(placement)
        self._adopt(plan)
        rank_zero_info(
            "balance_beam: measured times differ from the plan; re-planned:\n" + plan.explain()
        )
        self._report(plan, measured, prefix="replanned_")


def _link_seconds(engine: TrainingEngine) -> dict[str, float]:
    """Busy seconds of the store's links since it opened, as the planner names the links."""
    stats = {k: v.seconds for k, v in engine.store.stats().items()}
    return {
        "h2d": stats.get("host->device", 0.0),
        "nvme_read": stats.get("nvme->host", 0.0) + stats.get("nvme->device", 0.0),
        "nvme_write": stats.get("host->nvme", 0.0) + stats.get("device->nvme", 0.0),
    }


def _measured(mean: StepTimes, links: Mapping[str, float], optimizer_s: float) -> MeasuredTimes:
    """Measured seconds per step; device-to-host is not measured (gradients bypass the store)."""
    return MeasuredTimes(
        compute_s=mean.compute,
        h2d_s=links["h2d"],
        nvme_read_s=links["nvme_read"],
        nvme_write_s=links["nvme_write"],
        optimizer_s=optimizer_s,
        step_s=mean.step,
    )
