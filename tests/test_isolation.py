"""The suite leaves the user's files alone: the probes' caches (hardware profiles, model
rates) go to a directory of this pytest run, in this process and in those it starts."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from bb_lightning.probe import rate_cache
from bb_lightning.probe.measure import cache_dir


def test_the_probe_caches_live_in_this_runs_temporary_directory(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    base = tmp_path_factory.getbasetemp()
    run = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base
    assert cache_dir() == run / "bb-cache"
    assert not cache_dir().is_relative_to(Path.home() / ".cache")
    assert rate_cache._path().parent == cache_dir()
    code = "from bb_lightning.probe.measure import cache_dir; print(cache_dir())"
    child = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=300
    )
    assert child.stdout.strip() == str(cache_dir())
