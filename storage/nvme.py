"""The NVMe tier: a directory holding a plain zarr v3 group.

Each tensor is one array at the group's root, named by the tensor name, with
ONE uncompressed chunk equal to its shape (codecs: ``bytes``, little endian,
then ``crc32c``), fill value 0. ``bfloat16`` is stored as ``uint16``; every
array carries the real dtype in its attributes (``{"torch_dtype": "bfloat16"}``).
Any zarr reader opens the group; the hot path reads and writes the raw chunk
file through an :class:`~storage.io.IOBackend`.

Checksums: a chunk file is the tensor's bytes followed by their 4-byte CRC-32C
(:mod:`storage.checksum`, zarr's ``crc32c`` codec). Reads verify it on the
buffer the bytes were read into (a read into device memory through kvikio is
checked on a host copy of its bytes) and raise :class:`ChecksumError` naming
the tensor and file; a tensor over :data:`VERIFY_PIECE_BYTES` is read in pieces
so that the checksum of the first ones runs while the later ones are read. Arrays written before checksums existed (store format 1:
codecs just ``bytes``, as plain zarr writes by default) still open and read,
unverified, and keep that layout when rewritten (:attr:`ArraySpec.checksum`);
new arrays are format 2 unless created with ``checksum=False`` (the store's scratch
tensors, rewritten often and read back only by the process that wrote them).

Crash safety: a write goes to ``<chunk>.partial-<pid>-<n>`` in the chunk's
directory, is fsynced, renamed onto the chunk and the directory fsynced. A
crash leaves the previous version (or no chunk) and a stale partial file,
which the next opener removes. One process at a time holds a store, through
``fcntl.flock`` on ``<path>/.bb-lock``. A run's own scratch directory carries a marker,
is created when missing and rebuilt at each open; a directory holding anything else is
refused and never touched (:mod:`storage.scratch`).

Scratch arrays (``create(..., durable=False)``, :meth:`NvmeTier.set_durable`): a tensor
that only this process reads back, rewritten often (optimizer state, gradient sums,
paged weights of a run), needs none of that. Once its chunk exists and has no checksum
trailer, a write goes over the chunk's own blocks: no partial file, no fsync, no rename,
nothing allocated (write-backs in place through a :class:`storage.store.TieredStore`
ran several times faster than atomic ones, and a loop of matrix products beside them
lost far less compute per byte written).
Readers in flight see a mix of the two versions; :class:`storage.store.TieredStore`
runs the operations on one tensor in order, so none is. A write that fails part-way
removes the chunk (reads then raise :class:`CorruptTensorError`, as for a write that
never completed); a crash mid-write leaves a torn chunk, which no later run reads
before writing it.
"""

from __future__ import annotations

import contextlib
import fcntl
import itertools
import math
import os
import shutil
import threading
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from storage import scratch as scratch_dir
from storage.checksum import CHECKSUM_BYTES, crc32c, decode, file_crc32c
from storage.chunk_io import (
    ArraySpec,
    ChecksumError,
    CorruptTensorError,
    NvmeError,
    NvmeIOError,
    UnsupportedArrayError,
    chain,
    check_crc,
    finish_chunk,
    io_error,
    read_verified,
)
from storage.durable import fsync_dir, write_synced
from storage.io import ALIGNMENT, IOBackend, IOFuture, padded
from storage.nvme_write import NvmeWrite, check_piece
from storage.scratch import LOCK_NAME, PARTIAL, SCRATCH_ATTR
from storage.tiers import Budget, Tier, format_bytes
from storage.zarr_layout import (
    BY_NAME,
    DTYPES,
    StoreLockedError,
    array_metadata,
    check_group,
    check_name,
    check_store_dir,
    lock_store,
    parse_array,
    row_chunk_key,
    row_chunked_metadata,
    row_chunks,
    scan_group,
    write_json_atomic,
)

