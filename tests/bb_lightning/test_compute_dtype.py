"""The Trainer's precision is the job's compute dtype, planned and registered by the engine."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from bb_lightning import BalanceBeamStrategy
from bb_lightning.planner import HardwareProfile

CPU = HardwareProfile(
    name="test cpu",
    device_type="cpu",
    device_memory=2 << 30,
    device_flops=5e10,
    h2d_bandwidth=5e9,
    d2h_bandwidth=5e9,
    host_memory=4 << 30,
    nvme_read_bandwidth=0.0,
    nvme_write_bandwidth=0.0,
    nvme_capacity=0,
    host_adam_params_per_s=2e8,
    cores=2,
)


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
