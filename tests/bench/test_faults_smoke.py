"""The kill campaigns of ``bench/faults.py`` at smoke size: nothing corrupt, lost or twice.

Only the reproducible kills run here (``--no-timed``: SIGKILL at I/O events of the
checkpoint phase drawn from the seed, and at points of the predictions writer), so the
counts asserted do not depend on the machine's speed.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "faults.py"


def _run(tmp_path: Path, *args: str) -> str:
    env = dict(os.environ, BB_CACHE_DIR=str(tmp_path / "cache"), OMP_NUM_THREADS="1")
    cmd = [sys.executable, str(SCRIPT), "--no-timed", "--dir", str(tmp_path), *args]
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600, check=False)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done.stdout


def _figure(pattern: str, text: str) -> int:
    match = re.search(pattern, text)
    assert match is not None, f"no line matching {pattern!r} in:\n{text}"
    return int(match.group(1))


@pytest.mark.slow
def test_killed_checkpoint_saves_leave_resumable_checkpoints(tmp_path: Path) -> None:
    out = _run(tmp_path, "--kills", "2", "--steps", "2", "--seed", "3")
    assert "machine: CPU" in out
    assert _figure(r"training: (\d+) kills", out) == 2
    assert _figure(r"(\d+) inside a checkpoint phase", out) == 2
    assert _figure(r"(\d+) resumed runs", out) >= 1
    assert _figure(r"(\d+) runs to the end", out) >= 1
    assert _figure(r"corrupt checkpoints (\d+)", out) == 0
    assert _figure(r"diverged runs (\d+)", out) == 0
    assert _figure(r"leftovers after recovery (\d+)", out) == 0
    assert _figure(r"stores left locked (\d+)", out) == 0
    assert out.rstrip().endswith("PASS")
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith("bb-faults-")] == []


@pytest.mark.slow
def test_killed_predict_writes_every_prompt_exactly_once(tmp_path: Path) -> None:
    out = _run(tmp_path, "--predict", "--kills", "3", "--seed", "1")
    assert _figure(r"predict: (\d+) kills", out) == 3
    assert _figure(r"\((\d+) complete outputs", out) >= 1
    assert _figure(r"prompts lost (\d+)", out) == 0
    assert _figure(r"written twice (\d+)", out) == 0
    assert _figure(r"tokens unlike the uninterrupted run (\d+)", out) == 0
    assert _figure(r"outputs over that bound: (\d+)", out) == 0
    assert out.rstrip().endswith("PASS")
