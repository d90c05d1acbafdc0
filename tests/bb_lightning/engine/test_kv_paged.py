"""A KV cache on the host beside the device's attention, homed in the store's host tier and
paged layer by layer through the store, under the CPU double of CUDA's copy semantics
(storage.deferred: a copy lands only when ordered, its destination poisoned until then):
greedy tokens equal Hugging Face ``generate`` (fp32), and the store's budgets hold it."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch

from bb_lightning.engine.budgets import weights_budgets
from bb_lightning.engine.generate import GenerationConfig, LayerMajorGenerator
from bb_lightning.engine.inference import InferenceEngine
from bb_lightning.engine.kv_paged import PagedLayer, kv_budgets
from bb_lightning.hf.structure import find_block_list
from bb_lightning.placement import Placement
from bb_lightning.probe import model_profile_from_config
from bb_lightning.shapes import cache_length
from storage.store import StoreConfig, TieredStore
from storage.tiers import Tier

from .test_generate import NEW, _mid_eos, _model, _prompts, _reference

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize("arch", ["llama", "opt", "lfm2"])
def test_a_paged_host_cache_generates_like_hf_within_the_store_budgets(arch: str) -> None:
    model = _model(arch)
    want = _reference(copy.deepcopy(model))
    eos = _mid_eos(want)
    want_eos = _reference(copy.deepcopy(model), eos)
    _, blocks = find_block_list(model)
    placement = dataclasses.replace(
        Placement.uniform(len(blocks), weights=Tier.HOST, compute_dtype="float32"),
        kv_cache=Tier.HOST,
    )
    ids, mask = _prompts()
    rows, positions = ids.shape[0], cache_length(ids.shape[1] + NEW)
    profile = model_profile_from_config(model.config)
    kv = kv_budgets(placement, rows, positions, profile.kv_bytes_per_token, len(blocks))
    assert kv is not None
    need = weights_budgets([sum(p.numel() for p in b.parameters()) for b in blocks], placement)
    store = TieredStore(  # the engine's budgets and the cache's (and the strategy's slack)
        StoreConfig(
            device_budget=need[Tier.DEVICE] + kv[Tier.DEVICE] + (1 << 20),
            host_budget=need[Tier.HOST] + kv[Tier.HOST],
            device="cpu",
            cuda_double=True,
        )
    )
    engine = InferenceEngine(model, list(blocks), store, placement, device=torch.device("cpu"))
    before = store.usage()[Tier.HOST][0]
    gen = LayerMajorGenerator(model, kv_tier=Tier.HOST, kv_store=store)
    out = gen.generate(ids, mask, GenerationConfig(max_new_tokens=NEW))
    assert [g.token_ids for g in out] == want
    # EOS mid-way (rows leave the batch and the cache compacts), on the same cache
    cache = gen._kv
    out = gen.generate(ids, mask, GenerationConfig(max_new_tokens=NEW, eos_token_ids=(eos,)))
    assert [g.token_ids for g in out] == want_eos
    assert gen._kv is cache and cache is not None and cache.pager is not None
    paged = [x for x in cache.cache.layers if isinstance(x, PagedLayer)]
    assert paged  # every full-attention layer (LFM2's convolution layers keep their states)
    # every paged layer is a tensor of the store's host tier, and holds the cache's bytes
    held = store.usage()[Tier.HOST][0] - before
    assert held == len(paged) * (kv[Tier.HOST] // len(blocks))
    assert all(store.home(x.name) is Tier.HOST for x in paged)
    assert store._io.double is not None and store._io.double.poisoned_bytes > 0
    gen.close()  # the store gets its host memory back
    assert store.usage()[Tier.HOST][0] == before
    engine.close()
    store.close()
