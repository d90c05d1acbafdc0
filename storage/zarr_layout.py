"""The on-disk layout of the NVMe tier: a plain zarr v3 group, one array per tensor.

Each array's ``zarr.json`` (:func:`array_metadata`, :func:`row_chunked_metadata`) and its
validation when read back (:func:`parse_array`, :func:`scan_group`), the dtypes it stores
(:data:`DTYPES`), tensor names (:func:`check_name`), and the store directory itself: its checks
(:func:`check_store_dir`, :func:`check_group`) and its lock (:func:`lock_store`). The
layout is described in :mod:`storage.nvme`.
"""

from __future__ import annotations

import errno
import fcntl
import json
import math
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from storage import scratch as scratch_dir
from storage.checksum import CODEC
from storage.chunk_io import ArraySpec, CorruptTensorError, NvmeError, UnsupportedArrayError
from storage.durable import write_atomic
from storage.scratch import LOCK_NAME, PARTIAL

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

BY_NAME = {str(dt).removeprefix("torch."): dt for dt in DTYPES}
DEFAULT_FOR_ZARR = {z: dt for dt, z in DTYPES.items() if dt is not torch.bfloat16}


def write_json_atomic(path: Path, doc: dict[str, Any]) -> None:
    tmp = path.with_name(f"{path.name}{PARTIAL}{os.getpid()}")
    write_atomic(path, json.dumps(doc, indent=2).encode(), tmp)


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
        dtype = BY_NAME.get(str(attrs[DTYPE_ATTR]))
        if dtype is None or DTYPES[dtype] != zdtype:
            raise CorruptTensorError(
                f"{where}: attribute {DTYPE_ATTR}={attrs[DTYPE_ATTR]!r} does not fit "
                f"data_type {zdtype!r}"
            )
    elif zdtype in DEFAULT_FOR_ZARR:
        dtype = DEFAULT_FOR_ZARR[zdtype]
    else:
        raise UnsupportedArrayError(
            f"{where}: data_type {zdtype!r} is not one of {sorted(DEFAULT_FOR_ZARR)}"
        )
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    key = row_chunk_key(0, len(shape)).replace("/", sep)
    spec = ArraySpec(name, shape, dtype, nbytes, checksum=checksum)
    return spec, meta_path.parent.joinpath(*key.split("/"))


UNREADABLE_NODE = (OSError, ValueError, AttributeError, RecursionError)
"""What reading a ``zarr.json`` that is missing, not JSON, too deep or not an object raises."""


def child_nodes(root: str | os.PathLike[str]) -> Iterator[tuple[str, Path]]:
    """(name, path of its ``zarr.json``) of each node in the group at ``root`` (its
    subdirectories holding a ``zarr.json``), by name."""
    for entry in sorted(os.scandir(root), key=lambda e: e.name):
        meta = Path(entry.path, "zarr.json")
        if entry.is_dir() and meta.is_file():
            yield entry.name, meta


def node_type(meta: Path) -> Any:
    """The ``node_type`` of the ``zarr.json`` at ``meta``; raises one of
    :data:`UNREADABLE_NODE` where it cannot be read."""
    return json.loads(meta.read_text(encoding="utf-8")).get("node_type")


def scan_group(root: Path) -> dict[str, tuple[ArraySpec, Path]]:
    """Index the arrays at the group root (read only)."""
    found: dict[str, tuple[ArraySpec, Path]] = {}
    if not root.is_dir():
        return found
    for name, meta in child_nodes(root):
        try:
            kind = node_type(meta)
        except UNREADABLE_NODE as exc:
            raise CorruptTensorError(
                f"tensor {name!r}: unreadable metadata file {meta}: {exc!r}"
            ) from exc
        if kind == "array":
            found[name] = parse_array(name, meta)
    return found


class StoreLockedError(NvmeError):
    """Another NvmeTier (this process or another) holds the store directory."""


def check_store_dir(path: Path, create: bool) -> Path:
    """Validate the store directory ``path`` (or its parent when it is to be created); return
    an existing directory on its disk."""
    target = path if path.exists() or not create else path.parent
    if not target.exists():
        what = "its parent directory" if create else "the directory"
        raise ValueError(
            f"NVMe store {path}: {what} {target} does not exist: create it first"
            + ("" if create else " or pass create=True")
        )
    if not target.is_dir():
        raise ValueError(f"NVMe store {path}: {target} is not a directory: pick a directory path")
    if not os.access(target, os.W_OK | os.X_OK):
        raise ValueError(
            f"NVMe store {path}: {target} is not writable: fix its permissions or "
            f"pick a writable directory"
        )
    return target


def lock_store(path: Path) -> int:
    """Lock store directory ``path`` against other openers (``fcntl.flock`` on its lock
    file, which records this process id); return the lock's file descriptor."""
    lock_path = path / LOCK_NAME
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
                f"NVMe store {path} is locked by process {holder} (lock file "
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
    return fd


def check_group(path: Path) -> None:
    """Check the zarr group document of store directory ``path`` (``ValueError`` naming
    the damage), or write a new one."""
    group = path / "zarr.json"
    if group.is_file():
        try:
            doc = json.loads(group.read_text(encoding="utf-8"))
        except (ValueError, RecursionError) as exc:  # not UTF-8, not JSON, nested too deep
            raise ValueError(
                f"NVMe store {path}: {group} is not readable JSON ({exc}): the store "
                "is damaged; write it again into a new directory"
            ) from None
        if not isinstance(doc, dict):
            raise ValueError(
                f"NVMe store {path}: {group} holds a JSON {type(doc).__name__}, not a "
                "zarr group's object: the store is damaged; write it again into a new directory"
            )
        node_type = doc.get("node_type")
        if doc.get("zarr_format") != 3:
            raise ValueError(
                f"NVMe store {path}: {group} has zarr_format {doc.get('zarr_format')!r}, "
                "a format this version does not read (zarr v3 only): write the store again "
                "into a new directory, or use the release that wrote it"
            )
        if node_type != "group":
            raise ValueError(
                f"NVMe store {path}: {group} describes a zarr {node_type}, not a group: "
                f"pick another directory"
            )
    else:
        write_json_atomic(group, {"zarr_format": 3, "node_type": "group", "attributes": {}})
