"""measure() on this machine: sane figures, a per-machine cache, and its key."""

from __future__ import annotations

import importlib
import json
import math
import os
import shutil
import tempfile
from pathlib import Path

import psutil
import pytest
import torch

from bb_lightning.probe import contention
from bb_lightning.probe.measure import cache_path, machine_identity, measure

measure_module = importlib.import_module("bb_lightning.probe.measure")


@pytest.fixture(autouse=True)
def cache_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    root = tmp_path / "cache"
    monkeypatch.setenv("BB_CACHE_DIR", str(root))
    # these tests check the cache on a possibly shared machine: a profile is cached however
    # steady its rounds are (test_probe_contention.py checks the rounds)
    for name in ("SPREAD", "DISK_SPREAD", "BUSY_SHARE"):
        monkeypatch.setattr(contention, name, float("inf"))
    return root


def test_measure_is_sane_and_cached(
    tmp_path: Path, cache_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    disk = tmp_path / "nvme"
    disk.mkdir()
    first = measure(nvme_path=str(disk), max_seconds=2.0)
    assert first.device_type == ("cuda" if torch.cuda.is_available() else "cpu")
    assert 1e9 < first.device_flops < 1e16
    assert 1e8 < first.h2d_bandwidth < 1e12 and 1e8 < first.d2h_bandwidth < 1e12
    assert 1e8 < first.device_memory_bandwidth < 1e13
    assert 1e6 < first.nvme_read_bandwidth < 1e11 and 1e6 < first.nvme_write_bandwidth < 1e11
    assert 1e6 < first.host_adam_params_per_s < 1e11
    # a figure of timings, which a busy machine may make anything from 0 up (its formula:
    # test_the_disk_probe_prices_the_cpu_seconds_per_byte_moved, on a scripted clock)
    assert math.isfinite(first.nvme_cpu_seconds_per_byte) and first.nvme_cpu_seconds_per_byte >= 0
    assert first.nvme_capacity == pytest.approx(shutil.disk_usage(disk).free, rel=0.05)
    total_ram = psutil.virtual_memory().total
    assert 0 < first.host_memory < total_ram and 0 < first.device_memory
    assert first.cores == len(os.sched_getaffinity(0))
    assert list(disk.iterdir()) == []  # probe files removed

    def no_measuring(*args: object) -> None:
        raise AssertionError("a cached profile was measured again")

    monkeypatch.setattr(measure_module, "_measure_now", no_measuring)
    second = measure(nvme_path=str(disk), max_seconds=2.0)  # from the cache, not measured
    assert second.nvme_capacity == pytest.approx(shutil.disk_usage(disk).free, rel=0.05)
    assert second.replace(nvme_capacity=first.nvme_capacity) == first
    path = cache_path(machine_identity(str(disk)))
    assert path.parent == cache_dir
    assert cached_profile_dict(path) == first.to_dict()


def cached_profile_dict(path: Path) -> dict[str, object]:
    return json.loads(path.read_text())["profile"]


def test_without_nvme_and_cache_refresh(cache_dir: Path) -> None:
    p = measure(max_seconds=1.0, cache=False)
    assert p.nvme_read_bandwidth == p.nvme_write_bandwidth == 0.0 and p.nvme_capacity == 0
    path = cache_path(machine_identity(None))
    data = json.loads(path.read_text())
    data["profile"]["cores"] = p.cores + 1  # a marker the rewrite replaces
    path.write_text(json.dumps(data))
    measure(max_seconds=1.0, cache=False)  # measures again and rewrites the cache
    assert cached_profile_dict(path)["cores"] == p.cores


def test_a_cache_of_an_older_layout_is_measured_again(cache_dir: Path) -> None:
    first = measure(max_seconds=1.0, cache=False)
    path = cache_path(machine_identity(None))
    data = json.loads(path.read_text())
    del data["profile"]["device_memory_bandwidth"]  # written before that field existed
    data["profile"]["cores"] = first.cores + 1  # a marker: a profile read back would keep it
    path.write_text(json.dumps(data))
    again = measure(max_seconds=1.0)
    assert again.cores == first.cores and again.device_memory_bandwidth > 0
    assert set(cached_profile_dict(path)) == set(first.to_dict())


def test_cache_key(tmp_path: Path, cache_dir: Path) -> None:
    a = machine_identity(str(tmp_path))
    assert machine_identity(str(tmp_path)) == a
    assert set(a) == {"probes", "hostname", "cpu", "gpu", "nvme_filesystem"}
    path = cache_path(a)
    assert path.parent == cache_dir
    assert path.name.startswith("hardware-") and path.suffix == ".json"
    assert cache_path(dict(a)) == path
    assert cache_path(a | {"nvme_filesystem": "259:1 /mnt/nvme"}) != path
    assert cache_path(a | {"gpu": "NVIDIA H200"}) != path
    assert cache_path(a | {"probes": "1"}) != path  # a profile of earlier probes is not reused
    assert cache_path(a | {"hostname": "other"}).name.startswith("hardware-other-")


def test_a_directory_on_the_same_filesystem_reuses_the_profile(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    first_dir, other_dir = tmp_path / "run1" / "nvme", tmp_path / "run2" / "nvme"
    first_dir.mkdir(parents=True)
    other_dir.mkdir(parents=True)
    stat = os.stat(tmp_path)
    # the key names the filesystem as the kernel does: device number and mount point
    device, mount = machine_identity(str(other_dir))["nvme_filesystem"].split(" ", 1)
    assert device == f"{os.major(stat.st_dev)}:{os.minor(stat.st_dev)}"
    assert os.path.ismount(mount) and str(other_dir.resolve()).startswith(mount)
    first = measure(nvme_path=str(first_dir), max_seconds=1.0)

    def no_measuring(*args: object) -> None:
        raise AssertionError("a profile of the same filesystem was measured again")

    monkeypatch.setattr(measure_module, "_measure_now", no_measuring)
    reused = measure(nvme_path=str(other_dir), max_seconds=1.0)
    assert reused.nvme_read_bandwidth == first.nvme_read_bandwidth > 0
    assert reused.nvme_capacity == pytest.approx(shutil.disk_usage(other_dir).free, rel=0.05)
    shm = Path("/dev/shm")
    if shm.is_dir() and os.stat(shm).st_dev != stat.st_dev:  # another filesystem: measured
        with tempfile.TemporaryDirectory(dir=shm) as elsewhere:
            with pytest.raises(AssertionError, match="measured again"):
                measure(nvme_path=elsewhere, max_seconds=1.0)


def test_bad_arguments(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="max_seconds = 0"):
        measure(max_seconds=0)
    with pytest.raises(ValueError, match="is not a directory"):
        measure(nvme_path=str(tmp_path / "missing"))


def test_the_disk_probe_prices_the_cpu_seconds_per_byte_moved(tmp_path: Path) -> None:
    """The process's CPU seconds over the writes and the reads (a scripted clock: 0.5 s
    over the writes, 0.25 s over the reads), per byte written and read."""
    ticks = iter([10.0, 10.5, 20.0, 20.25])
    _, _, _, per_byte = measure_module._probe_nvme(
        str(tmp_path), 0.01, cpu_clock=lambda: next(ticks)
    )
    moved = measure_module._NVME_MIN_BYTES  # 0.01 s of probe: the least it moves, 4 files
    assert per_byte == pytest.approx(0.75 / (2 * moved), rel=1e-12)
    assert next(ticks, None) is None  # read once before and after each
    assert list(tmp_path.iterdir()) == []
