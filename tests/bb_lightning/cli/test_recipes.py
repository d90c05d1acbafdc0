"""Every recipe parses against the code and plans on its machine; tiny-cpu runs end to end."""

from __future__ import annotations

import csv
import json
import os
import re
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
import yaml

from bb_lightning.cli import UsageError, main, parse_recipe
from bb_lightning.data import TextDataModule
from bb_lightning.data.tokenizer import ByteTokenizer
from bb_lightning.hf.lora import LoraOptions, lora_profile
from bb_lightning.module import CausalLMModule
from bb_lightning.planner import FitJob, PlanOverrides, PredictJob, make_plan, preset
from bb_lightning.planner.models import BUILTIN_MODELS, builtin_config
from bb_lightning.planner.profile import HardwareProfile
from bb_lightning.probe import measure, model_profile_from_config
from bb_lightning.strategy import session as session_module

RECIPES = sorted((Path(__file__).parents[3] / "recipes").glob("*.yaml"))


def _header(path: Path, key: str) -> str | None:
    m = re.search(rf"^# {key}:\s*(.+?)(\s{{2,}}\(.*)?$", path.read_text(), re.MULTILINE)
    return m.group(1).strip() if m else None


def test_the_expected_recipes_exist() -> None:
    names = {p.stem for p in RECIPES}
    assert {"tiny-cpu", "llama-30b-full", "opt-30b-full", "llama-7b-24gb"} <= names
    assert "llama-7b-lora-24gb" in names
    assert any(n.endswith("-predict") for n in names)


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: p.stem)
def test_recipe_keys_validate_and_plan_on_its_preset(recipe: Path) -> None:
    task = "predict" if recipe.stem.endswith("-predict") else "fit"
    cfg = parse_recipe([task, "--config", str(recipe)])
    hardware = _header(recipe, "preset")
    assert hardware is not None, f"{recipe.name} has no '# preset:' line"
    if hardware == "measure":
        return  # planned on this machine by the end-to-end test below
    model = cfg.model.init_args.model
    spec = _header(recipe, "plan-as") or model
    config = builtin_config(spec) if spec in BUILTIN_MODELS else json.loads(spec)
    lora = getattr(cfg.model.init_args, "lora", None)
    if lora is not None:  # the adapters train, the base weights are frozen
        profile = lora_profile(config, LoraOptions.from_value(dict(lora)))
        assert 0 < profile.trainable_params < profile.total_params / 100
    else:
        profile = model_profile_from_config(config)
    data = cfg.data.init_args
    if task == "fit":
        accum = cfg.trainer.accumulate_grad_batches
        job = FitJob(seq_len=data.seq_len, global_batch_seqs=data.batch_size * accum)
        forced = PlanOverrides(micro_batch=data.batch_size, grad_accum=accum)
        plan = make_plan(profile, preset(hardware), job, overrides=forced)
        assert (plan.micro_batch, plan.grad_accum) == (data.batch_size, accum)
    else:
        fields = dict(kv.split("=") for kv in (_header(recipe, "predict") or "").split())
        job = PredictJob(**{k: int(v) for k, v in fields.items()})
        plan = make_plan(profile, preset(hardware), job)
    assert plan.predicted.total > 0


def test_a_bad_key_is_named(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("trainer:\n  max_stepz: 3\n")
    with pytest.raises(UsageError, match="max_stepz"):
        parse_recipe(["fit", "--config", str(bad)])


@pytest.mark.slow
def test_tiny_cpu_recipe_runs_end_to_end(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)  # the recipe's relative paths (checkpoints) land here
    recipe = next(p for p in RECIPES if p.stem == "tiny-cpu")
    run = tmp_path / "run"
    measured: list[str | None] = []

    def measure_briefly(*, nvme_path: str | None = None) -> HardwareProfile:
        # this machine measured, as the recipe asks, in 2 s rather than 20 (up to 30 on a
        # busy machine): the plan is still this machine's; the probe's own accuracy over its
        # full time is the probe tests' matter
        measured.append(nvme_path)
        return measure(nvme_path=nvme_path, max_seconds=2.0)

    monkeypatch.setattr(session_module, "measure", measure_briefly)
    argv = [
        "fit", "--config", str(recipe),
        "--trainer.max_steps=4", "--trainer.val_check_interval=2", "--trainer.limit_val_batches=1",
        "--trainer.log_every_n_steps=1",
        f"--trainer.default_root_dir={run}",
        f"--trainer.logger.init_args.save_dir={run}",
        f"--trainer.strategy.init_args.nvme_path={run / 'nvme'}",
        "--data.init_args.max_tokens=40000", "--data.init_args.cache_dir=null",
        "--samples=[def ]", "--sample_tokens=4",
        # rows of 64 tokens, 4 a micro-batch: the model-shaped probe and the steps a quarter
        # of the recipe's work (its own batch is the dry runs' and the predict test's)
        "--data.init_args.seq_len=64", "--data.init_args.batch_size=4",
    ]  # fmt: skip
    assert main(argv) == 0
    assert measured == [str(run / "nvme")]  # planned on this machine, its NVMe directory's
    out = capsys.readouterr().out
    assert "plan used:" in out and "samples (4 new tokens each" in out
    assert any((run / "nvme").rglob("zarr.json"))  # the NVMe tier held the blocks
    rows = list(csv.DictReader(next(run.rglob("metrics.csv")).open()))
    losses = [float(r["train_loss"]) for r in rows if r.get("train_loss")]
    assert losses and all(loss == loss for loss in losses)
    assert any(float(r["tokens/s"]) > 0 for r in rows if r.get("tokens/s"))


class _Losses(pl.Callback):
    """Records the loss of every training batch."""

    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer: Any, module: Any, outputs: Any, *args: Any) -> None:
        self.losses.append(float(outputs["loss"]))


