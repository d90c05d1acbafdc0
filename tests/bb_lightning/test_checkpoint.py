"""Checkpoint directories of the balance_beam strategy: layout, resume, rotation, crash safety."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
import zarr
from lightning.pytorch.callbacks import ModelCheckpoint

from bb_lightning import BalanceBeamStrategy
from bb_lightning.engine.checkpoint import (
    OLD,
    PARTIAL,
    CheckpointError,
    read_trainer_state,
    recover,
    verify_checkpoint,
)
from bb_lightning.module import CausalLMModule
from bb_lightning.placement import Placement
from storage.tiers import Tier

D, H, N = Tier.DEVICE, Tier.HOST, Tier.NVME
PLACEMENT = Placement(weights=(N, H, D, H), master=(H, N, H, N), prefetch_depth=1)


def _module(tiny: SimpleNamespace, layers: int = 4) -> CausalLMModule:
    # warm-up makes the learning rate depend on the scheduler state restored at resume
    return CausalLMModule(
        tiny.tiny_llama(layers), learning_rate=1e-3, weight_decay=0.01, warmup_steps=6, seed=0
    )


def _strategy(tmp: Path, placement: Placement = PLACEMENT) -> BalanceBeamStrategy:
    return BalanceBeamStrategy(placement=placement, compute_dtype="fp32", nvme_path=str(tmp))


def _fit(
    tiny: SimpleNamespace,
    tmp: Path,
    steps: int,
    ckpt_path: Path | None = None,
    callbacks: Sequence[pl.Callback] = (),
    **kw: Any,
) -> tuple[pl.Trainer, BalanceBeamStrategy, list[float]]:
    strategy = _strategy(tmp / f"nvme-{len(os.listdir(tmp))}")
    trainer, recorder = tiny.make_trainer(strategy, steps, **kw)
    trainer.callbacks.extend(callbacks)
    try:
        trainer.fit(_module(tiny), tiny.loader(4), ckpt_path=ckpt_path)
    except BaseException:
        strategy.close()  # no store, copy threads or NVMe lock left for later tests
        raise
    return trainer, strategy, recorder.losses


@pytest.mark.slow
def test_layout_is_plain_zarr_with_torch_adamw_state(tiny: SimpleNamespace, tmp_path: Path) -> None:
    trainer, strategy, _ = _fit(tiny, tmp_path, 2)
    path = tmp_path / "epoch=0-step=2.ckpt"
    trainer.save_checkpoint(path)
    want = dict(strategy.lightning_module_state_dict())
    strategy.close()

    # reference: plain Lightning with torch.optim.AdamW on the same data
    plain, _ = tiny.make_trainer("auto", 2)
    module = _module(tiny)
    plain.fit(module, tiny.loader(8))
    torch_state = plain.optimizers[0].state
    by_name = {k: torch_state[p] for k, p in module.named_parameters()}

    group = zarr.open_group(str(path / "state.zarr"), mode="r")
    assert group.attrs["step"] == 2 and group.attrs["format"] == "balance_beam.checkpoint"
    for key, param in module.named_parameters():
        master = torch.from_numpy(group["master"][key][...])
        torch.testing.assert_close(master, want[key], rtol=0, atol=0, msg=key)
        torch.testing.assert_close(master, param.detach(), rtol=1e-5, atol=1e-6, msg=key)
        for kind in ("exp_avg", "exp_avg_sq"):
            got, ref = torch.from_numpy(group[kind][key][...]), by_name[key][kind]
            # fp32 rounding of the gradient sums differs with the CPU's kernels: an element
            # near zero may differ by about 1e-7 of the tensor's largest (seen: 3.5e-7)
            scale = float(ref.abs().max())
            torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-6 * scale + 1e-12, msg=key)
    meta = json.loads((path / "meta.json").read_text())
    assert {p["name"] for p in meta["parameters"]} == set(want)
    assert meta["model"]["config"]["num_hidden_layers"] == 4
    state = read_trainer_state(path)  # JSON + safetensors, no pickle
    assert "state_dict" not in state and state["global_step"] == 2
    assert {"loops", "lr_schedulers", "optimizer_states", "callbacks"} <= state.keys()


def test_the_run_s_own_store_has_no_trailers_and_the_checkpoint_still_verifies(
    tiny: SimpleNamespace, tmp_path: Path
) -> None:
    """The run's own store is written by the run before it reads it (weights at setup,
    fp32 masters, moments and gradient accumulators every step), so its NVMe chunks carry
    no CRC-32C; a checkpoint's arrays are all checksummed."""
    trainer, strategy, _ = _fit(tiny, tmp_path, 1)
    trainer.save_checkpoint(tmp_path / "c.ckpt")
    strategy.close()
    codecs = {
        meta.parent.name: [c["name"] for c in json.loads(meta.read_text())["codecs"]]
        for meta in (tmp_path / "nvme-0").rglob("zarr.json")
        if json.loads(meta.read_text())["node_type"] == "array"
    }
    nvme_state = {k: v for k, v in codecs.items() if k.split(".")[-1] in
                  ("master", "exp_avg", "exp_avg_sq")}  # fmt: skip
    assert len(nvme_state) == 6  # blocks 1 and 3 (master on NVMe) x 3 kinds
    assert all(v == ["bytes"] for v in nvme_state.values()), nvme_state
    weights = [v for k, v in codecs.items() if k.endswith(".weight")]
    assert weights == [["bytes"]]  # block 0 is homed on NVMe
    report = verify_checkpoint(tmp_path / "c.ckpt")
    assert report.arrays > 0 and not report.problems and not report.unverified
    group = zarr.open_group(str(tmp_path / "c.ckpt" / "state.zarr"), mode="r")
    for kind in ("master", "exp_avg", "exp_avg_sq"):
        for key in group[kind].array_keys():
            names = [c["name"] for c in group[kind][key].metadata.to_dict()["codecs"]]
            assert names == ["bytes", "crc32c"], (kind, key)


