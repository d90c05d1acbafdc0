"""The phase timer keeps bounded records over long runs and still averages every step."""

from __future__ import annotations

import numpy as np
import pytest

from bb_lightning.engine import timing
from bb_lightning.engine.timing import KEEP_STEPS, PhaseTimer


def test_records_stay_bounded_and_the_mean_covers_every_step(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    clock = iter(np.cumsum(np.random.default_rng(0).uniform(0.001, 0.01, 100_000)).tolist())
    monkeypatch.setattr(timing.time, "perf_counter", lambda: next(clock))
    timer = PhaseTimer()
    closed = []
    for _ in range(3 * KEEP_STEPS):
        timer.begin_step()
        with timer.phase("wait_page_in"):
            pass
        with timer.phase("optimizer"):
            pass
        step = timer.end_step()
        assert step is not None
        closed.append(step)
    assert timer.count == len(closed) and len(timer.steps) == KEEP_STEPS
    assert list(timer.steps) == closed[-KEEP_STEPS:]
    for skip in (0, 1, 5):
        mean = timer.mean(skip=skip)
        assert mean is not None
        rest = closed[skip:]
        assert mean.step == pytest.approx(np.mean([s.step for s in rest]), rel=1e-9)
        assert mean.wait_page_in == pytest.approx(np.mean([s.wait_page_in for s in rest]), rel=1e-9)
        assert mean.optimizer == pytest.approx(np.mean([s.optimizer for s in rest]), rel=1e-9)
        assert mean.wait_grads == 0.0
    assert timer.mean(skip=len(closed)) == closed[-1]
    assert PhaseTimer().mean() is None
