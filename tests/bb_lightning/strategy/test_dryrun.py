"""The dry run on meta tensors against real runs of the same plan.

A tiny Llama's real fit step on the CPU, under the CPU double of CUDA's copy semantics
(HOST-home tensors paged in by copies, gradients copied off the device, as on CUDA),
moves exactly the bytes per link that the dry run counts on ``meta`` tensors; and a
plan whose device budget is below the true peak fails the dry run, naming the tier.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM

from bb_lightning.cli import main, parse_recipe
from bb_lightning.engine.optimizer_step import OptimizerStep
from bb_lightning.engine.trainer_engine import TrainingEngine
from bb_lightning.hf.lora import LoraOptions
from bb_lightning.hf.structure import find_block_list, load_config
from bb_lightning.placement import Placement
from bb_lightning.planner import FitJob, Plan, PlanOverrides, PredictJob, make_plan, preset
from bb_lightning.planner.models import BUILTIN_MODELS, builtin_config
from bb_lightning.probe import model_profile_from_config, model_profile_from_module
from bb_lightning.strategy import dryrun
from bb_lightning.strategy.assembly import build_engine
from bb_lightning.strategy.dryrun import (
    dry_fit,
    dry_predict,
    meta_model,
    priced_bytes,
    run_fit_step,
)
from bb_lightning.strategy.dryrun_memory import MemoryAccountant
from storage.store import StoreConfig
from storage.tiers import PRICED_LINKS, Link, Tier

from ..cli.test_recipes import RECIPES, _header
from ..tiny import tiny_llama_config

CONFIG = tiny_llama_config(4)
"""A 4-block Llama small enough to train for real in a second."""
ON_DEVICE = PlanOverrides(decode_attention=Tier.DEVICE)
"""Generation with the device's attention (the host's has its own dry runs:
``test_dryrun_host_attention.py``)."""


def _plan(placement: Placement, *, seqs: int, clip: bool) -> Plan:
    model = model_profile_from_config(CONFIG)
    job = FitJob(seq_len=16, global_batch_seqs=seqs, grad_clipping=clip, compute_dtype="float32")
    plan = make_plan(model, preset("a100-80gb"), job)
    return dataclasses.replace(plan, placement=placement, micro_batch=2, grad_accum=seqs // 2)


PLACEMENT = Placement(
    weights=(Tier.NVME, Tier.HOST, Tier.DEVICE, Tier.HOST),
    master=(Tier.NVME, Tier.HOST, Tier.HOST, Tier.NVME),
    grads=(Tier.HOST, Tier.NVME, Tier.HOST, Tier.HOST),
    prefetch_depth=1,
    read_ahead=1,
    compute_dtype="float32",
)


def _real_bytes(plan: Plan, tmp_path: Path) -> dict[str, int]:
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(load_config(CONFIG))
    model.config._attn_implementation = "sdpa"
    _, blocks = find_block_list(model)
    store = StoreConfig(
        device_budget=64 << 20,
        host_budget=64 << 20,
        nvme_path=str(tmp_path / "nvme"),
        nvme_budget=64 << 20,
        device="cpu",
        cuda_double=True,
    )
    built = build_engine(model, list(blocks), plan.placement, training=True,
                         device=torch.device("cpu"), loader=None, store=store)  # fmt: skip
    engine = built.engine
    assert isinstance(engine, TrainingEngine)
    # On a CPU device host and device tensors are both CPU tensors; on CUDA a source
    # outside the device arena (the optimizer's host buffers) is host memory.
    arena = built.store._device_arena
    built.store._tier_of = lambda tensor: Tier.DEVICE if arena.holds(tensor) else Tier.HOST  # type: ignore[method-assign]
    before = priced_bytes(built.store)
    try:
        run_fit_step(engine, plan, device=torch.device("cpu"), every=True)
    finally:
        engine.close()
        built.store.close()  # its write-backs done
    after = priced_bytes(built.store)
    return {link.value: after[link] - before[link] for link in PRICED_LINKS}


@pytest.mark.parametrize(
    ("seqs", "clip"),
    [(4, False), (4, True), (10, False)],  # 2 and 5 micro-batches (first, middle x3, last)
)
def test_dry_fit_moves_the_bytes_of_a_real_step(tmp_path: Path, seqs: int, clip: bool) -> None:
    plan = _plan(PLACEMENT, seqs=seqs, clip=clip)
    real = _real_bytes(plan, tmp_path)
    dry = dry_fit(plan, CONFIG, direct_device=True)  # a CPU store reads NVMe into its slots
    store = {link.value: dry.links[link] - dry.outside[link] for link in PRICED_LINKS}
    assert store == real
    assert real["h2d"] > 0 and real["nvme_read"] > 0 and real["nvme_write"] > 0


def test_a_clipped_dry_run_steps_the_blocks_after_backward_as_a_run_does(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Under norm clipping the strategy's step clips and steps every block on the gradient
    worker after the last backward (``OptimizerStep.step_deferred``); the dry run runs
    that step, each block's update done when it returns, not the plain step after it."""
    deferred: list[int] = []
    done: list[bool] = []
    real_deferred = OptimizerStep.step_deferred

    def spy(self: OptimizerStep, overlap: Any, norms: Any, submit: Any) -> None:
        deferred.append(len(norms))
        real_deferred(self, overlap, norms, submit)

    real_step = run_fit_step

    def checked(engine: TrainingEngine, *args: Any, **kwargs: Any) -> Any:
        out = real_step(engine, *args, **kwargs)
        updated = engine.steps.updated or []
        done.extend(event.is_set() for event in updated)
        return out

    monkeypatch.setattr(OptimizerStep, "step_deferred", spy)
    monkeypatch.setattr(dryrun, "run_fit_step", checked)
    dry_fit(_plan(PLACEMENT, seqs=4, clip=True), CONFIG, direct_device=True)
    assert deferred == [CONFIG["num_hidden_layers"]]
    assert done == [True] * CONFIG["num_hidden_layers"]


