"""What every I/O backend shares: the buffer rule, :class:`IOConfig`, :class:`IOFuture`,
the :class:`IOBackend` interface and the pooled base both backends build on.

Buffer rule: every buffer handed to a backend is a contiguous ``uint8`` tensor of at
least :func:`padded` ``(nbytes)`` bytes (use :func:`aligned_empty`), because ``O_DIRECT``
transfers whole 4 KiB blocks. A file holds exactly ``nbytes``.
"""

from __future__ import annotations

import abc
import contextlib
import errno
import math
import mmap
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Literal

import torch

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

BACKENDS = ("auto", "posix", "kvikio")


def padded(nbytes: int) -> int:
    """Round ``nbytes`` up to a multiple of :data:`ALIGNMENT` (bytes)."""
    if nbytes < 0:
        raise ValueError(f"byte count {nbytes} is negative: pass a size >= 0")
    return -(-nbytes // ALIGNMENT) * ALIGNMENT


HUGE_PAGE = 2 << 20
"""Bytes of a transparent huge page on x86-64; a mapping at least this long asks for them."""


def anonymous_map(nbytes: int, *, huge: bool = True) -> mmap.mmap:
    """A private anonymous mapping of ``nbytes`` (> 0) bytes, page-aligned, its pages touched
    on first use, and asked to be backed by transparent huge pages where the kernel offers
    them (``MADV_HUGEPAGE``; the default ``madvise`` mode of
    ``/sys/kernel/mm/transparent_hugepage/enabled`` gives them only where asked, and never to
    a shared mapping under the default ``shmem_enabled``). ``O_DIRECT`` transfers pin the
    pages they move: into huge pages that costs the kernel a small fraction of the CPU time
    of 4 KiB ones, time that on a CPU device comes out of the compute's cores, and the
    reads run faster too.

    A forked child does not inherit the mapping (``MADV_DONTFORK``): a DataLoader worker
    forked beside a store would otherwise keep the pages the parent rewrites after the
    fork (copy-on-write), up to a second copy of the whole arena, and never reads them.

    ``huge=False`` asks for no huge pages: a buffer written once soon after it is mapped (a
    KV cache a prefill fills), where a fresh huge page's first touch can cost more than its
    reads save (in a virtual machine the host may back each 4 KiB of it on first touch)."""
    mapped = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    advice = [getattr(mmap, "MADV_DONTFORK", None)]
    if huge and nbytes >= HUGE_PAGE:
        advice.append(getattr(mmap, "MADV_HUGEPAGE", None))
    for option in advice:
        if option is not None:
            with contextlib.suppress(OSError):  # a kernel without it: as without the advice
                mapped.madvise(option)
    return mapped


def mapped_empty(nbytes: int, *, huge: bool = True) -> torch.Tensor:
    """A ``uint8`` CPU tensor of ``padded(nbytes)`` bytes over its own :func:`anonymous_map`
    (page-aligned; the mapping lives as long as a view of it does): for large buffers that
    NVMe transfers land in."""
    size = padded(nbytes)
    if size == 0:
        return torch.empty(0, dtype=torch.uint8)
    return torch.frombuffer(anonymous_map(size, huge=huge), dtype=torch.uint8)


def mapped_zeros(shape: tuple[int, ...], dtype: torch.dtype, *, huge: bool = True) -> torch.Tensor:
    """A zeroed CPU tensor of ``shape`` and ``dtype`` over its own :func:`anonymous_map` (its
    pages zeroed by the kernel as first touched, in huge pages where the kernel gives them
    unless ``huge=False``; nothing writes the zeros beforehand): a KV cache on the host, which
    decode attention reads whole each step."""
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    return mapped_empty(nbytes, huge=huge)[:nbytes].view(dtype).view(shape)


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
        if self.backend not in BACKENDS:
            raise ValueError(
                f"IOConfig.backend={self.backend!r} is not one of {BACKENDS}: pick one of them"
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


def drop_cache(path: str | os.PathLike[str]) -> None:
    """Evict file ``path``'s pages from the page cache, written back first, so that its
    next read comes from the disk (a no-op where ``posix_fadvise`` is missing)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        if hasattr(os, "posix_fadvise"):
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


class PooledBackend(IOBackend):
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
