"""``bb-lightning predict --config RECIPE --dry-run``: one batch of the recipe's generation
job on meta tensors, planned on the preset its strategy names, as a run plans it."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from bb_lightning.cli import main
from bb_lightning.hf.lora import LoraOptions
from bb_lightning.planner import PlanOverrides, PredictJob, make_plan, preset
from bb_lightning.planner.models import builtin_config
from bb_lightning.probe import model_profile_from_config
from bb_lightning.strategy.dryrun import dry_predict, meta_model
from storage.tiers import Link

from .test_recipes import _header

RECIPES = Path(__file__).resolve().parents[3] / "recipes"
HARDWARE = "--trainer.strategy.init_args.hardware="


def _link_ratios(out: str) -> dict[str, float]:
    """The dry run's bytes per link over the plan's, as it prints them (``x 1.000``, a
    note of the bytes moved outside the store after it)."""
    found = re.findall(r"^\s+(\w+)\s+\S+ GiB\s+\S+ GiB\s+x\s+([\d.]+)(?:\s+\(.*\))?$", out, re.M)
    return {link: float(ratio) for link, ratio in found}


@pytest.mark.slow  # an OPT-30B batch: prefill, then three decode steps, on meta tensors
def test_a_predict_recipe_dry_runs_one_batch_on_its_preset(
    capsys: pytest.CaptureFixture[str],
) -> None:
    recipe = str(RECIPES / "opt-30b-predict.yaml")
    args = ["predict", "--config", recipe, HARDWARE + "a100-80gb",
            "--model.init_args.model=opt-30b", "--dry-run"]  # fmt: skip
    assert main(args) == 0
    out = capsys.readouterr().out
    # the recipe's job: prompts of up to max_prompt_len, max_new_tokens, batch_size rows
    assert "prompts of up to 512 tokens, 128 new tokens, 64 prompts" in out
    assert "batches of 64" in out and "dry run (predict, one batch)" in out
    assert "OVER BUDGET" not in out
    # every weight pass moves what the plan prices, as the same job dry-run directly
    ratios = _link_ratios(out)
    assert ratios["h2d"] == pytest.approx(1.0, abs=0.05), out[-3000:]
    job = PredictJob(prompt_len=512, new_tokens=128, num_prompts=64)
    profile = model_profile_from_config(builtin_config("opt-30b"))
    plan = make_plan(profile, preset("a100-80gb"), job, overrides=PlanOverrides(concurrent_seqs=64))
    direct = dry_predict(plan, builtin_config("opt-30b"))
    gib = direct.links[Link.HOST_TO_DEVICE] / (1 << 30)
    assert f"{gib:.2f} GiB" in out


def test_a_predict_recipe_counts_its_prompts_file_and_takes_the_plans_batch(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    recipe = str(RECIPES / "tiny-cpu-predict.yaml")  # batch_size: null, hardware: measure
    assert main(["predict", "--config", recipe, "--dry-run"]) == 2
    assert "--trainer.strategy.init_args.hardware=PRESET" in capsys.readouterr().err
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(f'{{"id": {i}, "prompt": "p{i}"}}\n' for i in range(5)) + "\n")
    args = ["predict", "--config", recipe, HARDWARE + "l4",
            f"--data.init_args.path={prompts}", "--dry-run"]  # fmt: skip
    assert main(args) == 0
    out = capsys.readouterr().out
    assert f"5 prompts (the 5 lines of {prompts})" in out  # the blank line is no prompt
    assert "prompts of up to 256 tokens, 64 new tokens" in out
    assert "OVER BUDGET" not in out
    # batch_size null: the plan's batch, never more rows than the job has prompts
    rows = int(re.findall(r"batches of (\d+)", out)[0])
    assert 1 <= rows <= 5 and f"batch: {rows} concurrent sequences" in out


def test_a_batch_the_preset_cannot_run_is_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    recipe = str(RECIPES / "opt-30b-predict.yaml")
    args = ["predict", "--config", recipe, HARDWARE + "t4", "--model.init_args.model=opt-30b",
            "--data.init_args.batch_size=100000", "--dry-run"]  # fmt: skip
    assert main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "t4 cannot run batches of 100000 prompts" in err[0], err
    assert "lower data.init_args.batch_size" in err[0]


def _peak_rows(out: str) -> dict[str, tuple[float, float]]:
    """Each memory tier's peak and budget, GiB, as the dry run prints them."""
    rows = re.findall(r"^\s+(device|host)\s+([\d.]+) GiB\s+[\d.]+ GiB\s+([\d.]+) GiB", out, re.M)
    return {tier: (float(peak), float(budget)) for tier, peak, budget in rows}


@pytest.mark.slow  # a 7B LoRA step on meta tensors: about 20 s on 2 cores
def test_a_lora_recipe_dry_runs_its_adapters_over_the_frozen_base(
    capsys: pytest.CaptureFixture[str],
) -> None:
    pytest.importorskip("peft")
    recipe = RECIPES / "llama-7b-lora-24gb.yaml"
    spec = _header(recipe, "plan-as")
    assert spec is not None
    args = ["fit", "--config", str(recipe), HARDWARE + "rtx4090",
            f"--model.init_args.model={spec}", "--dry-run"]  # fmt: skip
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "OVER BUDGET" not in out and "dry run (fit, 16 micro-batches)" in out
    peaks = _peak_rows(out)
    assert set(peaks) == {"device", "host"}
    assert all(0 < peak <= budget for peak, budget in peaks.values()), peaks
    # every link moves what the plan prices: the frozen base paged in, read-only
    ratios = _link_ratios(out)
    assert set(ratios) == {"h2d", "d2h"}, out[-1500:]
    assert all(r == pytest.approx(1.0, abs=0.05) for r in ratios.values()), ratios
    assert ", 14 swapped;" in out  # the last blocks' saved activations go to the host
    # every block recomputing (the recipe's override), the adapters' gradients leave the
    # device: peft's trained count, in bf16, per micro-batch (the 6.7 B frozen weights
    # would be 800 times more), and the recomputed blocks' boundary inputs where the plan
    # keeps them on the host (2 x 2,048 tokens x 4,096 wide, bf16, per block)
    no_swap = "--trainer.strategy.init_args.overrides.swap_activations=false"
    assert main([*args, no_swap]) == 0
    out = capsys.readouterr().out
    assert "swap" not in out.split("per block", 1)[1].split("\n", 1)[0]
    model = meta_model(json.loads(spec), torch.bfloat16, lora=LoraOptions(rank=16))
    trained, total = model.get_nb_trainable_parameters()
    assert (trained, total) == (39_976_960, 6_778_392_576)
    d2h = re.search(r"^\s+d2h\s+([\d.]+) GiB", out, re.M)
    assert d2h is not None
    recomputed = re.search(r"\((\d+) of 32 blocks recomputed", out)
    assert recomputed is not None
    bounds = 2 * 2048 * 4096 * 2 * int(recomputed.group(1)) if "live on the host" in out else 0
    assert float(d2h.group(1)) == pytest.approx(16 * (trained * 2 + bounds) / 2**30, abs=0.01)
