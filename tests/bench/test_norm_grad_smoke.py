"""The RMS norm and gated-MLP backward benchmark runs as a script at a tiny size and prints
its lines."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from bb_lightning.engine import host_norm

BENCH = Path(__file__).resolve().parents[2] / "bench" / "norm_grad.py"


def test_norm_grad_bench_prints_both_backwards_and_their_ratio(tmp_path: Path) -> None:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    figures = tmp_path / "figures.json"
    done = subprocess.run(
        [sys.executable, str(BENCH), "--shapes", "40x96", "--mlp-shapes", "40x100",
         "--seconds", "0.01", "--json", str(figures)],
        capture_output=True, text=True, env=env, timeout=120, check=False,
    )  # fmt: skip
    out = done.stdout
    assert done.returncode == 0, out[-3000:] + done.stderr[-3000:]
    assert "machine: CPU" in out
    written = json.loads(figures.read_text())
    if host_norm.kernel() is None:
        assert "no host kernels here" in out and written["figures"]["kernel"] is False
        pytest.skip("no host kernels: the benchmark times nothing")
    found = re.findall(r"40x96: .* autograd / kernel = ([\d.]+); error against float64", out)
    assert len(found) == 1, out
    entry = written["figures"]["shapes"]["40x96"]
    assert float(found[0]) == pytest.approx(entry["speedup"], abs=0.006)
    for ours, theirs in entry["errors"].values():
        assert ours <= 1.25 * theirs  # as close to float64 as autograd's backward
    found = re.findall(r"mlp 40x100: .* autograd / kernels = ([\d.]+); error against", out)
    assert len(found) == 1, out
    entry = written["figures"]["mlp"]["40x100"]
    assert float(found[0]) == pytest.approx(entry["speedup"], abs=0.006)
    (dgate, dgate_autograd), (dup, dup_autograd) = entry["errors"].values()
    assert dgate <= dgate_autograd and dup == dup_autograd  # the up projection's is torch's
