"""The MoE bulk-generation benchmark runs as a script at tiny sizes and prints its ratio lines."""

from __future__ import annotations

import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench" / "predict_moe.py"
TINY = ["--hidden", "64", "--layers", "2", "--ffn", "64", "--experts", "4", "--top-k", "2"]
TINY += ["--heads", "4", "--kv-heads", "2", "--vocab", "256", "--prompts", "4"]
TINY += ["--prompt-len", "8", "--new-tokens", "3", "--hf-batches", "2,4"]
TINY += ["--measure-seconds", "0.5"]


def _number(pattern: str, text: str) -> float:
    match = re.search(pattern, text)
    assert match is not None, f"no line matching {pattern!r} in:\n{text}"
    value = float(match.group(1))
    assert math.isfinite(value) and value >= 0, match.group(0)
    return value


@pytest.mark.slow
def test_predict_moe_prints_ratios(tmp_path: Path) -> None:
    env = dict(os.environ, BB_CACHE_DIR=str(tmp_path / "cache"), OMP_NUM_THREADS="1")
    cmd = [sys.executable, str(BENCH), *TINY, "--nvme-dir", str(tmp_path / "nvme")]
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300, check=False)
    out = done.stdout
    assert done.returncode == 0, out[-3000:] + done.stderr[-3000:]
    assert "machine: CPU" in out and "plan: predict" in out
    assert "MoE: top-2 of 4 experts per block" in out
    ours = _number(r"\[ours\] NVMe weights, batch \d+: ([\d.]+) tokens/s", out)
    assert _number(r"tier: ([\d.]+) MB\)", out) > 0  # the blocks were written to NVMe
    hf = {int(b): float(v) for b, v in re.findall(r"in memory, batch (\d+): ([\d.]+)", out)}
    assert set(hf) >= {2, 4}
    best = max((2, 4), key=lambda b: hf[b])
    ratio = _number(rf"ratio ours / hf generate \(best, batch {best}\) = ([\d.]+)", out)
    assert ratio == pytest.approx(ours / hf[best], rel=0.01, abs=0.006)
    predicted = _number(r"\[plan\] predicted: ([\d.]+) tokens/s", out)
    measured = _number(r"measured / predicted = ([\d.]+)", out)
    assert measured == pytest.approx(ours / predicted, rel=0.01, abs=0.006)
    _number(r"\(bf16\): ([\d.]+)% of \d+", out)
