"""Whether a Hugging Face causal LM can generate on the static KV cache balance_beam fills.

Layer-major generation (:mod:`bb_lightning.engine.generate`) hands the model a
transformers ``StaticCache`` and a padding mask as long as that cache, through the
model's own forward. :func:`static_cache_gap` says, from what the model class itself
declares (its forward's parameters, transformers' ``_supports_default_dynamic_cache``),
why a model cannot take such a cache; :func:`~bb_lightning.hf_load.check_generation`
refuses it at setup with that reason, before any weight is read.
"""

from __future__ import annotations

import inspect

from torch import nn

__all__ = ["static_cache_gap"]

CACHE_ARGUMENTS = ("cache", "past_key_values")
"""Names under which a transformers forward takes a KV cache (newest first)."""


def static_cache_gap(model: nn.Module) -> str | None:
    """Why ``model`` cannot generate on a transformers ``StaticCache`` (None: it can)."""
    params = inspect.signature(model.forward).parameters
    if not any(name in params for name in CACHE_ARGUMENTS):
        return (
            "its forward takes no KV cache (no 'cache' or 'past_key_values' argument): it "
            "recomputes the whole sequence for each new token"
        )
    supports = getattr(type(model), "_supports_default_dynamic_cache", None)
    if callable(supports) and not supports():
        return (
            "it keeps a cache of its own, not a transformers Cache "
            "(transformers' _supports_default_dynamic_cache() is False)"
        )
    return None
