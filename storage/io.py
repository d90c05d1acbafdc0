"""I/O backends that move raw bytes between files and tensor buffers.

Two backends share one small interface, :class:`IOBackend`:

* ``posix`` — a pool of threads, each doing ``os.preadv`` / ``os.pwritev`` on a
  ``task_size`` slice of the transfer straight into (or out of) the tensor's
  memory, with ``O_DIRECT`` where the filesystem accepts it. Works everywhere.
* ``kvikio`` — ``kvikio.CuFile`` (GPUDirect Storage where present, its POSIX
  compatibility mode otherwise), which can also read into CUDA tensors.
  kvikio 26.x needs ``libcuda.so.1`` even for host buffers, so it only runs
  where there is a CUDA driver.

Buffer rule: every buffer handed to a backend is a contiguous ``uint8`` tensor
of at least :func:`padded` ``(nbytes)`` bytes (use :func:`aligned_empty`), because
``O_DIRECT`` transfers whole 4 KiB blocks. A file holds exactly ``nbytes``.
"""

from __future__ import annotations

import abc
import ctypes
import errno
import fcntl
import functools
import importlib
import importlib.util
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Literal

import torch

__all__ = [
    "ALIGNMENT",
    "BACKEND_ENV",
    "KVIKIO_TASK_SIZE",
    "POSIX_TASK_SIZE",
    "IOBackend",
    "IOConfig",
    "IOFuture",
    "aligned_empty",
    "kvikio_status",
    "open_backend",
    "padded",
    "size_kvikio_threads",
]

ALIGNMENT: int = 4096
"""Alignment of buffer addresses, file offsets and lengths for ``O_DIRECT``, in bytes."""

POSIX_TASK_SIZE = 64 << 20
"""Default bytes per ``preadv`` / ``pwritev`` of the POSIX backend. The kernel splits a
request into the device's largest transfers itself, so large tasks cost the disk nothing;
what they save is kernel time, which on a CPU device comes out of the compute's cores:
64 MiB tasks cost fewer CPU-seconds per byte than 4 MiB ones at the same bandwidth, and
a training step with its optimizer state on NVMe was shorter with them."""
KVIKIO_TASK_SIZE = 4 << 20
"""Default bytes per task of kvikio's thread pool (kvikio's own default): GPUDirect
Storage reads a transfer's tasks in parallel."""

BACKEND_ENV = "BB_IO_BACKEND"
"""Environment variable (``posix`` | ``kvikio`` | ``auto``) that overrides ``backend="auto"``."""

_BACKENDS = ("auto", "posix", "kvikio")


