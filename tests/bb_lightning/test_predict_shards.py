"""Data-parallel bulk predict: one JSONL shard per rank, merged by rank 0, resumable.

Ranks are simulated in one process. Every rank sets up from the same files (Lightning's
post-setup barrier), so each simulated rank runs in its own copy of the output directory;
rank 0's merge barrier returns once the other ranks' shards are in its directory.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from bb_lightning.data import PromptsDataModule
from bb_lightning.data.writer import (
    JsonlPredictionWriter,
    find_shards,
    merge_shards,
    read_jsonl,
    shard_path,
)
from bb_lightning.module import CausalLMModule
from bb_lightning.placement import Placement
from bb_lightning.strategy.core import BalanceBeamStrategy
from storage.tiers import Tier

from .tiny import tiny_llama_config

CONFIG = tiny_llama_config(
    2, vocab_size=260, max_position_embeddings=48, bos_token_id=257, eos_token_id=258,
    pad_token_id=256,
)  # fmt: skip
TEXTS = ["The quick brown", "fox", "jumps over the", "lazy dog", "a", "b" * 60, "hello world"]
IDS = [f"p{i}" for i in range(len(TEXTS))]
NEW = 5


pytestmark = pytest.mark.usefixtures("one_thread")


def _prompts(root: Path) -> Path:
    path = root / "prompts.jsonl"
    path.write_text(
        "".join(json.dumps({"id": i, "prompt": t}) + "\n" for i, t in zip(IDS, TEXTS, strict=True))
    )
    return path


def _lines(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


class _Barrier:
    """Counts its calls; the first one runs ``arrive`` (the other ranks finish their shards)."""

    def __init__(self, arrive: Callable[[], None] = lambda: None) -> None:
        self.calls = 0
        self.arrive = arrive

    def __call__(self) -> None:
        if self.calls == 0:
            self.arrive()
        self.calls += 1


def _bring_shard(src: Path, dst: Path, rank: int, world: int) -> Callable[[], None]:
    return lambda: shutil.move(shard_path(src, rank, world), shard_path(dst, rank, world))


# -- the real path: a saved tiny Llama under balance_beam -----------------------------------


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Llama written with ``save_pretrained``, loaded by path as a user does."""
    cfg = dict(CONFIG)
    torch.manual_seed(3)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(cfg.pop("model_type"), **cfg))
    path = tmp_path_factory.mktemp("tiny") / "llama"
    model.save_pretrained(path)
    return path


def _predict(checkpoint: Path, prompts: Path, writer: JsonlPredictionWriter) -> None:
    module = CausalLMModule(str(checkpoint), max_new_tokens=NEW)
    strategy = BalanceBeamStrategy(
        placement=Placement.uniform(2, weights=Tier.HOST, master=Tier.HOST), compute_dtype="fp32"
    )
    trainer = pl.Trainer(
        accelerator="cpu", devices=1, strategy=strategy, logger=False,
        enable_progress_bar=False, enable_model_summary=False, callbacks=[writer],
    )  # fmt: skip
    dm = PromptsDataModule(str(prompts), batch_size=2, max_prompt_len=64)
    trainer.predict(module, datamodule=dm, return_predictions=False)
    strategy.close()


def test_two_ranks_write_every_id_once_with_the_one_process_tokens(
    tmp_path: Path, checkpoint: Path
) -> None:
    prompts = _prompts(tmp_path)
    whole = tmp_path / "one" / "out.jsonl"
    _predict(checkpoint, prompts, JsonlPredictionWriter(whole))
    expected = _lines(whole)
    assert [r["id"] for r in expected] == IDS
    assert find_shards(whole) == []  # world size 1: today's single file

    # Hugging Face greedy generation is the reference of the one-process run
    net = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
    for text, record in zip(TEXTS, expected, strict=True):
        ids = torch.tensor([list(text.encode())])
        if ids.shape[1] >= CONFIG["max_position_embeddings"]:
            assert "error" in record
            continue
        with torch.no_grad():
            want = net.generate(
                input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW,
                do_sample=False, pad_token_id=256, eos_token_id=258,
            )[0, ids.shape[1] :].tolist()  # fmt: skip
        assert record["token_ids"] == (want[: want.index(258)] if 258 in want else want)

    out1 = tmp_path / "rank1" / "out.jsonl"
    barrier1 = _Barrier()
    _predict(
        checkpoint, prompts, JsonlPredictionWriter(out1, rank=1, world_size=2, barrier=barrier1)
    )
    assert barrier1.calls == 2 and not out1.exists()  # rank 1 never writes the merged file
    assert [r["id"] for r in read_jsonl(shard_path(out1, 1, 2))] == IDS[1::2]

    out0 = tmp_path / "rank0" / "out.jsonl"
    barrier0 = _Barrier(_bring_shard(out1, out0, 1, 2))
    _predict(
        checkpoint, prompts, JsonlPredictionWriter(out0, rank=0, world_size=2, barrier=barrier0)
    )
    assert barrier0.calls == 2
    assert _lines(out0) == expected  # every id once, in input order, the same tokens
    assert find_shards(out0) == [] and sorted(p.name for p in out0.parent.iterdir()) == [
        "out.jsonl"
    ]


# -- resume, with a stand-in model (the reversed prompt) ------------------------------------


