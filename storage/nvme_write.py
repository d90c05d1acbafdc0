"""One atomic write of a tensor of the NVMe tier in pieces (:class:`NvmeWrite`)."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable
from pathlib import Path

import torch

from storage.checksum import crc32c
from storage.chunk_io import ArraySpec, NvmeError, chain, finish_chunk, io_error
from storage.durable import fsync_dir
from storage.io import ALIGNMENT, IOBackend, IOFuture


def check_piece(spec: ArraySpec, offset: int, nbytes: int | None) -> int:
    """The byte count of piece ``[offset, offset + nbytes)`` of ``spec``; ``ValueError`` if bad."""
    count = spec.nbytes - offset if nbytes is None else nbytes
    if not isinstance(offset, int) or offset < 0 or offset % ALIGNMENT or offset > spec.nbytes:
        raise ValueError(
            f"tensor {spec.name!r}: offset {offset!r} bytes must be a multiple of {ALIGNMENT} "
            f"bytes in [0, {spec.nbytes}]: split the tensor at multiples of {ALIGNMENT} bytes"
        )
    if count < 0 or offset + count > spec.nbytes:
        raise ValueError(
            f"tensor {spec.name!r}: {count} bytes from offset {offset} pass its end at "
            f"{spec.nbytes} bytes: pass nbytes <= {spec.nbytes - offset}"
        )
    return count


class NvmeWrite:
    """One atomic write of a tensor in pieces, from :meth:`NvmeTier.begin_write`.

    Pieces go into a temporary file beside the chunk, in increasing offsets
    (:meth:`write_async`); :meth:`commit` checks that they cover the tensor,
    fsyncs the file, renames it onto the chunk and fsyncs the directory, once.
    Until then readers see the previous version; :meth:`abort` (or leaving a
    ``with`` block without committing) removes the temporary file, and a
    crash leaves it for the next opener to remove.

    A scratch array's write (``durable=False``) skips the fsyncs; with ``settle``
    (``tmp`` is the chunk itself) the pieces go over the chunk in place, :meth:`commit`
    only checks them and calls ``settle(False)``, and an abort after a piece was written
    calls ``settle(True)``: the chunk is torn (see the module doc).
    """

    def __init__(
        self,
        spec: ArraySpec,
        chunk: Path,
        tmp: Path,
        backend: IOBackend,
        *,
        durable: bool = True,
        settle: Callable[[bool], None] | None = None,
    ) -> None:
        self.spec = spec
        """The tensor being written."""
        self._chunk, self._tmp, self._backend = chunk, tmp, backend
        self._durable = durable and settle is None
        self._settle = settle
        self._written = 0
        self._crc = 0
        self._done = False

    def write_async(
        self, src: torch.Tensor, *, offset: int = 0, nbytes: int | None = None
    ) -> IOFuture:
        """Write bytes ``[offset, offset + nbytes)`` of the tensor from the start of ``src``.

        ``nbytes`` defaults to the rest of the tensor; ``offset`` (bytes) is a
        multiple of :data:`storage.io.ALIGNMENT` and follows the previous
        piece's end (pieces are written in order, each one after the previous
        one's future completed).
        """
        name = self.spec.name
        if self._done:
            raise NvmeError(f"tensor {name!r}: this write was committed or aborted: begin another")
        count = check_piece(self.spec, offset, nbytes)
        if offset != self._written:
            raise ValueError(
                f"tensor {name!r}: piece at offset {offset} bytes does not follow the "
                f"{self._written} bytes written so far: write pieces in order from offset 0"
            )
        try:
            fut = self._backend.write_async(
                self._tmp, src, count, fsync=False, offset=offset, in_place=self._settle is not None
            )
        except ValueError as exc:
            raise ValueError(f"tensor {name!r}: {exc}") from exc
        except OSError as exc:
            raise io_error(name, "write", self._tmp, exc) from exc
        self._written = offset + count
        if self.spec.checksum:  # src holds the piece until the future completes
            self._crc = crc32c(src[:count], self._crc)
        return chain(fut, lambda: None, name, "write", self._tmp, count)

    def commit(self) -> None:
        """Make the written pieces the tensor's contents (blocks: fsync, rename, fsync)."""
        name = self.spec.name
        if self._done:
            raise NvmeError(f"tensor {name!r}: this write was committed or aborted: begin another")
        self._done = True
        if self.spec.nbytes == 0:
            return
        try:
            size = os.stat(self._tmp).st_size if self._written else 0
            if self._written != self.spec.nbytes or size != self.spec.nbytes:
                raise NvmeError(
                    f"tensor {name!r}: {self._written} of {self.spec.nbytes} bytes were written "
                    f"({size} bytes in {self._tmp}): write every piece before commit()"
                )
            if self._settle is not None:
                self._settle(False)
                return
            if self.spec.checksum:
                finish_chunk(self._tmp, self.spec.nbytes, self._crc)
            elif self._durable:
                fd = os.open(self._tmp, os.O_RDONLY)
                try:
                    os.fsync(fd)
                finally:
                    os.close(fd)
            os.replace(self._tmp, self._chunk)
            if self._durable:
                fsync_dir(self._chunk.parent)
        except OSError as exc:
            self._drop()
            raise io_error(name, "write", self._tmp, exc) from exc
        except BaseException:
            self._drop()
            raise

    def abort(self) -> None:
        """Drop the pieces written so far; the tensor keeps its previous contents (written in
        place: its chunk is torn once a piece was written, see the class doc). Idempotent."""
        if not self._done:
            self._done = True
            self._drop()

    def _drop(self) -> None:
        if self._settle is None:
            with contextlib.suppress(OSError):
                self._tmp.unlink()
        elif self._written:
            self._settle(True)

    def __enter__(self) -> NvmeWrite:
        return self

    def __exit__(self, *exc: object) -> None:
        self.abort()
