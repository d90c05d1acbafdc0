"""The JSONL prediction writer: durable appends, recovery of a torn last line, resume."""

from __future__ import annotations

import hashlib
import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch

from bb_lightning.data import PromptsDataModule
from bb_lightning.data.writer import JsonlPredictionWriter, find_shards, recover_jsonl, shard_path


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


MIXED = [
    {"prompt": "aa"},  # line 1: no id
    {"id": "1", "prompt": "bbb"},  # the id a row without one would get from line 1
    {"id": 4, "prompt": "c"},  # an integer id equal to the next row's line number
    {"prompt": "dddd"},
    {"prompt": "ee"},
    {"id": "line-1", "prompt": "f"},
    {"prompt": "gg"},
]
"""Rows without ids beside given ids equal to their line numbers: every row must run once."""


def _mixed(tmp_path: Path) -> Path:
    prompts = tmp_path / "mixed.jsonl"
    prompts.write_text("".join(json.dumps(r) + "\n" for r in MIXED))
    return prompts


def _one_record_per_row(out: Path) -> None:
    lines = _lines(out)
    # Each prompt comes back once, reversed (the echo): no row lost to an id clash.
    assert [r["token_ids"] for r in lines] == [list(r["prompt"].encode())[::-1] for r in MIXED]
    assert len({r["id"] for r in lines}) == len(MIXED)
    assert [r["id"] for r in lines] == ["line-1-2", "1", "4", "line-4", "5", "line-1", "7"]


def test_rows_without_ids_never_clash_and_resume(tmp_path: Path) -> None:
    prompts = _mixed(tmp_path)
    whole = tmp_path / "whole.jsonl"
    _run(prompts, whole, _EchoModule())
    _one_record_per_row(whole)

    out = tmp_path / "out.jsonl"
    with pytest.raises(_Killed):
        _run(prompts, out, _EchoModule(stop_after=1))
    assert len(_lines(out)) == 3
    assert recover_jsonl(out) == {"line-1-2", "1", "4"}
    resumed = _EchoModule()
    _run(prompts, out, resumed)
    assert resumed.seen == ["line-4", "5", "line-1", "7"]
    assert _lines(out) == _lines(whole)


def _no_wait() -> None:
    """The barrier of a rank that merges nothing."""


def _copy_once(src: Path, dst: Path) -> Callable[[], None]:
    """A barrier that, at its first call, brings the other rank's finished shard over."""
    done: list[bool] = []

    def barrier() -> None:
        if not done:
            shutil.copy(src, dst)
            done.append(True)

    return barrier


def test_rows_without_ids_split_over_two_ranks_and_merge(tmp_path: Path) -> None:
    prompts = _mixed(tmp_path)
    seen = []
    # Ranks simulated one after the other, each in its own directory (both set up before
    # either writes); rank 0's first merge barrier brings rank 1's shard over.
    for rank in (1, 0):
        out = tmp_path / f"rank{rank}" / "out.jsonl"
        other = shard_path(tmp_path / "rank1" / "out.jsonl", 1, 2)
        barrier = _copy_once(other, out.parent / other.name) if rank == 0 else _no_wait
        module = _EchoModule()
        writer = JsonlPredictionWriter(out, rank=rank, world_size=2, barrier=barrier)
        trainer = pl.Trainer(
            accelerator="cpu", logger=False, enable_progress_bar=False,
            enable_model_summary=False, callbacks=[writer],
        )  # fmt: skip
        dm = PromptsDataModule(str(prompts), batch_size=2, max_prompt_len=12)
        trainer.predict(module, datamodule=dm, return_predictions=False)
        seen.append(module.seen)
    assert seen == [["1", "line-4", "line-1"], ["line-1-2", "4", "5", "7"]]
    assert find_shards(out) == []
    _one_record_per_row(out)


def test_an_id_given_twice_is_refused_before_anything_is_written(tmp_path: Path) -> None:
    prompts = tmp_path / "dup.jsonl"
    rows = [{"id": "a", "prompt": "def "}, {"id": "b", "prompt": "x"}, {"id": "a", "prompt": "y"}]
    prompts.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "out.jsonl"
    with pytest.raises(ValueError, match=r"dup\.jsonl:3: id 'a' is also the id of line 1"):
        _run(prompts, out, _EchoModule())
    assert not out.exists()


def test_recover_names_a_line_that_is_not_utf8(tmp_path: Path) -> None:
    path = tmp_path / "out.jsonl"
    path.write_bytes(b'{"id": "a"}\n{"id": "\xff"}\n')
    with pytest.raises(ValueError, match=r"out\.jsonl:2: not a predictions line"):
        recover_jsonl(path)


def test_a_directory_for_prompts_or_predictions_is_refused(tmp_path: Path) -> None:
    prompts = _mixed(tmp_path)
    with pytest.raises(ValueError, match=r"predictions file .* is a directory: give a file name"):
        _run(prompts, tmp_path, _EchoModule())
    with pytest.raises(ValueError, match=r"prompts file .* is a directory: give the \.jsonl"):
        _run(tmp_path, tmp_path / "out.jsonl", _EchoModule())
    assert not (tmp_path / "out.jsonl").exists()


def test_a_resume_after_the_prompts_changed_is_refused_not_paired_with_old_lines(
    tmp_path: Path,
) -> None:
    """Rows without ids are numbered by their line: a line inserted before them between two
    runs gives a written id another prompt. The old line must not stand for the new prompt
    (that prompt would never be generated): the resume is refused naming the id."""
    prompts = tmp_path / "prompts.jsonl"
    first = [{"prompt": "aa"}, {"prompt": "bbb"}, {"prompt": "c"}]
    prompts.write_text("".join(json.dumps(r) + "\n" for r in first))
    out = tmp_path / "out.jsonl"
    _run(prompts, out, _EchoModule())
    written = _lines(out)
    digests = [hashlib.sha256(r["prompt"].encode()).hexdigest()[:16] for r in first]
    assert [r["prompt_digest"] for r in written] == digests
    before = out.read_bytes()

    prompts.write_text("".join(json.dumps(r) + "\n" for r in [{"prompt": "new"}, *first]))
    resumed = _EchoModule()
    with pytest.raises(
        ValueError,
        match=r"out\.jsonl holds a prediction for id '1' made for "
        r"another prompt than the prompts file gives that id now \(line 1\)",
    ):
        _run(prompts, out, resumed)  # fmt: skip
    assert resumed.seen == [] and out.read_bytes() == before

    # an unchanged prompts file resumes as before; lines without a digest are taken as is
    prompts.write_text("".join(json.dumps(r) + "\n" for r in first))
    out.write_text(
        "".join(json.dumps({"id": r["id"], "token_ids": [0]}) + "\n" for r in written[:2])
    )
    again = _EchoModule()
    _run(prompts, out, again)
    assert again.seen == ["3"]
    assert _lines(out)[2] == {"id": "3", "token_ids": [ord("c")], "prompt_digest": digests[2]}
