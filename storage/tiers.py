"""Tier names, residency states and byte-budget accounting.

Three tiers hold tensors: ``DEVICE`` (accelerator memory; ordinary memory on a
machine without CUDA), ``HOST`` (a pinned host arena; plain memory without
CUDA) and ``NVME`` (a directory holding a zarr v3 group). Every tensor has one
*home* tier. Its presence on the compute device is tracked separately by the
:class:`Residency` state machine owned by :class:`storage.store.TieredStore`.
Bytes move between tiers over copy links (:class:`Link`), the one name of a link
for the store's traffic counters, the planner's prices and measured times.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

__all__ = ["PRICED_LINKS", "Budget", "Link", "Residency", "Tier", "format_bytes", "format_count"]


class Tier(str, enum.Enum):
    """Where a tensor's authoritative copy lives."""

    DEVICE = "device"
    HOST = "host"
    NVME = "nvme"


class Link(enum.StrEnum):
    """A copy link from one tier to another; its value (``"h2d"``) is its one name: the
    store's counters, logged metrics, the plan's JSON and ``explain()``, the hardware
    profile's bandwidth fields (``h2d_bandwidth``) and measured times (``h2d_s``).

    ``NVME_TO_DEVICE`` / ``DEVICE_TO_NVME`` (``nvme_read_direct`` / ``nvme_write_direct``)
    are file transfers that land in (or leave from) device memory without host staging;
    the cost model prices them as the disk's read and write (:attr:`priced_as`).
    """

    NVME_TO_HOST = "nvme_read"
    HOST_TO_DEVICE = "h2d"
    DEVICE_TO_HOST = "d2h"
    HOST_TO_NVME = "nvme_write"
    NVME_TO_DEVICE = "nvme_read_direct"
    DEVICE_TO_NVME = "nvme_write_direct"

    @property
    def source(self) -> Tier:
        """The tier the bytes leave."""
        return _ENDS[self][0]

    @property
    def destination(self) -> Tier:
        """The tier the bytes reach."""
        return _ENDS[self][1]

    @property
    def priced_as(self) -> Link:
        """The link of :data:`PRICED_LINKS` whose bandwidth bounds this one: a file
        transfer is bound by the disk, whichever memory it lands in or leaves from."""
        if self.source is Tier.NVME:
            return Link.NVME_TO_HOST
        if self.destination is Tier.NVME:
            return Link.HOST_TO_NVME
        return self

    @classmethod
    def between(cls, source: Tier, destination: Tier) -> Link | None:
        """The link from ``source`` to ``destination``; None within one tier."""
        if source is destination:
            return None
        return _BY_ENDS[(Tier(source), Tier(destination))]


_ENDS: dict[Link, tuple[Tier, Tier]] = {
    Link.NVME_TO_HOST: (Tier.NVME, Tier.HOST),
    Link.HOST_TO_DEVICE: (Tier.HOST, Tier.DEVICE),
    Link.DEVICE_TO_HOST: (Tier.DEVICE, Tier.HOST),
    Link.HOST_TO_NVME: (Tier.HOST, Tier.NVME),
    Link.NVME_TO_DEVICE: (Tier.NVME, Tier.DEVICE),
    Link.DEVICE_TO_NVME: (Tier.DEVICE, Tier.NVME),
}
"""Each link's source and destination tier."""

_BY_ENDS = {ends: link for link, ends in _ENDS.items()}


PRICED_LINKS = (Link.NVME_TO_HOST, Link.HOST_TO_NVME, Link.HOST_TO_DEVICE, Link.DEVICE_TO_HOST)
"""The links the cost model prices (NVMe read, NVMe write, host to device, device to host);
every :class:`Link` is priced as one of them (:attr:`Link.priced_as`)."""


class Residency(str, enum.Enum):
    """Whether a tensor is usable on the compute device.

    Legal transitions: ``RELEASED -> IN_FLIGHT -> RESIDENT -> RELEASED``.
    A tensor whose home tier is ``DEVICE`` is always ``RESIDENT``.
    """

    RELEASED = "released"
    IN_FLIGHT = "in_flight"
    RESIDENT = "resident"


def format_bytes(n: float) -> str:
    """Format a byte count with binary units, e.g. ``1.50 GiB``."""
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024.0 or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.2f} {unit}"
        value /= 1024.0
    raise AssertionError("unreachable")


def format_count(n: float) -> str:
    """Format a count (parameters, tokens) with decimal units, e.g. ``3.3 M`` or ``135 K``.

    Three significant digits, units K (1e3), M (1e6), B (1e9) and T (1e12); counts
    under 1,000 print whole (``264``).
    """
    value = float(n)
    if abs(value) < 1000.0:
        return f"{value:.0f}"
    for unit in ("K", "M", "B", "T"):
        value /= 1000.0
        if abs(value) < 999.5:
            return f"{value:.3g} {unit}"
        if unit == "T":
            return f"{value:,.0f} {unit}"
    raise AssertionError("unreachable")


@dataclass
class Budget:
    """Byte accounting for one tier.

    ``capacity`` is the tier's budget in bytes; ``used`` the bytes currently
    reserved. :meth:`reserve` raises :class:`ValueError` naming the tensor,
    the tier, the bytes needed and the bytes free when the budget cannot hold
    a request.
    """

    tier: Tier
    capacity: int
    """Budget of the tier, in bytes."""
    used: int = 0
    """Bytes currently reserved, in bytes."""
    _by_name: dict[str, int] = field(default_factory=dict, repr=False)

    @property
    def free(self) -> int:
        """Bytes still available under the budget."""
        return self.capacity - self.used

    def reserve(self, name: str, nbytes: int) -> None:
        """Reserve ``nbytes`` for tensor ``name`` or raise ``ValueError``."""
        if nbytes < 0:
            raise ValueError(f"tensor {name!r}: negative size {nbytes} bytes")
        if name in self._by_name:
            raise ValueError(f"tensor {name!r} already holds bytes on tier {self.tier.value}")
        if nbytes > self.free:
            raise ValueError(
                f"tensor {name!r} needs {format_bytes(nbytes)} ({nbytes} bytes) on tier "
                f"{self.tier.value}, but only {format_bytes(self.free)} ({self.free} bytes) of "
                f"its {format_bytes(self.capacity)} budget are free: raise the {self.tier.value} "
                f"budget or home the tensor on another tier"
            )
        self._by_name[name] = nbytes
        self.used += nbytes

    def release(self, name: str) -> int:
        """Return the bytes held by ``name`` to the budget; returns how many."""
        nbytes = self._by_name.pop(name)
        self.used -= nbytes
        return nbytes

    def holds(self, name: str) -> bool:
        """Whether ``name`` holds bytes on this tier."""
        return name in self._by_name
