"""Kill campaign of bulk predict (``bench/faults.py --predict``): every prompt exactly once.

The campaign's tiny model (``_kill.py``) generates 8 new tokens for 40 prompts in
batches of 4 under ``balance_beam`` with ``JsonlPredictionWriter``; runs are SIGKILLed
(before or after a batch's append, halfway through the append -- a torn last line --,
or after a random delay in a batch) and restarted until the file is complete. Checked:
every prompt exactly once, with the tokens of an uninterrupted run; counted: prompts
generated twice (lost in flight and generated again; at most one batch per kill).

    .venv/bin/python bench/faults.py --predict [--kills 20] [--seed 0]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import _common
import lightning.pytorch as pl
import torch
from _kill import LAYERS, checked, die, failed, in_child

from bb_lightning.module import CausalLMModule

PROMPTS = 40
PROMPT_BATCH = 4
NEW_TOKENS = 8


class CountingModule(CausalLMModule):
    """``CausalLMModule`` that logs the ids of every batch it generated (before the write)."""

    log: Path | None = None

    def predict_step(self, batch: dict[str, Any], batch_idx: int, dataloader_idx: int = 0) -> Any:
        out = super().predict_step(batch, batch_idx, dataloader_idx)
        if self.log is not None:
            with self.log.open("a") as f:
                f.write("".join(f"{i}\n" for i in batch["id"]))
        return out


@dataclass(frozen=True)
class PredictKill:
    """A predict kill in batch ``batch`` of a run: ``where`` is before-write, after-write,
    torn-write (half the batch's lines reach the file) or after-delay (``delay`` s)."""

    batch: int
    where: str
    delay: float = 0.0


def predict_run(args: argparse.Namespace, run: Path, kill: PredictKill | None) -> None:
    """One predict process writing ``run/out.jsonl`` (resumes it when present)."""
    from bb_lightning.data import PromptsDataModule
    from bb_lightning.data.writer import JsonlPredictionWriter

    torch.set_num_threads(args.threads)
    _common.quiet()
    writer = JsonlPredictionWriter(run / "out.jsonl")
    write = writer.write_records
    calls = [0]

    def records(recs: Any) -> None:
        k = kill
        n, calls[0] = calls[0], calls[0] + 1
        if k is not None and k.batch == n and k.where == "before-write":
            die()
        if k is not None and k.batch == n and k.where == "torn-write":
            text = "".join(json.dumps(r) + "\n" for r in recs if str(r["id"]) not in writer.written)
            with writer.path.open("a", encoding="utf-8") as f:
                f.write(text[: len(text) // 2])  # a write cut short: half the batch's lines
            die()
        write(recs)
        if k is not None and k.batch == n and k.where == "after-write":
            die()

    writer.write_records = records  # type: ignore[method-assign]

    class Timed(pl.Callback):
        def on_predict_batch_start(self, trainer: Any, module: Any, batch: Any, idx: int) -> None:
            if kill is not None and kill.where == "after-delay" and kill.batch == idx:
                threading.Timer(kill.delay, die).start()

    strategy = _common.nvme_strategy(LAYERS, run / "nvme")
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        strategy=strategy,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[writer, Timed()],
    )
    module = CountingModule(str(args.dir / "model"), max_new_tokens=NEW_TOKENS, seed=0)
    module.log = run / "generated.log"
    data = PromptsDataModule(str(args.dir / "prompts.jsonl"), batch_size=PROMPT_BATCH)
    trainer.predict(module, datamodule=data, return_predictions=False)
    strategy.close()


def make_prompts(path: Path, rng: random.Random) -> None:
    """``PROMPTS`` prompts of 3 to 40 printable bytes (the byte tokenizer's ids < 256)."""
    rows = []
    for i in range(PROMPTS):
        text = "".join(chr(rng.randrange(32, 127)) for _ in range(rng.randrange(3, 41)))
        rows.append(json.dumps({"id": f"p{i}", "prompt": text}))
    path.write_text("\n".join(rows) + "\n")


def jsonl(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def predict_campaign(args: argparse.Namespace, rng: random.Random) -> dict[str, Any]:
    """The predict kill campaign; the figures."""
    make_prompts(args.dir / "prompts.jsonl", rng)
    ref_run = args.dir / "predict-reference"
    ref_run.mkdir()
    t0 = time.perf_counter()
    checked(predict_run, args, ref_run, None)
    seconds = time.perf_counter() - t0
    want = {r["id"]: r["token_ids"] for r in jsonl(ref_run / "out.jsonl")}
    assert len(want) == PROMPTS, f"the reference wrote {len(want)} of {PROMPTS} prompts"
    batches = -(-PROMPTS // PROMPT_BATCH)
    batch_s = seconds / batches  # an upper bound: the run's start-up is included
    print(f"reference: {PROMPTS} prompts in {batches} batches, {seconds:.1f} s per run")
    figures = dict.fromkeys(
        ["kills", "runs", "lost", "duplicated", "wrong_tokens", "twice", "over_batch"], 0
    )
    places = ["before-write", "after-write", "torn-write"]
    if not args.no_timed:
        places.append("after-delay")
    run, left = Path(), 0
    chains = kills_before = 0  # kills before the output in progress was started
    while figures["kills"] < args.kills or left > 0:
        if left == 0:
            chains += 1
            run = args.dir / f"predict-{chains}"
            run.mkdir()
            left = batches
        which = rng.randrange(left + 1)
        kill = None
        if which < left and figures["kills"] < args.kills:
            kill = PredictKill(which, rng.choice(places), rng.uniform(0, 1.2 * batch_s))
        status = in_child(predict_run, args, run, kill)
        figures["runs"] += 1
        killed = os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL
        if not killed and not (os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0):
            failed()
            raise SystemExit(f"a predict run failed (wait status {status}); see its traceback")
        figures["kills"] += killed
        rows = jsonl_complete(run / "out.jsonl")
        ids = [r["id"] for r in rows]
        figures["duplicated"] += len(ids) - len(set(ids))
        figures["wrong_tokens"] += sum(r["token_ids"] != want.get(r["id"]) for r in rows)
        left = -(-(PROMPTS - len(set(ids))) // PROMPT_BATCH)
        if not killed:
            figures["lost"] += PROMPTS - len(set(ids))
            gen = (run / "generated.log").read_text().split()
            twice = len(gen) - len(set(gen))
            figures["twice"] += twice
            figures["over_batch"] += twice > PROMPT_BATCH * (figures["kills"] - kills_before)
            kills_before = figures["kills"]
            left = 0
    figures["chains"] = chains
    return figures


def jsonl_complete(path: Path) -> list[dict[str, Any]]:
    """The complete lines of a predictions file (a torn last line is what a restart cuts)."""
    if not path.exists():
        return []
    data = path.read_text()
    return [json.loads(line) for line in data[: data.rfind("\n") + 1].splitlines() if line]
