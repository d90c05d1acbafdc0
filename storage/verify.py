"""Check every chunk of a zarr group laid out as the NVMe tier lays out tensors.

:func:`verify_group` walks a group (and its subgroups, as in a checkpoint's ``state.zarr``)
and checks, for each array: its metadata, that its chunk exists, its length, and its CRC-32C
(format 2; format 1 arrays, which have none, get the length check only); an array split
into chunks along dim 0 only (a checkpoint written by several ranks) gets every chunk
checked. It reads through
the page cache and takes no lock, so it runs beside nothing that writes the group.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from pathlib import Path

from storage.checksum import CHECKSUM_BYTES, decode, file_crc32c
from storage.chunk_io import ArraySpec
from storage.nvme import NvmeError, row_chunks
from storage.zarr_layout import UNREADABLE_NODE, child_nodes, node_type

__all__ = ["VerifyReport", "chunk_problem", "verify_group"]


@dataclass
class VerifyReport:
    """What :func:`verify_group` found."""

    problems: list[str] = field(default_factory=list)
    """One line per problem, naming the array and the file."""
    arrays: int = 0
    """Arrays examined."""
    bytes: int = 0
    """Tensor bytes checked (read and checksummed), in bytes."""
    unverified: list[str] = field(default_factory=list)
    """Arrays of format 1 (no checksum): only their length was checked."""

    def add(self, other: VerifyReport) -> None:
        """Fold ``other`` into this report."""
        self.problems += other.problems
        self.arrays += other.arrays
        self.bytes += other.bytes
        self.unverified += other.unverified


def _check_array(name: str, meta: Path, report: VerifyReport) -> None:
    report.arrays += 1
    try:
        spec, rows, chunks = row_chunks(name, meta)
    except NvmeError as exc:
        report.problems.append(str(exc))
        return
    if spec.nbytes == 0:
        return
    if not spec.checksum:
        report.unverified.append(name)
    if len(chunks) > 1:  # split along dim 0: each chunk holds `rows` rows (the last padded)
        nbytes = spec.nbytes // spec.shape[0] * rows
        spec = dataclasses.replace(spec, shape=(rows, *spec.shape[1:]), nbytes=nbytes)
    for chunk in chunks:
        _check_chunk(name, spec, chunk, report)


def _check_chunk(name: str, spec: ArraySpec, chunk: Path, report: VerifyReport) -> None:
    problem = chunk_problem(name, spec, chunk)
    if problem is not None:
        report.problems.append(problem)
    elif spec.checksum:
        report.bytes += spec.nbytes


def chunk_problem(name: str, spec: ArraySpec, chunk: Path) -> str | None:
    """What is wrong with ``chunk``, the chunk file of array ``name`` of ``spec``, in one
    line (missing, a length other than its metadata's, a failed CRC-32C); None if sound.
    Reads the whole chunk when ``spec`` has a checksum."""
    try:
        size = os.stat(chunk).st_size
    except FileNotFoundError:
        return f"tensor {name!r}: chunk file {chunk} is missing"
    if size != spec.file_bytes:
        return (
            f"tensor {name!r}: chunk file {chunk} holds {size} bytes, its metadata needs "
            f"{spec.file_bytes} bytes"
        )
    if not spec.checksum:
        return None
    try:
        computed, _ = file_crc32c(chunk, spec.nbytes)
        with open(chunk, "rb") as f:
            f.seek(spec.nbytes)
            stored = decode(f.read(CHECKSUM_BYTES))
    except OSError as exc:
        return f"tensor {name!r}: chunk file {chunk} cannot be read: {exc}"
    if computed != stored:
        return (
            f"tensor {name!r}: chunk file {chunk} fails its CRC-32C check (stored "
            f"{stored:#010x}, computed {computed:#010x})"
        )
    return None


def verify_group(root: str | os.PathLike[str], prefix: str = "") -> VerifyReport:
    """Check every array under the zarr group at ``root`` (see the module doc).

    ``prefix`` is put before array names in the problem lines (``"master/"``...).
    """
    report = VerifyReport()
    root = Path(root)
    try:
        kind = node_type(root / "zarr.json")
    except UNREADABLE_NODE as exc:
        report.problems.append(f"{root / 'zarr.json'}: not a readable zarr v3 node: {exc!r}")
        return report
    if kind != "group":
        report.problems.append(f"{root / 'zarr.json'}: a zarr {kind}, not a group")
        return report
    for child_name, meta in child_nodes(root):
        name = prefix + child_name
        try:
            child = node_type(meta)
        except UNREADABLE_NODE as exc:
            report.problems.append(f"tensor {name!r}: unreadable metadata file {meta}: {exc!r}")
            continue
        if child == "group":
            report.add(verify_group(meta.parent, prefix=f"{name}/"))
        elif child == "array":
            _check_array(name, meta, report)
    return report
