"""Overlapped optimizer step: block updates during backward give the non-overlapped result."""

from __future__ import annotations

import time
from types import SimpleNamespace
from typing import Any

import lightning.pytorch as pl
import pytest
import torch

from bb_lightning import BalanceBeamStrategy
from bb_lightning.placement import Placement
from storage.tiers import Tier


class _HoldOverlappedBackward(pl.Callback):
    """In the backward of an overlapped step, holds the hand-off of block 0 (the last block
    backward reaches, inside autograd) until the first block update has begun, for at most
    a minute. Whether the gradient worker is scheduled before the training thread leaves
    backward is up to the OS on a loaded machine; that the update can begin while backward
    is still under way is the engine's behaviour under test: an update that waited for
    backward to return would not begin within the hold."""

    def __init__(self) -> None:
        self.steps = 0

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        engine = trainer.strategy.engine  # type: ignore[attr-defined]

        def hold(i: int) -> None:
            if i != 0 or engine.step_count == self.steps:  # not an overlapped backward
                return
            self.steps = engine.step_count
            deadline = time.monotonic() + 60.0
            while not engine.overlap_starts and time.monotonic() < deadline:
                time.sleep(1e-3)

        engine.paged.on_block_backward = hold


def _run(
    tiny: SimpleNamespace, overlap: bool, steps: int = 3, **kwargs: Any
) -> tuple[list[float], dict[str, torch.Tensor], BalanceBeamStrategy]:
    placement = Placement(
        weights=(Tier.HOST, Tier.DEVICE, Tier.HOST, Tier.HOST),
        master=(Tier.HOST,) * 4,
        prefetch_depth=1,
    )
    strategy = BalanceBeamStrategy(
        placement=placement, compute_dtype="fp32", overlap_optimizer=overlap
    )
    trainer, recorder = tiny.make_trainer(strategy, steps, **kwargs)
    if overlap and kwargs.get("gradient_clip_val") is None:  # clipping steps after backward
        trainer.callbacks.append(_HoldOverlappedBackward())
    accum = kwargs.get("accumulate_grad_batches", 1)
    trainer.fit(tiny.make_module(tiny.tiny_llama()), tiny.loader(steps * accum))
    state = dict(strategy.lightning_module_state_dict())
    return recorder.losses, state, strategy


@pytest.mark.parametrize("accumulate", [1, 2])
def test_overlapped_step_equals_serial_step(tiny: SimpleNamespace, accumulate: int) -> None:
    got = _run(tiny, True, accumulate_grad_batches=accumulate)
    want = _run(tiny, False, accumulate_grad_batches=accumulate)
    assert got[0] == want[0]
    for key, value in want[1].items():
        torch.testing.assert_close(got[1][key], value, rtol=0, atol=0, msg=key)
    engine = got[2].engine
    assert engine is not None
    # Every block was stepped during backward, the last block first, and the first
    # block update began before the backward pass returned (the hold gives it the time).
    blocks = [i for i, _ in engine.overlap_starts]
    assert sorted(blocks) == [0, 1, 2, 3] and blocks[0] == 3
    assert min(t for _, t in engine.overlap_starts) < engine.backward_end
    assert engine.step_count == 3
    assert want[2].engine is not None and want[2].engine.overlap_starts == []
    got[2].close()
    want[2].close()


def test_norm_clipping_steps_the_blocks_after_backward_block_0_first(
    tiny: SimpleNamespace,
) -> None:
    _, _, strategy = _run(tiny, True, steps=2, gradient_clip_val=0.5)
    engine = strategy.engine
    assert engine is not None and [i for i, _ in engine.overlap_starts] == [0, 1, 2, 3]
    assert min(t for _, t in engine.overlap_starts) > engine.backward_end
    strategy.close()


def test_value_clipping_keeps_the_step_after_backward(tiny: SimpleNamespace) -> None:
    kwargs = {"gradient_clip_val": 1e-3, "gradient_clip_algorithm": "value"}
    _, _, strategy = _run(tiny, True, steps=2, **kwargs)
    assert strategy.engine is not None and strategy.engine.overlap_starts == []
    strategy.close()
