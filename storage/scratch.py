"""A run's scratch directory, told apart from a user's data.

An NVMe tier opened as *scratch* (:class:`storage.nvme.NvmeTier` with ``scratch=``, or
``StoreConfig.nvme_scratch``) belongs to the run that opens it: every tensor in it is
written by that run before it is read, and no other process reads it. Such a directory
carries a marker file, :data:`MARKER_NAME` (JSON: the marker format, and what the
caller says the scratch was built for, opaque to this layer), and each array the run
creates carries the attribute :data:`SCRATCH_ATTR` in its ``zarr.json``.

- **Claim** (:func:`prepare_dir`): a missing directory is created when its parent
  exists (refused in one line when not); a file in its place is refused; an existing
  directory is accepted when it holds the marker, or nothing but what a run leaves
  behind (its lock file, partial-write files, and entries the caller names as its own).
  Any other entry -- a converted store's or a checkpoint's ``zarr.json`` / ``meta.json``,
  a user's file -- makes the directory refused, naming it and the fix, and nothing in it
  is read, written or removed.
- **Rebuild** (:func:`clear`): at every open, under the tier's lock, the arrays marked
  :data:`SCRATCH_ATTR` are removed and the marker rewritten. A later run never reads a
  previous run's scratch (whatever its dtype, model or placement), so a run in another
  precision, of another model, or after a re-plan moved tensors between tiers starts
  from an empty group; entries without the attribute are left alone.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from storage.durable import write_atomic

__all__ = [
    "LOCK_NAME",
    "MARKER_FORMAT",
    "MARKER_NAME",
    "PARTIAL",
    "SCRATCH_ATTR",
    "clear",
    "prepare_dir",
    "read_marker",
    "write_marker",
]

MARKER_NAME = ".bb-scratch.json"
"""The file that makes a directory a run's scratch (JSON, see :func:`write_marker`)."""
MARKER_FORMAT = 1
"""Format version of the marker file."""
MARKER_KIND = "balance_beam scratch"
"""The marker's ``kind``: what the directory is, for a person who opens it."""
SCRATCH_ATTR = "bb_scratch"
"""Array attribute (``true``) of the arrays a run created in its scratch directory."""
LOCK_NAME = ".bb-lock"
"""The lock file an open NVMe tier holds in its directory (removed at close)."""
PARTIAL = ".partial-"
"""Infix of the temporary files of atomic writes (removed by the next opener)."""

Owned = Callable[[str], bool]
"""Whether a top-level entry name of a directory is the caller's own leftover."""


def prepare_dir(
    path: str | os.PathLike[str], *, key: str = "nvme_path", owned: Owned | None = None
) -> Path:
    """Make ``path`` a directory a run may use as scratch, or refuse it; return it absolute.

    Created when missing and its parent exists. ``ValueError`` (one line, naming ``key``,
    the path and the fix) when the parent is missing too, when a file is in its place, or
    when it holds entries that are not a run's (see the module doc); ``owned`` names
    further top-level entries that are the caller's own. Writes nothing else.
    """
    where = Path(path).absolute()
    if not where.is_dir():
        _create(where, key)
    _check_writable(where, where, key)
    _check_owned(where, key, owned)
    return where


def _create(where: Path, key: str) -> None:
    """Make the directory ``where`` (absent at the caller's look), or refuse it in one line.
    Several ranks prepare one shared directory at once: one that another process made since
    that look is taken as it is."""
    if where.exists() or where.is_symlink():
        if where.is_dir():  # made by another rank meanwhile
            return
        raise ValueError(
            f"{key} {str(where)!r} is a file, not a directory: pass a directory for the NVMe "
            "tier (a new one under an existing directory is created)"
        )
    parent = where.parent
    if not parent.exists():
        raise ValueError(
            f"{key} {str(where)!r}: its parent directory {str(parent)!r} does not exist "
            "either: create the parent, or pass a new directory under an existing one"
        )
    if not parent.is_dir():
        raise ValueError(
            f"{key} {str(where)!r}: {str(parent)!r} is a file, not a directory: pick a "
            "directory path under an existing directory"
        )
    _check_writable(where, parent, key)
    try:
        where.mkdir(exist_ok=True)
    except OSError as exc:
        raise ValueError(
            f"{key} {str(where)!r} cannot be created ({exc.strerror}): pass a directory you "
            "can write"
        ) from None


