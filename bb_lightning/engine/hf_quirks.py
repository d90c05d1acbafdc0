"""What differs between Hugging Face model families, in one place."""

from __future__ import annotations

import inspect
from typing import Any

from torch import nn

__all__ = ["forward_options", "model_context"]

# Keyword arguments through which Hugging Face layers read and write a KV cache. A
# recomputed block must not write its cache a second time, so with grad enabled they
# are dropped, as transformers' own gradient checkpointing does.
_CACHE_KWARGS: tuple[str, ...] = ("cache", "past_key_values", "past_key_value", "layer_past")


def forward_options(model: nn.Module) -> tuple[str, bool]:
    """How the model's forward takes a KV cache (``cache`` or ``past_key_values``) and whether
    it takes ``logits_to_keep`` (the generator asks for the last token's logits only)."""
    params = inspect.signature(model.forward).parameters
    return ("cache" if "cache" in params else "past_key_values"), "logits_to_keep" in params


def model_context(config: Any) -> int | None:
    """The model's context length in tokens (``max_position_embeddings`` or ``n_positions``)."""
    for key in ("max_position_embeddings", "n_positions", "max_sequence_length"):
        value = getattr(config, key, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def _config_int(config: Any, *names: str, default: int | None = None) -> int:
    for name in names:
        value = getattr(config, name, None)
        if value is not None:
            return int(value)
    if default is None:
        raise ValueError(
            f"{type(config).__name__} has none of the attributes {list(names)}: "
            "set one of them in the config"
        )
    return default


_NUM_EXPERTS = ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts")
"""Config fields naming the routed experts per MoE block (transformers' spellings)."""
_TOP_K = ("num_experts_per_tok", "experts_per_token", "moe_topk", "num_experts_per_token")
"""Config fields naming the experts each token is routed to."""