__all__ = [
    "DTYPES",
    "ArraySpec",
    "ChecksumError",
    "CorruptTensorError",
    "NvmeError",
    "NvmeIOError",
    "NvmeTier",
    "NvmeWrite",
    "StoreLockedError",
    "UnsupportedArrayError",
    "check_name",
    "fsync_dir",
    "parse_array",
    "row_chunk_key",
    "row_chunked_metadata",
    "row_chunks",
    "write_synced",
]

VERIFY_PIECE_BYTES = 16 << 20
"""Piece size of a verified whole-tensor read larger than it, in bytes: its pieces are all in
flight at once and each is checksummed as it arrives in order (a multiple of 4096)."""


class NvmeTier:
    """Named tensors as single-chunk arrays of a zarr v3 group in directory ``path``.

    ``capacity`` is the tier's budget in bytes; the filesystem must have that
    much free, less the bytes already stored. ``create=False`` requires the
    directory to exist. The constructor checks all of this before writing
    anything, then locks the directory against other openers
    (:class:`StoreLockedError`), creates or opens the group, indexes the arrays
    already there and removes stale partial-write files. Use it as a context
    manager or call :meth:`close`.

    ``scratch`` (a JSON-serialisable description of the run, recorded in the marker):
    the directory is the opening run's scratch (:mod:`storage.scratch`). A missing one is
    created when its parent exists; a file, or a directory holding anything but a run's
    scratch, is refused (``ValueError``) and left untouched; the arrays of the last run's
    scratch are removed once the lock is held, and each array created carries
    :data:`~storage.scratch.SCRATCH_ATTR`.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        capacity: int,
        backend: IOBackend,
        create: bool = True,
        scratch: Mapping[str, Any] | None = None,
    ) -> None:
        self.path = Path(path).absolute()
        self.backend = backend
        self._lock_fd: int | None = None
        self._mutex = threading.Lock()
        self._counter = itertools.count()
        self._reading: dict[str, tuple[int, int]] = {}  # piece reads: next offset, crc so far
        self._scratch: set[str] = set()  # arrays written in place (durable=False)
        self._torn: set[str] = set()  # scratch arrays whose last write failed part-way
        self._marked = scratch is not None  # arrays created carry SCRATCH_ATTR
        if capacity < 0:
            raise ValueError(f"NVMe capacity {capacity} bytes is negative: pass a size >= 0")
        if scratch is not None:
            self._claim(scratch)
        try:
            self._open(capacity, create)
        except BaseException:
            self.close()
            raise

    def _claim(self, built_for: Mapping[str, Any]) -> None:
        """Take the directory as this run's scratch (:mod:`storage.scratch`): refuse a
        user's, create a missing one, lock it, remove the last run's arrays, mark it."""
        scratch_dir.prepare_dir(self.path, key="nvme_path")
        self._lock()
        try:
            scratch_dir.clear(self.path)
            scratch_dir.write_marker(self.path, built_for)
        except BaseException:
            self.close()
            raise

    def _open(self, capacity: int, create: bool) -> None:
        """Check the directory and the disk's room, lock the directory, open the group."""
        probe = check_store_dir(self.path, create)
        existing = scan_group(self.path)
        stored = sum(spec.nbytes for spec, _ in existing.values())
        if stored > capacity:
            raise ValueError(
                f"NVMe store {self.path} already holds {format_bytes(stored)} ({stored} bytes), "
                f"more than the capacity {format_bytes(capacity)} ({capacity} bytes): raise "
                f"capacity to at least {stored} bytes or delete tensors from the store"
            )
        free = shutil.disk_usage(probe).free
        if free < capacity - stored:
            raise ValueError(
                f"NVMe capacity {format_bytes(capacity)} ({capacity} bytes) at {self.path} needs "
                f"{format_bytes(capacity - stored)} ({capacity - stored} bytes) of free disk, but "
                f"the filesystem has {format_bytes(free)} ({free} bytes) free: lower capacity to "
                f"at most {stored + free} bytes, free disk space, or pick another directory"
            )
        self._budget = Budget(Tier.NVME, capacity)
        self._arrays: dict[str, tuple[ArraySpec, Path]] = {}
        self.path.mkdir(exist_ok=True)
        if self._lock_fd is None:
            self._lock()
        self._open_group()

    def _lock(self) -> None:
        self._lock_fd = lock_store(self.path)

    def _open_group(self) -> None:
        check_group(self.path)
        for root, _dirs, files in os.walk(self.path):
            for file in files:
                if PARTIAL in file:
                    os.unlink(os.path.join(root, file))
        self._arrays = scan_group(self.path)
        for spec, _chunk in self._arrays.values():
            self._budget.reserve(spec.name, spec.nbytes)

    # -- catalogue ---------------------------------------------------------------------------

    @property
    def capacity(self) -> int:
        """Budget of the tier, in bytes."""
        return self._budget.capacity

    @property
    def used(self) -> int:
        """Bytes reserved by the tensors of the store."""
        return self._budget.used

    def contains(self, name: str) -> bool:
        """Whether tensor ``name`` is in the store (created, not necessarily written)."""
        return name in self._arrays

    def names(self) -> list[str]:
        """Names of the stored tensors, sorted."""
        return sorted(self._arrays)

    def spec(self, name: str) -> ArraySpec:
        """Shape, dtype and size of tensor ``name``; ``KeyError`` if absent."""
        return self._entry(name)[0]

    def chunk_path(self, name: str) -> Path:
        """The file holding the bytes of tensor ``name`` (the one plain zarr reads)."""
        return self._entry(name)[1]

    def _entry(self, name: str) -> tuple[ArraySpec, Path]:
        try:
            return self._arrays[name]
        except KeyError:
            raise KeyError(f"tensor {name!r} is not in NVMe store {self.path}") from None

    def create(
        self,
        name: str,
        shape: Sequence[int],
        dtype: torch.dtype,
        *,
        checksum: bool = True,
        durable: bool = True,
    ) -> ArraySpec:
        """Add tensor ``name`` (metadata only) and reserve its bytes under the capacity; its
        chunk ends with a CRC-32C trailer verified on every read unless ``checksum`` is
        False (the format 1 layout, read unverified). ``durable=False``: a scratch array
        (:meth:`set_durable`)."""
        self._check_open()
        check_name(name)
        dims = tuple(int(d) for d in shape)
        if any(d < 0 for d in dims):
            raise ValueError(f"tensor {name!r}: shape {dims} has a negative dimension")
        if dtype not in DTYPES:
            raise ValueError(
                f"tensor {name!r}: dtype {dtype} is not supported by the NVMe tier: use one of "
                f"{sorted(BY_NAME)}"
            )
        with self._mutex:
            if name in self._arrays:
                raise ValueError(
                    f"tensor {name!r} already exists in NVMe store {self.path}: delete it first"
                )
            nbytes = math.prod(dims) * torch.empty((), dtype=dtype).element_size()
            self._budget.reserve(name, nbytes)
            try:
                array_dir = self.path / name
                array_dir.mkdir(exist_ok=True)
                meta = array_metadata(dims, dtype, checksum=checksum)
                if self._marked:
                    meta["attributes"][SCRATCH_ATTR] = True
                write_json_atomic(array_dir / "zarr.json", meta)
                fsync_dir(self.path)
                entry = parse_array(name, array_dir / "zarr.json")
            except BaseException:
                self._budget.release(name)
                raise
            self._arrays[name] = entry
        self.set_durable(name, durable)
        return entry[0]

    def set_durable(self, name: str, durable: bool) -> None:
        """Whether writes of tensor ``name`` replace its chunk atomically (True, the default)
        or, once the chunk exists, go over it in place when it has no checksum trailer
        (False: a scratch array that only this process reads back; see the module doc)."""
        self._entry(name)
        with self._mutex:
            if durable:
                self._scratch.discard(name)
            else:
                self._scratch.add(name)

    def _writes_in_place(self, spec: ArraySpec, chunk: Path) -> bool:
        """Whether the next write of ``spec`` goes over its existing chunk (see the module doc)."""
        if spec.name not in self._scratch or spec.checksum:
            return False
        try:
            return os.stat(chunk).st_size == spec.file_bytes
        except FileNotFoundError:
            return False

    def _tear(self, name: str, chunk: Path) -> None:
        """A write over ``chunk`` failed part-way: its bytes are neither version; remove it."""
        with self._mutex:
            self._torn.add(name)
        with contextlib.suppress(OSError):
            chunk.unlink()

    def _settler(self, name: str, chunk: Path) -> Callable[[bool], None]:
        """``settle(torn)`` for a write over the chunk of ``name``: torn, or whole again."""

        def settle(torn: bool) -> None:
            if torn:
                self._tear(name, chunk)
            else:
                with self._mutex:
                    self._torn.discard(name)

        return settle

    def delete(self, name: str) -> None:
        """Remove tensor ``name`` and its files; its bytes return to the budget.

        Transfers of this tensor must have completed (``wait()``) first.
        """
        self._check_open()
        with self._mutex:
            self._entry(name)
            del self._arrays[name]
            self._reading.pop(name, None)
            self._scratch.discard(name)
            self._torn.discard(name)
            if self._budget.holds(name):
                self._budget.release(name)
            shutil.rmtree(self.path / name)
            fsync_dir(self.path)

    # -- data --------------------------------------------------------------------------------

    def write_async(self, name: str, src: torch.Tensor) -> IOFuture:
        """Write tensor ``name``'s bytes from ``src``, atomically.

        ``src`` is a contiguous ``uint8`` buffer holding the tensor's bytes at
        its start: a CPU tensor of at least ``padded(nbytes)`` bytes (see
        :func:`storage.io.aligned_empty`), or a CUDA tensor with the kvikio
        backend. The future completes once the new chunk replaced the old one
        on stable storage; until then readers see the previous version. Two
        writes of one tensor in flight at once land in the order they
        complete, not the order they started: wait for one before starting the
        next (:class:`storage.store.TieredStore` chains the operations on each
        tensor, so its write-backs land in the order they were issued).
        """
        self._check_open()
        spec, chunk = self._entry(name)
        if spec.nbytes == 0:
            return IOFuture.completed(0, path=str(chunk))
        if self._writes_in_place(spec, chunk):
            return self._write_in_place(spec, chunk, src)
        durable = name not in self._scratch
        self._ensure_dir(chunk.parent)
        tmp = chunk.with_name(f"{chunk.name}{PARTIAL}{os.getpid()}-{next(self._counter)}")
        try:
            inner = self.backend.write_async(
                tmp, src, spec.nbytes, fsync=durable and not spec.checksum
            )
        except ValueError as exc:
            raise ValueError(f"tensor {name!r}: {exc}") from exc
        except OSError as exc:
            raise io_error(name, "write", tmp, exc) from exc

        def commit() -> None:
            try:
                if spec.checksum:  # src is the caller's until this future completes
                    finish_chunk(tmp, spec.nbytes, crc32c(src[: spec.nbytes]))
                os.replace(tmp, chunk)
                if durable:
                    fsync_dir(chunk.parent)
                with self._mutex:
                    self._torn.discard(name)
            except BaseException:
                with contextlib.suppress(OSError):
                    tmp.unlink()
                raise

        def clean(done: IOFuture) -> None:
            if done._error is not None:
                with contextlib.suppress(OSError):
                    tmp.unlink()

        inner.add_done_callback(clean)
        return chain(inner, commit, name, "write", tmp, spec.nbytes)

    def _write_in_place(
        self,
        spec: ArraySpec,
        chunk: Path,
        src: torch.Tensor,
        count: int | None = None,
        offset: int = 0,
    ) -> IOFuture:
        """Write scratch tensor ``spec`` over its existing chunk (see the module doc): all of
        it, or ``count`` bytes at byte ``offset`` (a piece)."""
        name, count = spec.name, spec.nbytes if count is None else count
        try:
            inner = self.backend.write_async(
                chunk, src, count, fsync=False, offset=offset, in_place=True
            )
        except ValueError as exc:
            raise ValueError(f"tensor {name!r}: {exc}") from exc
        except OSError as exc:
            raise io_error(name, "write", chunk, exc) from exc

        settle = self._settler(name, chunk)
        inner.add_done_callback(lambda done: settle(done._error is not None))
        return chain(inner, lambda: None, name, "write", chunk, count)

    def write_piece_async(
        self, name: str, src: torch.Tensor, *, offset: int, nbytes: int
    ) -> IOFuture:
        """Write bytes ``[offset, offset + nbytes)`` of scratch tensor ``name`` from the start
        of ``src`` over its chunk in place (buffer rule of :meth:`write_async`; ``offset`` a
        multiple of :data:`storage.io.ALIGNMENT`); the other bytes stay. A chunk not yet
        written is first made, as zeros (sparse). ``ValueError`` for a durable or
        checksummed array: write those whole."""
        self._check_open()
        spec, chunk = self._entry(name)
        count = check_piece(spec, offset, nbytes)
        if name not in self._scratch or spec.checksum:
            raise ValueError(
                f"tensor {name!r} is written atomically (durable or with a checksum), not in "
                "pieces: write it whole"
            )
        if count % ALIGNMENT and offset + count != spec.nbytes:
            raise ValueError(
                f"tensor {name!r}: a piece of {count} bytes at offset {offset} neither fills "
                f"whole {ALIGNMENT}-byte blocks nor ends the tensor: split at {ALIGNMENT} bytes"
            )
        if not self._writes_in_place(spec, chunk):
            self._ensure_dir(chunk.parent)
            with open(chunk, "wb") as f:
                f.truncate(spec.file_bytes)
        if count == 0:
            return IOFuture.completed(0, path=str(chunk))
        return self._write_in_place(spec, chunk, src, count, offset)

    def begin_write(self, name: str) -> NvmeWrite:
        """Start writing tensor ``name`` in pieces (see :class:`NvmeWrite`): atomically, or
        over its chunk for a scratch array whose chunk exists (see the module doc)."""
        self._check_open()
        spec, chunk = self._entry(name)
        if self._writes_in_place(spec, chunk):
            return NvmeWrite(spec, chunk, chunk, self.backend, settle=self._settler(name, chunk))
        self._ensure_dir(chunk.parent)
        tmp = chunk.with_name(f"{chunk.name}{PARTIAL}{os.getpid()}-{next(self._counter)}")
        return NvmeWrite(spec, chunk, tmp, self.backend, durable=name not in self._scratch)

    def _piece_read(self, spec: ArraySpec, chunk: Path, dst: torch.Tensor, offset: int) -> None:
        """Fold one piece read of ``spec`` into its running checksum; verify at the last piece.

        Pieces read in order from offset 0 are checked on their buffers; a last piece
        whose earlier pieces came otherwise has the chunk file checked instead.
        """
        count = min(dst.numel(), spec.nbytes - offset)
        crc: int | None = None
        with self._mutex:
            prev = self._reading.pop(spec.name, None)
        if offset == 0:
            crc = crc32c(dst[:count])
        elif prev is not None and prev[0] == offset:
            crc = crc32c(dst[:count], prev[1])
        end = offset + count
        if end < spec.nbytes:
            if crc is not None:
                with self._mutex:
                    self._reading[spec.name] = (end, crc)
            return
        if crc is None:
            crc, _ = file_crc32c(chunk, spec.nbytes)
        check_crc(spec, chunk, crc, self.path)

    def read_async(
        self, name: str, dst: torch.Tensor, *, offset: int = 0, nbytes: int | None = None
    ) -> IOFuture:
        """Read tensor ``name``'s bytes into the start of ``dst`` (same buffer rule as writes).

        ``offset`` and ``nbytes`` (bytes) select a piece: bytes ``[offset,
        offset + nbytes)`` of the tensor, by default all from ``offset`` on;
        ``offset`` is a multiple of :data:`storage.io.ALIGNMENT`. Raises
        :class:`CorruptTensorError` naming the tensor and file, before
        reading, when the chunk is missing (its write never completed) or its
        size differs from the metadata.
        """
        self._check_open()
        spec, chunk = self._entry(name)
        count = check_piece(spec, offset, nbytes)
        if count == 0:
            return IOFuture.completed(0, path=str(chunk))
        if name in self._torn:
            raise CorruptTensorError(
                f"tensor {name!r}: its last write over chunk file {chunk} failed part-way (a "
                f"scratch array, written in place), so its contents are lost; write it again"
            )
        try:
            size = os.stat(chunk).st_size
        except FileNotFoundError:
            raise CorruptTensorError(
                f"tensor {name!r}: chunk file {chunk} is missing: the tensor was created but its "
                f"write is incomplete (never completed); write it again"
            ) from None
        if size != spec.file_bytes:
            trailer = f" + {CHECKSUM_BYTES} checksum bytes" if spec.checksum else ""
            raise CorruptTensorError(
                f"tensor {name!r}: chunk file {chunk} holds {size} bytes but its metadata "
                f"(shape {spec.shape}, {spec.dtype}) needs {spec.nbytes} bytes{trailer} = "
                f"{spec.file_bytes} bytes: the file is truncated or the metadata was changed; "
                f"write the tensor again"
            )
        whole = offset == 0 and count == spec.nbytes
        room = padded(count + CHECKSUM_BYTES) if dst.device.type == "cpu" else count + 4
        extra = CHECKSUM_BYTES if spec.checksum and whole and dst.numel() >= room else 0
        if spec.checksum and whole and count > VERIFY_PIECE_BYTES:
            return read_verified(
                self.backend, spec, chunk, dst, extra, VERIFY_PIECE_BYTES, self.path
            )
        try:  # the trailer comes in the same read when the buffer's padding can take it
            inner = self.backend.read_async(chunk, dst, count + extra, offset=offset)
        except ValueError as exc:
            raise ValueError(f"tensor {name!r}: {exc}") from exc
        except OSError as exc:
            raise CorruptTensorError(f"tensor {name!r}: cannot read {chunk}: {exc}") from exc

        def verify() -> None:
            if not spec.checksum:
                return
            if not whole:
                self._piece_read(spec, chunk, dst[:count], offset)
                return
            computed = crc32c(dst[:count])
            if extra:
                got = decode(bytes(dst[count : count + extra].cpu().numpy()))
                if got == computed:
                    return
            check_crc(spec, chunk, computed, self.path)

        return chain(inner, verify, name, "read", chunk, count)

    def _ensure_dir(self, directory: Path) -> None:
        if directory.is_dir():
            return
        missing = []
        while not directory.is_dir():
            missing.append(directory)
            directory = directory.parent
        for new in reversed(missing):
            new.mkdir(exist_ok=True)
            fsync_dir(new.parent)

    # -- lifecycle ---------------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._lock_fd is None:
            raise NvmeError(f"NVMe store {self.path} is closed: open a new NvmeTier")

    def close(self) -> None:
        """Release the directory lock (and remove the lock file); idempotent."""
        fd, self._lock_fd = self._lock_fd, None
        if fd is None:
            return
        try:
            os.unlink(self.path / LOCK_NAME)
        except FileNotFoundError:
            pass
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)

    def __enter__(self) -> NvmeTier:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        if getattr(self, "_lock_fd", None) is not None:
            self.close()