class _EchoModule(pl.LightningModule):
    """Predicts each prompt's reversed token ids; records the ids it ran."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(1, 1)
        self.seen: list[str] = []

    def predict_step(self, batch: dict[str, Any], batch_idx: int) -> list[dict[str, Any]]:
        self.seen += batch["id"]
        return [
            {"id": rid, "error": err}
            if err is not None
            else {"id": rid, "token_ids": ids[mask.bool()].flip(0).tolist()}
            for rid, ids, mask, err in zip(
                batch["id"],
                batch["input_ids"],
                batch["attention_mask"],
                batch["error"],
                strict=True,
            )
        ]


def _echo(prompts: Path, writer: JsonlPredictionWriter) -> list[str]:
    module = _EchoModule()
    trainer = pl.Trainer(
        accelerator="cpu", logger=False, enable_progress_bar=False,
        enable_model_summary=False, callbacks=[writer],
    )  # fmt: skip
    dm = PromptsDataModule(str(prompts), batch_size=2, max_prompt_len=40)
    trainer.predict(module, datamodule=dm, return_predictions=False)
    return module.seen


def _seed(out: Path, expected: dict[str, str]) -> None:
    """Files left by a killed 3-rank run: the merged file, shards, a torn line, a duplicate."""
    out.parent.mkdir(parents=True)
    out.write_text(expected["p0"])
    shard_path(out, 0, 3).write_text(expected["p3"] + expected["p6"][:9])  # torn last line
    shard_path(out, 1, 3).write_text(expected["p0"])  # merged, then killed before the cleanup
    shard_path(out, 2, 3).write_text(expected["p5"])


def test_resume_at_two_ranks_skips_what_a_three_rank_run_wrote(tmp_path: Path) -> None:
    prompts = _prompts(tmp_path)
    whole = tmp_path / "whole" / "out.jsonl"
    assert _echo(prompts, JsonlPredictionWriter(whole)) == IDS
    expected = {r["id"]: json.dumps(r) + "\n" for r in _lines(whole)}
    assert json.loads(expected["p5"])["error"].startswith("prompt has 60 tokens")

    out0, out1 = tmp_path / "rank0" / "out.jsonl", tmp_path / "rank1" / "out.jsonl"
    _seed(out0, expected)
    _seed(out1, expected)
    pending = ["p1", "p2", "p4", "p6"]
    seen1 = _echo(prompts, JsonlPredictionWriter(out1, rank=1, world_size=2, barrier=_Barrier()))
    assert seen1 == pending[1::2]
    barrier0 = _Barrier(_bring_shard(out1, out0, 1, 2))
    seen0 = _echo(prompts, JsonlPredictionWriter(out0, rank=0, world_size=2, barrier=barrier0))
    assert seen0 == pending[0::2]
    assert out0.read_text() == "".join(expected[i] for i in IDS)
    assert find_shards(out0) == []

    # a restart after the merge has nothing left to run
    barrier = _Barrier()
    again = _echo(prompts, JsonlPredictionWriter(out0, rank=0, world_size=2, barrier=barrier))
    assert again == [] and out0.read_text() == "".join(expected[i] for i in IDS)
    assert barrier.calls == 2  # an empty share still meets the other ranks at both barriers


def test_resume_at_one_process_merges_the_shards_it_finds(tmp_path: Path) -> None:
    prompts = _prompts(tmp_path)
    whole = tmp_path / "whole" / "out.jsonl"
    _echo(prompts, JsonlPredictionWriter(whole))
    expected = {r["id"]: json.dumps(r) + "\n" for r in _lines(whole)}
    out = tmp_path / "run" / "out.jsonl"
    _seed(out, expected)
    out.write_text(expected["p0"] + expected["p1"][:5])  # world size 1 wrote here, torn
    seen = _echo(prompts, JsonlPredictionWriter(out))
    assert seen == ["p1", "p2", "p4", "p6"]
    assert out.read_text() == "".join(expected[i] for i in IDS)
    assert find_shards(out) == []


def test_merge_keeps_the_first_record_of_an_id_and_orders_by_input(tmp_path: Path) -> None:
    out = tmp_path / "out.jsonl"
    shard_path(out, 1, 2).write_text('{"id": "b", "v": 1}\n{"id": "a", "v": 2}\n{"id": "c"')
    shard_path(out, 0, 2).write_text('{"id": "b", "v": 3}\n{"id": "z", "v": 4}\n')
    other = tmp_path / "out.jsonl.rank0-of-2.jsonl.bak"
    other.write_text("not a shard\n")
    stale = tmp_path / ".out.jsonl.merge-999.tmp"
    stale.write_text('{"id": "a", "v": 0}\n')  # a merge killed before its rename
    barrier = _Barrier()
    assert merge_shards(out, ["a", "b", "c"], rank=1, barrier=barrier) is None
    assert barrier.calls == 2 and not out.exists()  # only rank 0 merges
    assert merge_shards(out, ["a", "b", "c"], barrier=barrier) == 3
    assert _lines(out) == [{"id": "a", "v": 2}, {"id": "b", "v": 3}, {"id": "z", "v": 4}]
    assert find_shards(out) == [] and other.exists() and not stale.exists()
    assert merge_shards(tmp_path / "none.jsonl", ["a"]) == 0  # nothing written anywhere
    assert not (tmp_path / "none.jsonl").exists()
    with pytest.raises(ValueError, match=r"rank=2 of world_size=2"):
        shard_path(out, 2, 2)
    with pytest.raises(ValueError, match=r"rank=1 of world_size=1"):
        _echo(_prompts(tmp_path), JsonlPredictionWriter(out, rank=1, world_size=1))
    with pytest.raises(ValueError, match=r"rank=0 of world_size=0"):
        PromptsDataModule(str(_prompts(tmp_path))).use_share(0, 0)
