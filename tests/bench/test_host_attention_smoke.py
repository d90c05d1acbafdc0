"""The host decode-attention benchmark runs as a script at tiny sizes and prints its lines."""

from __future__ import annotations

import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench" / "host_attention.py"
TINY = ["--seqs", "2,3", "--positions", "16,40", "--heads", "4", "--kv-heads", "2"]
TINY += ["--head-dim", "16", "--seconds", "0.01", "--dtype", "fp32"]


def _numbers(pattern: str, text: str) -> list[tuple[float, ...]]:
    matches = [(m,) if isinstance(m, str) else m for m in re.findall(pattern, text)]
    found = [tuple(float(x) for x in m) for m in matches]
    assert found, f"no line matching {pattern!r} in:\n{text}"
    assert all(math.isfinite(x) and x >= 0 for row in found for x in row), found
    return found


def test_host_attention_bench_prints_rates_and_the_price(tmp_path: Path) -> None:
    env = dict(os.environ, BB_CACHE_DIR=str(tmp_path / "cache"), OMP_NUM_THREADS="1")
    done = subprocess.run(
        [sys.executable, str(BENCH), *TINY], capture_output=True, text=True, env=env,
        timeout=120, check=False,
    )  # fmt: skip
    out = done.stdout
    assert done.returncode == 0, out[-3000:] + done.stderr[-3000:]
    assert "machine: CPU" in out
    assert "decode attention: the compiled kernel, beside torch's products" in out
    (read,) = _numbers(r"probe: host memory read ([\d.]+) GB/s", out)
    ((attend_rate, priced),) = _numbers(
        r"probe: host decode attention ([\d.]+) GB/s .*priced at ([\d.]+) GB/s", out
    )
    assert priced == pytest.approx(min(read[0], attend_rate), abs=2e-3)  # the lesser
    # the engine's decode attention equals torch's sdpa on the first size (fp32)
    ((diff,),) = _numbers(r"max abs diff ([\d.e+-]+)", out)
    assert diff < 1e-5
    rows = _numbers(
        r"(\d+) seqs x (\d+) positions \(([\d.]+) MiB\): attention ([\d.]+) GB/s "
        r"\((?:vector products [\d.]+ GB/s, )?torch's products [\d.]+ GB/s\), plain read "
        r"([\d.]+) GB/s, attention / read = ([\d.]+); predicted ([\d.e+-]+) ms, "
        r"measured ([\d.e+-]+) ms, "
        r"measured / predicted = ([\d.]+)",
        out,
    )
    assert [(r[0], r[1]) for r in rows] == [(2, 16), (2, 40), (3, 16), (3, 40)]
    for seqs, pos, mib, attend, read, ratio, predicted, measured, over in rows:
        cache = 2 * seqs * 2 * pos * 16 * 4  # keys and values, fp32
        assert mib == pytest.approx(cache / 2**20, abs=0.06)
        # the price: the cache's bytes over the probe's priced rate (as printed, 3 digits)
        assert predicted == pytest.approx(cache / (priced * 1e9) * 1e3, rel=2e-3)
        assert ratio == pytest.approx(attend / read, rel=0.02, abs=0.002)
        assert over == pytest.approx(measured / predicted, rel=0.02, abs=0.002)
