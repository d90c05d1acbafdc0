"""The trainer state files of a checkpoint: every value round-trips, nothing runs code."""

from __future__ import annotations

import math
import pathlib
from pathlib import Path

import pytest
import torch
from lightning.fabric.utilities.data import AttributeDict

from bb_lightning.engine import trainer_state


class _Opaque:
    """A class no allowlist names: storing it would need its code at load time."""

    def __init__(self) -> None:
        self.x = 1


def test_state_round_trips_through_json_and_safetensors(tmp_path: Path) -> None:
    state = {
        "epoch": 3,
        "loops": {"fit_loop": {"state_dict": {}, "total": {"ready": 7, "done": True}}},
        "optimizer_states": [{"state": {0: {"step": torch.tensor(4.0)}}, "betas": (0.9, 0.95)}],
        "callbacks": {"ModelCheckpoint{'monitor': None}": {"best": torch.tensor(float("inf"))}},
        "buffers": {"model.rotary.inv_freq": torch.arange(8, dtype=torch.bfloat16)},
        "hyper_parameters": AttributeDict(lr=1e-3, path=pathlib.Path("/data/x"), tag="__bb__"),
        "odd": {"__bb__": 1, "nan": float("nan"), "none": None, "big": 2**70},
    }
    trainer_state.write(tmp_path, state)
    assert (tmp_path / trainer_state.PICKLE_NAME).exists()  # the Path only
    got = trainer_state.read(tmp_path, 2)
    assert got.keys() == state.keys() and got["epoch"] == 3 and got["loops"] == state["loops"]
    opt = got["optimizer_states"][0]
    assert opt["betas"] == (0.9, 0.95) and isinstance(opt["betas"], tuple)
    assert list(opt["state"]) == [0] and torch.equal(opt["state"][0]["step"], torch.tensor(4.0))
    buf = got["buffers"]["model.rotary.inv_freq"]
    assert buf.dtype == torch.bfloat16 and torch.equal(
        buf, state["buffers"]["model.rotary.inv_freq"]
    )
    hp = got["hyper_parameters"]
    assert isinstance(hp, AttributeDict) and hp == state["hyper_parameters"]
    assert isinstance(hp["path"], pathlib.Path)  # kept in trainer_state.pt, allowlisted
    assert got["odd"]["__bb__"] == 1 and math.isnan(got["odd"]["nan"])
    assert got["odd"]["big"] == 2**70 and got["odd"]["none"] is None


def test_a_value_that_would_need_code_is_refused_at_save(tmp_path: Path) -> None:
    with pytest.raises(trainer_state.UnsafeStateError, match=r"trainer_state\.odd.*_Opaque"):
        trainer_state.write(tmp_path, {"odd": _Opaque()})
    assert not list(tmp_path.iterdir())