def _plain_lightning(recipe: Path, steps: int, **data: Any) -> tuple[torch.nn.Module, list[float]]:
    """The Hugging Face model of the recipe's YAML (its model and data keys, ``data``
    overriding the latter) trained ``steps`` optimizer steps by plain Lightning (the
    default strategy, the same seed, module, data and precision), and its losses."""
    cfg = yaml.safe_load(recipe.read_text())
    stdlib = os.path.dirname(os.__file__)
    data = {**cfg["data"]["init_args"], **data}
    data["paths"] = data["paths"].replace("{stdlib}", stdlib)
    pl.seed_everything(cfg["seed_everything"])
    module = CausalLMModule(**cfg["model"]["init_args"])
    recorder = _Losses()
    trainer = pl.Trainer(
        accelerator="cpu", devices=1, precision=cfg["trainer"]["precision"], max_steps=steps,
        limit_val_batches=0, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, callbacks=[recorder],
    )  # fmt: skip
    trainer.fit(module, datamodule=TextDataModule(**data))
    assert module.model is not None
    return module.model.eval(), recorder.losses


@pytest.mark.slow
def test_tiny_cpu_predict_generates_from_the_main_jobs_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The README's main job (2 steps), then the predict recipe on its last checkpoint: the
    losses equal plain Lightning's on the recipe's model and data, and the tokens Hugging
    Face greedy ``generate`` of the model plain Lightning trained."""
    recipes = {p.stem: p for p in RECIPES}
    fit_cfg = parse_recipe(["fit", "--config", str(recipes["tiny-cpu"])])
    predict_cfg = parse_recipe(["predict", "--config", str(recipes["tiny-cpu-predict"])])
    assert predict_cfg.model.init_args.model == fit_cfg.model.init_args.model
    prompts = recipes["tiny-cpu"].parent / "tiny-cpu-prompts.jsonl"
    monkeypatch.chdir(tmp_path)  # runs/tiny-cpu/... of both recipes land here
    fit = [
        "fit", "--config", str(recipes["tiny-cpu"]),
        "--trainer.max_steps=2", "--trainer.val_check_interval=2", "--trainer.limit_val_batches=1",
        "--data.init_args.max_tokens=20000", "--data.init_args.cache_dir=null", "--samples=[]",
        "--trainer.strategy.init_args.hardware=a100-80gb",  # planned without probes
        "--trainer.log_every_n_steps=1",
    ]  # fmt: skip
    assert main(fit) == 0
    ckpt = tmp_path / "runs" / "tiny-cpu" / "checkpoints" / "last.ckpt"
    assert (ckpt / "state.zarr").is_dir()
    predict = [
        "predict", "--config", str(recipes["tiny-cpu-predict"]),
        f"--data.init_args.path={prompts}", "--model.init_args.max_new_tokens=4",
        "--trainer.strategy.init_args.hardware=a100-80gb",
    ]  # fmt: skip
    assert main(predict) == 0
    out = tmp_path / "runs" / "tiny-cpu" / "predictions.jsonl"
    records = {r["id"]: r for r in map(json.loads, out.read_text().splitlines())}
    texts = {r["id"]: r["prompt"] for r in map(json.loads, prompts.read_text().splitlines())}
    assert records.keys() == texts.keys()
    model, losses = _plain_lightning(recipes["tiny-cpu"], 2, max_tokens=20000, cache_dir=None)
    metrics = next((tmp_path / "runs" / "tiny-cpu").rglob("metrics.csv"))
    logged = [float(r["train_loss"]) for r in csv.DictReader(metrics.open()) if r["train_loss"]]
    # the main job trained as plain Lightning does (measured: 1e-7 relative; twice the
    # learning rate moves the second loss by 2.8e-2)
    torch.testing.assert_close(logged, losses, rtol=1e-5, atol=0)
    tokenizer = ByteTokenizer()
    for key, text in texts.items():
        ids = torch.tensor([tokenizer.encode(text)])
        with torch.no_grad():
            want = model.generate(
                input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=4,
                do_sample=False, pad_token_id=0,
            )[0, ids.shape[1] :].tolist()  # fmt: skip
        assert records[key]["token_ids"] == want, key
        assert records[key]["text"] == tokenizer.decode(want)
