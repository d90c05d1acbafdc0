"""Read-only NVMe tensors whose bytes live in files the store does not own.

A :class:`FilePiece` names the first ``nbytes`` bytes of a file (optionally followed by a
CRC-32C trailer, :mod:`storage.checksum`); an :class:`ExternalSource` is one tensor's
bytes as the concatenation of such pieces, in order. A tensor registered with one
(``TieredStore.register(..., source=...)``) is homed on NVMe but costs the NVMe tier no
bytes: page-ins read its pieces straight from those files, and the store never writes,
moves, deletes, locks or creates anything beside them (a write or move raises).

Reads go through the page cache (``preadv`` without ``O_DIRECT``), so pieces of any
size may land at any byte offset of the destination. A piece read whole is checked
against its trailer on the bytes just read; a piece read in parts (a staged read of a
tensor larger than a staging buffer) is checked by reading its file once more when its
last part arrives. A mismatch raises :class:`~storage.chunk_io.ChecksumError` naming the
file.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from storage.checksum import CHECKSUM_BYTES, crc32c, decode, file_crc32c
from storage.chunk_io import ChecksumError, CorruptTensorError

__all__ = ["ExternalSource", "FilePiece", "ReadOnlyTensorError"]


class ReadOnlyTensorError(ValueError):
    """A write, move or delete of a tensor whose bytes are files the store does not own."""


@dataclass(frozen=True)
class FilePiece:
    """The first ``nbytes`` bytes of file ``path``, read-only."""

    path: Path
    """The file holding the bytes."""
    nbytes: int
    """Bytes of the piece (the file holds them first)."""
    checksum: bool
    """Whether a CRC-32C trailer of :data:`~storage.checksum.CHECKSUM_BYTES` bytes follows
    them in the file."""

    @property
    def file_bytes(self) -> int:
        """Size the file must have, in bytes."""
        return self.nbytes + (CHECKSUM_BYTES if self.checksum and self.nbytes else 0)


class ExternalSource:
    """The bytes of tensor ``name``: ``pieces`` concatenated, ``nbytes`` in all.

    Raises ``ValueError`` (one line, naming the file) when the pieces do not add up to
    ``nbytes`` or a file is missing or of another size than its piece needs.
    """

    def __init__(self, name: str, pieces: Sequence[FilePiece], nbytes: int) -> None:
        self.name = name
        self.pieces = tuple(pieces)
        total = sum(p.nbytes for p in self.pieces)
        if total != nbytes or any(p.nbytes < 0 for p in self.pieces):
            raise ValueError(
                f"tensor {name!r}: its file pieces hold {total} bytes but the tensor needs "
                f"{nbytes} bytes: give pieces that add up to the tensor's size"
            )
        for piece in self.pieces:
            try:
                size = os.stat(piece.path).st_size if piece.nbytes else piece.file_bytes
            except OSError as err:
                raise ValueError(
                    f"tensor {name!r}: file {piece.path} cannot be read ({err.strerror}): "
                    "restore the file or rewrite the store holding it"
                ) from None
            if size != piece.file_bytes:
                raise ValueError(
                    f"tensor {name!r}: file {piece.path} holds {size} bytes, not the "
                    f"{piece.file_bytes} bytes its piece needs: the file is truncated or was "
                    "replaced; restore it or rewrite the store holding it"
                )
        self.starts = []
        at = 0
        for piece in self.pieces:
            self.starts.append(at)
            at += piece.nbytes

    def read_into(self, dst: torch.Tensor, offset: int, count: int) -> None:
        """Read bytes ``[offset, offset + count)`` of the tensor into ``dst[:count]``
        (a contiguous ``uint8`` tensor on any device), checking each piece it completes."""
        if dst.device.type != "cpu":  # through host memory
            host = torch.empty(count, dtype=torch.uint8)
            self.read_into(host, offset, count)
            dst[:count].copy_(host)
            return
        view = dst.numpy().data.cast("B")
        end = offset + count
        for piece, start in zip(self.pieces, self.starts, strict=True):
            lo, hi = max(offset, start), min(end, start + piece.nbytes)
            if lo >= hi:
                continue
            out = dst[lo - offset : hi - offset]
            _pread(piece.path, view[lo - offset : hi - offset], lo - start)
            if not piece.checksum:
                continue
            if lo == start and hi == start + piece.nbytes:
                self._check(piece, crc32c(out))
            elif hi == start + piece.nbytes:  # the last part of a piece read in parts
                crc, _ = file_crc32c(piece.path, piece.nbytes)
                self._check(piece, crc)

    def _check(self, piece: FilePiece, computed: int) -> None:
        with open(piece.path, "rb", buffering=0) as f:
            stored = os.pread(f.fileno(), CHECKSUM_BYTES, piece.nbytes)
        if len(stored) != CHECKSUM_BYTES or decode(stored) != computed:
            raise ChecksumError(
                f"tensor {self.name!r}: file {piece.path} fails its CRC-32C check over "
                f"{piece.nbytes} bytes: the file was damaged after it was written; restore it "
                "or rewrite the store holding it"
            )


def _pread(path: Path, view: memoryview, at: int) -> None:
    """Fill ``view`` with the bytes of ``path`` from byte ``at`` on."""
    got = 0
    with open(path, "rb", buffering=0) as f:
        while got < len(view):
            n = os.preadv(f.fileno(), [view[got:]], at + got)
            if not n:
                raise CorruptTensorError(
                    f"file {path} ends after {at + got} bytes, before the {len(view)} bytes "
                    f"read from byte {at}: the file was truncated; restore it"
                )
            got += n
