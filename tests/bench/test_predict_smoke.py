"""The bulk-generation benchmark runs as a script at tiny sizes and prints its ratio lines."""

from __future__ import annotations

import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench" / "predict_offload.py"
TINY = ["--hidden", "64", "--layers", "2", "--ffn", "128", "--heads", "4", "--vocab", "256"]
TINY += ["--prompts", "4", "--prompt-len", "8", "--new-tokens", "3", "--hf-batches", "2,4"]
TINY += ["--acc-batches", "4", "--check-prompts", "2", "--measure-seconds", "0.5"]


def _number(pattern: str, text: str) -> float:
    match = re.search(pattern, text)
    assert match is not None, f"no line matching {pattern!r} in:\n{text}"
    value = float(match.group(1))
    assert math.isfinite(value) and value >= 0, match.group(0)
    return value


@pytest.mark.slow
def test_predict_offload_prints_ratios(tmp_path: Path) -> None:
    env = dict(os.environ, BB_CACHE_DIR=str(tmp_path / "cache"), OMP_NUM_THREADS="1")
    cmd = [sys.executable, str(BENCH), *TINY, "--nvme-dir", str(tmp_path / "nvme"), "--busy-probe"]
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300, check=False)
    out = done.stdout
    assert done.returncode == 0, out[-3000:] + done.stderr[-3000:]
    assert "machine: CPU" in out and "plan: predict" in out
    assert out.index("busy neighbour stopped") < out.index("[ours] NVMe weights")
    ours = _number(r"\[ours\] NVMe weights, batch \d+: ([\d.]+) tokens/s", out)
    hf = {int(b): float(v) for b, v in re.findall(r"in memory, batch (\d+): ([\d.]+)", out)}
    assert set(hf) >= {2, 4}
    best = max((2, 4), key=lambda b: hf[b])
    ratio = _number(rf"ratio ours / hf generate \(best, batch {best}\) = ([\d.]+)", out)
    assert ratio == pytest.approx(ours / hf[best], rel=0.01, abs=0.006)
    for cache in ("cold", "warm"):
        pattern = rf"ratio ours / accelerate disk offload \({cache} page cache; best, batch 4\) = "
        _number(pattern + r"([\d.]+)", out)
    for label in ("matrix-product probe", "model-shaped probe"):
        _number(rf"\[plan\] predicted \({label}\): ([\d.]+) tokens/s", out)
    assert "[plan] model-shaped predict probe: one block" in out
    floor = _number(r"-> at most ([\d.]+) tokens/s", out)
    reached = _number(r"ours reaches (\d+)% of it", out)
    assert reached == pytest.approx(100 * ours / floor, abs=1)
    _number(r"prefill ([\d.]+) s \+ decode", out)
    # the products-alone bound: 4 prompts x 3 tokens over its seconds, as a share of the floor
    bound = re.search(r"\[bound\] .* = ([\d.e+-]+) s: (\d+)% of the floor", out)
    assert bound is not None, out
    seconds, share = float(bound.group(1)), int(bound.group(2))
    assert seconds > 0 and share == pytest.approx(100 * 4 * 3 / seconds / floor, rel=0.01, abs=1)
    # greedy fp32 tokens equal in-memory generate's on the same batch shape
    assert _number(r"\(fp32\): ([\d.]+)% of 2", out) == 100.0


@pytest.mark.slow
def test_predict_offload_fp32_computes_every_run_in_fp32(tmp_path: Path) -> None:
    """``--dtype fp32``: ours plans and runs in fp32 from the bf16 checkpoint, and its tokens
    equal in-memory fp32 ``generate``'s at the same batch (the ratio run itself)."""
    env = dict(os.environ, BB_CACHE_DIR=str(tmp_path / "cache"), OMP_NUM_THREADS="1")
    tiny = [a if a != "2,4" else "4" for a in TINY]
    cmd = [sys.executable, str(BENCH), *tiny, "--acc-batches", "", "--batch", "4"]
    cmd += ["--dtype", "fp32", "--nvme-dir", str(tmp_path / "nvme")]
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300, check=False)
    out = done.stdout
    assert done.returncode == 0, out[-3000:] + done.stderr[-3000:]
    assert "bf16 checkpoint" in out and "fp32 compute" in out
    assert "compute in float32" in out  # the plan in force
    assert _number(r"at batch 4 \(fp32\): ([\d.]+)% of 4", out) == 100.0
    assert "(bf16)" not in out  # no bf16 run, no separate fp32 check
    assert re.search(r"block FLOPs at [\d.e+-]+ TFLOP/s in fp32", out)
    floor = _number(r"-> at most ([\d.]+) tokens/s", out)
    ours = _number(r"\[ours\] NVMe weights, batch 4: ([\d.]+) tokens/s", out)
    assert _number(r"ours reaches (\d+)% of it", out) == pytest.approx(100 * ours / floor, abs=1)


@pytest.mark.slow
def test_predict_offload_spills_the_host_kv_cache_to_nvme(tmp_path: Path) -> None:
    """``--decode-attention host`` with too little memory for the plan's batch: the last
    blocks' KV cache homes on NVMe, and ``--ram-batch`` runs the largest batch that keeps it
    in memory, each with its prediction."""
    env = dict(os.environ, BB_CACHE_DIR=str(tmp_path / "cache"), OMP_NUM_THREADS="1")
    cmd = [sys.executable, str(BENCH), *TINY, "--nvme-dir", str(tmp_path / "nvme")]
    cmd += ["--acc-batches", "", "--hf-batches", "16"]
    cmd += ["--prompts", "16", "--prompt-len", "256", "--new-tokens", "4", "--batch", "16"]
    cmd += ["--check-prompts", "0", "--decode-attention", "host", "--ram-batch"]
    cmd += ["--host-memory-gib", "0.002", "--device-memory-gib", "1.118"]  # 8.8 MiB in all
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300, check=False)
    out = done.stdout
    assert done.returncode == 0, out[-3000:] + done.stderr[-3000:]
    spilled = re.search(r"KV cache on host, the last (\d+) blocks' on NVMe", out)
    assert spilled is not None and int(spilled.group(1)) >= 1, out
    ours = _number(r"\[ours\] NVMe weights, batch \d+: ([\d.]+) tokens/s", out)
    ram = _number(r"\[ram batch\] batch \d+, KV cache in memory: ([\d.]+) tokens/s", out)
    ratio = _number(r"with the cache spilled / this = ([\d.]+)", out)
    assert ratio == pytest.approx(ours / ram, rel=0.02, abs=0.006)
    _number(r"\[ram batch\] .*measured / predicted = ([\d.]+)", out)
