"""Profile a model for the planner: its structure, found by introspection.

The planner reasons on a :class:`~bb_lightning.planner.profile.ModelProfile` (plain data)
and never looks at a model; these constructors build one from a Hugging Face config
(on the meta device, no weights) or from an instantiated model, through
:mod:`bb_lightning.hf.structure` (no per-architecture tables).
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

from bb_lightning.planner.profile import ModelProfile

if TYPE_CHECKING:
    import torch
    from transformers import PretrainedConfig

__all__ = ["model_profile_from_config", "model_profile_from_module"]


def model_profile_from_config(
    config: PretrainedConfig | dict[str, Any] | str | os.PathLike[str],
) -> ModelProfile:
    """Profile the model a config describes, built on the meta device (no weights).

    ``config`` is a ``PretrainedConfig``, a dict with ``model_type``, a path to a
    ``config.json`` or to a directory holding one, or a hub id (needs network).
    """
    from bb_lightning.hf.structure import profile_fields_from_config

    return ModelProfile(**profile_fields_from_config(config))


def model_profile_from_module(model: torch.nn.Module) -> ModelProfile:
    """Profile an instantiated Hugging Face causal LM (any device, meta included).

    Parameters with ``requires_grad=False`` (frozen base weights under LoRA adapters)
    are counted as weights but not as trained: see ``ModelProfile.block_trainable_params``.
    """
    from bb_lightning.hf.structure import find_block_list, profile_fields_from_module

    profile = ModelProfile(**profile_fields_from_module(model))
    if all(p.requires_grad for p in model.parameters()):
        return profile
    _, blocks = find_block_list(model)
    in_blocks = {id(p) for b in blocks for p in b.parameters()}
    block = max(sum(p.numel() for p in b.parameters() if p.requires_grad) for b in blocks)
    rest = sum(p.numel() for p in model.parameters() if p.requires_grad and id(p) not in in_blocks)
    return profile.with_trainable(min(block, profile.block_params), min(rest, profile.rest_params))