def test_accountant_counts_device_blocks_as_cuda_rounds_them() -> None:
    acct = MemoryAccountant()
    with acct:
        acct.where("small", None)
        small = torch.empty(1000, dtype=torch.uint8, device="meta")  # one 512 B multiple
        acct.where("large", 3)
        large = torch.empty((3 << 20) + 1, dtype=torch.uint8, device="meta")  # 2 MiB segments
        host = torch.empty(1000, dtype=torch.float32)  # no device named: host memory
        assert host.is_meta and acct.tier_of(host) is Tier.HOST
        assert acct.current(Tier.DEVICE) == 1024 + (4 << 20)
        assert acct.current(Tier.HOST) == 4000
        total = (small.float() + 1).sum()  # device inputs: device outputs
        assert total.item() == 1.0  # no value to read on meta: one
        del large
        assert acct.current(Tier.DEVICE) == 1024 + 512  # small and the sum (temporaries freed)
    peak = acct.peaks[Tier.DEVICE]
    # small, large, then small.float() and its + 1 (4000 B each, in 512 B blocks) at once
    assert (peak.bytes, peak.phase, peak.block) == (1024 + (4 << 20) + 2 * 4096, "large", 3)
    assert acct.peaks[Tier.HOST].bytes == 4000


def _shrunk(plan: Plan, tier: Tier, budget: int) -> Plan:
    memory = tuple(
        dataclasses.replace(m, budget=budget) if m.tier is tier else m for m in plan.memory
    )
    return dataclasses.replace(plan, memory=memory)


