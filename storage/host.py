"""The host arena and the staging buffers for NVMe transfers.

:class:`HostArena` holds the tensors whose home tier is ``HOST`` in one
4 KiB-aligned buffer (page-locked where CUDA exists, so copies to the device
can be asynchronous), carved by the same allocator as the device arena.
:class:`StagingPool` is a small set of aligned buffers, allocated once and
reused, that carry NVMe transfers whose other end cannot take ``O_DIRECT``
(CUDA memory with the POSIX backend, arbitrary caller tensors).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

import torch

from storage.device import Arena
from storage.io import ALIGNMENT, aligned_empty

__all__ = ["HostArena", "StagingPool"]


class HostArena(Arena):
    """The arena of ``HOST``-home tensors: one aligned buffer, pinned where CUDA exists."""

    def __init__(self, capacity: int) -> None:
        """``capacity`` in bytes (rounded down to 4 KiB)."""
        capacity -= capacity % ALIGNMENT
        super().__init__(aligned_empty(capacity, pin=True)[:capacity], label="host")

    @property
    def pinned(self) -> bool:
        """Whether the buffer is page-locked."""
        return bool(self.buffer.numel()) and self.buffer.is_pinned()


class StagingPool:
    """``count`` aligned buffers of ``nbytes`` bytes each, borrowed one at a time.

    :meth:`borrow` blocks while every buffer is lent out, so at most
    ``count`` staged transfers run at once and nothing is allocated per
    transfer.
    """

    def __init__(self, count: int, nbytes: int) -> None:
        """``count`` buffers of ``nbytes`` bytes (a multiple of 4 KiB), pinned where CUDA exists."""
        if count < 1:
            raise ValueError(f"staging buffer count {count} must be >= 1: use at least 1")
        if nbytes <= 0 or nbytes % ALIGNMENT:
            raise ValueError(
                f"staging buffer size {nbytes} bytes must be a positive multiple of {ALIGNMENT} "
                f"bytes: use e.g. {64 << 20}"
            )
        self.buffer_bytes = nbytes
        """Bytes of each buffer."""
        self._free = [aligned_empty(nbytes, pin=True) for _ in range(count)]
        self.count = count
        """Number of buffers."""
        self._cond = threading.Condition()

    @contextlib.contextmanager
    def borrow(self) -> Iterator[torch.Tensor]:
        """Lend one buffer (a ``uint8`` tensor of ``buffer_bytes``) for the ``with`` block."""
        with self._cond:
            self._cond.wait_for(lambda: bool(self._free))
            buf = self._free.pop()
        try:
            yield buf
        finally:
            with self._cond:
                self._free.append(buf)
                self._cond.notify()

    @property
    def available(self) -> int:
        """Buffers not lent out right now."""
        with self._cond:
            return len(self._free)
