"""Kill campaigns: SIGKILL a training run or a bulk predict, then check that nothing is lost.

Training (default). A 2-layer tiny Llama (hidden 64, vocab 264, written with
``save_pretrained``) trains under ``balance_beam`` with every block's weights, fp32
master weights and AdamW moments on the NVMe tier, fp32 compute, and
``ModelCheckpoint(every_n_train_steps=1, save_last=True)``. A reference run goes
uninterrupted and records every step's loss and weights. Then runs are started and
SIGKILLed ``--kills`` times at seeded random moments; each restart resumes from the
newest complete checkpoint in the same directories (same NVMe store, same checkpoint
folder), until a run reaches the last step and a fresh chain begins. Kill moments:

- inside the checkpoint phase (``--save-share`` of the kills, default 0.8): at a random
  event of a random save -- before an array is written, before ``zarr.json`` /
  ``meta.json`` / the trainer state are written, before a directory fsync, before
  each rename, before the old checkpoint is deleted (every event is a point a real kill
  can fall between; which one is drawn from the seed, so these are reproducible);
- anywhere in a step (the rest): a timer thread sends SIGKILL a random delay after a
  random step starts: half of them within the reference run's training time of a step
  (forward, backward, optimizer), half within its training and checkpoint time.

After every kill a fresh process checks: every checkpoint under a final name opens
with plain ``zarr`` (every array read, shapes as ``meta.json`` says), its master
weights equal the reference run's at that step (bit for bit), the trainer state
loads; after ``recover`` no ``.partial-``/``.old-`` leftover is left; the NVMe store's
lock is free. Every resumed run's losses must equal the reference's bit for bit, and a
run that reaches the end must end with the reference's final weights.

Predict (``--predict``): see ``faults_predict.py``.

Prints the kill counts, the failures (goal 0) and the machine; exits 1 on a failure.

    .venv/bin/python bench/faults.py [--kills 50] [--steps 6] [--seed 0] [--dir D]
    .venv/bin/python bench/faults.py --predict [--kills 20]
    (--no-timed: only the reproducible event kills, as the test suite's smoke run does)
"""

from __future__ import annotations

import argparse
import fcntl
import json
import os
import random
import shutil
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import _common
import faults_predict
import lightning.pytorch as pl
import torch
from _kill import LAYERS, LOG, VOCAB, checked, die, failed, in_child, make_model
from lightning.pytorch.callbacks import ModelCheckpoint

from bb_lightning import BalanceBeamStrategy
from bb_lightning.engine import checkpoint as ckpt
from bb_lightning.module import CausalLMModule

SEQ = 32
"""Tokens per training row."""
BATCH = 2
"""Rows per optimizer step."""


class ResumableBatches:
    """Fixed token batches, one per optimizer step, resuming at the step saved.

    Implements Lightning's stateful-loader protocol (``state_dict`` / ``load_state_dict``):
    a checkpoint records the optimizer step it was taken at, and a resumed run's first
    batch is that step's, as a run that was never stopped would have it.
    """

    def __init__(self, steps: int, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.batches = [
            {"input_ids": torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)} for _ in range(steps)
        ]
        self.start = 0
        self.trainer: pl.Trainer | None = None

    def __len__(self) -> int:
        return len(self.batches)  # the epoch's length, resumed or not (as Lightning counts)

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        start, self.start = self.start, 0  # a later epoch starts from its first batch
        return iter(self.batches[start:])

    def state_dict(self) -> dict[str, int]:
        assert self.trainer is not None
        return {"step": self.trainer.global_step}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.start = int(state["step"])


class LossLog(pl.Callback):
    """Appends ``step loss.hex()`` per optimizer step (unbuffered: a kill loses nothing)."""

    def __init__(self, path: Path) -> None:
        self.fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    def on_train_batch_end(self, trainer: pl.Trainer, module: Any, outputs: Any, *a: Any) -> None:
        os.write(self.fd, f"{trainer.global_step} {float(outputs['loss']).hex()}\n".encode())


class Phase:
    """Where the process is: a byte in a file (S: checkpoint phase, T: training)."""

    def __init__(self, path: Path) -> None:
        self.fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
        self.set(b"T")

    def set(self, mark: bytes) -> None:
        os.pwrite(self.fd, mark, 0)


@dataclass(frozen=True)
class Kill:
    """A kill: at event ``event`` of checkpoint phase ``save`` of a run (counted from 0),
    or ``delay`` seconds after training step ``step`` of the run starts."""

    save: int | None = None
    event: int = 0
    step: int | None = None
    delay: float = 0.0