def padded(nbytes: int) -> int:
    """Round ``nbytes`` up to a multiple of :data:`ALIGNMENT` (bytes)."""
    if nbytes < 0:
        raise ValueError(f"byte count {nbytes} is negative: pass a size >= 0")
    return -(-nbytes // ALIGNMENT) * ALIGNMENT


def aligned_empty(nbytes: int, *, pin: bool = False) -> torch.Tensor:
    """A ``uint8`` CPU tensor of ``padded(nbytes)`` bytes whose address is ALIGNMENT-aligned.

    The tensor is a slice of a slightly larger allocation. ``pin=True`` pins
    it (page-locked, for fast asynchronous copies to the device) only where
    CUDA is available; without CUDA there is no pinned memory and the flag is
    ignored. PyTorch's pinned allocator rounds the request up to a power of two
    and caches it after use: for long-lived buffers of a known size use
    :class:`storage.host.HostBuffer` (exact, released explicitly).
    """
    size = padded(nbytes)
    pin = pin and torch.cuda.is_available()
    if pin:  # pinned blocks start at page boundaries: no extra unit (the allocator rounds up)
        raw = torch.empty(size, dtype=torch.uint8, pin_memory=True)
        if raw.data_ptr() % ALIGNMENT == 0:
            return raw
    raw = torch.empty(size + ALIGNMENT, dtype=torch.uint8, pin_memory=pin)
    shift = (-raw.data_ptr()) % ALIGNMENT
    out = raw[shift : shift + size]
    assert out.data_ptr() % ALIGNMENT == 0
    return out


@dataclass(frozen=True, kw_only=True)
class IOConfig:
    """Choice and tuning of the I/O backend."""

    backend: Literal["auto", "posix", "kvikio"] = "auto"
    """``auto`` picks kvikio where it can run, else posix; the environment variable
    ``BB_IO_BACKEND`` (posix|kvikio|auto) overrides ``auto`` only."""
    threads: int = 4
    """Worker threads of the POSIX backend (transfers in flight at once, in tasks), and
    the size of kvikio's thread pool (its own default is one thread)."""
    task_size: int | None = None
    """Bytes per pread/pwrite task, a multiple of ALIGNMENT (4096 bytes); None: the
    backend's own (:data:`POSIX_TASK_SIZE`, :data:`KVIKIO_TASK_SIZE`)."""
    direct: bool = True
    """Open files with ``O_DIRECT`` (bypassing the page cache) where the filesystem
    accepts it; files it refuses fall back to buffered I/O, one file at a time."""

    def __post_init__(self) -> None:
        if self.backend not in _BACKENDS:
            raise ValueError(
                f"IOConfig.backend={self.backend!r} is not one of {_BACKENDS}: pick one of them"
            )
        if self.threads < 1:
            raise ValueError(f"IOConfig.threads={self.threads} must be >= 1: use at least 1")
        if self.task_size is not None and (self.task_size <= 0 or self.task_size % ALIGNMENT):
            raise ValueError(
                f"IOConfig.task_size={self.task_size} bytes must be a positive multiple of "
                f"{ALIGNMENT} bytes: use e.g. {max(ALIGNMENT, padded(self.task_size))}, "
                "or None for the backend's own"
            )


class IOFuture:
    """Handle of one file read or write in flight.

    :meth:`wait` blocks until the transfer is complete and returns the bytes
    transferred, or re-raises the exception that stopped it. ``seconds`` is
    the busy time of the transfer (first byte to completion, in seconds),
    valid after :meth:`wait`. ``direct`` tells whether ``O_DIRECT`` was used
    (``None`` where the backend does not say).
    """

    def __init__(self, path: str = "") -> None:
        self.path = path
        self.seconds: float = 0.0
        self.direct: bool | None = None
        self._event = threading.Event()
        self._lock = threading.Lock()
        self._result = 0
        self._error: BaseException | None = None
        self._callbacks: list[Callable[[IOFuture], None]] = []

    @classmethod
    def completed(cls, nbytes: int, *, path: str = "") -> IOFuture:
        """A future that is already done with ``nbytes`` transferred."""
        fut = cls(path)
        fut.set_result(nbytes, 0.0)
        return fut

    def wait(self) -> int:
        """Block until done; return the bytes transferred or re-raise the worker's error."""
        self._event.wait()
        if self._error is not None:
            raise self._error
        return self._result

    def done(self) -> bool:
        """Whether the transfer has finished (successfully or not); never blocks."""
        return self._event.is_set()

    def set_result(self, nbytes: int, seconds: float) -> None:
        """Complete the future (backend side)."""
        self._result, self.seconds = nbytes, seconds
        self._finish()

    def set_exception(self, error: BaseException, seconds: float = 0.0) -> None:
        """Fail the future (backend side)."""
        self._error, self.seconds = error, seconds
        self._finish()

    def _finish(self) -> None:
        with self._lock:
            callbacks, self._callbacks = self._callbacks, []
            self._event.set()
        for callback in callbacks:
            callback(self)

    def add_done_callback(self, callback: Callable[[IOFuture], None]) -> None:
        """Call ``callback(self)`` once done: in the completing thread, or now if already done.

        Callbacks must not raise (an error would keep later callbacks from running).
        """
        with self._lock:
            if not self._event.is_set():
                self._callbacks.append(callback)
                return
        callback(self)

    def then(self, step: Callable[[int], None]) -> IOFuture:
        """A future that completes after ``step(nbytes)`` ran on this one's success.

        ``step`` runs in the thread that completes this future (a worker), so
        follow-up work such as renaming a file happens without a caller
        waiting. Errors of this future or of ``step`` fail the new one.
        """
        out = IOFuture(self.path)

        def run(inner: IOFuture) -> None:
            out.direct = inner.direct
            if inner._error is not None:
                out.set_exception(inner._error, inner.seconds)
                return
            start = time.perf_counter()
            try:
                step(inner._result)
            except BaseException as exc:
                out.set_exception(exc, inner.seconds + time.perf_counter() - start)
                return
            out.set_result(inner._result, inner.seconds + time.perf_counter() - start)

        self.add_done_callback(run)
        return out


def check_buffer(buf: torch.Tensor, nbytes: int, *, path: str, allow_cuda: bool) -> None:
    """Raise ``ValueError`` unless ``buf`` can carry ``nbytes`` of ``path`` (see module doc)."""
    if nbytes < 0:
        raise ValueError(f"{path}: byte count {nbytes} is negative: pass a size >= 0")
    if buf.dtype != torch.uint8 or not buf.is_contiguous():
        raise ValueError(
            f"{path}: buffer must be a contiguous uint8 tensor, got dtype {buf.dtype} "
            f"contiguous={buf.is_contiguous()}: pass a storage.io.aligned_empty() buffer"
        )
    if buf.device.type != "cpu" and not (allow_cuda and buf.device.type == "cuda"):
        where = "CPU or CUDA" if allow_cuda else "CPU"
        raise ValueError(
            f"{path}: buffer on {buf.device} but this backend takes {where} tensors: "
            f"stage it through a host buffer"
        )
    need = padded(nbytes) if buf.device.type == "cpu" else nbytes
    if buf.numel() < need:
        raise ValueError(
            f"{path}: buffer of {buf.numel()} bytes is smaller than the {need} bytes required "
            f"for {nbytes} bytes (padded to {ALIGNMENT}-byte blocks): allocate it with "
            f"storage.io.aligned_empty({nbytes})"
        )


class IOBackend(abc.ABC):
    """Reads and writes whole files to and from tensor buffers, asynchronously."""

    name: str
    """``"posix"`` or ``"kvikio"``."""

    @abc.abstractmethod
    def read_async(
        self, path: str | os.PathLike[str], dst: torch.Tensor, nbytes: int, *, offset: int = 0
    ) -> IOFuture:
        """Read ``nbytes`` of file ``path``, from byte ``offset`` on, into the start of ``dst``.

        ``dst`` is a contiguous ``uint8`` tensor of at least ``padded(nbytes)``
        bytes (host; kvikio also takes CUDA tensors); ``offset`` (bytes) is a
        multiple of :data:`ALIGNMENT`. Raises ``ValueError`` for a bad buffer
        or offset and an ``OSError`` naming the file if it is missing or
        holds fewer than ``offset + nbytes`` bytes.
        """

    @abc.abstractmethod
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
        """Write ``nbytes`` bytes from the start of ``src`` to file ``path`` at byte ``offset``.

        ``offset=0`` creates or truncates the file, which then holds exactly
        ``nbytes`` bytes. ``offset > 0`` (a multiple of :data:`ALIGNMENT`)
        writes one piece of a file written in parts, in increasing offsets:
        the file is created if missing, never truncated first, and ends at
        ``offset + nbytes`` when that piece is the last one. ``in_place`` also
        keeps the file at ``offset=0``: the bytes are written over the file's
        own blocks (the caller rewrites a file of the same size), which on ext4
        allocates nothing and journals nothing but the times, where truncating
        frees every block and the write allocates them again. Same buffer rule
        as :meth:`read_async`. With ``fsync`` the data is on stable storage
        before the future completes.
        """

    @abc.abstractmethod
    def close(self) -> None:
        """Wait for transfers in flight and release the workers; idempotent."""

    def __enter__(self) -> IOBackend:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def check_offset(offset: int, *, path: str) -> None:
    """Raise ``ValueError`` unless ``offset`` is a file offset a backend takes (bytes)."""
    if not isinstance(offset, int) or offset < 0 or offset % ALIGNMENT:
        raise ValueError(
            f"{path}: file offset {offset!r} bytes must be an int >= 0 and a multiple of "
            f"{ALIGNMENT} bytes: split transfers at multiples of {ALIGNMENT} bytes"
        )


def short_file_error(path: str, size: int, nbytes: int) -> OSError:
    """The error for a file that holds fewer bytes than a read asks for."""
    return OSError(
        errno.EIO,
        f"file {path} holds {size} bytes but {nbytes} bytes were to be read: the file is "
        f"truncated or belongs to another tensor",
    )


class _PooledBackend(IOBackend):
    """What both backends share: config, a worker pool, argument checks and closing."""

    accepts_cuda: bool = False
    """Whether buffers may be CUDA tensors (else host tensors only)."""

    def __init__(self, config: IOConfig | None, *, thread_name_prefix: str) -> None:
        self.config = config or IOConfig()
        self._pool = ThreadPoolExecutor(self.config.threads, thread_name_prefix=thread_name_prefix)
        self._closed = False

    def _check_open(self, path: str) -> None:
        if self._closed:
            raise RuntimeError(f"{path}: the {self.name} I/O backend is closed: open a new one")

    def _checked_path(
        self, path: str | os.PathLike[str], buf: torch.Tensor, nbytes: int, offset: int
    ) -> str:
        """``path`` as a string, once buffer, offset and open state are valid (else raise)."""
        p = os.fspath(path)
        check_buffer(buf, nbytes, path=p, allow_cuda=self.accepts_cuda)
        check_offset(offset, path=p)
        self._check_open(p)
        return p

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._pool.shutdown(wait=True)


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


def resolve_backend_name(config: IOConfig) -> str:
    """The backend ``open_backend(config)`` uses: ``"posix"`` or ``"kvikio"``."""
    choice: str = config.backend
    if choice == "auto":
        env = os.environ.get(BACKEND_ENV, "").strip().lower()
        if env and env not in _BACKENDS:
            raise ValueError(
                f"environment variable {BACKEND_ENV}={env!r} is not one of {_BACKENDS}: "
                f"unset it or pick one of them"
            )
        choice = env or "auto"
    if choice == "auto":
        return "kvikio" if kvikio_status()[0] else "posix"
    return choice


def open_backend(config: IOConfig | None = None) -> IOBackend:
    """Build the backend ``config`` asks for (``auto``: kvikio where it can run, else posix).

    Raises ``ValueError`` when kvikio is asked for explicitly but cannot run.
    """
    config = config or IOConfig()
    name = resolve_backend_name(config)
    if name == "kvikio":
        usable, reason = kvikio_status()
        if not usable:
            raise ValueError(
                f"I/O backend 'kvikio' cannot run here: {reason}: use backend='posix' "
                f"(or {BACKEND_ENV}=posix), or install kvikio on a machine with a CUDA driver"
            )
        return _hooked(KvikioBackend(config))
    return _hooked(PosixBackend(config))


_BACKEND_HOOKS: list[Callable[[IOBackend], IOBackend]] = []
"""Wrappers :func:`open_backend` applies to every backend it builds, in order (fault
injection in tests: :mod:`storage.fault_injection`)."""


def _hooked(backend: IOBackend) -> IOBackend:
    for wrap in list(_BACKEND_HOOKS):
        backend = wrap(backend)
    return backend


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


class PosixBackend(_PooledBackend):
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


class KvikioBackend(_PooledBackend):
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
