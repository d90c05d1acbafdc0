"""Disk faults on demand: an I/O backend that fails the transfers a :class:`Fault` picks.

:class:`FaultyBackend` wraps any :class:`~storage.io.IOBackend`. A transfer a fault
selects fails in flight, as a failing disk does: its future raises ``OSError(errno)``
naming the file; a failed read leaves zeros in the buffer (so a caller that swallowed the
error would see a zero page), a failed write leaves an empty file. :func:`inject` installs
faults for every backend :func:`storage.io.open_backend` builds inside a ``with`` block, so
a :class:`~storage.store.TieredStore` or a checkpoint save meets them unchanged::

    with inject(Fault("write", errno.ENOSPC, path_contains="exp_avg", after=3)):
        trainer.save_checkpoint(path)   # the 4th moment array fails: disk full
"""

from __future__ import annotations

import contextlib
import errno as errnos
import os
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Literal

import torch

from storage import io
from storage.io import IOBackend, IOFuture

__all__ = ["Fault", "FaultyBackend", "inject"]


@dataclass
class Fault:
    """Which transfers fail, and how."""

    op: Literal["read", "write"]
    """The kind of transfer that fails."""
    errno: int = errnos.EIO
    """The error number of the failure (``errno.EIO``, ``errno.ENOSPC``...)."""
    path_contains: str = ""
    """Only transfers of files whose path contains this string (all when empty)."""
    after: int = 0
    """Matching transfers that succeed before the first failure."""
    times: int | None = None
    """Failures before the fault stops failing (``None``: every later matching transfer)."""
    failed: list[str] = field(default_factory=list)
    """Files of the transfers failed so far (filled in as they fail)."""
    _seen: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def fires(self, op: str, path: str) -> bool:
        """Count transfer ``op`` of ``path``; whether this one fails."""
        if op != self.op or self.path_contains not in path:
            return False
        with self._lock:
            self._seen += 1
            if self._seen <= self.after:
                return False
            if self.times is not None and len(self.failed) >= self.times:
                return False
            self.failed.append(path)
            return True


class FaultyBackend(IOBackend):
    """``inner`` with the transfers that ``faults`` select failing (see module doc)."""

    def __init__(self, inner: IOBackend, faults: list[Fault]) -> None:
        self.inner = inner
        self.faults = faults
        self.name = inner.name

    def _fails(self, op: str, path: str) -> Fault | None:
        return next((f for f in self.faults if f.fires(op, path)), None)

    @staticmethod
    def _failed(fault: Fault, path: str) -> IOFuture:
        fut = IOFuture(path)
        fut.set_exception(OSError(fault.errno, os.strerror(fault.errno), path))
        return fut

    def read_async(
        self, path: str | os.PathLike[str], dst: torch.Tensor, nbytes: int, *, offset: int = 0
    ) -> IOFuture:
        fault = self._fails("read", os.fspath(path))
        if fault is None:
            return self.inner.read_async(path, dst, nbytes, offset=offset)
        dst[:nbytes].zero_()
        return self._failed(fault, os.fspath(path))

    def write_async(
        self,
        path: str | os.PathLike[str],
        src: torch.Tensor,
        nbytes: int,
        *,
        fsync: bool = True,
        offset: int = 0,
        in_place: bool = False,
    ) -> IOFuture:
        fault = self._fails("write", os.fspath(path))
        if fault is None:
            return self.inner.write_async(
                path, src, nbytes, fsync=fsync, offset=offset, in_place=in_place
            )
        os.close(os.open(path, os.O_WRONLY | os.O_CREAT | (os.O_TRUNC if offset == 0 else 0)))
        return self._failed(fault, os.fspath(path))

    def close(self) -> None:
        self.inner.close()


@contextlib.contextmanager
def inject(*faults: Fault) -> Iterator[list[Fault]]:
    """Make every backend :func:`storage.io.open_backend` builds in the block fail as ``faults``
    say (backends built before keep working); yields the faults, to read ``failed``."""
    chosen = list(faults)

    def wrap(backend: IOBackend) -> IOBackend:
        return FaultyBackend(backend, chosen)

    io._BACKEND_HOOKS.append(wrap)
    try:
        yield chosen
    finally:
        io._BACKEND_HOOKS.remove(wrap)