@pytest.mark.slow
def test_resume_equals_uninterrupted_run(tiny: SimpleNamespace, tmp_path: Path) -> None:
    _, full, losses_a = _fit(tiny, tmp_path, 8)
    want = dict(full.lightning_module_state_dict())
    full.close()
    # saved by ModelCheckpoint at the batch end: the loop state resumes with the next batch
    every = ModelCheckpoint(dirpath=tmp_path, filename="mid", every_n_train_steps=4)
    _, first, losses_b = _fit(tiny, tmp_path, 4, callbacks=[every])
    path = tmp_path / "mid.ckpt"
    first.close()
    trainer2, second, losses_c = _fit(tiny, tmp_path, 8, ckpt_path=path)
    assert second.engine is not None and second.engine.step_count == 8
    torch.testing.assert_close(
        torch.tensor(losses_b + losses_c), torch.tensor(losses_a), rtol=1e-6, atol=1e-6
    )
    got = dict(second.lightning_module_state_dict())
    for key, value in want.items():
        torch.testing.assert_close(got[key], value, rtol=1e-6, atol=1e-7, msg=key)
    assert trainer2.lr_scheduler_configs[0].scheduler.last_epoch == 8  # type: ignore[union-attr]
    second.close()


@pytest.mark.slow
def test_model_checkpoint_top_k_removes_directories(
    tiny: SimpleNamespace, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    removed: list[str] = []
    callback = ModelCheckpoint(
        dirpath=tmp_path / "ckpts",
        every_n_train_steps=1,
        save_top_k=1,
        monitor="step",
        mode="max",
    )
    remove = BalanceBeamStrategy.remove_checkpoint

    def counting(self: BalanceBeamStrategy, filepath: Any) -> None:
        removed.append(Path(filepath).name)
        remove(self, filepath)

    monkeypatch.setattr(BalanceBeamStrategy, "remove_checkpoint", counting)
    _, strategy, _ = _fit(tiny, tmp_path, 3, callbacks=[callback])
    strategy.close()
    names = os.listdir(tmp_path / "ckpts")
    assert len(removed) == 2 and not set(removed) & set(names), (removed, names)
    assert names == [Path(callback.best_model_path).name]
    assert (tmp_path / "ckpts" / names[0] / "state.zarr" / "master").is_dir()


def test_bad_paths_and_mismatched_models_are_named(tiny: SimpleNamespace, tmp_path: Path) -> None:
    missing = tmp_path / "nope.ckpt"
    with pytest.raises(CheckpointError, match=r"nope\.ckpt.*does not exist"):
        _fit(tiny, tmp_path, 1, ckpt_path=missing)
    other = tmp_path / "other"
    other.mkdir()
    torch.save({}, other / "model.pt")
    with pytest.raises(CheckpointError, match=r"other.*not a balance_beam checkpoint"):
        _fit(tiny, tmp_path, 1, ckpt_path=other)
    trainer, strategy, _ = _fit(tiny, tmp_path, 1)
    path = tmp_path / "four.ckpt"
    trainer.save_checkpoint(path)
    strategy.close()
    place = Placement.uniform(2, weights=H)
    small = BalanceBeamStrategy(placement=place, compute_dtype="fp32")
    trainer, _ = tiny.make_trainer(small, 2)
    with pytest.raises(
        CheckpointError, match=r"parameter 18 is \('model\.model\.layers\.2\.self_attn"
    ):
        trainer.fit(_module(tiny, layers=2), tiny.loader(2), ckpt_path=path)
    small.close()


_CHILD = """
import sys, time, torch
from pathlib import Path
sys.path.insert(0, {root!r})
from tests.bb_lightning.conftest import make_trainer, loader
from tests.bb_lightning.tiny import tiny_llama_config
from bb_lightning import BalanceBeamStrategy
from bb_lightning.engine import checkpoint
from bb_lightning.module import CausalLMModule
from bb_lightning.placement import Placement
from storage.tiers import Tier

out = Path({out!r})
strategy = BalanceBeamStrategy(
    placement=Placement.uniform(2, weights=Tier.HOST), compute_dtype="fp32"
)
trainer, _ = make_trainer(strategy, 1)
module = CausalLMModule(tiny_llama_config(2), learning_rate=1e-3, seed=0)
trainer.fit(module, loader(2))
trainer.save_checkpoint(out / "ck")
torch.save(dict(strategy.lightning_module_state_dict()), out / "a.pt")
trainer.fit_loop.epoch_loop.max_steps = 2
trainer.fit(module, loader(2))
torch.save(dict(strategy.lightning_module_state_dict()), out / "b.pt")
checkpoint._after_array = lambda name: time.sleep(0.01)
print("saving-b", flush=True)
trainer.save_checkpoint(out / "ck")
print("saved-b", flush=True)
time.sleep(60)
"""


@pytest.mark.slow
def test_killed_save_leaves_old_or_new_never_a_mix(tiny: SimpleNamespace, tmp_path: Path) -> None:
    root = str(Path(__file__).parents[2])
    code = textwrap.dedent(_CHILD).format(root=root, out=str(tmp_path))
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert child.stdout is not None
    try:
        line = ""
        while line.strip() != "saving-b":
            line = child.stdout.readline()
            assert line, "child ended before saving checkpoint B"
        # 2 blocks x 9 + 3 parameters, 3 arrays each, 10 ms apart: the save takes about 0.6 s
        time.sleep(random.Random(os.getpid()).uniform(0.05, 0.6))
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait()
    leftovers = [p.name for p in tmp_path.iterdir() if p.name.startswith("ck.")]
    # A kill between the two renames of a save leaves no "ck" but a complete "ck.old-<pid>":
    # recover() (run by every load and save) puts it back before a plain zarr reader looks.
    recover(tmp_path / "ck")
    group = zarr.open_group(str(tmp_path / "ck" / "state.zarr"), mode="r")
    a, b = (torch.load(tmp_path / f"{n}.pt") for n in "ab")
    step = group.attrs["step"]
    assert step in (1, 2)
    want = a if step == 1 else b
    for key in want:
        if key in group["master"]:
            got = torch.from_numpy(group["master"][key][...])
            torch.testing.assert_close(got, want[key], rtol=0, atol=0, msg=key)
    assert len(list(group["exp_avg"].array_keys())) == len(list(group["master"].array_keys()))
    # the next run resumes from it and saves over it, clearing the leftovers
    strategy = BalanceBeamStrategy(placement=Placement.uniform(2, weights=H), compute_dtype="fp32")
    trainer, recorder = tiny.make_trainer(strategy, 3)
    module = CausalLMModule(tiny.tiny_llama(2), learning_rate=1e-3, seed=0)
    trainer.fit(module, tiny.loader(2), ckpt_path=tmp_path / "ck")
    assert len(recorder.losses) == 3 - step
    trainer.save_checkpoint(tmp_path / "ck")
    strategy.close()
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith("ck.")] == []
    assert zarr.open_group(str(tmp_path / "ck" / "state.zarr"), mode="r").attrs["step"] == 3
    assert leftovers == [] or all(".partial-" in n or ".old-" in n for n in leftovers)


def test_recover_puts_back_a_checkpoint_renamed_aside_by_a_dead_process(tmp_path: Path) -> None:
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    old = tmp_path / f"ck{OLD}{dead.pid}"
    old.mkdir()
    meta = {"format": "balance_beam.checkpoint", "version": 1}
    (old / "meta.json").write_text(json.dumps(meta))
    partial = tmp_path / f"ck{PARTIAL}{dead.pid}"
    partial.mkdir()
    recover(tmp_path / "ck")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck"]
    assert json.loads((tmp_path / "ck" / "meta.json").read_text()) == meta
