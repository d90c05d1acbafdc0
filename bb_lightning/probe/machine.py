"""What a measured hardware profile is valid for, and where it is cached: the machine's
identity (:func:`machine_identity`: probes' version, host, CPU, GPU, the NVMe path's
filesystem), the cache directory and file (:func:`cache_dir`, :func:`cache_path`) and
reading a cached profile back and writing one (:func:`read_cache`, :func:`write_cache`,
:func:`nvme_rates_age`); the CUDA memory this process can
still allocate (:func:`cuda_device_memory`)."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import platform
import socket
import time
from pathlib import Path
from typing import Any

import torch

from bb_lightning.planner.presets import datasheet_flops
from bb_lightning.planner.profile import LAYOUT_FIELDS, HardwareProfile

__all__ = [
    "CACHE_ENV",
    "PROBES_VERSION",
    "cache_dir",
    "cache_path",
    "cores",
    "cpu_model",
    "cuda_device_memory",
    "datasheet_peak",
    "filesystem_of",
    "machine_identity",
    "read_cache",
]

CACHE_ENV = "BB_CACHE_DIR"
"""Environment variable naming the cache directory (default ``~/.cache/balance_beam``)."""


PROBES_VERSION = "10"
"""Changes when a probe measures something else (2: host AdamW on the gradient worker's
threads, and the CPU time of NVMe transfers; 3: matrix products in a linear layer's operand
order; 4: host AdamW on the calling thread's team, where a CPU device's training steps it;
5: on a CPU device, the compute lost beside NVMe transfers; 6: NVMe writes over existing
files without fsync, as the store writes its scratch tensors; 7: host memory bandwidth as
the lesser of a plain read and the engine's decode attention; 8: NVMe transfers to and from
buffers in huge pages, as the store's arenas are, and the host memory probes over buffers
allocated as the host KV cache is; 9: the decode attention kernel on the calling thread's
OpenMP team, its keys asked for into every cache level; 10: on Intel CPUs, four query heads'
key products in 512-bit vectors, and cache rows read with one vector load each), so that
profiles cached by the earlier probes are measured again."""


def cpu_model() -> str:
    """The CPU's model name (``/proc/cpuinfo``, else what :mod:`platform` says)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def cores() -> int:
    """Cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def machine_identity(nvme_path: str | None) -> dict[str, str]:
    """What a cached profile is valid for: the probes' version, hostname, CPU model, GPU
    name and the filesystem that holds the NVMe path (:func:`filesystem_of`)."""
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else ""
    return {
        "probes": PROBES_VERSION,
        "hostname": socket.gethostname(),
        "cpu": cpu_model(),
        "gpu": gpu,
        "nvme_filesystem": filesystem_of(nvme_path) if nvme_path else "",
    }


def filesystem_of(path: str) -> str:
    """The filesystem that holds ``path``: its device number and mount point
    (``"259:1 /mnt/nvme"``). The NVMe probes measure the disk and filesystem, not the
    directory, so every directory on one filesystem shares a profile; a path that does
    not exist yet is judged by its nearest existing parent."""
    real = Path(os.path.realpath(path))
    while not real.exists() and real != real.parent:
        real = real.parent
    mount = real
    while not os.path.ismount(mount) and mount != mount.parent:
        mount = mount.parent
    dev = os.stat(real).st_dev
    return f"{os.major(dev)}:{os.minor(dev)} {mount}"


def cache_dir() -> Path:
    """The directory of the probes' caches: ``$BB_CACHE_DIR``, else ``~/.cache/balance_beam``."""
    return Path(os.environ.get(CACHE_ENV) or os.path.join(Path.home(), ".cache", "balance_beam"))


def cache_path(identity: dict[str, str]) -> Path:
    """Cache file for ``identity``: ``<cache dir>/hardware-<hostname>-<hash>.json``."""
    digest = hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:16]
    host = "".join(c if c.isalnum() or c in "-_." else "_" for c in identity["hostname"])
    return cache_dir() / f"hardware-{host}-{digest}.json"


def read_cache(path: Path, identity: dict[str, str]) -> HardwareProfile | None:
    """The profile cached at ``path`` for ``identity``; None when missing, unreadable, for
    another machine or from an older layout."""
    try:
        data: dict[str, Any] = json.loads(path.read_text())
        if data.get("identity") != identity:
            return None
        # a measured profile has one rank's layout, which its dict leaves out
        fields = {f.name for f in dataclasses.fields(HardwareProfile)} - set(LAYOUT_FIELDS)
        if set(data["profile"]) != fields:  # an older layout lacks what was added since
            return None
        return HardwareProfile.from_dict(data["profile"])
    except (OSError, ValueError, KeyError, TypeError):
        return None  # missing, unreadable or from an older layout: measure again


_NVME_AT = "nvme_measured_at"
"""A cache entry's key for when its NVMe rates were measured (seconds since the epoch)."""


def write_cache(path: Path, identity: dict[str, str], profile: HardwareProfile) -> None:
    """Cache ``profile`` for ``identity`` at ``path`` (atomically), its NVMe rates as of now."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    entry = {"identity": identity, "profile": profile.to_dict(), _NVME_AT: time.time()}
    tmp.write_text(json.dumps(entry, indent=2))
    os.replace(tmp, path)


def nvme_rates_age(path: Path) -> float:
    """Seconds since the NVMe rates cached at ``path`` were measured; infinite when the
    entry does not say (written before entries did) or cannot be read."""
    try:
        return time.time() - float(json.loads(path.read_text())[_NVME_AT])
    except (OSError, ValueError, KeyError, TypeError):
        return math.inf


def datasheet_peak(device: torch.device) -> float:
    """The datasheet dense bf16 FLOP/s of ``device``, the denominator of MFU
    (:func:`~bb_lightning.planner.presets.datasheet_flops` of its CUDA name); 0.0 off CUDA
    or for a GPU without a listed figure."""
    if device.type != "cuda":
        return 0.0
    return datasheet_flops(torch.cuda.get_device_name(device))


def cuda_device_memory(device: torch.device) -> int:
    """Bytes this process can still allocate on CUDA ``device``.

    The free memory the driver reports once the caching allocator's unused blocks are
    given back (``empty_cache``), and no more than the share
    ``torch.cuda.set_per_process_memory_fraction`` allows: ``fraction x total`` less what
    the allocator holds already (``memory_reserved``).
    """
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(device)
    cap = int(torch.cuda.get_per_process_memory_fraction(device) * total)
    return max(0, min(int(free), cap - int(torch.cuda.memory_reserved(device))))
