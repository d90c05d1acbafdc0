"""A user's torch thread settings survive a balance_beam fit on the CPU.

The strategy's background threads (the store's copy threads, the gradient worker) run
their torch ops on one intra-op thread each (storage/threads.py); the training thread,
threads the user starts later and the user's own count are left as they were, and the
run still trains as plain Lightning does.
"""

from __future__ import annotations

import threading
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import lightning.pytorch as pl
import torch

from bb_lightning import BalanceBeamStrategy
from bb_lightning.placement import Placement
from storage.tiers import Tier

D, H, N = Tier.DEVICE, Tier.HOST, Tier.NVME
STEPS = 3


class _Counts(pl.Callback):
    """The training thread's torch thread count at every batch."""

    def __init__(self) -> None:
        self.seen: list[int] = []

    def on_train_batch_start(self, *args: Any) -> None:
        self.seen.append(torch.get_num_threads())


def test_fit_leaves_the_users_thread_counts_and_trains_as_plain_lightning(
    tiny: SimpleNamespace, reference_run: Any, tmp_path: Path
) -> None:
    before = torch.get_num_threads()
    torch.set_num_threads(2)  # the user's setting
    try:
        config = tiny.tiny_llama(3)
        placement = Placement(weights=(N, H, D), master=(N, H, N))  # copies to and from NVMe
        strategy = BalanceBeamStrategy(
            placement=placement, compute_dtype="fp32", nvme_path=str(tmp_path)
        )
        module = tiny.make_module(config)
        counts = _Counts()
        trainer, recorder = tiny.make_trainer(strategy, STEPS, accumulate_grad_batches=2)
        trainer.callbacks.append(counts)
        trainer.fit(module, tiny.loader(2 * STEPS))
        strategy.close()
        later: list[int] = []
        thread = threading.Thread(target=lambda: later.append(torch.get_num_threads()))
        thread.start()
        thread.join()
        assert counts.seen == [2] * (2 * STEPS)
        assert torch.get_num_threads() == 2 and later == [2]
        losses, state = reference_run(config, STEPS, accumulate_grad_batches=2)
        torch.testing.assert_close(torch.tensor(recorder.losses), torch.tensor(losses))
        got = module.state_dict()
        for key, value in state.items():
            torch.testing.assert_close(got[key], value, rtol=1e-5, atol=1e-6, msg=key)
    finally:
        torch.set_num_threads(before)
