"""The host arena and the staging buffers for NVMe transfers.

:class:`HostArena` holds the tensors whose home tier is ``HOST`` in one
4 KiB-aligned buffer (page-locked when the store's device is CUDA, so copies to the
device can be asynchronous), carved by the same allocator as the device arena.
:class:`StagingPool` is a small set of aligned buffers, allocated once and
reused, that carry NVMe transfers whose other end cannot take ``O_DIRECT``
(CUDA memory with the POSIX backend, arbitrary caller tensors).

Both are :class:`HostBuffer` s: a private anonymous ``mmap`` of exactly the bytes asked
for (page-aligned, in transparent huge pages where the kernel gives them:
:func:`storage.io.anonymous_map`), registered with ``cudaHostRegister`` when it is to be pinned (``pin``:
the store pins only for a CUDA device; a CPU device's buffers stay pageable even where
CUDA is visible). Before registering, its pages are asked for on the GPU's NUMA node
(``node``, :mod:`storage.numa`), since registering touches them. The
PyTorch pinned allocator would round each request up to a power of two and keep
the block cached after it is freed; a registered mapping pins exactly its size
and is unpinned by :meth:`HostBuffer.release` (the store calls it at close).
"""

from __future__ import annotations

import contextlib
import mmap
import threading
import weakref
from collections.abc import Iterator

import torch

from storage.device import Arena
from storage.io import ALIGNMENT, anonymous_map, padded
from storage.numa import prefer_node

__all__ = ["HostArena", "HostBuffer", "StagingPool", "mapped_bytes"]

_NEVER = mmap.mmap(-1, mmap.PAGESIZE)  # stands for "no mapping" in weak references
_mapped = [0]
_mapped_lock = threading.Lock()


def mapped_bytes() -> int:
    """Bytes of host buffers mapped by this process and not released yet."""
    with _mapped_lock:
        return _mapped[0]


def _cuda_status(code: object) -> int:
    return int(getattr(code, "value", code))  # type: ignore[call-overload]


class HostBuffer:
    """``padded(nbytes)`` bytes of page-aligned host memory, page-locked when ``pin`` and
    CUDA exists.

    An anonymous ``mmap`` (pages are touched on first use on the CPU; registering
    them with CUDA touches and locks them all). :attr:`tensor` is its ``uint8`` view.
    """

    def __init__(self, nbytes: int, *, pin: bool = True, node: int | None = None) -> None:
        """``nbytes`` in bytes (rounded up to 4 KiB); ``pin`` registers it where CUDA exists;
        ``node``: the NUMA node its pages are placed on when pinned (None: where the
        registering thread runs)."""
        self.nbytes = padded(nbytes)
        """Bytes mapped (a multiple of 4096)."""
        self.pinned = False
        """Whether the mapping is registered with CUDA (page-locked)."""
        self.node: int | None = None
        """The NUMA node its pages were asked for on (None: no placement asked)."""
        self._map: mmap.mmap | None = None
        self.mapping: weakref.ref[mmap.mmap] = weakref.ref(_NEVER)
        """The mapping, weakly (dead once it is unmapped)."""
        if self.nbytes == 0:
            self.tensor = torch.empty(0, dtype=torch.uint8)
            return
        self._map = anonymous_map(self.nbytes)
        self.tensor = torch.frombuffer(self._map, dtype=torch.uint8)
        """The whole buffer as a ``uint8`` tensor."""
        assert self.tensor.data_ptr() % ALIGNMENT == 0
        with _mapped_lock:
            _mapped[0] += self.nbytes
        if pin and torch.cuda.is_available():
            if prefer_node(self.tensor.data_ptr(), self.nbytes, node):  # before the touch
                self.node = node
            cudart = torch.cuda.cudart()
            status = _cuda_status(cudart.cudaHostRegister(self.tensor.data_ptr(), self.nbytes, 0))
            if status != 0:
                self.release()
                raise ValueError(
                    f"cudaHostRegister of {self.nbytes} bytes failed (CUDA error {status}): "
                    f"lower the host budget or the staging buffers, or raise the locked-memory "
                    f"limit (ulimit -l)"
                )
            self.pinned = True

    def release(self) -> None:
        """Unpin the buffer now and drop this object's hold on the mapping (idempotent).

        The mapping is unmapped when the last tensor viewing it is freed (each view holds
        a reference to it), so a view kept longer stays valid host memory, only unpinned.
        """
        if self._map is None:
            return
        if self.pinned:
            torch.cuda.cudart().cudaHostUnregister(self.tensor.data_ptr())
            self.pinned = False
        with _mapped_lock:
            _mapped[0] -= self.nbytes
        self.mapping = weakref.ref(self._map)
        self._map = None
        self.tensor = torch.empty(0, dtype=torch.uint8)

    @property
    def released(self) -> bool:
        """Whether :meth:`release` ran."""
        return self._map is None and self.nbytes > 0

    @property
    def unmapped(self) -> bool:
        """Whether the memory is gone: released, and no view of it left."""
        return self.released and self.mapping() is None


class HostArena(Arena):
    """The arena of ``HOST``-home tensors: one aligned buffer, pinned when ``pin`` and CUDA
    exists, its pages on NUMA node ``node`` when pinned (see :class:`HostBuffer`)."""

    def __init__(self, capacity: int, *, pin: bool = True, node: int | None = None) -> None:
        """``capacity`` in bytes (rounded down to 4 KiB), mapped (and pinned) exactly."""
        capacity -= capacity % ALIGNMENT
        self.host = HostBuffer(capacity, pin=pin, node=node)
        """The mapping behind the arena (released by :meth:`release`)."""
        super().__init__(self.host.tensor, label="host")

    @property
    def pinned(self) -> bool:
        """Whether the buffer is page-locked."""
        return self.host.pinned

    def release(self) -> None:
        """Unpin and unmap the arena (its slots must not be used afterwards)."""
        self.buffer = torch.empty(0, dtype=torch.uint8)
        self.host.release()


class StagingPool:
    """``count`` aligned buffers of ``nbytes`` bytes each, borrowed one at a time.

    :meth:`borrow` blocks while every buffer is lent out, so at most
    ``count`` staged transfers run at once and nothing is allocated per
    transfer.
    """

    def __init__(
        self, count: int, nbytes: int, *, pin: bool = True, node: int | None = None
    ) -> None:
        """``count`` buffers of ``nbytes`` bytes (a multiple of 4 KiB), pinned when ``pin``
        and CUDA exists, on NUMA node ``node`` when pinned."""
        if count < 1:
            raise ValueError(f"staging buffer count {count} must be >= 1: use at least 1")
        if nbytes <= 0 or nbytes % ALIGNMENT:
            raise ValueError(
                f"staging buffer size {nbytes} bytes must be a positive multiple of {ALIGNMENT} "
                f"bytes: use e.g. {64 << 20}"
            )
        self.buffer_bytes = nbytes
        """Bytes of each buffer."""
        self._buffers = [HostBuffer(nbytes, pin=pin, node=node) for _ in range(count)]
        self._free = [b.tensor for b in self._buffers]
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

    def release(self) -> None:
        """Unpin and unmap the buffers (no transfer may borrow one afterwards)."""
        with self._cond:
            self._free = []
        for buf in self._buffers:
            buf.release()

    @property
    def available(self) -> int:
        """Buffers not lent out right now."""
        with self._cond:
            return len(self._free)