class SaveEvents:
    """Counts the I/O events of checkpoint phases and SIGKILLs at the one asked for.

    The checkpoint module's writes, fsyncs and the renames and deletions of the save are
    wrapped (in this child process only); ``counts`` keeps the events of each phase.
    """

    def __init__(self, kill: Kill | None) -> None:
        self.kill = kill
        self.phase = -1
        self.inside = False
        self.counts: list[int] = []
        for owner, name in [
            (ckpt, "_after_array"),
            (ckpt, "write_synced"),
            (ckpt, "fsync_dir"),
            (ckpt.torch, "save"),
            (os, "replace"),
            (shutil, "rmtree"),
        ]:
            setattr(owner, name, self._wrap(getattr(owner, name)))

    def _wrap(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        def wrapped(*args: Any, **kwargs: Any) -> Any:
            if self.inside:
                self.counts[-1] += 1
                k = self.kill
                if k is not None and k.save == self.phase and k.event == self.counts[-1] - 1:
                    die()
            return fn(*args, **kwargs)

        return wrapped

    def begin(self) -> None:
        self.phase += 1
        self.counts.append(0)
        self.inside = True

    def end(self) -> None:
        self.inside = False
        k = self.kill
        if k is not None and k.save == self.phase and k.event >= self.counts[-1]:
            die()  # drawn past this phase's last event: the kill falls at the phase's end


class KillableCheckpoint(ModelCheckpoint):
    """``ModelCheckpoint`` whose batch-end phase (save, save-last, rotation) is observed."""

    def __init__(self, events: SaveEvents, phase: Phase, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.events = events
        self.mark = phase
        self.seconds: list[float] = []

    def on_train_batch_end(self, *args: Any, **kwargs: Any) -> None:
        start = time.perf_counter()
        self.mark.set(b"S")
        self.events.begin()
        super().on_train_batch_end(*args, **kwargs)
        self.events.end()
        self.mark.set(b"T")
        self.seconds.append(time.perf_counter() - start)


class StepTimer(pl.Callback):
    """Arms the timed kill at the start of its step; records step times (reference run)."""

    def __init__(self, kill: Kill | None) -> None:
        self.kill = kill
        self.steps = 0
        self.starts: list[float] = []
        self.train_seconds: list[float] = []

    def on_train_batch_start(self, *args: Any) -> None:
        self.starts.append(time.perf_counter())
        k = self.kill
        if k is not None and k.step == self.steps:
            threading.Timer(k.delay, die).start()
        self.steps += 1

    def on_train_batch_end(self, *args: Any) -> None:
        """Runs before the checkpoint phase (Lightning calls ``ModelCheckpoint`` last)."""
        self.train_seconds.append(time.perf_counter() - self.starts[-1])


def newest_checkpoint(folder: Path) -> tuple[Path | None, int]:
    """The complete checkpoint with the highest step under ``folder`` (after recovery)."""
    if not folder.is_dir():
        return None, 0
    names = {p.name.split(ckpt.PARTIAL)[0].split(ckpt.OLD)[0] for p in folder.iterdir()}
    for name in names:
        ckpt.recover(folder / name)
    best: tuple[Path | None, int] = (None, 0)
    for path in sorted(folder.iterdir()):
        try:
            step = int(ckpt.read_meta(path)["step"])
        except ckpt.CheckpointError:
            continue
        if best[0] is None or step > best[1]:
            best = (path, step)
    return best


def train_run(args: argparse.Namespace, chain: Path, kill: Kill | None, reference: bool) -> None:
    """One training process over ``chain``'s checkpoints and store; resumes when it can."""
    torch.set_num_threads(args.threads)
    _common.quiet()
    resume, _ = newest_checkpoint(chain / "ckpts")
    events = SaveEvents(kill)
    timer = StepTimer(kill)
    strategy = _common.nvme_strategy(LAYERS, chain / "nvme")
    saver = KillableCheckpoint(
        events,
        Phase(chain / "phase"),
        dirpath=chain / "ckpts",
        every_n_train_steps=1,
        save_last=True,
    )
    callbacks: list[pl.Callback] = [LossLog(chain / "losses.log"), timer, saver]
    if reference:
        callbacks.append(Snapshots(chain / "ref", strategy))
    trainer = _common.quiet_trainer(
        strategy,
        steps=args.steps,
        accumulate=1,
        callbacks=callbacks,
        precision="32-true",
        max_epochs=-1,
        enable_checkpointing=True,
    )
    data = ResumableBatches(args.steps)
    data.trainer = trainer
    module = CausalLMModule(
        str(args.dir / "model"), learning_rate=1e-3, weight_decay=0.01, warmup_steps=3, seed=0
    )
    trainer.fit(module, data, ckpt_path=resume)  # type: ignore[arg-type]
    torch.save(dict(strategy.lightning_module_state_dict()), chain / "final.pt")
    strategy.close()
    if reference:
        info = {
            "events": events.counts,
            "train_seconds": sorted(timer.train_seconds)[len(timer.train_seconds) // 2],
            "save_seconds": sorted(saver.seconds)[len(saver.seconds) // 2],
        }
        (chain / "ref" / "info.json").write_text(json.dumps(info))


class Snapshots(pl.Callback):
    """The reference run's weights after every optimizer step, as ``step-<n>.pt``."""

    def __init__(self, folder: Path, strategy: BalanceBeamStrategy) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        self.folder = folder
        self.strategy = strategy

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        state = dict(self.strategy.lightning_module_state_dict())
        torch.save(state, self.folder / f"step-{trainer.global_step}.pt")


def verify_training(chain: Path, ref: Path, out: Path) -> None:
    """Check ``chain``'s checkpoints and store after a kill; the findings as JSON in ``out``."""
    import zarr

    folder = chain / "ckpts"
    found: dict[str, Any] = {"corrupt": [], "leftovers": [], "locked": False, "newest": 0}
    _, step = newest_checkpoint(folder)  # recovers, as every load does
    entries = sorted(folder.iterdir()) if folder.is_dir() else []
    leftover = [p for p in entries if ckpt.PARTIAL in p.name or ckpt.OLD in p.name]
    found["leftovers"] = [p.name for p in leftover]
    for path in [p for p in entries if p not in leftover]:
        try:
            meta = ckpt.read_meta(path)
            group = zarr.open_group(str(path / ckpt.STATE_DIR), mode="r")
            want = torch.load(ref / f"step-{meta['step']}.pt")
            for p in meta["parameters"]:
                for kind in ("master", "exp_avg", "exp_avg_sq"):
                    value = group[kind][p["name"]][...]
                    if list(value.shape) != p["shape"]:
                        raise ValueError(f"{kind}/{p['name']} has shape {value.shape}")
                master = torch.from_numpy(group["master"][p["name"]][...])
                if not torch.equal(master, want[p["name"]]):
                    raise ValueError(f"master/{p['name']} differs from the reference")
            ckpt.read_trainer_state(path)  # the Lightning state loads (without running code)
        except Exception as err:  # any failure to read is the finding
            found["corrupt"].append(f"{path.name}: {type(err).__name__}: {err}")
    found["newest"] = step
    lock = chain / "nvme" / ".bb-lock"
    if lock.exists():
        fd = os.open(lock, os.O_RDWR)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            fcntl.flock(fd, fcntl.LOCK_UN)
        except BlockingIOError:
            found["locked"] = True
        finally:
            os.close(fd)
    out.write_text(json.dumps(found))


def compare_final(final: Path, ref: Path, out: Path) -> None:
    """Whether a finished run's weights equal the reference's final ones (JSON in ``out``)."""
    got, want = torch.load(final), torch.load(ref)
    differ = [k for k in want if not torch.equal(got[k], want[k])]
    out.write_text(json.dumps({"differ": differ}))


def read_losses(path: Path) -> list[tuple[int, str]]:
    if not path.exists():
        return []
    return [(int(a), b) for a, b in (line.split() for line in path.read_text().splitlines())]


def training_campaign(args: argparse.Namespace, rng: random.Random) -> dict[str, Any]:
    """The training kill campaign; the figures."""
    ref_chain = args.dir / "reference"
    ref_chain.mkdir()
    checked(train_run, args, ref_chain, None, reference=True)
    info = json.loads((ref_chain / "ref" / "info.json").read_text())
    ref_losses = dict(read_losses(ref_chain / "losses.log"))
    events = max(info["events"])
    train_s, save_s = float(info["train_seconds"]), float(info["save_seconds"])
    print(
        f"reference: {args.steps} steps, losses {[float.fromhex(v) for v in ref_losses.values()]}"
        f"; per step {train_s:.2f} s of training and {save_s:.2f} s of checkpoint phase "
        f"({events} I/O events)"
    )
    figures = dict.fromkeys(
        ["kills", "in_save", "corrupt", "diverged", "leftovers", "locked", "finished", "resumes"],
        0,
    )
    chains = 0
    chain = Path()
    done_steps = args.steps  # start a fresh chain
    while figures["kills"] < args.kills or done_steps < args.steps:
        if done_steps >= args.steps:
            chains += 1
            chain = args.dir / f"chain-{chains}"
            chain.mkdir()
            done_steps = 0
            history: list[str] = []
        left = args.steps - done_steps
        timed = not args.no_timed and rng.random() >= args.save_share
        which = rng.randrange(left + 1)  # == left: this run is not killed
        kill: Kill | None = None
        if which < left and figures["kills"] < args.kills:
            if timed:
                # half in the training work, half anywhere in the step, save included
                span = train_s if rng.random() < 0.5 else train_s + save_s
                kill = Kill(step=which, delay=rng.uniform(0, span))
            else:
                kill = Kill(save=which, event=rng.randrange(events + 1))
        before = len(read_losses(chain / "losses.log"))
        resumed = done_steps > 0
        status = in_child(train_run, args, chain, kill, reference=False)
        killed = os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL
        if not killed and not (os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0):
            failed()
            raise SystemExit(f"a training run failed (wait status {status}); see its traceback")
        figures["resumes"] += resumed
        run_losses = read_losses(chain / "losses.log")[before:]
        history.append(f"from step {done_steps}: {kill} -> {'killed' if killed else 'ended'}")
        if any(ref_losses.get(s) != v for s, v in run_losses):
            figures["diverged"] += 1
            print(f"  {chain.name}: losses differ {run_losses}; runs: {'; '.join(history)}")
        if killed:
            figures["kills"] += 1
            inside = (chain / "phase").read_bytes()[:1] == b"S"
            figures["in_save"] += inside
        report = chain / "verify.json"
        checked(verify_training, chain, ref_chain / "ref", report)
        found = json.loads(report.read_text())
        figures["corrupt"] += len(found["corrupt"])
        figures["leftovers"] += bool(found["leftovers"])
        figures["locked"] += found["locked"]
        for line in found["corrupt"]:
            print(f"  {chain.name}: corrupt {line}; runs: {'; '.join(history)}")
        if killed:
            done_steps = int(found["newest"])
        else:
            figures["finished"] += 1
            out = chain / "final.json"
            checked(compare_final, chain / "final.pt", ref_chain / "final.pt", out)
            if json.loads(out.read_text())["differ"]:
                figures["diverged"] += 1
                print(f"  {chain.name}: final weights differ; runs: {'; '.join(history)}")
            done_steps = args.steps
    figures["chains"] = chains
    return figures


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--predict", action="store_true", help="the predict campaign")
    p.add_argument("--kills", type=int, help="SIGKILLs (default: 50 training, 20 predict)")
    p.add_argument("--steps", type=int, default=6, help="optimizer steps of a training run")
    p.add_argument("--seed", type=int, default=0, help="seed of the kill moments")
    p.add_argument("--save-share", type=float, default=0.8, help="share of kills in a save")
    p.add_argument("--no-timed", action="store_true", help="only reproducible event kills")
    p.add_argument("--threads", type=int, default=1, help="torch threads per run")
    p.add_argument("--dir", type=Path, help="work directory on the disk to test (default: tmp)")
    args = p.parse_args(argv)
    if args.kills is None:
        args.kills = 20 if args.predict else 50
    if args.kills < 1 or args.steps < 2:
        p.error("--kills must be >= 1 and --steps >= 2")
    base = args.dir or Path(tempfile.gettempdir())
    base.mkdir(parents=True, exist_ok=True)
    args.dir = Path(tempfile.mkdtemp(prefix="bb-faults-", dir=base))
    rng = random.Random(args.seed)
    LOG.append(args.dir / "runs.log")
    print(_common.machine(args.dir), flush=True)
    t0 = time.perf_counter()
    try:
        checked(make_model, args.dir)
        campaign = faults_predict.predict_campaign if args.predict else training_campaign
        figures = campaign(args, rng)
    finally:
        if args.dir.exists():
            shutil.rmtree(args.dir)
    seconds = time.perf_counter() - t0
    if args.predict:
        bad = figures["lost"] + figures["duplicated"] + figures["wrong_tokens"]
        bad += figures["over_batch"]
        print(
            f"predict: {figures['kills']} kills over {figures['runs']} runs "
            f"({figures['chains']} complete outputs, seed {args.seed}, {seconds:.0f} s)\n"
            f"  prompts lost {figures['lost']} (goal 0), written twice {figures['duplicated']} "
            f"(goal 0), tokens unlike the uninterrupted run {figures['wrong_tokens']} (goal 0)\n"
            f"  prompts generated twice {figures['twice']} (at most {faults_predict.PROMPT_BATCH} "
            "per kill; "
            f"outputs over that bound: {figures['over_batch']})"
        )
    else:
        bad = figures["corrupt"] + figures["diverged"] + figures["leftovers"] + figures["locked"]
        print(
            f"training: {figures['kills']} kills, {figures['in_save']} inside a checkpoint "
            f"phase, {figures['kills'] - figures['in_save']} in the training work, "
            f"{figures['resumes']} resumed runs, {figures['finished']} runs to the end "
            f"({figures['chains']} chains, {args.steps} steps each, seed {args.seed}, "
            f"{seconds:.0f} s)\n"
            f"  corrupt checkpoints {figures['corrupt']} (goal 0), diverged runs "
            f"{figures['diverged']} (goal 0), leftovers after recovery {figures['leftovers']} "
            f"(goal 0), stores left locked {figures['locked']} (goal 0)"
        )
    print("PASS" if bad == 0 else "FAIL")
    return 0 if bad == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
