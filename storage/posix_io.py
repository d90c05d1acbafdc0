"""The POSIX backend: a pool of threads doing ``os.preadv`` / ``os.pwritev`` on
``task_size`` slices of a transfer, with ``O_DIRECT`` where the filesystem accepts it."""

from __future__ import annotations

import errno
import fcntl
import os
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

from storage.io_base import (
    ALIGNMENT,
    POSIX_TASK_SIZE,
    IOConfig,
    IOFuture,
    PooledBackend,
    padded,
    short_file_error,
)


def tensor_memoryview(buf: torch.Tensor) -> memoryview:
    """A zero-copy, writable byte view of a contiguous ``uint8`` CPU tensor."""
    array: Any = buf.detach().numpy()
    return memoryview(array).cast("B")


class _Transfer:
    """One file transfer split into tasks; the last task to finish completes the future."""

    def __init__(self, future: IOFuture, tasks: int, finish: Callable[[], None]) -> None:
        self.future = future
        self.remaining = tasks
        self.finish = finish
        self.error: BaseException | None = None
        self.lock = threading.Lock()
        self.start = time.perf_counter()

    def task_done(self, error: BaseException | None) -> None:
        with self.lock:
            if error is not None and self.error is None:
                self.error = error
            self.remaining -= 1
            last = self.remaining == 0
        if not last:
            return
        try:
            self.finish()
        except BaseException as exc:
            if self.error is None:
                self.error = exc
        elapsed = time.perf_counter() - self.start
        if self.error is not None:
            self.future.set_exception(self.error, elapsed)
        else:
            self.future.set_result(self.future._result, elapsed)


class PosixBackend(PooledBackend):
    """Thread-pool backend: ``task_size`` pieces with ``os.preadv`` / ``os.pwritev``.

    Files are opened with ``O_DIRECT`` when ``config.direct`` is set and the
    buffer is ALIGNMENT-aligned; a filesystem that refuses it (``EINVAL``), at
    ``open()`` or at the first direct ``pread``/``pwrite``, gets buffered I/O
    for that file (the failed piece is redone buffered). Direct writes write
    the padded length, then truncate the file to ``nbytes``; direct reads ask
    for the padded length and stop once the wanted bytes came (the last read
    comes back short at end of file), so every direct request starts at an
    aligned offset.
    """

    name = "posix"

    def __init__(self, config: IOConfig | None = None) -> None:
        super().__init__(config, thread_name_prefix="bb-io")

    def _open(self, path: str, flags: int, aligned: bool) -> tuple[int, bool]:
        if self.config.direct and aligned and hasattr(os, "O_DIRECT"):
            try:
                return os.open(path, flags | os.O_DIRECT, 0o644), True
            except OSError as exc:
                if exc.errno != errno.EINVAL:
                    raise
        return os.open(path, flags, 0o644), False

    def read_async(
        self, path: str | os.PathLike[str], dst: torch.Tensor, nbytes: int, *, offset: int = 0
    ) -> IOFuture:
        p = self._checked_path(path, dst, nbytes, offset)
        fd, direct = self._open(p, os.O_RDONLY, dst.data_ptr() % ALIGNMENT == 0)
        try:
            size = os.fstat(fd).st_size
            if size < offset + nbytes:
                raise short_file_error(p, size, offset + nbytes)
        except BaseException:
            os.close(fd)
            raise
        length = padded(nbytes) if direct else nbytes
        return self._submit(
            fd, p, dst, length, nbytes, direct, finish=lambda: os.close(fd), base=offset
        )

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
        p = self._checked_path(path, src, nbytes, offset)  # before open(): O_TRUNC empties it
        flags = os.O_WRONLY | os.O_CREAT | (os.O_TRUNC if offset == 0 and not in_place else 0)
        fd, direct = self._open(p, flags, src.data_ptr() % ALIGNMENT == 0)
        length = padded(nbytes) if direct else nbytes

        def finish() -> None:
            try:
                if length != nbytes:
                    os.ftruncate(fd, offset + nbytes)
                if fsync:
                    os.fsync(fd)
            finally:
                os.close(fd)

        return self._submit(
            fd, p, src, length, nbytes, direct, finish=finish, write=True, base=offset
        )

    def _submit(
        self,
        fd: int,
        path: str,
        buf: torch.Tensor,
        length: int,
        nbytes: int,
        direct: bool,
        *,
        finish: Callable[[], None],
        write: bool = False,
        base: int = 0,
    ) -> IOFuture:
        """Split ``length`` bytes of ``buf`` into tasks; buffer byte ``i`` is file byte ``base + i``."""
        if self._closed:
            os.close(fd)
            self._check_open(path)  # raises
        future = IOFuture(path)
        future.direct = direct
        future._result = nbytes
        view = tensor_memoryview(buf)
        step = self.config.task_size or POSIX_TASK_SIZE
        offsets = list(range(0, length, step)) or [0]
        transfer = _Transfer(future, len(offsets), finish)

        def piece(offset: int) -> None:
            end = min(offset + step, length)
            part, at = view[offset:end], base + offset
            if write:
                _pwrite_all(fd, part, at, path)
            else:
                _pread_all(fd, part, at, path, min(end, nbytes) - offset)

        def run(offset: int) -> None:
            error: BaseException | None = None
            try:
                if transfer.error is None:
                    try:
                        piece(offset)
                    except OSError as exc:
                        # a filesystem that opened the file O_DIRECT but refuses the transfer
                        if not (direct and exc.errno == errno.EINVAL):
                            raise
                        _drop_direct(fd)
                        future.direct = False
                        piece(offset)  # pread/pwrite of one piece is idempotent
            except BaseException as exc:
                error = exc
            transfer.task_done(error)

        for offset in offsets:
            self._pool.submit(run, offset)
        return future


def _drop_direct(fd: int) -> None:
    """Turn ``O_DIRECT`` off on ``fd``: its transfers are buffered from now on (idempotent)."""
    flags = fcntl.fcntl(fd, fcntl.F_GETFL)
    if flags & os.O_DIRECT:
        fcntl.fcntl(fd, fcntl.F_SETFL, flags & ~os.O_DIRECT)


def _pread_all(fd: int, view: memoryview, offset: int, path: str, need: int) -> None:
    """Read into ``view`` from ``offset`` until ``need`` bytes came; the file may end after them.

    Each request asks for the rest of ``view`` (a padded length for ``O_DIRECT``)
    and the loop stops as soon as ``need`` bytes arrived, so a short read at end of
    file is never followed by a request at an unaligned offset.
    """
    done = 0
    while done < need:
        got = os.preadv(fd, [view[done:]], offset + done)
        if got == 0:
            break
        done += got
    if done < need:
        raise short_file_error(path, offset + done, offset + need)


def _pwrite_all(fd: int, view: memoryview, offset: int, path: str) -> None:
    done = 0
    while done < len(view):
        put = os.pwritev(fd, [view[done:]], offset + done)
        if put <= 0:
            raise OSError(
                errno.EIO, f"file {path}: write at offset {offset + done} made no progress"
            )
        done += put
