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
import errno
import fcntl
import itertools
import json
import math
import os
import shutil
import threading
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from storage import scratch as scratch_dir
from storage.checksum import CHECKSUM_BYTES, CODEC, crc32c, decode, file_crc32c
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
from storage.io import ALIGNMENT, IOBackend, IOFuture, padded
from storage.scratch import LOCK_NAME, PARTIAL, SCRATCH_ATTR
from storage.tiers import Budget, Tier, format_bytes

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
]

DTYPE_ATTR = "torch_dtype"

DTYPES: dict[torch.dtype, str] = {
    torch.bfloat16: "uint16",
    torch.float16: "float16",
    torch.float32: "float32",
    torch.float64: "float64",
    torch.int8: "int8",
    torch.uint8: "uint8",
    torch.int16: "int16",
    torch.int32: "int32",
    torch.int64: "int64",
    torch.uint16: "uint16",
    torch.uint32: "uint32",
    torch.uint64: "uint64",
    torch.bool: "bool",
}
"""Supported torch dtypes and the zarr ``data_type`` each is stored as."""

VERIFY_PIECE_BYTES = 16 << 20
"""Piece size of a verified whole-tensor read larger than it, in bytes: its pieces are all in
flight at once and each is checksummed as it arrives in order (a multiple of 4096)."""

_BY_NAME = {str(dt).removeprefix("torch."): dt for dt in DTYPES}
_DEFAULT_FOR_ZARR = {z: dt for dt, z in DTYPES.items() if dt is not torch.bfloat16}


class StoreLockedError(NvmeError):
    """Another NvmeTier (this process or another) holds the store directory."""


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


def _write_json_atomic(path: Path, doc: dict[str, Any]) -> None:
    tmp = path.with_name(f"{path.name}{PARTIAL}{os.getpid()}")
    write_synced(tmp, json.dumps(doc, indent=2).encode())
    os.replace(tmp, path)
    fsync_dir(path.parent)


def check_name(name: str) -> None:
    """Raise ``ValueError`` unless ``name`` can be a zarr array at the group root."""
    bad = (
        not isinstance(name, str)
        or not name
        or "/" in name
        or "\\" in name
        or "\x00" in name
        or set(name) == {"."}
        or name.startswith("__")
        or PARTIAL in name
        or name in (LOCK_NAME, scratch_dir.MARKER_NAME, "zarr.json")
    )
    if bad:
        raise ValueError(
            f"tensor name {name!r} cannot be a zarr array at the group root: names must be "
            f"non-empty, hold no '/', '\\' or NUL, not be only dots, not start with '__' and not "
            f"contain {PARTIAL!r}; rename the tensor (e.g. 'model.layers.0.mlp.up_proj.weight')"
        )


def array_metadata(
    shape: tuple[int, ...], dtype: torch.dtype, *, checksum: bool = True
) -> dict[str, Any]:
    """The ``zarr.json`` of a single-chunk uncompressed array holding a ``dtype`` tensor:
    codecs ``bytes`` then ``crc32c`` (format 2), or ``bytes`` alone without ``checksum``
    (format 1: no trailer, read unverified)."""
    zdtype = DTYPES[dtype]
    bytes_codec: dict[str, Any] = {"name": "bytes"}
    if torch.empty((), dtype=dtype).element_size() > 1:
        bytes_codec["configuration"] = {"endian": "little"}
    fill: Any = False if dtype is torch.bool else (0.0 if dtype.is_floating_point else 0)
    if dtype is torch.bfloat16:
        fill = 0
    return {
        "zarr_format": 3,
        "node_type": "array",
        "shape": list(shape),
        "data_type": zdtype,
        "chunk_grid": {
            "name": "regular",
            "configuration": {"chunk_shape": [max(1, d) for d in shape]},
        },
        "chunk_key_encoding": {"name": "default", "configuration": {"separator": "/"}},
        "fill_value": fill,
        "codecs": [bytes_codec, dict(CODEC)] if checksum else [bytes_codec],
        "attributes": {DTYPE_ATTR: str(dtype).removeprefix("torch.")},
        "storage_transformers": [],
    }


