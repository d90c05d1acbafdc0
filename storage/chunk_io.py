"""Chunk files of the NVMe tier: errors, the tensor spec, checksum trailers, named failures.

What :mod:`storage.nvme` needs around one chunk file: the errors it raises (each naming the
tensor and the file), :class:`ArraySpec`, futures whose ``OSError`` becomes an
:class:`NvmeIOError` naming both (:func:`chain`), the CRC-32C trailer
(:func:`finish_chunk`, :func:`read_trailer`, :func:`check_crc`) and the pipelined verified
read of a large tensor (:func:`read_verified`).
"""

from __future__ import annotations

import errno
import functools
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from storage.checksum import CHECKSUM_BYTES, crc32c, decode, encode
from storage.io import IOBackend, IOFuture

__all__ = ["ArraySpec", "ChecksumError", "CorruptTensorError", "NvmeError", "NvmeIOError"]
__all__ += ["UnsupportedArrayError", "chain", "check_crc", "finish_chunk", "io_error"]
__all__ += ["read_trailer", "read_verified"]


class NvmeError(RuntimeError):
    """Base of NVMe tier errors; messages name the tensor and the file."""


class CorruptTensorError(NvmeError):
    """Chunk missing (write never completed), truncated, or disagreeing with its metadata."""


class ChecksumError(CorruptTensorError):
    """A chunk's bytes disagree with the CRC-32C stored after them: the file was damaged."""


class NvmeIOError(OSError, NvmeError):
    """The disk failed a transfer (full, I/O error...): an ``OSError`` keeping the errno, whose
    message names the tensor and the file."""


class UnsupportedArrayError(NvmeError):
    """An array of the group is not laid out as this tier requires (compressed, chunked...)."""


@dataclass(frozen=True)
class ArraySpec:
    """What the NVMe tier knows about one stored tensor."""

    name: str
    """Tensor name, also the zarr array name."""
    shape: tuple[int, ...]
    """Tensor shape (elements per dimension)."""
    dtype: torch.dtype
    """The tensor's torch dtype (``bfloat16`` even though zarr stores ``uint16``)."""
    nbytes: int
    """Size of the tensor's bytes, in bytes (the chunk file adds the checksum trailer)."""
    checksum: bool = True
    """Whether the chunk ends with a CRC-32C trailer (store format 2); False for arrays
    written before checksums existed (format 1), which are read unverified."""

    @property
    def file_bytes(self) -> int:
        """Size of the chunk file once written, in bytes (0 for an empty tensor: no chunk)."""
        if self.nbytes == 0:
            return 0
        return self.nbytes + (CHECKSUM_BYTES if self.checksum else 0)

    @property
    def format_version(self) -> int:
        """Store format of the array: 2 with a checksum trailer, 1 without."""
        return 2 if self.checksum else 1


def io_error(name: str, verb: str, path: Path | str, exc: OSError) -> NvmeIOError:
    """The error for ``OSError`` ``exc`` on tensor ``name``'s file ``path``."""
    fix = {
        errno.ENOSPC: "the disk is full: free space on it or pick another directory; the "
        "tensor keeps its previous contents",
        errno.EDQUOT: "the disk quota is exhausted: raise it or pick another directory",
        errno.EIO: "the device reported an I/O error: check the disk (dmesg, smartctl)",
    }.get(exc.errno or -1, "check the disk and the file")
    return NvmeIOError(exc.errno, f"tensor {name!r}: cannot {verb} {path}: {exc}: {fix}")


def chain(
    inner: IOFuture, step: Callable[[], None], name: str, verb: str, path: Path, result: int
) -> IOFuture:
    """A future completing with ``result`` bytes once ``inner`` succeeded and ``step()`` ran.

    ``step`` runs in the completing worker. An ``OSError`` of either becomes an
    :class:`NvmeIOError` naming the tensor and file; errors of this module pass unchanged.
    """
    out = IOFuture(str(path))

    def run(done: IOFuture) -> None:
        out.direct = done.direct
        start = time.perf_counter()
        error = done._error
        if error is None:
            try:
                step()
            except BaseException as exc:
                error = exc
        seconds = done.seconds + time.perf_counter() - start
        if isinstance(error, OSError) and not isinstance(error, NvmeError):
            wrapped = io_error(name, verb, path, error)
            wrapped.__cause__ = error
            error = wrapped
        if error is not None:
            out.set_exception(error, seconds)
        else:
            out.set_result(result, seconds)

    inner.add_done_callback(run)
    return out


