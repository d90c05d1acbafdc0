"""Mechanism of Balance Beam: named tensors on device / pinned host / NVMe tiers.

:class:`TieredStore` is the entry point; :mod:`storage.io` and
:mod:`storage.nvme` are the file layer beneath it. Nothing here knows about
models or Lightning. :mod:`storage.deferred` is a CPU double of CUDA's copy
semantics for tests (``StoreConfig.cuda_double`` or ``BB_CUDA_DOUBLE=1``).
"""

from storage.deferred import DOUBLE_ENV
from storage.device import ArenaFullError, slot_bytes
from storage.host import HostBuffer
from storage.io import ALIGNMENT, IOConfig, aligned_empty, open_backend, padded
from storage.nvme import (
    ArraySpec,
    ChecksumError,
    CorruptTensorError,
    NvmeError,
    NvmeIOError,
    NvmeTier,
    StoreLockedError,
)
from storage.observers import TransferKind, TransferObserver
from storage.store import LinkStats, StateError, StoreConfig, Ticket, TieredStore
from storage.tiers import PRICED_LINKS, Budget, Link, Residency, Tier, format_bytes

__all__ = [
    "ALIGNMENT",
    "DOUBLE_ENV",
    "PRICED_LINKS",
    "ArenaFullError",
    "ArraySpec",
    "Budget",
    "ChecksumError",
    "CorruptTensorError",
    "HostBuffer",
    "IOConfig",
    "Link",
    "LinkStats",
    "NvmeError",
    "NvmeIOError",
    "NvmeTier",
    "Residency",
    "StateError",
    "StoreConfig",
    "StoreLockedError",
    "Ticket",
    "Tier",
    "TieredStore",
    "TransferKind",
    "TransferObserver",
    "aligned_empty",
    "format_bytes",
    "open_backend",
    "padded",
    "slot_bytes",
]
