"""The tests' one factory of tiny models: config dicts of a tiny Llama and GPT-2 (overrides
as keyword arguments), tiny configs of model families of the installed transformers, seeded
random models built from them and saved as users save them (``save_pretrained``), an
fp32 CPU training engine over the 3-block Llama the engine tests share, and the small CPU
machine (a ``HardwareProfile``) the tests plan those models on. Model sizes are in
elements (hidden widths, vocabularies), never bytes."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import torch
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig

from bb_lightning.engine.trainer_engine import TrainingEngine
from bb_lightning.placement import Placement
from bb_lightning.planner.profile import HardwareProfile
from storage.store import TieredStore

LLAMA_VOCAB = 256
LAYERS = 3  # blocks of :func:`tiny_llama`, the engine tests' model


def tiny_llama_config(layers: int = 4, **over: Any) -> dict[str, Any]:
    """A Llama config dict: hidden 64, ``layers`` blocks, GQA 4:2, vocab 256, 64 positions,
    untied head; ``over`` replaces or adds keys."""
    return {
        "model_type": "llama",
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": layers,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": LLAMA_VOCAB,
        "max_position_embeddings": 64,
        "tie_word_embeddings": False,
        **over,
    }


def tiny_gpt2_config(**over: Any) -> dict[str, Any]:
    """A GPT-2 config dict (learned positions, tied head, Conv1D), width 64, 3 blocks,
    dropout off; ``over`` replaces or adds keys."""
    return {
        "model_type": "gpt2",
        "n_embd": 64,
        "n_layer": 3,
        "n_head": 4,
        "vocab_size": LLAMA_VOCAB,
        "n_positions": 64,
        "resid_pdrop": 0.0,
        "embd_pdrop": 0.0,
        "attn_pdrop": 0.0,
        **over,
    }


def hf_config(config: dict[str, Any]) -> PretrainedConfig:
    """The transformers config object of a config dict (its ``model_type`` picks the class)."""
    values = dict(config)
    return AutoConfig.for_model(values.pop("model_type"), **values)


def tiny_model(config: dict[str, Any], seed: int = 0, **load: Any) -> torch.nn.Module:
    """A random causal LM of ``config`` with ``torch.manual_seed(seed)`` weights; ``load``
    goes to ``from_config`` (``attn_implementation=...``)."""
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(hf_config(config), **load)


def save_tiny(directory: Path, config: dict[str, Any], seed: int = 0, **save: Any) -> Path:
    """:func:`tiny_model` written with ``save_pretrained`` into ``directory`` (``save`` goes to
    it: ``max_shard_size=...``)."""
    tiny_model(config, seed).save_pretrained(directory, **save)
    return directory


def cpu_profile(*, nvme: int = 0, **changes: Any) -> HardwareProfile:
    """The tests' small CPU machine: a 2 GiB device share at 50 GFLOP/s, 5 GB/s copy links
    both ways, 4 GiB of host memory, host AdamW at 2e8 parameters/s, 2 cores (figures of
    the order measured on such a machine); ``nvme`` bytes of NVMe read and written at
    1 GB/s (0: none); ``changes`` replace fields."""
    disk = 1e9 if nvme else 0.0
    base = HardwareProfile(
        name="test cpu",
        device_type="cpu",
        device_memory=2 << 30,
        device_flops=5e10,
        h2d_bandwidth=5e9,
        d2h_bandwidth=5e9,
        host_memory=4 << 30,
        nvme_read_bandwidth=disk,
        nvme_write_bandwidth=disk,
        nvme_capacity=nvme,
        host_adam_params_per_s=2e8,
        cores=2,
    )
    return base.replace(**changes)


def tiny_llama() -> torch.nn.Module:
    """The engine tests' model: a :data:`LAYERS`-block, width-64 Llama (GQA 4:2, vocab 128)
    with seed-0 weights."""
    return tiny_model(tiny_llama_config(LAYERS, vocab_size=128))


def cpu_engine(model: torch.nn.Module, store: TieredStore, placement: Placement) -> TrainingEngine:
    """An fp32 training engine on the CPU over the model's decoder layers."""
    return TrainingEngine(
        model,
        model.model.layers,
        store,
        dataclasses.replace(placement, compute_dtype="float32"),
        device=torch.device("cpu"),
    )


