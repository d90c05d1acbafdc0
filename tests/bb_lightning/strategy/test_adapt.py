"""The adapt controller without a Trainer: scripted measured times against the planner's adapt."""

from __future__ import annotations

from collections.abc import Mapping

import pytest

from bb_lightning.planner import FitJob, MeasuredTimes, Plan, adapt, make_plan
from bb_lightning.probe import model_profile_from_config
from bb_lightning.strategy.adapt import AdaptController

from ..tiny import cpu_profile, tiny_llama_config

CONFIG = tiny_llama_config(4, vocab_size=260, max_position_embeddings=128)
CPU = cpu_profile()


@pytest.fixture(scope="module")
def plan() -> Plan:
    return make_plan(
        model_profile_from_config(CONFIG), CPU, FitJob(seq_len=64, global_batch_seqs=4)
    )


def _as_predicted(plan: Plan, compute_factor: float = 1.0) -> MeasuredTimes:
    p = plan.predicted
    return MeasuredTimes(
        compute_s=p.compute * compute_factor,
        h2d_s=p.h2d,
        optimizer_s=p.optimizer,
        step_s=p.total - p.compute + p.compute * compute_factor,
    )


def test_times_as_predicted_keep_the_plan_and_are_reported(plan: Plan) -> None:
    logged: list[Mapping[str, float]] = []
    controller = AdaptController(warmup_steps=3, tolerance=0.25)
    measured = _as_predicted(plan)
    assert controller.review(plan, measured, logged.append) is None
    p = plan.predicted
    assert controller.metrics == {
        "bb/predicted_step_s": p.total,
        "bb/measured_step_s": measured.step_s,
        "bb/predicted_compute_s": p.compute,
        "bb/measured_compute_s": p.compute,
        "bb/predicted_h2d_s": p.h2d,
        "bb/measured_h2d_s": p.h2d,
        "bb/predicted_optimizer_s": p.optimizer,
        "bb/measured_optimizer_s": p.optimizer,
    }
    assert logged == [controller.metrics]


def test_slow_compute_replans_as_the_planner_adapts(plan: Plan) -> None:
    measured = _as_predicted(plan, compute_factor=10.0)
    controller = AdaptController(warmup_steps=2, tolerance=0.25)
    replanned = controller.review(plan, measured)
    want = adapt(plan, measured)
    assert replanned is not None
    assert replanned.hardware == want.hardware and replanned.predicted == want.predicted
    assert replanned.hardware.compute_efficiency < plan.hardware.compute_efficiency
    assert controller.metrics["bb/measured_compute_s"] == measured.compute_s


def test_tolerance_none_reports_but_never_replans(plan: Plan) -> None:
    controller = AdaptController(warmup_steps=1, tolerance=None)
    assert controller.skip == 0  # one step measured: none is left out of the mean
    assert controller.review(plan, _as_predicted(plan, compute_factor=10.0)) is None
    assert controller.metrics["bb/predicted_compute_s"] == plan.predicted.compute


def test_bad_settings_raise_naming_the_value() -> None:
    with pytest.raises(ValueError, match="warmup_steps=0"):
        AdaptController(warmup_steps=0)
    with pytest.raises(ValueError, match=r"adapt_tolerance=-0\.5"):
        AdaptController(tolerance=-0.5)
