"""``trainer.predict`` in bf16 on a CPU device runs a prefill cut in row chunks
(``Placement.prefill_tokens``) on each block's linear layers laid out once a block
(``engine.host_packed``, over ``engine.host_linear``'s kernel where it holds them): the
greedy tokens equal a run with torch's ``F.linear`` on every chunk, from a
``save_pretrained`` directory, and the module handed back runs its own ``forward``."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from torch import Tensor, nn
from transformers import AutoModelForCausalLM

from bb_lightning import BalanceBeamStrategy
from bb_lightning.engine import host_linear, host_packed
from bb_lightning.placement import Placement
from storage.tiers import Tier

from .tiny import FAMILIES, VOCAB, save_tiny

NEW = 5

pytestmark = [
    pytest.mark.usefixtures("one_thread"),
    pytest.mark.skipif(not host_packed.available(), reason="no oneDNN packed linear here"),
]


@pytest.mark.parametrize("family", ["llama", "qwen2_tied"])  # Qwen2's q, k, v with biases
def test_predict_prefill_chunks_on_packed_weights_predict_torch_s_tokens(
    family: str, tiny: SimpleNamespace, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = save_tiny(tmp_path / "ckpt", {**FAMILIES[family], "initializer_range": 0.2})
    model = AutoModelForCausalLM.from_pretrained(path)
    per_block = sum(type(m) is nn.Linear for m in model.model.layers[0].modules())
    blocks = len(model.model.layers)
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(3, VOCAB, (12, 50), generator=g)
    mask = torch.ones_like(ids)
    ids[2, :3] = mask[2, :3] = 0  # a shorter prompt, padded on the left
    batch = {"id": [str(i) for i in range(12)], "input_ids": ids, "attention_mask": mask}
    packs: list[tuple[int, ...]] = []
    pack = host_packed.pack_weight

    def counted(weight: Tensor, tokens: int) -> Tensor:
        packs.append(tuple(weight.shape))
        return pack(weight, tokens)

    monkeypatch.setattr(host_packed, "pack_weight", counted)
    exact: dict[tuple[int, int, int, bool], bool] = {}  # this test's product shapes only
    monkeypatch.setattr(host_packed, "_exact", exact)

    def run(name: str) -> object:
        placement = Placement.uniform(blocks, weights=Tier.HOST)
        strategy = BalanceBeamStrategy(
            # six prompts a chunk: 300 rows, past what host_linear's kernel keeps
            placement=dataclasses.replace(placement, prefill_tokens=300),
            compute_dtype="bf16", nvme_path=str(tmp_path / name),
        )  # fmt: skip
        return tiny.predict(path, batch, strategy, NEW)

    assert 300 > host_linear.MAX_ROWS
    packed = run("packed")
    # every linear layer of every block laid out once, at the prefill (two chunks), whether
    # host_linear's kernel holds the layers or not; the decode steps (12 rows of one token)
    # run whole. A shape whose packed product differs from F.linear's (checked at its first
    # call) is laid out that once and runs F.linear after
    assert exact  # each product shape checked once
    if all(exact.values()):
        assert len(packs) == blocks * per_block
    else:
        assert 0 < len(packs) < blocks * per_block
    counted_packs = len(packs)
    monkeypatch.setattr(host_packed, "available", lambda: False)
    assert run("torch") == packed
    assert len(packs) == counted_packs
