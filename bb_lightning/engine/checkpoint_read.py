"""The checkpoint directory's format on the reading side: its names, crash recovery, reads.

:mod:`bb_lightning.engine.checkpoint` describes the format and writes it; this module holds
what reading needs: the file names and versions, :func:`recover` (run before every save
and load: an interrupted save is finished or undone), ``meta.json`` checked field by field,
each array read chunk by chunk with its CRC-32C checked (at any world size), the lazy
:class:`CheckpointStateDict`, the trainer state read without running code, and
:func:`verify_checkpoint`.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from bb_lightning.engine import trainer_state as state_files
from bb_lightning.placement import STATE_KINDS
from storage.checksum import CHECKSUM_BYTES, crc32c, decode
from storage.nvme import check_name, fsync_dir, row_chunks
from storage.verify import VerifyReport, verify_group

__all__ = [
    "FORMAT",
    "META",
    "OLD",
    "PARTIAL",
    "READABLE_VERSIONS",
    "STATE_DIR",
    "TRAINER_STATE",
    "VERSION",
    "CheckpointError",
    "CheckpointStateDict",
    "read_array",
    "read_meta",
    "read_trainer_state",
    "recover",
    "verify_checkpoint",
]

FORMAT = "balance_beam.checkpoint"
VERSION = 3
READABLE_VERSIONS = (1, 2, 3)
STATE_DIR = "state.zarr"
TRAINER_STATE = "trainer_state.pt"
META = "meta.json"
PARTIAL = ".partial-"
OLD = ".old-"


class CheckpointError(ValueError):
    """A checkpoint path that is missing, not a balance_beam checkpoint, or not of this model."""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _siblings(path: Path, marker: str) -> list[tuple[Path, int]]:
    """Leftovers ``<path><marker><pid>`` next to ``path``, with their pids."""
    found = []
    if path.parent.is_dir():
        for entry in path.parent.iterdir():
            tail = entry.name.removeprefix(path.name + marker)
            if tail != entry.name and tail.isdigit():
                found.append((entry, int(tail)))
    return found


def _complete(path: Path) -> bool:
    try:
        return bool(json.loads((path / META).read_text(encoding="utf-8"))["format"] == FORMAT)
    except (OSError, ValueError, KeyError, TypeError, RecursionError):
        return False


def recover(path: str | os.PathLike[str]) -> None:
    """Finish or undo a save that a crash interrupted, and remove dead processes' leftovers.

    When ``path`` is missing but a complete ``<path>.old-<pid>`` exists (the crash fell
    between the two renames), the old checkpoint is put back.
    """
    final = Path(path)
    for old, pid in _siblings(final, OLD):
        if pid != os.getpid() and _alive(pid):
            continue
        if not final.exists() and _complete(old):
            os.replace(old, final)
            fsync_dir(final.parent)
        else:
            shutil.rmtree(old, ignore_errors=True)
    for partial, pid in _siblings(final, PARTIAL):
        if pid == os.getpid() or not _alive(pid):
            shutil.rmtree(partial, ignore_errors=True)


def read_meta(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The ``meta.json`` of the checkpoint at ``path``; :class:`CheckpointError` if none."""
    root = Path(path)
    recover(root)
    if not root.exists():
        raise CheckpointError(
            f"checkpoint {str(root)!r} does not exist: pass the path of a directory written by "
            "trainer.save_checkpoint under strategy='balance_beam'"
        )
    if not _complete(root):
        raise CheckpointError(
            f"{str(root)!r} is not a balance_beam checkpoint (no {META} with format {FORMAT!r}): "
            "pass a directory written by trainer.save_checkpoint under strategy='balance_beam'"
        )
    meta: dict[str, Any] = json.loads((root / META).read_text(encoding="utf-8"))
    if meta.get("version") not in READABLE_VERSIONS:
        raise CheckpointError(
            f"checkpoint {str(root)!r} has format version {meta.get('version')!r}; this version "
            f"of balance_beam reads versions {READABLE_VERSIONS}: convert it or use a matching "
            f"release"
        )
    problem = _meta_problem(meta)
    if problem is not None:
        raise CheckpointError(
            f"checkpoint {str(root)!r}: {META} is damaged: {problem}; resume from another "
            "checkpoint or save it again"
        )
    return meta


def _is_int(value: Any, low: int) -> bool:
    return type(value) is int and value >= low


def _meta_problem(meta: Mapping[str, Any]) -> str | None:
    """What in a ``meta.json`` (format and version already checked) is not as the writer
    writes it, in a few words; None when every field read later has its type."""
    if not _is_int(meta.get("step"), 0):
        return f"step {meta.get('step')!r} is not an integer >= 0"
    if type(meta.get("weights_only")) is not bool:
        return f"weights_only {meta.get('weights_only')!r} is not true or false"
    if not _is_int(meta.get("world_size", 1), 1):
        return f"world_size {meta.get('world_size')!r} is not an integer >= 1"
    model = meta.get("model")
    if not isinstance(model, dict) or (
        model
        and not (
            isinstance(model.get("prefix"), str)
            and isinstance(model.get("config"), dict)
            and isinstance(model.get("architectures"), list)
        )
    ):
        return "model is not an object with a prefix, architectures and a config"
    params = meta.get("parameters")
    if not isinstance(params, list):
        return "parameters is not a list"
    for i, p in enumerate(params):
        if not (
            isinstance(p, dict)
            and isinstance(p.get("shape"), list)
            and all(_is_int(d, 0) for d in p["shape"])
            and isinstance(p.get("aliases"), list)
            and all(isinstance(a, str) for a in p["aliases"])
        ):
            return f"parameter {i} is not an object with a shape of integers >= 0 and aliases"
        try:
            check_name(p.get("name"))  # type: ignore[arg-type]
        except ValueError:
            return f"parameter {i} has the name {p.get('name')!r}, not an array name"
    return None


