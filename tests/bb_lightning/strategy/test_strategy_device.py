"""The strategy runs on the device its Trainer's accelerator names, on a machine that sees CUDA."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch

from bb_lightning import BalanceBeamStrategy
from bb_lightning.placement import Placement
from storage.tiers import Tier

STEPS = 2


def _fit_on_cpu(tiny: SimpleNamespace, strategy: Any) -> tuple[list[float], Any]:
    """Build the Trainer (``accelerator="cpu"``) while CUDA looks visible, then fit on the CPU."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(torch.cuda, "is_available", lambda: True)
        mp.setattr(torch.cuda, "device_count", lambda: 1)
        if strategy is None:  # built from its name with CUDA in sight
            strategy = "balance_beam"
        trainer, recorder = tiny.make_trainer(strategy, STEPS)
    built = trainer.strategy
    assert isinstance(built, BalanceBeamStrategy)
    built.placement = Placement.uniform(4, weights=Tier.HOST, master=Tier.HOST)
    trainer.fit(tiny.make_module(tiny.tiny_llama()), tiny.loader(STEPS))
    return recorder.losses, built


@pytest.mark.parametrize("by_name", [True, False], ids=["by-name", "instance"])
def test_cpu_accelerator_runs_on_the_cpu_where_cuda_is_visible(
    tiny: SimpleNamespace, reference_run: Any, by_name: bool
) -> None:
    strategy = None
    if not by_name:
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(torch.cuda, "is_available", lambda: True)
            strategy = BalanceBeamStrategy(compute_dtype="fp32")
            # outside a Trainer it would take CUDA device 0
            assert strategy.root_device == torch.device("cuda", 0)
    losses, built = _fit_on_cpu(tiny, strategy)
    assert built.root_device == torch.device("cpu")
    assert built.store is not None and built.store.device == torch.device("cpu")
    want, _ = reference_run(tiny.tiny_llama(), STEPS)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(want), rtol=1e-5, atol=1e-6)
    built.close()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cpu_accelerator_on_a_gpu_machine_and_devices_select_the_gpu(
    tiny: SimpleNamespace,
) -> None:
    trainer, _ = tiny.make_trainer("balance_beam", STEPS)
    strategy = trainer.strategy
    assert isinstance(strategy, BalanceBeamStrategy)
    strategy.placement = Placement.uniform(4, weights=Tier.HOST, master=Tier.HOST)
    trainer.fit(tiny.make_module(tiny.tiny_llama()), tiny.loader(STEPS))
    assert strategy.root_device.type == "cpu"
    strategy.close()

    import lightning.pytorch as pl

    last = torch.cuda.device_count() - 1
    gpu = pl.Trainer(accelerator="cuda", devices=[last], strategy="balance_beam", logger=False)
    assert gpu.strategy.root_device == torch.device("cuda", last)
