"""The GPU check's preflight (``bench/gpu_check_preflight.py``) and the wheels it installs
(``scripts/device-wheels.sh``): only what the machine lacks, for torch's CUDA, without
the network."""

from __future__ import annotations

import importlib
import os
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path
from types import ModuleType

import pytest

REPO = Path(__file__).resolve().parents[2]
WHEELS = REPO / "scripts" / "device-wheels.sh"


def _preflight() -> ModuleType:
    sys.path.insert(0, str(REPO / "bench"))
    try:
        return importlib.import_module("gpu_check_preflight")
    finally:
        sys.path.remove(str(REPO / "bench"))


def _wheel(folder: Path, dist: str, module: str, text: str) -> Path:
    """A minimal pure-Python wheel of ``dist`` holding ``module`` (``VALUE = text``)."""
    version = "1.0"
    info = f"{dist.replace('-', '_')}-{version}.dist-info"
    path = folder / f"{dist.replace('-', '_')}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr(f"{module}/__init__.py", f"VALUE = {text!r}\n")
        zf.writestr(
            f"{info}/METADATA", f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n"
        )
        zf.writestr(
            f"{info}/WHEEL",
            "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
        )
        zf.writestr(f"{info}/RECORD", "")
    return path


def test_only_missing_wheels_for_torchs_cuda_are_installed(tmp_path: Path) -> None:
    pre = _preflight()
    folder = tmp_path / "wheels"
    folder.mkdir()
    missing = _wheel(folder, "bb-preflight-probe", "bb_preflight_probe", "from the wheel")
    present = _wheel(folder, "pytest", "pytest_shadow", "never installed")
    cu12 = _wheel(folder, "kvikio-cu12", "kvikio_probe12", "cuda 12")
    cu13 = _wheel(folder, "kvikio-cu13", "kvikio_probe13", "cuda 13")
    wheels = [missing, present, cu12, cu13]
    keep, left = pre.to_install(wheels, "13.0")
    assert keep == [missing, cu13]
    assert sorted(left) == ["kvikio-cu12: for CUDA 12, torch has 13.0", "pytest: installed"]
    keep, left = pre.to_install(wheels, None)  # a CPU build of torch takes no CUDA build
    assert keep == [missing] and "kvikio-cu13: for CUDA 13, torch has no CUDA" in left
    site = tmp_path / "site"
    assert pre.install([missing], site) == "pip"
    env = dict(os.environ, PYTHONPATH=str(site))
    done = subprocess.run([sys.executable, "-c", "import bb_preflight_probe as m; print(m.VALUE)"],
                          capture_output=True, text=True, env=env, check=True)  # fmt: skip
    assert done.stdout.strip() == "from the wheel"
    assert not (site / "pytest_shadow").exists()


def test_a_missing_required_module_fails_the_preflight(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pre = _preflight()
    monkeypatch.setenv("BB_DEVICE_WHEELS", str(tmp_path / "none"))
    monkeypatch.setattr(pre, "REQUIRED", ["json", "bb_no_such_module"])
    monkeypatch.setattr(pre, "OPTIONAL", ["bb_no_such_option"])
    figures: dict[str, object] = {}
    assert pre.preflight(figures, None) is False
    assert list(figures["missing"]) == ["bb_no_such_module"]  # type: ignore[call-overload]
    assert "No module named" in figures["missing"]["bb_no_such_module"]  # type: ignore[index]
    assert list(figures["optional_missing"]) == ["bb_no_such_option"]  # type: ignore[call-overload]
    monkeypatch.setattr(pre, "REQUIRED", ["json", "storage.store", "gpu_check_runs"])
    assert pre.preflight({}, None) is True  # the repository and bench/ are on the path


def _listed(*args: str) -> list[str]:
    done = subprocess.run(["bash", str(WHEELS), *args, "--print"], capture_output=True,
                          text=True, check=True)  # fmt: skip
    return done.stdout.split()


def test_device_wheels_lists_what_the_gpu_image_lacks() -> None:
    subprocess.run(["bash", "-n", str(WHEELS)], check=True)
    both = _listed()
    names = {re.split(r"[=<>]", r)[0] for r in both}
    assert {"zarr", "numcodecs", "google-crc32c", "crc32c", "jsonargparse", "donfig",
            "typing-extensions", "transformers", "accelerate", "pytest", "kvikio-cu12",
            "libkvikio-cu12", "kvikio-cu13"} <= names  # fmt: skip
    assert not names & {"torch", "numpy", "lightning", "cupy-cuda12x"}  # never replaced, too big
    assert "zarr==3.1.6" in both
    # the pins agree with constraints.txt where it pins the same package
    pins = dict(r.split("==") for r in both if "==" in r)
    for line in (REPO / "constraints.txt").read_text().splitlines():
        if "==" in line and not line.startswith("#"):
            name, pinned = line.split("==")
            assert pins.get(name, pinned) == pinned, name
    assert [
        r for r in _listed("--cuda", "12") if "cu13" in r or r.startswith("nvidia-cufile==")
    ] == []
    done = subprocess.run(["bash", str(WHEELS), "--cuda", "11", "--print"], capture_output=True,
                          text=True, check=False)  # fmt: skip
    assert done.returncode == 2 and "must be 12 or 13" in done.stderr
    assert subprocess.run(["git", "check-ignore", "-q", ".device-wheels/x.whl"], cwd=REPO,
                          check=False).returncode == 0  # fmt: skip


def test_the_device_scripts_parse_and_pass_shellcheck_where_it_is_installed() -> None:
    scripts = [str(WHEELS), str(REPO / "scripts" / "gpu-check.sh")]
    for script in scripts:
        subprocess.run(["bash", "-n", script], check=True)
    if shutil.which("shellcheck") is None:
        pytest.skip("shellcheck is not installed")
    done = subprocess.run(["shellcheck", *scripts], capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stdout
