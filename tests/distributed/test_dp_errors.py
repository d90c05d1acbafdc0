"""What data-parallel runs refuse, with a ValueError that says why, and without hanging."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from bb_lightning import BalanceBeamStrategy

pytestmark = [pytest.mark.distributed]


def test_spawn_is_refused() -> None:
    with pytest.raises(ValueError, match="spawn"):
        BalanceBeamStrategy(start_method="spawn")  # type: ignore[arg-type]


@pytest.mark.slow
def test_unequal_initial_weights_are_refused(runs: Any, tmp_path: Path) -> None:
    # random weights from the same seed on both ranks, then rank 1 changes one in block 1
    run = runs.unchecked(tmp_path, "--devices", "2", "--accum", "2", "--from-config", "--perturb")
    assert run.returncode != 0
    assert "ValueError" in run.stderr and "initial weights differ" in run.stderr
    message = run.stderr[run.stderr.index("initial weights differ") :].splitlines()[0]
    assert "layers.1" in message and "layers.0" not in message, message


@pytest.mark.slow
def test_checkpoint_directory_every_rank_cannot_see_is_refused(runs: Any, tmp_path: Path) -> None:
    # ``here`` is a link to the cwd of whichever process follows it, and each rank moves
    # to a directory of its own before saving: one path string, two directories
    out = tmp_path / "not-shared"
    for rank in (0, 1):
        (out / "cwd" / f"rank{rank}").mkdir(parents=True)
    os.symlink("/proc/self/cwd", out / "here")
    run = runs.unchecked(
        tmp_path, "--devices", "2", "--accum", "2", "--steps", "1",
        "--chdir", str(out / "cwd"), "--ckpt", str(out / "here" / "ckpt"),
    )  # fmt: skip
    assert run.returncode != 0
    assert "ValueError" in run.stderr and "not visible" in run.stderr, run.stderr[-3000:]
    assert not any(Path(out / "cwd" / "rank1").iterdir())  # rank 1 wrote nothing there


@pytest.mark.slow
def test_an_error_on_one_rank_ends_every_rank_without_waiting_for_the_timeout(
    runs: Any, tmp_path: Path
) -> None:
    # the collectives' timeout is 60 s: a rank left waiting in one would print "Timed out"
    run = runs.unchecked(
        tmp_path, "--devices", "2", "--accum", "2", "--raise-at", "1", "--pg-timeout", "60"
    )
    assert run.returncode != 0
    assert "the user's training_step fails at step 1" in run.stderr
    assert "Timed out" not in run.stderr and "timed out" not in run.stderr, run.stderr[-3000:]


@pytest.mark.slow
def test_a_checkpoint_directory_rank_0_cannot_create_is_refused_on_every_rank(
    runs: Any, tmp_path: Path
) -> None:
    out = tmp_path / "unwritable"
    out.mkdir(parents=True)
    (out / "a-file").write_text("not a directory\n")
    run = runs.unchecked(
        tmp_path, "--devices", "2", "--accum", "2", "--steps", "1", "--pg-timeout", "60",
        "--ckpt", str(out / "a-file" / "ckpt"),
    )  # fmt: skip
    assert run.returncode != 0
    lines = [line for line in run.stderr.splitlines() if "cannot be created or written" in line]
    assert any("[rank0]" in line for line in lines) and any("[rank1]" in line for line in lines)
    assert "Timed out" not in run.stderr, run.stderr[-3000:]
