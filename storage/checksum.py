"""CRC-32C checksums of NVMe chunks, laid out as zarr v3's ``crc32c`` codec lays them out.

An array written with the codecs ``[bytes, crc32c]`` has a chunk file holding
the tensor's bytes followed by :data:`CHECKSUM_BYTES` bytes: the CRC-32C
(Castagnoli) of those bytes as a little-endian ``uint32``
(``zarr.codecs.Crc32cCodec``), so plain zarr verifies it on every read. The
CRC runs in the C library ``google_crc32c`` ships (hardware CRC instructions
where the CPU has them), called straight on the buffer the bytes were read into
and without the GIL, so page-ins of other tensors and the compute thread go on
meanwhile (``google_crc32c.extend`` keeps the GIL for anything but ``bytes``;
it is the fallback, 1 MiB at a time, where the library cannot be found).
"""

from __future__ import annotations

import ctypes
import glob
import os
import struct
from collections.abc import Callable

import google_crc32c
import torch

__all__ = ["CHECKSUM_BYTES", "CODEC", "crc32c", "decode", "encode", "file_crc32c"]

CHECKSUM_BYTES = 4
"""Length of the checksum trailer at the end of a chunk file, in bytes."""

CODEC: dict[str, str] = {"name": "crc32c"}
"""The zarr v3 codec entry that declares the trailer (after the ``bytes`` codec)."""

_BLOCK = 16 << 20
_SLICE = 1 << 20


def _native() -> Callable[[int, int, int], int] | None:
    """``crc32c_extend(crc, address, nbytes)`` of the C library google_crc32c ships, if found.

    A ``ctypes.CDLL`` call releases the GIL for its duration.
    """
    here = os.path.dirname(os.path.dirname(os.path.abspath(google_crc32c.__file__)))
    for path in sorted(glob.glob(os.path.join(here, "google_crc32c.libs", "libcrc32c*.so*"))):
        try:
            fn = ctypes.CDLL(path).crc32c_extend
        except (OSError, AttributeError):
            continue
        fn.restype = ctypes.c_uint32
        fn.argtypes = [ctypes.c_uint32, ctypes.c_void_p, ctypes.c_size_t]
        probe = ctypes.create_string_buffer(b"123456789", 9)
        if fn(0, ctypes.addressof(probe), 9) == 0xE3069283:  # the CRC-32C check value
            return fn  # type: ignore[no-any-return]
    return None


_EXTEND = _native()


def crc32c(data: torch.Tensor, crc: int = 0) -> int:
    """CRC-32C of the bytes of the contiguous ``uint8`` tensor ``data``, continuing ``crc``.

    A CUDA tensor is copied to the host first (the checksum runs on the CPU).
    """
    if data.device.type != "cpu":
        data = data.cpu()
    flat = data.detach().contiguous().view(torch.uint8).reshape(-1)
    if _EXTEND is not None:
        return int(_EXTEND(crc, flat.data_ptr(), flat.numel()))
    view = flat.numpy().view()
    view.flags.writeable = False  # google_crc32c.extend takes read-only buffers only
    for start in range(0, view.size, _SLICE):  # lets other threads run between slices
        crc = int(google_crc32c.extend(crc, view[start : start + _SLICE]))
    return crc


def encode(crc: int) -> bytes:
    """The trailer bytes of checksum ``crc`` (little-endian ``uint32``)."""
    return struct.pack("<I", crc)


def decode(trailer: bytes) -> int:
    """The checksum held in trailer bytes ``trailer``."""
    return int(struct.unpack("<I", trailer)[0])


def file_crc32c(path: str | os.PathLike[str], nbytes: int) -> tuple[int, int]:
    """CRC-32C of the first ``nbytes`` bytes of file ``path``, and the bytes actually read.

    Reads through the page cache in 16 MiB blocks; the count is below
    ``nbytes`` when the file is shorter.
    """
    crc, done = 0, 0
    with open(path, "rb", buffering=0) as f:
        while done < nbytes:
            block = f.read(min(_BLOCK, nbytes - done))
            if not block:
                break
            crc = int(google_crc32c.extend(crc, block))
            done += len(block)
    return crc, done