VOCAB = 128
_BASE: dict[str, Any] = {
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": VOCAB,
    "max_position_embeddings": 64,
}
_EXPERTS: dict[str, Any] = {"num_experts": 4, "num_experts_per_tok": 2}
FAMILIES: dict[str, dict[str, Any]] = {
    "llama": {"model_type": "llama", **_BASE},
    "mistral_sliding": {"model_type": "mistral", **_BASE, "sliding_window": 8},
    "qwen2_tied": {"model_type": "qwen2", **_BASE, "tie_word_embeddings": True},
    "qwen3": {"model_type": "qwen3", **_BASE, "head_dim": 8},
    "gemma_tied": {"model_type": "gemma", **_BASE, "head_dim": 8},
    "gemma2_sliding": {"model_type": "gemma2", **_BASE, "head_dim": 8, "sliding_window": 8},
    "gemma3_sliding": {
        "model_type": "gemma3_text",
        **_BASE,
        "head_dim": 8,
        "sliding_window": 8,
        "layer_types": ["sliding_attention", "full_attention"],
    },
    "phi3": {"model_type": "phi3", **_BASE, "pad_token_id": 0},
    "llama_dropout": {"model_type": "llama", **_BASE, "attention_dropout": 0.5},
    "phimoe_sampled_router": {  # in training mode its router samples experts at random
        "model_type": "phimoe",
        **_BASE,
        "num_local_experts": 4,
        "num_experts_per_tok": 2,
    },
    "gemma3n_per_layer_inputs": {  # each block takes a per-layer input made by trainable weights
        "model_type": "gemma3n_text",
        **_BASE,
        "head_dim": 8,
        "layer_types": ["sliding_attention", "full_attention"],
        "sliding_window": 8,
        "num_kv_shared_layers": 0,
        "vocab_size_per_layer_input": VOCAB,
        "hidden_size_per_layer_input": 8,
        "laurel_rank": 4,
        "altup_num_inputs": 2,
        "intermediate_size": [64, 64],
        "activation_sparsity_pattern": [0.0, 0.0],
    },
    "lfm2_conv": {  # short convolutions: a per-row state in the cache beside keys and values
        "model_type": "lfm2",
        **_BASE,
        "block_ff_dim": 64,
        "layer_types": ["conv", "full_attention"],
        "conv_L_cache": 3,
        "initializer_range": 0.2,  # weights large enough that a wrong state shows in tokens
    },
    "mamba_state": {  # no attention at all: a convolution and an SSM state per row
        "model_type": "mamba",
        "hidden_size": 32,
        "state_size": 8,
        "num_hidden_layers": 2,
        "vocab_size": VOCAB,
        "initializer_range": 0.2,
    },
    "qwen3_next_linear": {  # a gated-delta-net layer (conv and recurrent states), then attention
        "model_type": "qwen3_next",
        **_BASE,
        **_EXPERTS,
        "head_dim": 8,
        "moe_intermediate_size": 32,
        "layer_types": ["linear_attention", "full_attention"],
        "initializer_range": 0.2,
    },
    "falcon_h1_state_and_keys": {  # each layer keeps a mamba state and attention keys
        "model_type": "falcon_h1",
        **_BASE,
        "head_dim": 8,
        "mamba_d_ssm": 32,
        "mamba_n_heads": 4,
        "mamba_d_head": 8,
        "mamba_d_state": 8,
        "mamba_n_groups": 1,
        "mamba_chunk_size": 16,
        "initializer_range": 0.2,
    },
    "gpt2_tied": {
        "model_type": "gpt2",
        "n_embd": 32,
        "n_layer": 2,
        "n_head": 4,
        "vocab_size": VOCAB,
        "n_positions": 64,
        "resid_pdrop": 0.0,
        "embd_pdrop": 0.0,
        "attn_pdrop": 0.0,
    },
    "bloom_alibi_tied": {
        "model_type": "bloom",
        "hidden_size": 32,
        "n_layer": 2,
        "n_head": 4,
        "vocab_size": VOCAB,
        "hidden_dropout": 0.0,
        "attention_dropout": 0.0,
    },
    "falcon": {
        "model_type": "falcon",
        "hidden_size": 32,
        "max_position_embeddings": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "vocab_size": VOCAB,
        "hidden_dropout": 0.0,
        "attention_dropout": 0.0,
    },
    "mpt_alibi": {
        "model_type": "mpt",
        "d_model": 32,
        "n_layers": 2,
        "n_heads": 4,
        "expansion_ratio": 2,
        "max_seq_len": 64,
        "vocab_size": VOCAB,
        "resid_pdrop": 0.0,
        "emb_pdrop": 0.0,
        "attn_config": {"attn_pdrop": 0, "alibi": True},
    },
    "gpt_neox": {
        "model_type": "gpt_neox",
        **{k: v for k, v in _BASE.items() if k != "num_key_value_heads"},
        "hidden_dropout": 0.0,
        "attention_dropout": 0.0,
    },
    "olmo2": {"model_type": "olmo2", **_BASE},
    "gpt_neo_local": {  # local attention cut from a mask by the key length: caches <= window
        "model_type": "gpt_neo",
        "hidden_size": 32,
        "num_layers": 2,
        "num_heads": 4,
        "attention_types": [[["global", "local"], 1]],
        "window_size": 16,
        "vocab_size": VOCAB,
        "max_position_embeddings": 64,
        "embed_dropout": 0.0,
        "attention_dropout": 0.0,
        "resid_dropout": 0.0,
    },
    "starcoder2_sliding": {
        "model_type": "starcoder2",
        **_BASE,
        "sliding_window": 8,
        "residual_dropout": 0.0,
        "embedding_dropout": 0.0,
    },
    "mixtral_moe": {
        "model_type": "mixtral",
        **_BASE,
        "num_local_experts": 4,
        "num_experts_per_tok": 2,
    },
    "mixtral_aux_loss": {  # the routers' load-balancing loss joins the loss (captured logits)
        "model_type": "mixtral",
        **_BASE,
        "num_local_experts": 4,
        "num_experts_per_tok": 2,
        "output_router_logits": True,
        "router_aux_loss_coef": 0.5,
    },
    "qwen2_moe": {
        "model_type": "qwen2_moe",
        **_BASE,
        **_EXPERTS,
        "moe_intermediate_size": 32,
        "shared_expert_intermediate_size": 32,
    },
    "qwen3_moe": {
        "model_type": "qwen3_moe",
        **_BASE,
        **_EXPERTS,
        "head_dim": 8,
        "moe_intermediate_size": 32,
    },
    "qwen3_moe_dense_first": {
        "model_type": "qwen3_moe",
        **_BASE,
        **_EXPERTS,
        "head_dim": 8,
        "moe_intermediate_size": 32,
        "mlp_only_layers": [0],
    },
    "deepseek_v3_mla_moe": {
        "model_type": "deepseek_v3",
        **_BASE,
        "num_key_value_heads": 4,
        "moe_intermediate_size": 32,
        "n_routed_experts": 4,
        "num_experts_per_tok": 2,
        "first_k_dense_replace": 1,
        "kv_lora_rank": 16,
        "q_lora_rank": 16,
        "qk_rope_head_dim": 4,
        "qk_nope_head_dim": 8,
        "v_head_dim": 8,
        "n_group": 1,
        "topk_group": 1,
    },
    "olmoe": {"model_type": "olmoe", **_BASE, **_EXPERTS},
}