def _check_writable(where: Path, directory: Path, key: str) -> None:
    if not os.access(directory, os.W_OK | os.X_OK):
        raise ValueError(
            f"{key} {str(where)!r}: {str(directory)!r} is not writable: fix its permissions "
            "or pick a writable directory"
        )


def _check_owned(where: Path, key: str, owned: Owned | None) -> None:
    """Refuse ``where`` unless it is a scratch directory or holds only a run's leftovers."""
    if read_marker(where, key=key) is not None:
        return
    names = os.listdir(where)
    # several ranks prepare one shared directory at once: another may have marked it since
    # the look above, and its marker is then a run's, not a user's file
    if MARKER_NAME in names and read_marker(where, key=key) is not None:
        return
    foreign = sorted(
        name
        for name in names
        if name != LOCK_NAME and PARTIAL not in name and not (owned is not None and owned(name))
    )
    if foreign:
        shown = ", ".join(repr(n) for n in foreign[:3]) + (", ..." if len(foreign) > 3 else "")
        raise ValueError(
            f"{key} {str(where)!r} holds {len(foreign)} entries that are not a balance_beam "
            f"run's scratch ({shown}; no {MARKER_NAME}), which a run never overwrites or "
            f"deletes: choose an empty or new directory for {key}"
        )


def read_marker(path: str | os.PathLike[str], *, key: str = "nvme_path") -> dict[str, Any] | None:
    """The marker of scratch directory ``path``; None when it has none. ``ValueError`` (one
    line) when the file is there but is not a marker this version wrote."""
    marker = Path(path) / MARKER_NAME
    try:
        text = marker.read_text(encoding="utf-8")
    except FileNotFoundError:
        return None
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(
            f"{key} {str(Path(path))!r}: its scratch marker {MARKER_NAME} cannot be read "
            f"({exc}): choose an empty or new directory for {key}"
        ) from None
    try:
        doc = json.loads(text)
        ok = doc.get("kind") == MARKER_KIND and isinstance(doc.get("format"), int)
    except (ValueError, AttributeError):
        ok = False
    if not ok:
        raise ValueError(
            f"{key} {str(Path(path))!r}: {MARKER_NAME} is not a balance_beam scratch marker, so "
            f"nothing in the directory is touched: choose an empty or new directory for {key}"
        )
    if doc["format"] > MARKER_FORMAT:
        raise ValueError(
            f"{key} {str(Path(path))!r}: scratch marker format {doc['format']} is newer than "
            f"this version's {MARKER_FORMAT}: use the release that wrote it, or choose an empty "
            f"or new directory for {key}"
        )
    return dict(doc)


def write_marker(path: str | os.PathLike[str], built_for: Mapping[str, Any]) -> None:
    """Mark ``path`` as scratch, recording ``built_for`` (JSON-serialisable; atomic, synced)."""
    where = Path(path)
    doc = {"kind": MARKER_KIND, "format": MARKER_FORMAT, "built_for": dict(built_for)}
    tmp = where / f"{MARKER_NAME}{PARTIAL}{os.getpid()}-{secrets.token_hex(4)}"
    write_atomic(
        where / MARKER_NAME, json.dumps(doc, indent=2, sort_keys=True, default=str).encode(), tmp
    )


def clear(path: str | os.PathLike[str]) -> list[str]:
    """Remove the arrays of scratch directory ``path`` that carry :data:`SCRATCH_ATTR` (the
    caller holds the directory's lock); return their names, sorted. Other entries stay."""
    removed = []
    for entry in sorted(os.scandir(path), key=lambda e: e.name):
        if not entry.is_dir(follow_symlinks=False):
            continue
        try:
            meta = json.loads(Path(entry.path, "zarr.json").read_text(encoding="utf-8"))
            ours = (
                meta.get("node_type") == "array"
                and (meta.get("attributes") or {}).get(SCRATCH_ATTR) is True
            )
        except (OSError, ValueError, AttributeError):
            ours = False
        if ours:
            shutil.rmtree(entry.path)
            removed.append(entry.name)
    return removed
