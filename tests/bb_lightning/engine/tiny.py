"""A tiny Llama and an fp32 CPU training engine over it, shared by the engine tests."""

from __future__ import annotations

import dataclasses

import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from bb_lightning.engine.trainer_engine import TrainingEngine
from bb_lightning.placement import Placement
from storage.store import TieredStore

LAYERS = 3


def tiny_llama() -> torch.nn.Module:
    """A 3-block, width-64 Llama (GQA 4:2) with seed-0 weights."""
    cfg = LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=LAYERS,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=128,
        max_position_embeddings=64,
    )
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(cfg)


def cpu_engine(model: torch.nn.Module, store: TieredStore, placement: Placement) -> TrainingEngine:
    """An fp32 training engine on the CPU over the model's decoder layers."""
    return TrainingEngine(
        model,
        model.model.layers,
        store,
        dataclasses.replace(placement, compute_dtype="float32"),
        device=torch.device("cpu"),
    )
