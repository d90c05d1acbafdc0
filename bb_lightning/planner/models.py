"""Built-in model shapes for planning without a checkpoint (configs only, no weights).

Each entry is a Hugging Face config dict (with ``model_type``) accepted by
:func:`bb_lightning.probe.model_profile_from_config`. Shapes follow the
published configs of the models named.
"""

from __future__ import annotations

from typing import Any

__all__ = ["BUILTIN_MODELS", "builtin_config", "builtin_names"]


def _llama(hidden: int, layers: int, heads: int, ffn: int, ctx: int) -> dict[str, Any]:
    return {
        "model_type": "llama",
        "hidden_size": hidden,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": heads,
        "intermediate_size": ffn,
        "vocab_size": 32000,
        "max_position_embeddings": ctx,
        "tie_word_embeddings": False,
    }


BUILTIN_MODELS: dict[str, dict[str, Any]] = {
    # A tiny Llama-shaped model for demos and tests on a CPU.
    "tiny-llama": _llama(256, 4, 4, 688, 2048),
    # Llama-architecture models of about 370 M and 1.5 B parameters.
    "llama-370m": _llama(1024, 24, 16, 2752, 2048),
    "llama-1.5b": _llama(2048, 24, 16, 5504, 2048),
    # LLaMA-30B (Touvron et al. 2023): hidden 6656, 60 layers, 52 heads, ffn 17920.
    "llama-30b": _llama(6656, 60, 52, 17920, 2048),
    # Llama 3 8B (Meta 2024): hidden 4096, 32 layers, 32 heads (8 KV), ffn 14336, a
    # 128,256-token vocabulary.
    "llama-8b": {
        **_llama(4096, 32, 32, 14336, 8192),
        "num_key_value_heads": 8,
        "vocab_size": 128256,
        "rope_theta": 500000.0,
    },
    # Llama 3 70B (Meta 2024): hidden 8192, 80 layers, 64 heads (8 KV), ffn 28672, a
    # 128,256-token vocabulary.
    "llama-70b": {
        **_llama(8192, 80, 64, 28672, 8192),
        "num_key_value_heads": 8,
        "vocab_size": 128256,
        "rope_theta": 500000.0,
    },
    # OPT-30B (Zhang et al. 2022): hidden 7168, 48 layers, 56 heads, ffn 28672.
    "opt-30b": {
        "model_type": "opt",
        "hidden_size": 7168,
        "num_hidden_layers": 48,
        "num_attention_heads": 56,
        "ffn_dim": 28672,
        "word_embed_proj_dim": 7168,
        "vocab_size": 50272,
        "max_position_embeddings": 2048,
        "do_layer_norm_before": True,
        "tie_word_embeddings": True,
    },
    # Mixtral 8x7B (Jiang et al. 2024, "Mixtral of Experts"): hidden 4096, 32 layers, 32
    # heads (8 KV), 8 experts of ffn 14336 per layer, top-2 routing; 47 B params, 13 B active.
    "mixtral-8x7b": {
        "model_type": "mixtral",
        "hidden_size": 4096,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "intermediate_size": 14336,
        "num_local_experts": 8,
        "num_experts_per_tok": 2,
        "vocab_size": 32000,
        "max_position_embeddings": 32768,
        "tie_word_embeddings": False,
    },
}
"""Built-in names -> Hugging Face config dicts."""


def builtin_names() -> list[str]:
    """Names of the built-in model shapes."""
    return sorted(BUILTIN_MODELS)


def builtin_config(name: str) -> dict[str, Any]:
    """A copy of the config dict of the built-in model ``name`` (case-insensitive)."""
    key = name.strip().lower()
    if key not in BUILTIN_MODELS:
        raise ValueError(
            f"unknown built-in model {name!r}: known names are {builtin_names()}; "
            "or pass a local directory, a config.json or a hub id"
        )
    return dict(BUILTIN_MODELS[key])