def saved(family: str, directory: Path, **save: Any) -> Path:
    """A seeded random model of ``family`` (a key of :data:`FAMILIES`) written with
    ``save_pretrained`` into ``directory``."""
    return save_tiny(directory, FAMILIES[family], **save)


def check_like_generate(
    path: Path, module: Any, batches: list[Any], records: Any, new_tokens: int
) -> None:
    """Each record's ``token_ids`` equal Hugging Face greedy ``generate`` (fp32) of the
    ``save_pretrained`` model at ``path`` on the record's prompt (its padding dropped), cut at
    the module's first stop token."""
    reference = AutoModelForCausalLM.from_pretrained(path).eval()
    stop = set(module.generation_config().eos_token_ids)
    for batch, got in zip(batches, records, strict=True):
        for row, record in enumerate(got):
            ids = batch["input_ids"][row][batch["attention_mask"][row].bool()][None]
            with torch.no_grad():
                out = reference.generate(
                    input_ids=ids, attention_mask=torch.ones_like(ids),
                    max_new_tokens=new_tokens, do_sample=False, pad_token_id=0,
                    eos_token_id=sorted(stop) or None,
                )[0, ids.shape[1] :].tolist()  # fmt: skip
            cut = next((i for i, t in enumerate(out) if t in stop), len(out))
            assert record["token_ids"] == out[:cut], record["id"]