def read_array(path: str | os.PathLike[str], kind: str, name: str) -> Tensor:
    """One parameter's ``kind`` array (``master``, ``exp_avg``, ``exp_avg_sq``) as a tensor.

    An array written by several ranks (chunked along dim 0) is read chunk by chunk, each
    checked, and its rows put together: a checkpoint loads at any world size.
    """
    spec, rows, chunks = row_chunks(name, Path(path, STATE_DIR, kind, name, "zarr.json"))
    if spec.nbytes == 0:
        return torch.zeros(spec.shape, dtype=spec.dtype)
    where = f"checkpoint {str(path)!r}: tensor {kind}/{name}"
    if len(chunks) == 1:
        data = _read_chunk(chunks[0], spec.nbytes, spec.checksum, where)
        return data.view(spec.dtype).view(spec.shape)
    per_row = spec.nbytes // spec.shape[0]
    out = torch.empty(spec.nbytes, dtype=torch.uint8)
    for k, chunk in enumerate(chunks):
        data = _read_chunk(chunk, rows * per_row, spec.checksum, where)
        start = k * rows * per_row
        take = min(rows * per_row, spec.nbytes - start)
        out[start : start + take].copy_(data[:take])
    return out.view(spec.dtype).view(spec.shape)


def _read_chunk(chunk: Path, nbytes: int, checksum: bool, where: str) -> Tensor:
    """The ``nbytes`` data bytes of one chunk file, its length and CRC-32C checked."""
    file_bytes = nbytes + (CHECKSUM_BYTES if checksum else 0)
    raw = np.fromfile(chunk, dtype=np.uint8, count=file_bytes + 1) if chunk.exists() else None
    if raw is None or raw.size != file_bytes:
        held = "no file" if raw is None else f"{raw.size} bytes"
        raise CheckpointError(
            f"{where} (file {chunk}) holds {held}, {file_bytes} bytes expected: the checkpoint "
            "is damaged; resume from another checkpoint"
        )
    data = torch.from_numpy(raw[:nbytes])
    if checksum:
        stored = decode(raw[nbytes : nbytes + CHECKSUM_BYTES].tobytes())
        computed = crc32c(data)
        if stored != computed:
            raise CheckpointError(
                f"{where} (file {chunk}) fails its CRC-32C check (stored {stored:#010x}, "
                f"computed {computed:#010x}): the checkpoint is damaged; resume from another "
                "checkpoint"
            )
    return data


class CheckpointStateDict(Mapping[str, Tensor]):
    """The module state dict of a checkpoint, each parameter read from disk when asked for."""

    def __init__(self, path: str | os.PathLike[str], buffers: Mapping[str, Tensor]) -> None:
        self.path = Path(path)
        self.meta = read_meta(path)
        self.buffers = dict(buffers)
        self._source = {p["name"]: p["name"] for p in self.meta["parameters"]}
        for p in self.meta["parameters"]:
            self._source.update(dict.fromkeys(p["aliases"], p["name"]))

    def __getitem__(self, key: str) -> Tensor:
        if key in self.buffers:
            return self.buffers[key]
        return read_array(self.path, "master", self._source[key])

    def __iter__(self) -> Iterator[str]:
        yield from self._source
        yield from self.buffers

    def __len__(self) -> int:
        return len(self._source) + len(self.buffers)


def read_trainer_state(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Lightning's trainer state of the checkpoint at ``path`` (with ``"buffers"``).

    Raises :class:`CheckpointError` naming the file when a pickle in it would run code
    (:mod:`bb_lightning.engine.trainer_state`).
    """
    meta = read_meta(path)
    try:
        return state_files.read(Path(path), int(meta["version"]))
    except state_files.UnsafeStateError as exc:
        raise CheckpointError(f"checkpoint {str(path)!r}: {exc}") from exc


def verify_checkpoint(path: str | os.PathLike[str]) -> VerifyReport:
    """Check the checkpoint at ``path``: its metadata, that every parameter has its arrays
    (moments too unless weights only), every chunk's length and CRC-32C, and that its trainer
    state loads without running code. One problem line each in the report."""
    root = Path(path)
    report = VerifyReport()
    try:
        meta = read_meta(root)
    except CheckpointError as exc:
        report.problems.append(str(exc))
        return report
    report.add(verify_group(root / STATE_DIR))
    kinds = ("master",) if meta.get("weights_only") else STATE_KINDS
    for p in meta.get("parameters", []):
        for kind in kinds:
            if not (root / STATE_DIR / kind / p["name"] / "zarr.json").is_file():
                report.problems.append(
                    f"tensor '{kind}/{p['name']}': missing from {root / STATE_DIR / kind}"
                )
    try:
        read_trainer_state(root)
    except (CheckpointError, OSError, ValueError, RuntimeError) as exc:
        report.problems.append(str(exc).splitlines()[0])
    return report
