"""The saved activations a swapped block stores, as the planner's profile counts them.

A swapped block packs every tensor autograd saves in its forward through
:class:`~bb_lightning.engine.swapped.SavedActivations`: its own weights as references,
integer and broadcast tensors kept in the graph, and each other distinct view stored on
the host, at its own bytes. The profile's ``swap_bytes_per_token`` (the meta trace's
count) prices the host memory and the link traffic of those stores, so it must equal what
the packer stores per token, per family. The reference here is the packer itself, run on
the first block of the model on ``meta`` tensors in bf16 with fused attention, as the
engine runs it in a dry run.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch

from bb_lightning.engine.swapped import SavedActivations
from bb_lightning.hf.structure import find_block_list
from bb_lightning.probe import model_profile_from_module
from bb_lightning.strategy.dryrun import meta_model

from ..tiny import FAMILIES, VOCAB, hf_config, tiny_model

OPT = {
    "model_type": "opt",
    "hidden_size": 32,
    "ffn_dim": 64,
    "word_embed_proj_dim": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "vocab_size": VOCAB,
    "max_position_embeddings": 64,
}
CONFIGS: dict[str, dict[str, Any]] = {
    "llama": FAMILIES["llama"],
    "opt": OPT,
    "mixtral_moe": FAMILIES["mixtral_moe"],
    "qwen2_tied": FAMILIES["qwen2_tied"],
}
TOKENS = 48
"""Tokens of the packed forward (batch 2 x 24: the trace runs batch 1 x 64)."""


def _packed_bytes(config: dict[str, Any]) -> int:
    """Bytes the swapped-block packer stores for block 0 of ``config``'s model in one
    forward of batch 2 x ``TOKENS // 2`` tokens (bf16 on ``meta``, attention fused)."""
    model = meta_model(hf_config(config), torch.bfloat16)
    _path, blocks = find_block_list(model)
    block = blocks[0]
    params = [p for p in block.parameters() if p.requires_grad]
    frozen = [p for p in block.parameters() if not p.requires_grad]
    runner = SimpleNamespace(pager=SimpleNamespace(params=[params], frozen=[frozen]))
    saved = SavedActivations(runner, 0, SimpleNamespace())  # type: ignore[arg-type]  # stored
    hooks = torch.autograd.graph.saved_tensors_hooks(saved.pack, saved.unpack)
    stored: list[int] = []

    def enter(*_: Any) -> None:
        hooks.__enter__()

    def leave(*_: Any) -> None:
        hooks.__exit__(None, None, None)
        stored.append(sum(t.numel() * t.element_size() for t in saved._held))

    block.register_forward_pre_hook(enter)
    block.register_forward_hook(leave)
    ids = torch.zeros((2, TOKENS // 2), dtype=torch.long, device="meta")
    model(input_ids=ids, labels=ids)
    return stored[0]


@pytest.mark.parametrize("family", sorted(CONFIGS))
def test_the_profile_prices_the_bytes_a_swapped_block_stores(family: str) -> None:
    config = CONFIGS[family]
    per_token = _packed_bytes(config) / TOKENS
    profile = model_profile_from_module(tiny_model(config))
    assert profile.swap_bytes_per_token == pytest.approx(per_token, rel=0.02)
