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

The shared pieces live in :mod:`storage.io_base`, the backends in :mod:`storage.posix_io`
and :mod:`storage.kvikio_io`; this module chooses and builds one (:func:`open_backend`) and
is where callers import all of them from.
"""

from __future__ import annotations

import os
from collections.abc import Callable

from storage.io_base import (
    ALIGNMENT,
    BACKEND_ENV,
    BACKENDS,
    KVIKIO_TASK_SIZE,
    POSIX_TASK_SIZE,
    IOBackend,
    IOConfig,
    IOFuture,
    aligned_empty,
    anonymous_map,
    check_buffer,
    check_offset,
    drop_cache,
    mapped_empty,
    mapped_zeros,
    padded,
    short_file_error,
)
from storage.kvikio_io import KvikioBackend, kvikio_status, size_kvikio_threads
from storage.posix_io import PosixBackend

__all__ = [
    "ALIGNMENT",
    "BACKEND_ENV",
    "KVIKIO_TASK_SIZE",
    "POSIX_TASK_SIZE",
    "IOBackend",
    "IOConfig",
    "IOFuture",
    "KvikioBackend",
    "PosixBackend",
    "aligned_empty",
    "anonymous_map",
    "check_buffer",
    "check_offset",
    "drop_cache",
    "kvikio_status",
    "mapped_empty",
    "mapped_zeros",
    "open_backend",
    "padded",
    "short_file_error",
    "size_kvikio_threads",
]


def resolve_backend_name(config: IOConfig) -> str:
    """The backend ``open_backend(config)`` uses: ``"posix"`` or ``"kvikio"``."""
    choice: str = config.backend
    if choice == "auto":
        env = os.environ.get(BACKEND_ENV, "").strip().lower()
        if env and env not in BACKENDS:
            raise ValueError(
                f"environment variable {BACKEND_ENV}={env!r} is not one of {BACKENDS}: "
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
