"""When an overlapped step's optimizer state is read ahead, over one accumulation window.

In a window that ends in an overlapped step (each block steps as its gradient comes in the
last backward), the off-host state is read ahead from the window's start
(:meth:`~bb_lightning.engine.trainer_engine.TrainingEngine.read_state_ahead`). Where blocks
page their weights in from NVMe and the window has more than one micro-batch, it is read in
the window's backwards only: a forward computes each paged block for a few milliseconds
against its page-in, and state reads running beside it stretched every page-in (figures:
docs/benchmarks.md, "Measurements behind design choices"), while a backward computes each
block for about twice as long. The reads are held through each forward, run one read-ahead
set at a time in the backwards but the last (each block's gradients issue the next, so that
no more than one set's reads run on into a forward), and all at once in the last.
"""

from __future__ import annotations

from typing import Any

from bb_lightning.engine.trainer_engine import TrainingEngine
from storage.tiers import Tier

__all__ = ["StateReads"]


class StateReads:
    """The strategy's schedule of one window's state reads (the module doc says which)."""

    def __init__(self) -> None:
        self.in_backwards = False
        """Whether this window's reads run in its backwards only."""
        self._begun = False

    def window_start(self, engine: TrainingEngine, trainer: Any, overlapped: bool) -> None:
        """A window begins (``trainer``'s ``accumulate_grad_batches`` micro-batches); it ends
        in an overlapped step where ``overlapped``."""
        self.in_backwards = self._begun = False
        if not overlapped:
            return
        window = 1 if trainer is None else trainer.accumulate_grad_batches
        if window > 1 and Tier.NVME in engine.pager.placement.weights:
            self.in_backwards = True
        else:
            engine.read_state_ahead()

    def before_backward(self, engine: TrainingEngine) -> None:
        """A backward begins: let the reads run (planned at the window's first)."""
        if not self.in_backwards:
            return
        last = engine.steps.overlap is not None  # the window's overlapped step has begun
        engine.pool.limit_reads(None if last else 1)
        if not self._begun:
            self._begun = True
            engine.read_state_ahead()

    def after_backward(self, engine: TrainingEngine) -> None:
        """A backward has ended: hold the reads through the next forward."""
        if self.in_backwards and engine.steps.overlap is None:
            engine.pool.limit_reads(0)