def test_a_device_budget_below_the_peak_fails_naming_the_tier_and_the_phase(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    plan = _plan(PLACEMENT, seqs=4, clip=False)
    fits = dry_fit(plan, CONFIG)
    assert fits.over == []
    peak = fits.peaks[Tier.DEVICE]
    assert peak.phase.startswith(("forward", "backward"))
    under = _shrunk(plan, Tier.DEVICE, peak.bytes - 1)
    report = dry_fit(under, CONFIG)
    assert report.over == [Tier.DEVICE]
    assert report.peaks[Tier.DEVICE] == peak  # the same run, the same peak
    line = next(s for s in report.render().splitlines() if s.strip().startswith("device"))
    assert "OVER BUDGET" in line and peak.phase in line

    import bb_lightning.planner as planner

    monkeypatch.setattr(planner, "make_plan", lambda *a, **k: under)
    monkeypatch.setattr("bb_lightning.planner.models.builtin_config", lambda name: dict(CONFIG))
    rc = main(["plan", "--model", "tiny-llama", "--hardware", "a100-80gb", "--dry-run"])
    err = capsys.readouterr().err
    assert rc == 1
    assert f"the device tier exceeds the plan's budget during {peak.phase}" in err


def test_dry_fit_moves_the_plans_bytes_per_link_within_5_percent() -> None:
    # a 370M Llama on a device of 2 GiB and 3 GiB of host memory: weights paged from the
    # host, optimizer state on NVMe, every priced link busy
    config = builtin_config("llama-370m")
    hw = preset("a100-80gb").replace(device_memory=2 << 30, host_memory=3 << 30)
    job = FitJob(seq_len=512, global_batch_seqs=16)
    plan = make_plan(model_profile_from_config(config), hw, job)
    assert Tier.NVME in plan.placement.master and Tier.HOST in plan.placement.weights
    report = dry_fit(plan, config)
    for link in PRICED_LINKS:
        want = report.planned_links[link]
        assert want > 0, link
        assert report.links[link] == pytest.approx(want, rel=0.05), link


def test_dry_predict_moves_the_plans_bytes_per_link_within_5_percent() -> None:
    # a 370M Llama on a device of 1.6 GiB: 19 of 24 blocks paged from the host per pass
    config = builtin_config("llama-370m")
    hw = preset("a100-80gb").replace(device_memory=int(1.6 * 2**30), host_memory=2 << 30)
    plan = make_plan(
        model_profile_from_config(config),
        hw,
        PredictJob(prompt_len=128, new_tokens=8, num_prompts=8),
        overrides=ON_DEVICE,
    )
    assert plan.placement.kv_cache is Tier.DEVICE and Tier.HOST in plan.placement.weights
    report = dry_predict(plan, config)
    want = report.planned_links[Link.HOST_TO_DEVICE]
    assert want > 0
    assert report.links[Link.HOST_TO_DEVICE] == pytest.approx(want, rel=0.05)
    for link in (Link.NVME_TO_HOST, Link.HOST_TO_NVME, Link.DEVICE_TO_HOST):
        assert report.links[link] == report.planned_links[link] == 0, link
    assert report.over == []


# the LoRA recipe's step is dry-run as the CLI plans it (the same plan: its micro-batch and
# accumulation on its preset) by test_recipe_dryrun, which checks its peaks and links too
DRY_RECIPES = [p for p in RECIPES if p.stem != "llama-7b-lora-24gb"]


@pytest.mark.slow  # a 30B, a 7B and two OPT-30B dry runs: about 25 s on 2 cores
@pytest.mark.parametrize("recipe", DRY_RECIPES, ids=lambda p: p.stem)
def test_every_recipe_dry_runs_on_its_preset(recipe: Path) -> None:
    task = "predict" if recipe.stem.endswith("-predict") else "fit"
    cfg = parse_recipe([task, "--config", str(recipe)])
    hardware = _header(recipe, "preset")
    if hardware == "measure":
        pytest.skip("planned on this machine")
    assert hardware is not None
    spec = _header(recipe, "plan-as") or cfg.model.init_args.model
    config = builtin_config(spec) if spec in BUILTIN_MODELS else json.loads(spec)
    lora = getattr(cfg.model.init_args, "lora", None)
    options = None if lora is None else LoraOptions.from_value(dict(lora))
    if options is None:
        profile = model_profile_from_config(config)
    else:  # the adapters train over the frozen base
        profile = model_profile_from_module(meta_model(config, torch.bfloat16, lora=options))
    data = cfg.data.init_args
    if task == "fit":
        accum = cfg.trainer.accumulate_grad_batches
        job = FitJob(seq_len=data.seq_len, global_batch_seqs=data.batch_size * accum)
        forced = PlanOverrides(micro_batch=data.batch_size, grad_accum=accum)
        plan = make_plan(profile, preset(hardware), job, overrides=forced)
        report = dry_fit(plan, config, lora=options)
    else:
        fields = dict(kv.split("=") for kv in (_header(recipe, "predict") or "").split())
        ask = PredictJob(**{k: int(v) for k, v in fields.items()})  # type: ignore[arg-type]
        report = dry_predict(make_plan(profile, preset(hardware), ask), config)
    assert report.peaks[Tier.DEVICE].bytes > 0
    for link in PRICED_LINKS:
        assert report.links[link] == pytest.approx(report.planned_links[link], rel=0.05), link


def test_a_fit_recipe_dry_runs_on_the_machine_its_strategy_names(
    capsys: pytest.CaptureFixture[str],
) -> None:
    recipe = str(Path(__file__).parents[3] / "recipes" / "tiny-cpu.yaml")
    rc = main(["fit", "--config", recipe, "--dry-run"])  # hardware: measure
    err = capsys.readouterr().err
    assert rc == 2 and "--trainer.strategy.init_args.hardware=PRESET" in err
    hardware = "--trainer.strategy.init_args.hardware=a100-80gb"
    assert main(["fit", "--config", recipe, hardware, "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "micro-batch 8 x grad-accum 1" in out  # the recipe's batch, planned as given
    assert "dry run (fit, 1 micro-batches)" in out and "OVER BUDGET" not in out


def test_a_128k_vocabulary_plan_fits_its_device_budget() -> None:
    # transformers' loss holds three fp32 buffers of the logits' size at once in its
    # backward: priced at 12 bytes per token per vocabulary entry, the plan fits
    config = {**CONFIG, "hidden_size": 512, "num_attention_heads": 8, "num_key_value_heads": 8,
              "intermediate_size": 1024, "vocab_size": 128256, "max_position_embeddings": 4096}  # fmt: skip
    hw = preset("h100").replace(device_memory=6 << 30)
    plan = make_plan(
        model_profile_from_config(config), hw, FitJob(seq_len=2048, global_batch_seqs=64)
    )
    report = dry_fit(plan, config)
    peak = report.peaks[Tier.DEVICE]
    assert report.over == [], (peak, report.budgets[Tier.DEVICE])


def test_the_predict_setup_copies_are_priced_in_the_plans_host_memory() -> None:
    # filling the store, the engine lays each block out in fp32 and casts it to bf16 beside
    # the host arena: the host's peak, which the plan's host memory must cover
    config = builtin_config("llama-370m")
    hw = preset("a100-80gb").replace(device_memory=int(1.6 * 2**30), host_memory=2 << 30)
    job = PredictJob(prompt_len=128, new_tokens=8, num_prompts=8)
    plan = make_plan(model_profile_from_config(config), hw, job, overrides=ON_DEVICE)
    assert Tier.HOST in plan.placement.weights
    report = dry_predict(plan, config)
    peak = report.peaks[Tier.HOST]
    assert peak.phase == "setup"
    with torch.device("meta"):
        _, blocks = find_block_list(AutoModelForCausalLM.from_config(load_config(config)))
    block = sum(p.numel() for p in blocks[0].parameters())  # torch's count, not the profile's
    assert peak.bytes - dict(peak.top)["base"] == pytest.approx(block * (4 + 2), abs=4096)
    assert peak.bytes <= report.planned[Tier.HOST] <= report.budgets[Tier.HOST]
