"""The matrix-tile product benchmark runs as a script at tiny sizes and prints its lines."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from bb_lightning.engine import host_linear

BENCH = Path(__file__).resolve().parents[2] / "bench" / "host_linear.py"


def test_host_linear_bench_prints_both_times_and_their_ratio(tmp_path: Path) -> None:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    figures = tmp_path / "figures.json"
    done = subprocess.run(
        [sys.executable, str(BENCH), "--rows", "1,33", "--shapes", "64x96", "--weights", "2",
         "--seconds", "0.01", "--json", str(figures)],
        capture_output=True, text=True, env=env, timeout=120, check=False,
    )  # fmt: skip
    out = done.stdout
    assert done.returncode == 0, out[-3000:] + done.stderr[-3000:]
    assert "machine: CPU" in out
    written = json.loads(figures.read_text())
    if host_linear.kernel() is None:
        assert "no bf16 matrix tiles or vector pair products here" in out
        assert written["figures"]["kernel"] is False
        pytest.skip("no compiled product here: the benchmark times nothing")
    line = r"64 x 96, (\d+) rows: torch \d+ us, kernel \d+ us, torch / kernel = ([\d.]+)"
    found = re.findall(line, out)
    assert [int(m[0]) for m in found] == [1, 33], out
    products = written["figures"]["products"]
    for m, ratio in found:
        entry = products[f"64x96x{m}"]
        assert entry["speedup"] == pytest.approx(entry["torch_us"] / entry["kernel_us"])
        assert float(ratio) == pytest.approx(entry["speedup"], abs=0.006)  # printed rounded
        assert entry["equal_share"] > 0.9  # 64-term sums: the two orders rarely round apart
