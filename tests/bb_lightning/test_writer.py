"""The JSONL prediction writer: durable appends, recovery of a torn last line, resume."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch

from bb_lightning.data import PromptsDataModule
from bb_lightning.writer import JsonlPredictionWriter, recover_jsonl


def _lines(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_recover_cuts_a_torn_last_line(tmp_path: Path) -> None:
    path = tmp_path / "out.jsonl"
    path.write_text(
        '{"id": "a", "token_ids": [1]}\n{"id": "b", "token_ids": [2]}\n{"id": "c", "tok'
    )
    assert recover_jsonl(path) == {"a", "b"}
    assert path.read_text().endswith("[2]}\n") and len(_lines(path)) == 2
    assert recover_jsonl(tmp_path / "absent.jsonl") == set()
    path.write_text('{"id": "a"}\nnot json\n')
    with pytest.raises(ValueError, match=r"out\.jsonl:2: not valid JSON"):
        recover_jsonl(path)


class _Killed(Exception):
    """The process dies with a batch in flight."""


class _EchoModule(pl.LightningModule):
    """Predicts each prompt's reversed token ids (a stand-in for a model)."""

    def __init__(self, stop_after: int | None = None) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(1, 1)
        self.stop_after = stop_after
        self.seen: list[str] = []

    def predict_step(self, batch: dict[str, Any], batch_idx: int) -> list[dict[str, Any]]:
        if self.stop_after is not None and batch_idx == self.stop_after:
            raise _Killed
        self.seen += batch["id"]
        out = []
        for rid, ids, mask, err in zip(
            batch["id"], batch["input_ids"], batch["attention_mask"], batch["error"], strict=True
        ):
            if err is not None:
                out.append({"id": rid, "error": err})
            else:
                out.append({"id": rid, "token_ids": ids[mask.bool()].flip(0).tolist()})
        return out


def _run(prompts: Path, out: Path, module: _EchoModule) -> None:
    trainer = pl.Trainer(
        accelerator="cpu",
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[JsonlPredictionWriter(out)],
    )
    dm = PromptsDataModule(str(prompts), batch_size=3, max_prompt_len=12)
    trainer.predict(module, datamodule=dm, return_predictions=False)


def test_resume_writes_only_the_rest(tmp_path: Path) -> None:
    prompts = tmp_path / "prompts.jsonl"
    rows = [{"id": f"p{i}", "prompt": "ab" * (i + 1)} for i in range(10)]
    prompts.write_text("\n".join(json.dumps(r) for r in rows))
    whole = tmp_path / "whole.jsonl"
    _run(prompts, whole, _EchoModule())
    expected = _lines(whole)
    assert [r["id"] for r in expected] == [r["id"] for r in rows]
    assert expected[0]["token_ids"] == list(b"ab")[::-1]
    assert expected[9]["error"] == "prompt has 20 tokens > max_prompt_len=12"

    out = tmp_path / "out.jsonl"
    with pytest.raises(_Killed):
        _run(prompts, out, _EchoModule(stop_after=2))
    assert [r["id"] for r in _lines(out)] == [f"p{i}" for i in range(6)]
    with out.open("a") as f:
        f.write('{"id": "p6", "token_')  # a torn line from a write cut short
    resumed = _EchoModule()
    _run(prompts, out, resumed)
    assert resumed.seen == [f"p{i}" for i in range(6, 10)]
    assert _lines(out) == expected

    again = _EchoModule()
    _run(prompts, out, again)  # nothing left to do
    assert again.seen == [] and _lines(out) == expected
