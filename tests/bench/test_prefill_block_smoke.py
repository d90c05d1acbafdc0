"""The prefill block benchmark runs as a script at tiny sizes and prints its lines."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from bb_lightning.engine import host_linear, host_norm

BENCH = Path(__file__).resolve().parents[2] / "bench" / "prefill_block.py"


def test_prefill_block_bench_prints_each_time_and_their_ratio(tmp_path: Path) -> None:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    figures = tmp_path / "figures.json"
    done = subprocess.run(
        [sys.executable, str(BENCH), "--prompts", "2", "--tokens", "8", "--hidden", "64",
         "--ffn", "96", "--heads", "2", "--seconds", "0.01", "--json", str(figures)],
        capture_output=True, text=True, env=env, timeout=120, check=False,
    )  # fmt: skip
    out = done.stdout
    assert done.returncode == 0, out[-3000:] + done.stderr[-3000:]
    assert "machine: CPU" in out
    written = json.loads(figures.read_text())["figures"]
    if host_norm.kernel() is None:
        assert "did not build" in out and written["kernels"] is False
        pytest.skip("no host kernels: the benchmark times nothing")
    tiles = host_linear.attention_kernel() is not None
    names = ["block", "MLP's SiLU and product"] + (["attention"] if tiles else [])
    for name in names:
        found = re.search(
            re.escape(name)
            + r": torch ([\d.]+) ms, kernels ([\d.]+) ms, torch / kernels = ([\d.]+)",
            out,
        )
        assert found is not None, out
        entry = written[name]
        assert entry["ratio"] == pytest.approx(entry["torch_ms"] / entry["kernels_ms"])
    assert "norms_rotary_ms" in written["block"]
    assert ("attention" in written) == tiles
    assert 0.5 <= written["equal"] <= 1.0  # the norms' and the tiles' roundings aside, torch's
