"""The first step of ``scripts/gpu-check.sh``: install what the machine lacks from the
wheels ``scripts/device-wheels.sh`` downloaded beforehand (no network), then import every
module the other steps need, each in a fresh interpreter, so that a missing one fails the
call in seconds rather than a step minutes in.

Wheels come from ``$BB_DEVICE_WHEELS`` (default ``<repo>/.device-wheels``) and go into
``$BB_DEVICE_SITE`` (default ``<repo>/.device-site``), which the driver puts on
``PYTHONPATH``. A wheel is installed only when its distribution is not installed already
(the image's own torch, numpy and Lightning are never replaced); kvikio and its cuFile
library only in the build for the CUDA major version torch was built with.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import zipfile
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent

REQUIRED = [
    "torch", "lightning", "transformers", "accelerate", "zarr", "numcodecs", "google_crc32c",
    "jsonargparse", "psutil", "safetensors", "pytest", "storage.store", "storage.io",
    "bb_lightning", "bb_lightning.cli", "bb_lightning.module", "bb_lightning.strategy.dryrun",
    "bb_lightning.engine.inference", "bb_lightning.engine.generate", "gpu_check_runs",
    "gpu_check_compile",
]  # fmt: skip
"""Modules every step together needs: the preflight fails unless each imports."""
OPTIONAL = ["kvikio", "deepspeed", "peft"]
"""Modules a step uses when they import (GPUDirect reads, the DeepSpeed peer, LoRA)."""

BY_CUDA = {
    "12": {"kvikio-cu12", "libkvikio-cu12", "nvidia-cufile-cu12"},
    "13": {"kvikio-cu13", "libkvikio-cu13", "nvidia-cufile"},
}
"""Distributions built for one CUDA major version."""


def wheels_dir() -> Path:
    return Path(os.environ.get("BB_DEVICE_WHEELS") or REPO / ".device-wheels")


def site_dir() -> Path:
    return Path(os.environ.get("BB_DEVICE_SITE") or REPO / ".device-site")


def dist_of(wheel: Path) -> str:
    """The normalised distribution name of a wheel file (``kvikio_cu12-26.10.0-...whl``
    -> ``kvikio-cu12``)."""
    return re.sub(r"[-_.]+", "-", wheel.name.split("-", 1)[0]).lower()


def installed(dist: str) -> bool:
    try:
        version(dist)
    except PackageNotFoundError:
        return False
    return True


def to_install(wheels: list[Path], cuda: str | None) -> tuple[list[Path], list[str]]:
    """The wheels to install (not installed yet; CUDA-specific ones only for ``cuda``'s
    major version, none without CUDA) and why each other one is left."""
    keep: list[Path] = []
    left: list[str] = []
    major = cuda.split(".")[0] if cuda else None
    for wheel in sorted(wheels):
        dist = dist_of(wheel)
        other_cuda = [m for m, dists in BY_CUDA.items() if dist in dists and m != major]
        if other_cuda:
            left.append(f"{dist}: for CUDA {other_cuda[0]}, torch has {cuda or 'no CUDA'}")
        elif installed(dist):
            left.append(f"{dist}: installed")
        else:
            keep.append(wheel)
    return keep, left


def install(wheels: list[Path], target: Path) -> str:
    """Install ``wheels`` into ``target`` without the network or dependency resolution:
    with pip where it runs, else by unpacking each wheel (what pip does for these)."""
    target.mkdir(parents=True, exist_ok=True)
    pip = subprocess.run([sys.executable, "-m", "pip", "--version"], capture_output=True,
                         check=False)  # fmt: skip
    if pip.returncode == 0:
        cmd = [sys.executable, "-m", "pip", "install", "--no-index", "--no-deps",
               "--no-compile", "--disable-pip-version-check", "--upgrade", "--target",
               str(target), *map(str, wheels)]  # fmt: skip
        done = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if done.returncode != 0:
            raise RuntimeError(f"pip install failed: {(done.stdout + done.stderr)[-1500:]}")
        return "pip"
    for wheel in wheels:
        with zipfile.ZipFile(wheel) as zf:
            zf.extractall(target)
        for data in target.glob("*.data"):  # purelib / platlib go to the top
            for lib in ("purelib", "platlib"):
                for item in (data / lib).glob("*") if (data / lib).is_dir() else []:
                    shutil.move(str(item), target / item.name)
            shutil.rmtree(data)
    return "unpacked"


IMPORT_PROBE = """
import importlib, json, sys
found = {}
for name in sys.argv[1:]:
    try:
        importlib.import_module(name)
        found[name] = None
    except BaseException as err:
        found[name] = f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"
print(json.dumps(found))
"""


def import_all(modules: list[str]) -> dict[str, str | None]:
    """Import ``modules`` in a fresh interpreter (the one the steps will run in, with what
    was just installed on its path): name -> None, or the error it raised."""
    path = [str(REPO), str(REPO / "bench"), str(site_dir()), os.environ.get("PYTHONPATH", "")]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in path if p))
    done = subprocess.run([sys.executable, "-c", IMPORT_PROBE, *modules], capture_output=True,
                          text=True, cwd=REPO, env=env, check=False)  # fmt: skip
    lines = done.stdout.strip().splitlines()
    if done.returncode != 0 or not lines:
        return dict.fromkeys(modules, f"import probe exit {done.returncode}: {done.stderr[-300:]}")
    found: dict[str, str | None] = json.loads(lines[-1])
    return found


def preflight(figures: dict[str, Any], cuda: str | None) -> bool:
    """Install the missing wheels and import every module: True when all required import.
    ``cuda``: the CUDA version torch was built with (``torch.version.cuda``), or None."""
    folder = wheels_dir()
    wheels = sorted(folder.glob("*.whl")) if folder.is_dir() else []
    figures["wheels_dir"] = str(folder) if wheels else f"{folder}: none there"
    if wheels:
        keep, left = to_install(wheels, cuda)
        figures["left"] = left
        figures["installed"] = [w.name for w in keep]
        if keep:
            figures["install_method"] = install(keep, site_dir())
    figures["site"] = str(site_dir())
    found = import_all(REQUIRED + OPTIONAL)
    figures["missing"] = {k: v for k, v in found.items() if v is not None and k in REQUIRED}
    figures["optional_missing"] = {
        k: v for k, v in found.items() if v is not None and k in OPTIONAL
    }
    return not figures["missing"]
