"""The budgets and placement of a :class:`~storage.store.TieredStore` (:class:`StoreConfig`)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from storage.device import resolve_device
from storage.io import ALIGNMENT, IOConfig, padded
from storage.tiers import Tier

__all__ = ["StoreConfig"]


@dataclass(frozen=True, kw_only=True)
class StoreConfig:
    """Budgets and placement of a :class:`TieredStore`."""

    device_budget: int
    """Bytes of the device arena (ordinary memory without CUDA); rounded down to 4 KiB."""
    host_budget: int
    """Bytes of the host arena (pinned when the device is CUDA); rounded down to 4 KiB."""
    nvme_path: str | None = None
    """Directory of the NVMe tier's zarr group; ``None`` for no NVMe tier."""
    nvme_budget: int = 0
    """Bytes the NVMe tier may hold."""
    staging_buffers: int = 4
    """Aligned host buffers (pinned when the device is CUDA) for NVMe transfers that cannot
    go direct."""
    staging_bytes: int = 64 << 20
    """Bytes of each staging buffer (a multiple of 4096): the piece size of staged NVMe
    transfers, which stream a tensor of any size through one buffer at a time."""
    stage_nvme: bool = False
    """Stage every NVMe transfer, piece by piece, even where it could land straight in an
    arena slot (on the CPU, or with kvikio); off by default."""
    io: IOConfig = field(default_factory=IOConfig)
    """I/O backend of the NVMe tier."""
    device: str | None = None
    """Compute device: ``"cuda"``, ``"cuda:1"``, ``"cpu"``; ``None`` = cuda when available."""
    copy_threads: int = 2
    """Threads that run page-ins and write-backs, per pool: one pool serves tensors homed
    on NVMe, one the others (on CUDA they only issue copies)."""
    scratch_checksums: bool = False
    """Give NVMe-homed tensors registered as scratch (``register(..., scratch=True)``:
    rewritten often, never reopened by another process) CRC-32C trailers too. Off: their
    chunks are written and read without one (format 1 layout), which spares a checksum
    pass over every byte each way (about 1 CPU second per 6 GB on one core)."""
    nvme_scratch: Mapping[str, Any] | None = None
    """The NVMe directory is the opening run's scratch (:mod:`storage.scratch`): a
    JSON-serialisable description of what the run built it for, recorded in the
    directory's marker. A missing directory is created when its parent exists; a file, or
    a directory holding anything but a run's scratch (a converted store, a checkpoint, a
    user's files), is refused and left untouched; the last run's scratch arrays are
    removed. None: a plain store directory, reopened with its arrays."""
    cuda_double: bool | None = None
    """On a CPU device, run copies between the device arena and host memory under the CPU
    double of CUDA's semantics (:mod:`storage.deferred`: destinations poisoned until the
    host synchronises), for tests; None reads the environment variable
    ``BB_CUDA_DOUBLE``. Never on a CUDA device (it has the real semantics)."""

    def __post_init__(self) -> None:
        for key in ("device_budget", "host_budget", "nvme_budget"):
            value = getattr(self, key)
            if not isinstance(value, int) or value < 0:
                raise ValueError(f"StoreConfig.{key}={value!r} must be an int >= 0 (bytes)")
        if self.nvme_path is None and self.nvme_budget:
            raise ValueError(
                f"StoreConfig.nvme_budget={self.nvme_budget} bytes but nvme_path is None: "
                f"set nvme_path to a directory, or nvme_budget=0"
            )
        if self.nvme_path is not None and self.nvme_budget <= 0:
            raise ValueError(
                f"StoreConfig.nvme_path={self.nvme_path!r} with nvme_budget=0 bytes: "
                f"give the NVMe tier a budget > 0, or nvme_path=None"
            )
        if self.staging_buffers < 1:
            raise ValueError(f"StoreConfig.staging_buffers={self.staging_buffers} must be >= 1")
        if self.staging_bytes <= 0 or self.staging_bytes % ALIGNMENT:
            raise ValueError(
                f"StoreConfig.staging_bytes={self.staging_bytes} must be a positive multiple of "
                f"{ALIGNMENT} bytes: use e.g. {max(ALIGNMENT, padded(self.staging_bytes))}"
            )
        if self.copy_threads < 1:
            raise ValueError(f"StoreConfig.copy_threads={self.copy_threads} must be >= 1")
        resolve_device(self.device)

    @property
    def budgets(self) -> dict[Tier, int]:
        """Bytes per tier the store holds: the device and host budgets rounded down to
        4 KiB as their arenas are carved, the NVMe budget as given."""
        return {
            Tier.DEVICE: self.device_budget - self.device_budget % ALIGNMENT,
            Tier.HOST: self.host_budget - self.host_budget % ALIGNMENT,
            Tier.NVME: self.nvme_budget,
        }
