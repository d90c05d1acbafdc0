"""The attention backward benchmark runs as a script at a tiny size and prints its lines."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from bb_lightning.engine import host_linear

BENCH = Path(__file__).resolve().parents[2] / "bench" / "attention_grad.py"


def test_attention_grad_bench_prints_both_backwards_and_their_ratio(tmp_path: Path) -> None:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    figures = tmp_path / "figures.json"
    done = subprocess.run(
        [sys.executable, str(BENCH), "--shapes", "1x2x40x32", "--seconds", "0.01",
         "--json", str(figures)],
        capture_output=True, text=True, env=env, timeout=120, check=False,
    )  # fmt: skip
    out = done.stdout
    assert done.returncode == 0, out[-3000:] + done.stderr[-3000:]
    assert "machine: CPU" in out
    written = json.loads(figures.read_text())
    kern = host_linear.attention_kernel()
    if kern is None:
        assert "neither bf16 matrix tiles" in out and written["figures"]["kernel"] is False
        pytest.skip("no compiled attention backward: the benchmark times nothing")
    assert f"products run on the {'matrix tiles' if kern.tiles else 'vectors'}" in out
    found = re.findall(
        r"1x2x40x32: .* torch / kernel = ([\d.]+), forwards ([\d.]+); .* "
        r"backwards torch / kernel = ([\d.]+); error against float64",
        out,
    )
    assert len(found) == 1, out
    entry = written["figures"]["shapes"]["1x2x40x32"]
    for shown, key in zip(
        found[0], ("speedup", "forward_speedup", "backward_speedup"), strict=True
    ):
        assert float(shown) == pytest.approx(entry[key], abs=0.006)
    assert set(entry["errors"]) == {"out", "dq", "dk", "dv"}
    for ours, theirs in entry["errors"].values():
        assert ours <= 1.25 * theirs  # as close to float64 as torch's
