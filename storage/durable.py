"""Small files that last: written and synced, renamed into place, their directory synced.

:func:`write_synced` writes a file and flushes it to stable storage, :func:`fsync_dir`
does the same for a directory's entries (the renames and creations in it), and
:func:`write_atomic` combines them so that after a crash a path holds either its old
bytes or the new ones, never a mix. The NVMe tier's metadata (:mod:`storage.zarr_layout`),
the scratch marker (:mod:`storage.scratch`) and the checkpoint writer use them.
"""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["fsync_dir", "write_atomic", "write_synced"]


def fsync_dir(path: Path) -> None:
    """Flush directory ``path`` to stable storage, so the renames and creations in it last."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_synced(path: Path, data: bytes) -> None:
    """Create or truncate file ``path``, write ``data`` and fsync it (not its directory)."""
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def write_atomic(path: Path, data: bytes, tmp: Path) -> None:
    """Replace file ``path`` by ``data`` atomically: written synced to ``tmp`` (a free name
    in the same directory), renamed onto ``path``, the directory synced."""
    write_synced(tmp, data)
    os.replace(tmp, path)
    fsync_dir(path.parent)
