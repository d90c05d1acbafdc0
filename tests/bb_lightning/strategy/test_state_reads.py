"""Where the blocks page their weights in from NVMe and a window accumulates several
micro-batches, the overlapped step's optimizer state is read in the window's backwards,
not beside the forwards' page-ins: no more than one read-ahead set's reads may still be
starting when a forward begins. The user's run trains as plain Lightning does."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import lightning.pytorch as pl
import torch

from bb_lightning import BalanceBeamStrategy
from bb_lightning.placement import STATE_KINDS, Placement
from storage import Tier, TransferKind

STEPS, ACCUM, BLOCKS = 2, 3, 4


class Phases(pl.Callback):
    """Each micro-batch's forward span, and the start of each read of optimizer state."""

    def __init__(self) -> None:
        self.forwards: list[list[float]] = []
        self.reads: list[tuple[float, str]] = []
        self._lock = threading.Lock()

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        engine = trainer.strategy.engine  # type: ignore[attr-defined]
        engine.store.add_observer(self)

    def on_train_batch_start(self, *args: Any) -> None:
        self.forwards.append([time.perf_counter()])

    def on_before_backward(self, *args: Any) -> None:
        self.forwards[-1].append(time.perf_counter())

    def transfer_started(self, kind: TransferKind, name: str) -> None:
        state = name.rsplit(".", 1)[-1] in STATE_KINDS
        if state and kind not in (TransferKind.PAGE_IN, TransferKind.WRITE_BACK):
            with self._lock:
                self.reads.append((time.perf_counter(), name))

    def transfer_finished(self, kind: TransferKind, name: str) -> None:
        pass


def test_state_reads_leave_the_forwards_to_the_page_ins(
    tiny: SimpleNamespace, tmp_path: Path, reference_run: Any
) -> None:
    config = tiny.tiny_llama(BLOCKS)
    placement = Placement(
        weights=(Tier.NVME,) * BLOCKS,
        master=(Tier.NVME,) * BLOCKS,
        prefetch_depth=1,
        read_ahead=3,
    )
    strategy = BalanceBeamStrategy(
        placement=placement, nvme_path=str(tmp_path), compute_dtype="fp32"
    )
    module = tiny.make_module(config)
    trainer, recorder = tiny.make_trainer(strategy, STEPS, accumulate_grad_batches=ACCUM)
    phases = Phases()
    trainer.callbacks.append(phases)
    trainer.fit(module, tiny.loader(STEPS * ACCUM))
    strategy.close()

    assert len(phases.forwards) == STEPS * ACCUM
    assert len(phases.reads) >= STEPS * BLOCKS * len(STATE_KINDS)  # every block's state read
    for start, end in phases.forwards:
        during = [name for t, name in phases.reads if start <= t < end]
        assert len(during) <= len(STATE_KINDS), during  # one set's reads at most
    losses, state = reference_run(config, STEPS, accumulate_grad_batches=ACCUM)
    torch.testing.assert_close(torch.tensor(recorder.losses), torch.tensor(losses))
    got = module.state_dict()
    for key, value in state.items():
        torch.testing.assert_close(got[key], value, rtol=1e-5, atol=1e-6, msg=key)
