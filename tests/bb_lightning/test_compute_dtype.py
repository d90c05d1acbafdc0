"""The Trainer's precision is the job's compute dtype, planned and registered by the engine."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from bb_lightning import BalanceBeamStrategy

from .tiny import cpu_profile

CPU = cpu_profile()


@pytest.mark.parametrize(("precision", "dtype"), [("32-true", torch.float32),
                                                  ("bf16-true", torch.bfloat16)])  # fmt: skip
def test_the_trainer_precision_is_the_planned_and_registered_dtype(
    tiny: SimpleNamespace, precision: str, dtype: torch.dtype
) -> None:
    strategy = BalanceBeamStrategy(hardware=CPU)
    trainer, _ = tiny.make_trainer(strategy, 1, precision=precision)
    trainer.fit(tiny.make_module(tiny.tiny_llama(2)), tiny.loader(1))
    plan, engine = strategy.plan, strategy.engine
    assert plan is not None and engine is not None
    name = str(dtype).removeprefix("torch.")
    assert plan.job.compute_dtype == plan.placement.compute_dtype == name
    assert engine.pager.placement == plan.placement  # executed as planned
    weights = [n for n in engine.store.names() if n.endswith(".weight")]
    assert len(weights) == 2 and {engine.store.spec(n).dtype for n in weights} == {dtype}
    strategy.close()
