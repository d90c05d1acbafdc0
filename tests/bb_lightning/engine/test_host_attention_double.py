"""Host decode attention beside paged blocks under the CPU double of CUDA's copy semantics
(storage.deferred): each block's weights reach the device by a copy that lands only when
ordered, as on CUDA, while the KV cache lives on the host (its last layer in a file on the
NVMe path) and decode attention runs there; the batch as one group, and as two and three
(uneven) groups of sequences in flight, which page each block in once per step for all."""

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


@pytest.mark.parametrize(("spilled", "groups"), [(0, 1), (1, 1), (0, 2), (1, 3)])
def test_paged_blocks_with_host_attention_generate_like_hf_under_the_double(
    spilled: int, groups: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
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
    acquired: list[int] = []
    acquire = engine.pager.acquire

    def counted(i: int) -> list[torch.Tensor]:
        acquired.append(i)
        return acquire(i)

    monkeypatch.setattr(engine.pager, "acquire", counted)
    gen = LayerMajorGenerator(
        model, kv_tier=Tier.HOST, attention_tier=Tier.HOST, kv_nvme_layers=spilled,
        kv_nvme_dir=str(tmp_path), attention_groups=groups,
    )  # fmt: skip
    ids, mask = _prompts()
    out = gen.generate(ids, mask, GenerationConfig(max_new_tokens=NEW))
    assert [g.token_ids for g in out] == want
    assert store._io.double is not None and store._io.double.poisoned_bytes > 0
    assert [kv.rows for kv in gen._kvs] == [[4], [2, 2], [2, 1, 1]][groups - 1]
    assert all(kv.nvme_layers == spilled for kv in gen._kvs)
    # each step pages every block in once, whatever the groups in flight
    assert gen.steps == NEW and acquired == list(range(len(blocks))) * NEW
    engine.close()
    store.close()