def _piece_arrived(
    arrived: Callable[[int, BaseException | None], None], index: int, done: IOFuture
) -> None:
    arrived(index, done._error)


def finish_chunk(path: Path, nbytes: int, crc: int) -> None:
    """Append checksum ``crc`` to the ``nbytes`` bytes of file ``path`` and fsync the file."""
    fd = os.open(path, os.O_WRONLY)
    try:
        if os.pwrite(fd, encode(crc), nbytes) != CHECKSUM_BYTES:
            raise OSError(errno.EIO, f"short write of the checksum of {path}")
        os.fsync(fd)
    finally:
        os.close(fd)


def read_trailer(spec: ArraySpec, chunk: Path) -> int:
    """The checksum stored at the end of chunk file ``chunk``."""
    with open(chunk, "rb", buffering=0) as f:
        f.seek(spec.nbytes)
        trailer = f.read(CHECKSUM_BYTES)
    if len(trailer) != CHECKSUM_BYTES:
        raise CorruptTensorError(
            f"tensor {spec.name!r}: chunk file {chunk} ends before its checksum: the file is "
            f"truncated; write the tensor again"
        )
    return decode(trailer)


def check_crc(spec: ArraySpec, chunk: Path, computed: int, store: Path) -> None:
    """Raise :class:`ChecksumError` unless ``computed`` is the checksum stored in ``chunk``."""
    stored = read_trailer(spec, chunk)
    if stored != computed:
        raise ChecksumError(
            f"tensor {spec.name!r}: chunk file {chunk} fails its CRC-32C check (stored "
            f"{stored:#010x}, computed {computed:#010x} over {spec.nbytes} bytes): the file "
            f"was damaged after it was written; write the tensor again or restore it from a "
            f"checkpoint ('bb-lightning verify {store}' lists every damaged chunk)"
        )


def read_verified(
    backend: IOBackend,
    spec: ArraySpec,
    chunk: Path,
    dst: torch.Tensor,
    extra: int,
    piece: int,
    store: Path,
) -> IOFuture:
    """Read all of ``spec`` into ``dst`` in pieces of ``piece`` bytes, all in
    flight at once, folding each into the checksum as soon as it and the pieces before it
    arrived: the CRC of the first pieces runs while the later ones are still read."""
    count = spec.nbytes
    pieces = [(at, min(piece, count - at)) for at in range(0, count, piece)]
    out = IOFuture(str(chunk))
    lock = threading.Lock()
    ready: set[int] = set()
    st: dict[str, Any] = {"next": 0, "crc": 0, "error": None, "running": False, "done": False}
    start = time.perf_counter()

    def finish() -> None:
        error: BaseException | None = st["error"]
        if error is None:
            try:
                trailer = dst[count : count + extra].cpu().numpy().tobytes() if extra else b""
                if not extra or decode(trailer) != st["crc"]:
                    check_crc(spec, chunk, st["crc"], store)
            except BaseException as exc:
                error = exc
        if isinstance(error, OSError) and not isinstance(error, NvmeError):
            error = io_error(spec.name, "read", chunk, error)
        if error is not None:
            out.set_exception(error, time.perf_counter() - start)
        else:
            out.set_result(count, time.perf_counter() - start)

    def arrived(i: int, error: BaseException | None) -> None:
        with lock:
            st["error"] = st["error"] or error
            ready.add(i)
            if st["running"]:
                return  # the thread folding pieces in takes this one too
            st["running"] = True
        while True:
            with lock:
                j = st["next"]
                if st["error"] is None and j in ready:
                    st["next"] = j + 1
                else:
                    st["running"] = False
                    last = len(ready) == len(pieces) and not st["done"]
                    st["done"] = st["done"] or last
                    break
            at, n = pieces[j]
            st["crc"] = crc32c(dst[at : at + n], st["crc"])
        if last:
            finish()

    for i, (at, n) in enumerate(pieces):
        tail = extra if i == len(pieces) - 1 else 0
        try:
            fut = backend.read_async(chunk, dst[at:], n + tail, offset=at)
        except (OSError, ValueError) as exc:
            if i == 0:
                raise CorruptTensorError(
                    f"tensor {spec.name!r}: cannot read {chunk}: {exc}"
                ) from exc
            for k in range(i, len(pieces)):  # never issued: count them in, failed
                arrived(k, exc)
            break
        fut.add_done_callback(functools.partial(_piece_arrived, arrived, i))
    return out
