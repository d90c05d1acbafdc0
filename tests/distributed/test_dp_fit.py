"""Data-parallel training on 2 CPU ranks (gloo) equals one process at the same global batch.

``devices=2`` with 2 micro-batches per rank against ``devices=1`` with 4, micro-batch 2
(8 rows per optimizer step), 3 steps of AdamW (weight decay 0.1, constant lr): the fp32
masters and both AdamW moments, read back from the checkpoint with plain zarr, the
per-step mean losses and the step counts agree. The micro-batches are the same rows in
both runs (``dp_run.StridedSteps``), so the only difference is where the sums happen.
The clipped cases clip at 0.5, below the initial gradient norm (about 0.9), so that the
clip changes the update.

Weights and state on the host without clipping (the optimizer step overlapped with
backward) and on NVMe with clipping (the whole step after backward) run 3 steps at both
world sizes; the two other combinations run 2-rank steps in the resume tests, which
compare a run resumed at the other world size with the uninterrupted one-process run.
The one-process runs themselves train as plain Lightning with ``torch.optim.AdamW``.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

KINDS = ("master", "exp_avg", "exp_avg_sq")
CLIP = ("--clip", "0.5")
CASES: dict[str, tuple[str, ...]] = {
    "host": ("--tier", "host", "--validate"),
    "nvme-clip": ("--tier", "nvme", *CLIP),
    "host-clip": ("--tier", "host", *CLIP),
    "nvme": ("--tier", "nvme"),
}
EQUIVALENCE = ("host", "nvme-clip")
"""The cases run 3 steps at both world sizes; ``host-clip`` and ``nvme`` run 2-rank steps
in the resume tests."""


def assert_same_training(got: Any, want: Any, steps: int = 3) -> None:
    """Equal step counts, per-step mean losses and each step's micro-batch losses (rtol
    1e-5), and state (rtol 1e-5, atol 1e-6)."""
    assert got.result()["step"] == want.result()["step"] == steps
    got_losses, want_losses = got.losses(), want.losses()
    assert sorted(got_losses) == sorted(want_losses)
    for step, values in want_losses.items():
        assert len(got_losses[step]) == len(values), step  # micro-batches of the step
        mean = torch.tensor(got_losses[step]).mean()
        torch.testing.assert_close(mean, torch.tensor(values).mean(), rtol=1e-5, atol=0, msg=step)
        # the same rows in the same micro-batches: the same losses, whichever rank ran them
        torch.testing.assert_close(
            torch.tensor(sorted(got_losses[step])), torch.tensor(sorted(values)), rtol=1e-5, atol=0
        )
    got_state, want_state = got.state(), want.state()
    for kind in KINDS:
        assert got_state[kind].keys() == want_state[kind].keys(), kind
        for name, value in want_state[kind].items():
            torch.testing.assert_close(
                got_state[kind][name], value, rtol=1e-5, atol=1e-6, msg=f"{kind} {name}"
            )


def _moved(run: Any, initial: dict[str, Any]) -> float:
    """Largest change of any master weight from its initial value."""
    masters = run.state()["master"]
    return max(float((masters[k] - v).abs().max()) for k, v in initial.items())


@pytest.mark.parametrize("case", EQUIVALENCE)
def test_two_ranks_equal_one_process(runs: Any, case: str) -> None:
    one = runs.fit(1, 4, *CASES[case])
    two = runs.fit(2, 2, *CASES[case])
    assert two.result()["world_size"] == two.result()["saved_by"] == 2
    assert one.result()["saved_by"] == 1
    assert two.loss_files() == ["losses.rank0.json", "losses.rank1.json"]
    assert [len(v) for v in two.losses().values()] == [4, 4, 4]
    assert_same_training(two, one)
    # both ranks destroyed the process group before the interpreter's teardown
    exits = [json.loads(p.read_text()) for p in sorted(two.out.glob("exit.*.json"))]
    assert exits == [{"group_alive": False}] * 2
    # every parameter is trained (named as in the module: its HF model is ``model``)
    initial = {f"model.{k}": v for k, v in load_file(runs.model / "model.safetensors").items()}
    assert set(initial) == set(one.state()["master"])
    assert _moved(one, initial) > 1e-4  # three steps moved the weights


@pytest.mark.parametrize("case", EQUIVALENCE)
def test_one_process_equals_plain_lightning(runs: Any, case: str) -> None:
    """The reference of the 2-rank runs trains as plain Lightning with torch AdamW."""
    one = runs.fit(1, 4, *CASES[case])
    plain = runs.fit(1, 4, "--plain", *CASES[case][2:])  # the clip, if any
    assert_like_plain(one, plain)


@pytest.mark.parametrize("case", ["host", "nvme-clip"])
def test_a_user_s_own_module_trains_on_two_ranks_as_plain_lightning(runs: Any, case: str) -> None:
    """A LightningModule of the user's (a Hugging Face model loaded in ``__init__``, its
    own ``training_step`` and ``torch.optim.AdamW``): 2 ranks equal 1, which equals plain
    Lightning."""
    one = runs.fit(1, 4, *CASES[case], "--user-module")
    two = runs.fit(2, 2, *CASES[case], "--user-module")
    assert_same_training(two, one)
    plain = runs.fit(1, 4, "--plain", "--user-module", *CASES[case][2:])
    assert_like_plain(one, plain)


def assert_like_plain(one: Any, plain: Any) -> None:
    """A one-process run against plain Lightning: losses (rtol 1e-5), masters (rtol 1e-5,
    atol 1e-6) and moments (rtol 1e-4, atol 1e-9)."""
    assert one.losses().keys() == plain.losses().keys()
    for step, values in plain.losses().items():
        torch.testing.assert_close(
            torch.tensor(one.losses()[step]), torch.tensor(values), rtol=1e-5, atol=0
        )
    got, want = one.state(), plain.state()
    assert got["master"].keys() == want["master"].keys()
    for name, value in want["master"].items():
        torch.testing.assert_close(got["master"][name], value, rtol=1e-5, atol=1e-6, msg=name)
        for kind in ("exp_avg", "exp_avg_sq"):  # as tests/bb_lightning/test_checkpoint.py
            torch.testing.assert_close(got[kind][name], want[kind][name], rtol=1e-4, atol=1e-9)


def test_validation_after_fit_reports_the_loss_over_every_rank_s_rows(runs: Any) -> None:
    one = runs.fit(1, 4, *CASES["host"])
    two = runs.fit(2, 2, *CASES["host"])
    want = json.loads((one.out / "val.rank0.json").read_text())["val_loss"]
    for rank in range(2):  # each rank reports the mean over both ranks' halves
        got = json.loads((two.out / f"val.rank{rank}.json").read_text())["val_loss"]
        assert got == pytest.approx(want, rel=1e-5), rank


def test_clip_changes_the_update(runs: Any) -> None:
    plain = runs.fit(1, 4, *CASES["host"]).state()["master"]
    clipped = runs.fit(1, 4, *CASES["host-clip"]).state()["master"]
    assert max(float((clipped[k] - v).abs().max()) for k, v in plain.items()) > 1e-6


def test_nvme_path_gets_a_directory_per_rank(runs: Any) -> None:
    two = runs.fit(2, 2, *CASES["nvme-clip"])
    dirs = sorted(p.name for p in (two.out / "nvme").iterdir() if p.is_dir())
    assert dirs == ["rank0", "rank1"]
    for rank in dirs:  # each rank's tier holds the arrays of its own store
        assert any((two.out / "nvme" / rank).rglob("zarr.json")), rank


def test_two_rank_checkpoint_resumes_in_one_process(runs: Any) -> None:
    case = CASES["host-clip"]
    first = runs.fit(2, 2, *case, "--steps", "2", "--save-at", "2")
    assert first.result() == {"step": 2, "world_size": 2, "saved_by": 2}
    resumed = runs.fit(1, 4, *case, "--resume", str(first.out / "mid.ckpt"))
    whole = runs.fit(1, 4, *case)
    assert sorted(resumed.losses()) == [2]  # only the third step ran
    _assert_resumed(first, resumed, whole)


def test_one_process_checkpoint_resumes_at_two_ranks(runs: Any) -> None:
    case = CASES["nvme"]
    first = runs.fit(1, 4, *case, "--steps", "2", "--save-at", "2")
    resumed = runs.fit(2, 2, *case, "--resume", str(first.out / "mid.ckpt"))
    whole = runs.fit(1, 4, *case)
    assert sorted(resumed.losses()) == [2] and resumed.result()["world_size"] == 2
    _assert_resumed(first, resumed, whole)


def _assert_resumed(first: Any, resumed: Any, whole: Any) -> None:
    """``first`` then ``resumed`` trained as ``whole``: same losses per step, same state."""
    losses = {**first.losses(), **resumed.losses()}
    for step, values in whole.losses().items():
        assert len(losses[step]) == len(values), f"step {step}: micro-batches over the ranks"
        torch.testing.assert_close(
            torch.tensor(losses[step]).mean(), torch.tensor(values).mean(), rtol=1e-5, atol=0
        )
    assert resumed.result()["step"] == whole.result()["step"] == 3
    got, want = resumed.state(), whole.state()
    for kind in KINDS:
        assert got[kind].keys() == want[kind].keys()
        for name, value in want[kind].items():
            torch.testing.assert_close(got[kind][name], value, rtol=1e-5, atol=1e-6, msg=name)


def test_weights_left_in_the_store_save_pretrained_from_every_rank(runs: Any) -> None:
    from transformers import AutoModelForCausalLM

    two = runs.fit(2, 2, *CASES["host"], "--save-pretrained")
    errors = [json.loads((two.out / f"saved.rank{r}.json").read_text())["error"] for r in (0, 1)]
    assert errors == ["", ""]
    saved = AutoModelForCausalLM.from_pretrained(two.out / "hf", dtype=torch.float32)
    masters = two.state()["master"]
    for name, param in saved.named_parameters():
        torch.testing.assert_close(param.detach(), masters[f"model.{name}"], rtol=0, atol=0)


def test_a_save_pretrained_rank_0_refuses_fails_on_every_rank(runs: Any) -> None:
    two = runs.fit(2, 2, *CASES["host"], "--save-pretrained", "--freeze-embed", "--steps", "1")
    first, second = (json.loads((two.out / f"saved.rank{r}.json").read_text()) for r in (0, 1))
    assert "frozen parameters" in first["error"]
    assert "failed on another rank" in second["error"]
