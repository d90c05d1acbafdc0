"""The data-parallel benchmark runs as a script at a tiny size and prints its lines."""

from __future__ import annotations

import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"


def _number(pattern: str, text: str) -> float:
    match = re.search(pattern, text)
    assert match is not None, f"no line matching {pattern!r} in:\n{text}"
    value = float(match.group(1))
    assert math.isfinite(value) and value > 0, match.group(0)
    return value


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs 2 cores")
def test_data_parallel_smoke_prints_both_runs(tmp_path: Path) -> None:
    env = dict(os.environ, BB_CACHE_DIR=str(tmp_path / "cache"), OMP_NUM_THREADS="1")
    cmd = [sys.executable, str(BENCH / "data_parallel.py"), "--smoke"]
    cmd += ["--nvme-dir", str(tmp_path / "nvme")]
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300, check=False)
    out = done.stdout
    assert done.returncode == 0, out[-3000:] + done.stderr[-3000:]
    assert "machine: CPU" in out and "model: Llama" in out
    one = _number(
        r"\[1 process x 2 threads\] micro-batch 1 x accumulation 4 x seq 32: ([\d.]+)", out
    )
    two = _number(
        r"\[2 ranks x 1 thread\] micro-batch 1 x accumulation 2 per rank .*: ([\d.]+)", out
    )
    ratio = _number(r"ratio 2 ranks / 1 process = ([\d.]+)", out)
    assert ratio == pytest.approx(two / one, rel=0.01, abs=0.006)
    _number(r"network per step, one rank: ([\d.e+-]+) MB sent in the ring", out)
    _number(r"; ([\d.e+-]+) MB handed to the collectives", out)  # ShardComm.bytes_sent
    _number(r"gloo all-reduce probe ([\d.e+-]+) GB/s", out)
    for name in (r"1 process x 2 threads", r"2 ranks x 1 thread"):
        _number(rf"\[{name}\] planner predicted ([\d.e+-]+) s/step", out)
        _number(rf"\[{name}\] .*measured / predicted = ([\d.]+)", out)
