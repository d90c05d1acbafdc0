"""``bench/soak.py`` at smoke size: descriptors flat, no store record grows with the steps."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "soak.py"


@pytest.mark.slow
def test_soak_keeps_fds_and_store_records_flat(tmp_path: Path) -> None:
    env = dict(os.environ, BB_CACHE_DIR=str(tmp_path / "cache"), OMP_NUM_THREADS="1")
    # warm-up past the timer's first 64 steps (kept for its mean), then 30 steps more
    args = ["--steps", "100", "--warmup", "70", "--every", "30", "--layers", "2", "--seq", "32"]
    args += ["--batch", "2", "--nvme-dir", str(tmp_path)]
    done = subprocess.run(
        [sys.executable, str(SCRIPT), *args],
        capture_output=True, text=True, env=env, timeout=600, check=False,
    )  # fmt: skip
    out = done.stdout
    assert done.returncode == 0, out[-3000:] + done.stderr[-3000:]
    fds = re.search(r"open fds step 70: (\d+), step 100: (\d+)", out)
    assert fds is not None and fds.group(1) == fds.group(2), out
    tracked = re.search(r"containers tracked: (\d+) \((\d+) in the store\)", out)
    assert tracked is not None and int(tracked.group(2)) > 0, out  # the walk reaches the store
    assert not re.search(r"grew after warm-up: store", out), out
    grew = re.findall(r"grew after warm-up: (.*)", out)
    assert all("(at most" in line for line in grew), grew
    for verdict in ("fds flat", "store containers flat", "no unbounded container grew"):
        assert f"{verdict}: PASS" in out
    assert list(tmp_path.glob("bb-soak-*")) == []  # the store is removed at the end
