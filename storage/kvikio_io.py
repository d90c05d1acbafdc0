"""The kvikio backend: ``kvikio.CuFile`` (GPUDirect Storage where present, its POSIX
compatibility mode otherwise), which also reads into and writes from CUDA tensors.
kvikio 26.x needs ``libcuda.so.1`` even for host buffers, so it only runs where there is
a CUDA driver (:func:`kvikio_status`)."""

from __future__ import annotations

import ctypes
import functools
import importlib
import importlib.util
import os
import time
from collections.abc import Callable
from typing import Any

import torch

from storage.io_base import (
    KVIKIO_TASK_SIZE,
    IOConfig,
    IOFuture,
    PooledBackend,
    short_file_error,
)


@functools.lru_cache(maxsize=1)
def kvikio_status() -> tuple[bool, str]:
    """Whether the kvikio backend can run here, and why (not).

    kvikio must be importable and the CUDA driver library ``libcuda.so.1``
    loadable (kvikio 26.x needs it even for host buffers).
    """
    if importlib.util.find_spec("kvikio") is None:
        return False, "kvikio is not installed (pip install kvikio-cu12)"
    try:
        ctypes.CDLL("libcuda.so.1")
    except OSError as exc:
        return False, f"libcuda.so.1 cannot be loaded (no CUDA driver): {exc}"
    try:
        kvikio = importlib.import_module("kvikio")
    except Exception as exc:
        return False, f"kvikio fails to import: {exc!r}"
    return True, f"kvikio {getattr(kvikio, '__version__', '?')} with a CUDA driver"


def size_kvikio_threads(kvikio: Any, threads: int) -> None:
    """Set kvikio's (process-wide) thread pool to ``threads`` threads.

    kvikio >= 24.12 takes ``kvikio.defaults.set({"num_threads": n})``; older releases
    ``kvikio.defaults.num_threads_reset(n)``. Raises ``ValueError`` if neither exists.
    """
    defaults = getattr(kvikio, "defaults", None)
    if defaults is not None and hasattr(defaults, "set"):
        defaults.set({"num_threads": threads})
    elif defaults is not None and hasattr(defaults, "num_threads_reset"):
        defaults.num_threads_reset(threads)
    else:
        raise ValueError(
            f"kvikio {getattr(kvikio, '__version__', '?')} has neither defaults.set nor "
            f"defaults.num_threads_reset: install kvikio >= 24.12, or use backend='posix'"
        )


class KvikioBackend(PooledBackend):
    """``kvikio.CuFile`` backend: GPUDirect Storage where present, compat mode otherwise.

    Takes host buffers and CUDA tensors; a CUDA source must be ready (its
    producing stream synchronised) before :meth:`write_async`. kvikio's own
    thread pool, sized to ``IOConfig.threads`` (:func:`size_kvikio_threads`), does
    host I/O in ``task_size`` pieces; a small pool of ours waits on it, fsyncs and
    closes the file.

    A read into (write from) CUDA memory is issued on the caller's current CUDA stream
    (``CuFile.raw_read_async`` / ``raw_write_async``: GPUDirect's stream-ordered calls,
    a read into a bounce buffer after that stream in compat mode): kvikio's ``pread``
    and ``pwrite`` of device memory first synchronise the device's default stream, so a
    page-in issued from a copy thread would wait for all the compute queued there. The
    store issues them on its copy streams (:mod:`storage.transfers`); the transfer is
    done (the stream synchronised) when :meth:`IOFuture.wait` returns.
    """

    name = "kvikio"
    accepts_cuda = True

    def __init__(self, config: IOConfig | None = None) -> None:
        self._kvikio: Any = importlib.import_module("kvikio")
        super().__init__(config, thread_name_prefix="bb-kvikio")
        size_kvikio_threads(self._kvikio, self.config.threads)

    @staticmethod
    def _target(buf: torch.Tensor, nbytes: int) -> Any:
        part = buf[:nbytes]
        # CUDA tensors expose __cuda_array_interface__; host ones go through numpy.
        return part if part.device.type == "cuda" else part.detach().numpy()

    @staticmethod
    def _device_stream(buf: torch.Tensor) -> int | None:
        """The raw handle of the current CUDA stream of ``buf``'s device; None for host
        memory (read and written through kvikio's thread pool)."""
        if buf.device.type != "cuda":
            return None
        return int(torch.cuda.current_stream(buf.device).cuda_stream)

    def _issue(self, handle: Any, buf: torch.Tensor, nbytes: int, offset: int, write: bool) -> Any:
        """Start one transfer of ``nbytes`` at file ``offset``; a zero-argument callable
        that waits for it and returns the bytes moved."""
        target = self._target(buf, nbytes)
        stream = self._device_stream(buf)
        raw = getattr(handle, "raw_write_async" if write else "raw_read_async", None)
        if stream is not None and raw is not None:  # ordered on ``stream`` only
            done = raw(target, stream, nbytes, offset)
            return done.check_bytes_done
        call = handle.pwrite if write else handle.pread
        kfuture = call(target, nbytes, offset, task_size=self.config.task_size or KVIKIO_TASK_SIZE)
        return kfuture.get

    def _finish(
        self, path: str, handle: Any, wait_io: Callable[[], Any] | None, fsync: bool
    ) -> IOFuture:
        future = IOFuture(path)
        start = time.perf_counter()

        def wait() -> None:
            try:
                nbytes = int(wait_io()) if wait_io is not None else 0
                if fsync:
                    os.fsync(handle.fileno())
                handle.close()
            except BaseException as exc:
                handle.close()
                future.set_exception(exc, time.perf_counter() - start)
                return
            future.set_result(nbytes, time.perf_counter() - start)

        if self._closed:
            handle.close()
            self._check_open(path)  # raises
        self._pool.submit(wait)
        return future

    def read_async(
        self, path: str | os.PathLike[str], dst: torch.Tensor, nbytes: int, *, offset: int = 0
    ) -> IOFuture:
        p = self._checked_path(path, dst, nbytes, offset)
        size = os.stat(p).st_size
        if size < offset + nbytes:
            raise short_file_error(p, size, offset + nbytes)
        handle = self._kvikio.CuFile(p, "r")
        try:
            wait_io = self._issue(handle, dst, nbytes, offset, write=False) if nbytes else None
        except BaseException:
            handle.close()
            raise
        return self._finish(p, handle, wait_io, fsync=False)

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
        p = self._checked_path(path, src, nbytes, offset)  # before CuFile(p, "w") empties it
        keep = bool(offset) or in_place  # "r+" does not truncate: a later piece, or in place
        if keep:
            os.close(os.open(p, os.O_WRONLY | os.O_CREAT, 0o644))
        handle = self._kvikio.CuFile(p, "r+" if keep else "w")
        try:
            wait_io = self._issue(handle, src, nbytes, offset, write=True) if nbytes else None
        except BaseException:
            handle.close()
            raise
        return self._finish(p, handle, wait_io, fsync=fsync)