def row_chunked_metadata(
    shape: tuple[int, ...], dtype: torch.dtype, chunk_rows: int
) -> dict[str, Any]:
    """The ``zarr.json`` of an uncompressed array split along dim 0 only, into chunks of
    ``chunk_rows`` rows (the last chunk stored whole, zero-padded, as zarr stores it)."""
    meta = array_metadata(shape, dtype)
    if shape:
        rest = [max(1, d) for d in shape[1:]]
        meta["chunk_grid"]["configuration"]["chunk_shape"] = [max(1, chunk_rows), *rest]
    return meta


def row_chunk_key(index: int, ndim: int) -> str:
    """The chunk key (``/`` separated) of row chunk ``index`` of an ``ndim``-d array."""
    return "c" if ndim == 0 else "/".join(["c", str(index), *(["0"] * (ndim - 1))])


def row_chunks(name: str, meta_path: Path) -> tuple[ArraySpec, int, list[Path]]:
    """Validate an array split along dim 0 only (or not split): the whole array's spec,
    the rows per chunk, and every chunk's file, in row order. Each chunk file holds
    ``rows * row bytes`` of data (padded) and, with a checksum, its CRC-32C trailer."""
    spec, first = parse_array(name, meta_path, split_rows=True)
    if not spec.shape or spec.shape[0] == 0:
        return spec, max(1, spec.shape[0]) if spec.shape else 1, [first] if spec.nbytes else []
    meta = json.loads(meta_path.read_text(encoding="utf-8"))
    rows = int(meta["chunk_grid"]["configuration"]["chunk_shape"][0])
    sep = ((meta.get("chunk_key_encoding") or {}).get("configuration") or {}).get("separator", "/")
    count = -(-spec.shape[0] // rows)
    if count > MAX_ROW_CHUNKS:
        raise CorruptTensorError(
            f"tensor {name!r} (file {meta_path}): {count} chunks of {rows} rows, more than "
            f"the {MAX_ROW_CHUNKS} a store or checkpoint writes: the metadata is damaged; "
            "write the array again"
        )
    keys = [row_chunk_key(k, len(spec.shape)).replace("/", sep) for k in range(count)]
    paths = [meta_path.parent.joinpath(*key.split("/")) for key in keys]
    return spec, rows, paths


MAX_ELEMENTS = 1 << 50
"""Most elements one array's metadata may declare (2**50: far past any disk; a larger
shape is damage, refused before its byte count is used)."""


MAX_ROW_CHUNKS = 1 << 16
"""Most chunks along dim 0 an array may have (one per rank that wrote it)."""


def _dims(values: Any) -> tuple[int, ...]:
    """A shape from JSON: a list of integers, each in 0..2**50 (``ValueError`` otherwise)."""
    if not isinstance(values, list) or not all(
        type(d) is int and 0 <= d <= MAX_ELEMENTS for d in values
    ):
        raise ValueError(f"{values!r} is not a list of integers in 0..{MAX_ELEMENTS}")
    if math.prod(values) > MAX_ELEMENTS:
        raise ValueError(f"{values!r} holds more than {MAX_ELEMENTS} elements")
    return tuple(values)


def parse_array(name: str, meta_path: Path, *, split_rows: bool = False) -> tuple[ArraySpec, Path]:
    """Validate one array's ``zarr.json``; return its spec and chunk file path.

    ``split_rows`` also accepts an array split along dim 0 only (:func:`row_chunks`);
    the path is then the first chunk's.
    """
    where = f"tensor {name!r} (file {meta_path})"
    try:
        meta = json.loads(meta_path.read_text(encoding="utf-8"))
        shape = _dims(meta["shape"])
        chunks = _dims(meta["chunk_grid"]["configuration"]["chunk_shape"])
        if 0 in chunks:
            raise ValueError(f"chunk shape {list(chunks)} has a dimension of 0 (zarr needs >= 1)")
        grid = meta["chunk_grid"]["name"]
        zdtype = meta["data_type"]
        codecs = meta.get("codecs", [])
        keys = meta.get("chunk_key_encoding", {"name": "default"})
        attrs = meta.get("attributes", {}) or {}
        if not isinstance(keys, dict) or not isinstance(attrs, dict):
            raise TypeError("chunk_key_encoding and attributes must be objects")
    except (OSError, ValueError, KeyError, TypeError, AttributeError, RecursionError) as exc:
        raise CorruptTensorError(f"{where}: unreadable array metadata: {exc!r}") from exc
    fix = (
        "rewrite it as one uncompressed chunk (codecs: bytes, little endian, optionally then "
        "crc32c) of its shape"
    )
    if grid != "regular" or len(chunks) != len(shape):
        raise CorruptTensorError(
            f"{where}: chunk grid {grid!r} {chunks} does not fit shape {shape}"
        )
    whole = list(zip(shape, chunks, strict=True))[1 if split_rows else 0 :]
    if any(s > 0 and c < s for s, c in whole):
        raise UnsupportedArrayError(
            f"{where}: shape {shape} is split into several chunks of {chunks}: {fix}"
        )
    if any(s > 0 and c != s for s, c in whole):
        raise CorruptTensorError(f"{where}: shape {shape} disagrees with its chunk shape {chunks}")
    try:
        endian = (codecs[0].get("configuration") or {}).get("endian", "little")
        names = [c.get("name") for c in codecs]
        checksum = names == ["bytes", CODEC["name"]]
    except (IndexError, KeyError, AttributeError, TypeError):  # codecs not a list of objects
        endian, names, checksum = None, [], False
    if not (names == ["bytes"] or checksum) or endian != "little":
        raise UnsupportedArrayError(
            f"{where}: codecs {codecs} are not 'bytes' (little endian) optionally followed by "
            f"'crc32c': {fix}"
        )
    if meta.get("storage_transformers"):
        raise UnsupportedArrayError(f"{where}: storage transformers are not supported: {fix}")
    config = keys.get("configuration") or {}
    sep = config.get("separator", "/") if isinstance(config, dict) else None
    if keys.get("name") != "default" or sep not in ("/", "."):
        raise UnsupportedArrayError(f"{where}: chunk key encoding {keys} is not zarr's default")
    if DTYPE_ATTR in attrs:
        dtype = _BY_NAME.get(str(attrs[DTYPE_ATTR]))
        if dtype is None or DTYPES[dtype] != zdtype:
            raise CorruptTensorError(
                f"{where}: attribute {DTYPE_ATTR}={attrs[DTYPE_ATTR]!r} does not fit "
                f"data_type {zdtype!r}"
            )
    elif zdtype in _DEFAULT_FOR_ZARR:
        dtype = _DEFAULT_FOR_ZARR[zdtype]
    else:
        raise UnsupportedArrayError(
            f"{where}: data_type {zdtype!r} is not one of {sorted(_DEFAULT_FOR_ZARR)}"
        )
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    key = row_chunk_key(0, len(shape)).replace("/", sep)
    spec = ArraySpec(name, shape, dtype, nbytes, checksum=checksum)
    return spec, meta_path.parent.joinpath(*key.split("/"))


def _scan(root: Path) -> dict[str, tuple[ArraySpec, Path]]:
    """Index the arrays at the group root (read only)."""
    found: dict[str, tuple[ArraySpec, Path]] = {}
    if not root.is_dir():
        return found
    for entry in sorted(os.scandir(root), key=lambda e: e.name):
        meta = Path(entry.path, "zarr.json")
        if not entry.is_dir() or not meta.is_file():
            continue
        try:
            node_type = json.loads(meta.read_text(encoding="utf-8")).get("node_type")
        except (OSError, ValueError, AttributeError, RecursionError) as exc:
            raise CorruptTensorError(
                f"tensor {entry.name!r}: unreadable metadata file {meta}: {exc!r}"
            ) from exc
        if node_type == "array":
            found[entry.name] = parse_array(entry.name, meta)
    return found


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
        probe = self._check_path(create)
        existing = _scan(self.path)
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

    def _check_path(self, create: bool) -> Path:
        """Validate the directory (or its parent); return an existing directory on its disk."""
        target = self.path if self.path.exists() or not create else self.path.parent
        if not target.exists():
            what = "its parent directory" if create else "the directory"
            raise ValueError(
                f"NVMe store {self.path}: {what} {target} does not exist: create it first"
                + ("" if create else " or pass create=True")
            )
        if not target.is_dir():
            raise ValueError(
                f"NVMe store {self.path}: {target} is not a directory: pick a directory path"
            )
        if not os.access(target, os.W_OK | os.X_OK):
            raise ValueError(
                f"NVMe store {self.path}: {target} is not writable: fix its permissions or "
                f"pick a writable directory"
            )
        return target

    def _lock(self) -> None:
        lock_path = self.path / LOCK_NAME
        while True:
            fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as exc:
                holder = os.pread(fd, 64, 0).decode(errors="replace").strip() or "unknown"
                os.close(fd)
                if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                    raise
                raise StoreLockedError(
                    f"NVMe store {self.path} is locked by process {holder} (lock file "
                    f"{lock_path}): close its NvmeTier or end that process first"
                ) from None
            try:
                same = os.fstat(fd).st_ino == os.stat(lock_path).st_ino
            except FileNotFoundError:
                same = False
            if same:  # else the holder removed the file while we waited: retry
                break
            os.close(fd)
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self._lock_fd = fd

    def _open_group(self) -> None:
        group = self.path / "zarr.json"
        if group.is_file():
            try:
                doc = json.loads(group.read_text(encoding="utf-8"))
            except (ValueError, RecursionError) as exc:  # not UTF-8, not JSON, nested too deep
                raise ValueError(
                    f"NVMe store {self.path}: {group} is not readable JSON ({exc}): the store "
                    "is damaged; write it again into a new directory"
                ) from None
            if not isinstance(doc, dict):
                raise ValueError(
                    f"NVMe store {self.path}: {group} holds a JSON {type(doc).__name__}, not a "
                    "zarr group's object: the store is damaged; write it again into a new directory"
                )
            node_type = doc.get("node_type")
            if doc.get("zarr_format") != 3:
                raise ValueError(
                    f"NVMe store {self.path}: {group} has zarr_format {doc.get('zarr_format')!r}, "
                    "a format this version does not read (zarr v3 only): write the store again "
                    "into a new directory, or use the release that wrote it"
                )
            if node_type != "group":
                raise ValueError(
                    f"NVMe store {self.path}: {group} describes a zarr {node_type}, not a group: "
                    f"pick another directory"
                )
        else:
            _write_json_atomic(group, {"zarr_format": 3, "node_type": "group", "attributes": {}})
        for root, _dirs, files in os.walk(self.path):
            for file in files:
                if PARTIAL in file:
                    os.unlink(os.path.join(root, file))
        self._arrays = _scan(self.path)
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
                f"{sorted(_BY_NAME)}"
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
                _write_json_atomic(array_dir / "zarr.json", meta)
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

    def _write_in_place(self, spec: ArraySpec, chunk: Path, src: torch.Tensor) -> IOFuture:
        """Write scratch tensor ``spec`` over its existing chunk (see the module doc)."""
        name = spec.name
        try:
            inner = self.backend.write_async(chunk, src, spec.nbytes, fsync=False, in_place=True)
        except ValueError as exc:
            raise ValueError(f"tensor {name!r}: {exc}") from exc
        except OSError as exc:
            raise io_error(name, "write", chunk, exc) from exc

        settle = self._settler(name, chunk)
        inner.add_done_callback(lambda done: settle(done._error is not None))
        return chain(inner, lambda: None, name, "write", chunk, spec.nbytes)

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
        count = _check_piece(spec, offset, nbytes)
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


def _check_piece(spec: ArraySpec, offset: int, nbytes: int | None) -> int:
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
        count = _check_piece(self.spec, offset, nbytes)
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
