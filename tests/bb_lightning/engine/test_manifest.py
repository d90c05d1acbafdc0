"""The manifest is what the engines register, and what the planner counts on NVMe."""

from __future__ import annotations

import copy
from collections.abc import Sequence
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from bb_lightning.engine.inference import InferenceEngine
from bb_lightning.placement import (
    ModelSizes,
    Placement,
    StoredTensor,
    manifest_bytes,
    training_manifest,
    weights_manifest,
)
from bb_lightning.planner import FitJob, PlanOverrides, PredictJob, make_plan
from bb_lightning.planner.profile import HardwareProfile, ModelProfile
from bb_lightning.probe import model_profile_from_module
from storage.store import StoreConfig, TieredStore
from storage.tiers import Tier

from ..tiny import cpu_engine, hf_config, tiny_llama, tiny_llama_config

D, H, N = Tier.DEVICE, Tier.HOST, Tier.NVME


def _registered(store: TieredStore) -> set[tuple[str, int, str, Tier]]:
    out = set()
    for name in store.names():
        spec = store.spec(name)
        dtype = str(spec.dtype).removeprefix("torch.")
        out.add((name, int(torch.Size(spec.shape).numel()), dtype, store.home(name)))
    return out


def _listed(manifest: Sequence[StoredTensor]) -> set[tuple[str, int, str, Tier]]:
    return {(t.name, t.numel, t.dtype, t.home) for t in manifest}


def test_the_training_engine_registers_its_manifest(tmp_path: Path) -> None:
    model = tiny_llama()
    layer = model.model.layers[1]
    for p in layer.mlp.parameters():  # block 1 has frozen weights: no state for them
        p.requires_grad_(False)
    store = TieredStore(StoreConfig(device_budget=8 << 20, host_budget=32 << 20, device="cpu",
                                    nvme_path=str(tmp_path / "nvme"), nvme_budget=32 << 20))  # fmt: skip
    placement = Placement(weights=(N, H, D), master=(H, N, H), grads=(N, H, H), read_ahead=3)
    frozen = sum(p.numel() for p in layer.mlp.parameters())
    trained = sum(p.numel() for p in layer.parameters()) - frozen
    largest = max(sum(p.numel() for p in b.parameters() if p.requires_grad)
                  for b in model.model.layers)  # fmt: skip
    engine = cpu_engine(model, store, placement)
    try:
        assert _registered(store) == _listed(engine.manifest)
        assert ("block.1.frozen", frozen, "float32", H) in _listed(engine.manifest)
        assert ("block.1.exp_avg", trained, "float32", N) in _listed(engine.manifest)
        assert ("block.1.grad", trained, "float32", H) in _listed(engine.manifest)
        # three read-ahead sets (state of block 1 on NVMe) of the largest trained block
        ahead = [t for t in engine.manifest if ".ahead." in t.name]
        assert len(ahead) == 9 and {t.numel for t in ahead} == {largest}
    finally:
        engine.close()
        store.close()


def test_the_inference_engine_registers_its_weights_manifest() -> None:
    model = copy.deepcopy(tiny_llama())
    store = TieredStore(StoreConfig(device_budget=8 << 20, host_budget=8 << 20, device="cpu"))
    placement = Placement(weights=(H, D, H), master=(), compute_dtype="bfloat16")
    blocks = list(model.model.layers)
    want = {(f"block.{i}.weight", sum(p.numel() for p in b.parameters()), "bfloat16", w)
            for i, (b, w) in enumerate(zip(blocks, placement.weights, strict=True))}  # fmt: skip
    engine = InferenceEngine(model, blocks, store, placement, device=torch.device("cpu"))
    try:
        assert _registered(store) == _listed(engine.manifest) == want
    finally:
        engine.close()
        store.close()


def _profile() -> ModelProfile:
    cfg = hf_config(tiny_llama_config(4, vocab_size=128, max_position_embeddings=2048))
    with torch.device("meta"):
        return model_profile_from_module(AutoModelForCausalLM.from_config(cfg))


HW = HardwareProfile(
    name="small", device_type="cuda", device_memory=2 << 30, device_flops=1e13,
    h2d_bandwidth=1e10, d2h_bandwidth=1e10, host_memory=1 << 30, nvme_read_bandwidth=2e9,
    nvme_write_bandwidth=1e9, nvme_capacity=1 << 40, host_adam_params_per_s=1e9, cores=4,
)  # fmt: skip


@pytest.mark.parametrize(
    "ov",
    [
        PlanOverrides(weights_tier=N, master_tier=N, micro_batch=1),
        PlanOverrides(weights_tier=H, master_tier=N, micro_batch=1),
        PlanOverrides(weights_tier=N, master_tier=H, micro_batch=1),
    ],
    ids=["all-nvme", "state-nvme", "weights-nvme"],
)
def test_the_planned_nvme_bytes_are_the_manifests(ov: PlanOverrides) -> None:
    m = _profile()
    job = FitJob(seq_len=32, global_batch_seqs=2, compute_dtype="float32")
    plan = make_plan(m, HW, job, overrides=ov)
    n = m.num_blocks
    sizes = ModelSizes(blocks=(m.block_train,) * n, rest=m.rest_train,
                       frozen=(m.block_params - m.block_train,) * n)  # fmt: skip
    nvme = manifest_bytes(training_manifest(sizes, plan.placement))[N]
    assert nvme > 0 and {t.tier: t.used for t in plan.memory}[N] == nvme


def test_the_planned_nvme_weights_of_generation_are_the_manifests() -> None:
    m = _profile()
    job = PredictJob(prompt_len=16, new_tokens=4, num_prompts=4)
    plan = make_plan(m, HW, job, overrides=PlanOverrides(weights_tier=N, concurrent_seqs=4))
    sizes = ModelSizes(blocks=(m.block_params,) * m.num_blocks)
    nvme = manifest_bytes(weights_manifest(sizes, plan.placement))[N]
    assert nvme == m.num_blocks * m.block_params * 2
    assert {t.tier: t.used for t in plan.memory}[N] == nvme
