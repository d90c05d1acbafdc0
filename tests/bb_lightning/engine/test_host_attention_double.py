"""Host decode attention beside paged blocks under the CPU double of CUDA's copy semantics
(storage.deferred): each block's weights reach the device by a copy that lands only when
ordered, as on CUDA, while the KV cache lives on the host (its last layer in a file on the
NVMe path) and decode attention runs there."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

from bb_lightning.engine.generate import GenerationConfig, LayerMajorGenerator
from bb_lightning.engine.inference import InferenceEngine
from bb_lightning.hf.structure import find_block_list
from bb_lightning.placement import Placement
from storage.store import StoreConfig, TieredStore
from storage.tiers import Tier

from .test_generate import NEW, _model, _prompts, _reference

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize("spilled", [0, 1])
def test_paged_blocks_with_host_attention_generate_like_hf_under_the_double(
    spilled: int, tmp_path: Path
) -> None:
    model = _model("llama")
    want = _reference(copy.deepcopy(model))
    store = TieredStore(
        StoreConfig(device_budget=16 << 20, host_budget=16 << 20, device="cpu", cuda_double=True)
    )
    _, blocks = find_block_list(model)
    engine = InferenceEngine(
        model,
        list(blocks),
        store,
        Placement.uniform(len(blocks), weights=Tier.HOST, compute_dtype="float32"),
        device=torch.device("cpu"),
    )
    gen = LayerMajorGenerator(
        model, kv_tier=Tier.HOST, attention_tier=Tier.HOST, kv_nvme_layers=spilled,
        kv_nvme_dir=str(tmp_path),
    )  # fmt: skip
    ids, mask = _prompts()
    out = gen.generate(ids, mask, GenerationConfig(max_new_tokens=NEW))
    assert [g.token_ids for g in out] == want
    assert store._io.double is not None and store._io.double.poisoned_bytes > 0
    assert gen._kv is not None and gen._kv.nvme_layers == spilled
    engine.close()
    store.close()
