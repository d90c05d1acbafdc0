"""Host memory near the GPU: the GPU's NUMA node, and page placement on it.

A page of an anonymous mapping lands on the NUMA node of the thread that first touches
it. ``cudaHostRegister`` touches every page of a buffer it pins, on the thread that
registers it, which need not run on the GPU's node; on a machine with two sockets a
pinned arena could then sit across the inter-socket link from the GPU, and every copy
between them crosses it. :func:`prefer_node` asks the kernel to place a mapping's pages
on one node when they are first touched (``mbind(2)`` with ``MPOL_PREFERRED``: pages go
elsewhere rather than fail when that node is full), and :func:`device_numa_node` finds
the GPU's node from its PCI address in sysfs. Both are no-ops where the information or
the system call is missing (one node, no sysfs, no NUMA support).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import os
from pathlib import Path

import torch

__all__ = ["PCI_DEVICES", "device_numa_node", "numa_node", "pci_address", "prefer_node"]

PCI_DEVICES = Path("/sys/bus/pci/devices")
"""Where Linux lists PCI devices, each with a ``numa_node`` file (``-1``: no node)."""

_MPOL_PREFERRED = 1
_SYS_MBIND = {"x86_64": 237, "aarch64": 235, "ppc64le": 259}
"""``mbind``'s system call number per machine (Linux's syscall tables)."""


def pci_address(domain: int, bus: int, device: int, function: int = 0) -> str:
    """The sysfs name of a PCI function, as ``0000:3b:00.0``."""
    return f"{domain:04x}:{bus:02x}:{device:02x}.{function:x}"


def numa_node(pci: str, *, sysfs: Path = PCI_DEVICES) -> int | None:
    """The NUMA node of PCI device ``pci`` (``0000:3b:00.0``) as sysfs reports it; None
    where sysfs has no such device or no node for it (``-1``)."""
    try:
        text = (sysfs / pci.lower() / "numa_node").read_text().strip()
        node = int(text)
    except (OSError, ValueError):
        return None
    return node if node >= 0 else None


def device_numa_node(device: torch.device, *, sysfs: Path = PCI_DEVICES) -> int | None:
    """The NUMA node of CUDA ``device``; None for a CPU device, or where it is unknown."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    index = device.index if device.index is not None else torch.cuda.current_device()
    props = torch.cuda.get_device_properties(index)
    ids = [getattr(props, f"pci_{k}_id", None) for k in ("domain", "bus", "device")]
    if any(not isinstance(i, int) for i in ids):
        return None
    domain, bus, dev = (int(i) for i in ids)  # type: ignore[arg-type]
    return numa_node(pci_address(domain, bus, dev), sysfs=sysfs)


@functools.lru_cache(maxsize=1)
def _syscall() -> ctypes._CFuncPtr | None:  # type: ignore[name-defined]
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    fn = ctypes.CDLL(name, use_errno=True).syscall
    fn.restype = ctypes.c_long
    return fn  # type: ignore[no-any-return]


def prefer_node(address: int, nbytes: int, node: int | None) -> bool:
    """Ask that the pages of ``nbytes`` bytes at page-aligned ``address`` (a mapping not
    touched yet) be placed on NUMA node ``node`` when first touched. Returns whether the
    kernel took the policy; False (nothing changed) for ``node=None``, on a machine
    without ``mbind``, or when the kernel refuses it (no such node, no NUMA support)."""
    number = _SYS_MBIND.get(os.uname().machine)
    if node is None or nbytes <= 0 or number is None or not 0 <= node < 1023:
        return False
    call = _syscall()
    if call is None:
        return False
    mask = (ctypes.c_ulong * (1024 // (8 * ctypes.sizeof(ctypes.c_ulong))))()
    bits = 8 * ctypes.sizeof(ctypes.c_ulong)
    mask[node // bits] = 1 << (node % bits)
    status = call(
        ctypes.c_long(number),
        ctypes.c_void_p(address),
        ctypes.c_ulong(nbytes),
        ctypes.c_int(_MPOL_PREFERRED),
        mask,
        ctypes.c_ulong(1024),
        ctypes.c_uint(0),
    )
    return int(status) == 0
