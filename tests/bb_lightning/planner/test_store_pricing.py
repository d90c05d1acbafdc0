"""A plan prices at least the store its engine registers for the plan's placement.

The reference is the engines' own accounting: ``required_budgets`` (the training
manifest: every tensor the training engine stores, its scratch and read-ahead sets
included) and ``weights_budgets`` (the weights-only engine's, paging slots included),
which size the store's arenas. Beside its arena the training engine holds fp32 copies
while it registers its state (``setup`` below, written out from
``TrainingEngine.__init__``); those too must fit the host budget.
"""

from __future__ import annotations

import pytest

from bb_lightning.engine.budgets import required_budgets, weights_budgets
from bb_lightning.planner import FitJob, Plan, PlanOverrides, PredictJob, make_plan, preset
from bb_lightning.planner.models import builtin_config
from bb_lightning.planner.profile import ModelProfile
from bb_lightning.probe import model_profile_from_config
from storage.tiers import Tier


def _used(plan: Plan, tier: Tier) -> int:
    return next(m.used for m in plan.memory if m.tier is tier)


@pytest.mark.parametrize(("name", "hardware"), [("llama-30b", "a100-80gb"), ("llama-70b", "h100")])
def test_a_fit_plans_host_bytes_hold_its_engines_store_and_setup(name: str, hardware: str) -> None:
    model = model_profile_from_config(builtin_config(name))
    plan = make_plan(model, preset(hardware), FitJob(seq_len=2048, global_batch_seqs=512))
    n = model.num_blocks
    need = required_budgets([model.block_train] * n, model.rest_train, plan.placement)
    # the fp32 values of the weights outside the blocks (their moments made as zeros by
    # the store), dropped once bound to the device; then each block's fp32 values and the
    # bf16 copy its weights are stored from
    setup = max(4 * model.rest_train, (4 + 2) * model.block_params)
    # after setup the same host memory holds the pages of paged blocks in flight (depth + 1
    # blocks' bf16 weights) and two blocks' bf16 gradients on their way off the device
    p = plan.placement
    if any(w is not Tier.DEVICE for w in p.weights):
        setup = max(setup, 2 * (p.prefetch_depth + 1 + 2) * model.block_params)
    # boundary inputs the chunked blocks keep in pinned host memory (registered as they
    # come, beside the manifest): each recomputed block's input, or two staged for NVMe
    recomputed = len(p.recomputed or ())
    kept = {Tier.HOST: recomputed, Tier.NVME: 2}.get(p.boundaries or Tier.DEVICE, 0)
    setup += kept * plan.tokens_per_pass * model.act_bytes_per_token_checkpointed
    host = _used(plan, Tier.HOST)
    assert need[Tier.HOST] + setup <= host <= need[Tier.HOST] + setup + (8 << 20)
    assert host <= next(m.budget for m in plan.memory if m.tier is Tier.HOST)


def _predict(model: ModelProfile, attention: Tier) -> Plan:
    job = PredictJob(prompt_len=512, new_tokens=128, num_prompts=10000)
    ov = PlanOverrides(decode_attention=attention)
    return make_plan(model, preset("a100-80gb"), job, overrides=ov)


@pytest.mark.parametrize("name", ["llama-30b", "opt-30b"])
def test_a_predict_plans_device_bytes_hold_its_engines_arena_and_kv_cache(name: str) -> None:
    model = model_profile_from_config(builtin_config(name))
    plan = _predict(model, Tier.DEVICE)
    need = weights_budgets([model.block_params] * model.num_blocks, plan.placement)
    assert plan.placement.kv_cache is Tier.DEVICE
    kv = plan.concurrent_seqs * (512 + 128) * model.kv_bytes_per_token * model.num_blocks
    outside = 2 * (model.embed_params + model.head_params + model.final_params)
    assert _used(plan, Tier.DEVICE) >= need[Tier.DEVICE] + kv + outside


@pytest.mark.parametrize("name", ["llama-30b", "opt-30b"])
def test_a_host_attention_plans_host_bytes_hold_its_kv_cache(name: str) -> None:
    """With attention on the host the cache lies in host memory beside the paged weights'
    host arena; the device holds the arena's slots and resident blocks, not the cache."""
    model = model_profile_from_config(builtin_config(name))
    plan = _predict(model, Tier.HOST)
    need = weights_budgets([model.block_params] * model.num_blocks, plan.placement)
    assert plan.placement.kv_cache is Tier.HOST
    kv = plan.concurrent_seqs * (512 + 128) * model.kv_bytes_per_token * model.num_blocks
    outside = 2 * (model.embed_params + model.head_params + model.final_params)
    assert _used(plan, Tier.DEVICE) >= need[Tier.DEVICE] + outside
    assert _used(plan, Tier.HOST) >= need[Tier.HOST] + kv
