"""Observer hook of the :class:`~bb_lightning.engine.pager.BlockPager`: blocks acquired and released.

A :class:`BlockObserver` added with :meth:`BlockPager.add_observer` is called on the
thread that drives the pager (the training or generation loop) when a block is asked
for, when it is on the device and bound, and when it is released, so a tracer can
time the waits and the holds without wrapping the pager's methods. With no observer
the pager pays one ``None`` check per call. The store's transfers have their own hook
(:mod:`storage.observers`).
"""

from __future__ import annotations

from typing import Protocol

__all__ = ["BlockObserver"]


class BlockObserver(Protocol):
    """Called by the pager for block index ``i``."""

    def block_acquiring(self, i: int) -> None:
        """``acquire(i)`` was called: the wait for the block's page-in starts."""

    def block_acquired(self, i: int) -> None:
        """``acquire(i)`` is about to return: the block is on the device, its parameters bound."""

    def block_released(self, i: int) -> None:
        """``release(i)`` was called: the block is about to be unbound and its slot freed."""
