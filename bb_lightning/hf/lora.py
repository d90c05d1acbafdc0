"""LoRA fine-tuning through ``peft``: the options, the wrap, and the profile to plan it.

``peft`` is an optional extra (``pip install 'balance-beam[peft]'``), imported only when
a LoRA model is built (:func:`require_peft`), never when the package is imported.

Under the balance_beam strategy the frozen base weights are paged read-only and only
the adapters carry gradients and optimizer state (see :mod:`bb_lightning.engine.pager`);
:func:`lora_profile` prices such a job for the planner. Modules trained whole
(``modules_to_save``) are trained copies with full fp32 state beside their frozen
originals; on a base streamed from its checkpoint both are read from the base layer's
tensors (:func:`unwrap_saved_copies` gives the checkpoint's name of each).
"""

from __future__ import annotations

import importlib
import math
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

if TYPE_CHECKING:
    from transformers import PretrainedConfig, PreTrainedModel

    from bb_lightning.planner.profile import ModelProfile

__all__ = [
    "PEFT_EXTRA",
    "LoraOptions",
    "lora_profile",
    "require_peft",
    "saved_copy_prefixes",
    "unwrap_saved_copies",
    "wrap_lora",
]

PEFT_EXTRA = "pip install 'balance-beam[peft]'"
"""The command that installs the optional ``peft`` dependency."""

DEFAULT_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
"""Llama-style attention and MLP projections."""


def _number(value: object) -> bool:
    """Whether ``value`` is a finite int or float (not a bool, not NaN)."""
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


@dataclass(frozen=True, kw_only=True)
class LoraOptions:
    """Low-rank adapters on a model's linear layers (Hu et al. 2021, "LoRA")."""

    rank: int = 16
    """Rank ``r`` of each adapter (``A``: r x in, ``B``: out x r), elements."""
    alpha: float = 32.0
    """Scale numerator: the adapter's output is multiplied by ``alpha / rank``."""
    dropout: float = 0.0
    """Dropout probability on the adapter's input, in [0, 1)."""
    target_modules: tuple[str, ...] = DEFAULT_TARGETS
    """Names (last component) of the linear layers that get adapters."""
    modules_to_save: tuple[str, ...] = ()
    """Names (last component) of modules trained whole beside the adapters (e.g. ``lm_head``):
    ``peft`` trains a copy of each, saved with the adapters, and keeps the original frozen."""

    def __post_init__(self) -> None:
        if not isinstance(self.rank, int) or isinstance(self.rank, bool) or self.rank < 1:
            raise ValueError(f"LoRA rank={self.rank!r} must be a positive integer (e.g. 16)")
        if not _number(self.alpha) or not self.alpha > 0:
            raise ValueError(f"LoRA alpha={self.alpha!r} must be a number > 0 (e.g. 2 x rank)")
        if not _number(self.dropout) or not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"LoRA dropout={self.dropout!r} must be a number in [0, 1)")
        if not self.target_modules:
            raise ValueError("LoRA target_modules is empty: name the layers, e.g. ['q_proj']")
        for key in ("target_modules", "modules_to_save"):
            names = getattr(self, key)
            if not all(isinstance(n, str) and n for n in names):
                raise ValueError(
                    f"LoRA {key}={list(names)!r} must be a list of layer names, e.g. ['q_proj']"
                )

    @classmethod
    def from_value(cls, value: LoraOptions | dict[str, Any]) -> LoraOptions:
        """Options from themselves or a dict of their fields (as a recipe gives them)."""
        if isinstance(value, LoraOptions):
            return value
        known = {"rank", "alpha", "dropout", "target_modules", "modules_to_save"}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"unknown LoRA option(s) {unknown}: use {sorted(known)}")
        fields = dict(value)
        for key in ("target_modules", "modules_to_save"):
            if key in fields:
                names = fields[key]
                if isinstance(names, str) or not isinstance(names, list | tuple):
                    raise ValueError(
                        f"LoRA {key}={names!r} must be a list of layer names, e.g. ['q_proj']"
                    )
                fields[key] = tuple(names)
        return cls(**fields)

    def peft_config(self) -> Any:
        """The equivalent ``peft.LoraConfig`` (causal LM task)."""
        peft = require_peft()
        return peft.LoraConfig(
            r=self.rank,
            lora_alpha=self.alpha,
            lora_dropout=self.dropout,
            target_modules=list(self.target_modules),
            modules_to_save=list(self.modules_to_save) or None,
            task_type="CAUSAL_LM",
        )


def require_peft() -> Any:
    """The ``peft`` module; ``ImportError`` naming the extra to install when it is missing."""
    try:
        return importlib.import_module("peft")
    except ImportError as err:
        raise ImportError(
            f"LoRA needs the optional 'peft' package, which is not installed: {PEFT_EXTRA}"
        ) from err


def wrap_lora(model: PreTrainedModel, options: LoraOptions) -> Any:
    """``model`` with LoRA adapters (a ``peft.PeftModel``): the base weights frozen.

    Base parameters on the meta device (:func:`bb_lightning.hf.hf_load.empty_model`) stay
    there, for a strategy to stream them from the checkpoint; the adapters get real
    initial values all the same, drawn from the random state exactly as for a
    materialised base (``peft`` would otherwise put them on their base layer's device,
    meta). peft's default initialisation reads no base weight, so none is needed here.
    """
    peft = require_peft()
    with _real_placeholders(model):
        return peft.get_peft_model(model, options.peft_config())


@contextmanager
def _real_placeholders(model: nn.Module) -> Iterator[None]:
    """Swap each meta parameter for a CPU stand-in of its shape and dtype (one element,
    broadcast: no memory) for the block, then back; parameter objects and ties stay."""
    cpu = torch.device("cpu")
    before = {id(p) for p in model.parameters()}
    swapped = []
    for p in model.parameters():  # each shared parameter once
        if p.is_meta:
            stand_in = torch.zeros((), dtype=p.dtype, device=cpu).expand(p.shape)
            other = nn.Parameter(stand_in, requires_grad=p.requires_grad)
            torch.utils.swap_tensors(p, other)
            swapped.append((p, other))
    try:
        yield
    finally:
        for p, other in swapped:
            requires_grad = p.requires_grad  # peft froze the base: keep that
            torch.utils.swap_tensors(p, other)
            p.requires_grad_(requires_grad)
    if not swapped:
        return
    known = before | {
        id(p)
        for m in model.modules()
        if isinstance(getattr(m, "base_layer", None), nn.Module)
        and hasattr(m, "adapter_layer_names")
        for n, p in m.named_parameters()
        if not n.startswith("base_layer.")
    }
    for name, p in model.named_parameters():
        if id(p) not in known:  # peft's modules_to_save copied a base layer to train it
            _to_meta(name, p)


def _to_meta(name: str, param: nn.Parameter) -> None:
    """Put a copy of a meta base weight back on the meta device, to be read from the
    checkpoint like the weight it copies (:func:`unwrap_saved_copies` names it)."""
    if ".modules_to_save." not in f".{name}":
        raise ValueError(
            f"LoRA on a model streamed from its checkpoint made parameter {name!r}, which "
            "is neither an adapter nor a modules_to_save copy: load the base model first"
        )
    meta = nn.Parameter(torch.empty(param.shape, dtype=param.dtype, device="meta"),
                        requires_grad=param.requires_grad)  # fmt: skip
    torch.utils.swap_tensors(param, meta)


def saved_copy_prefixes(model: nn.Module) -> list[str]:
    """``name.`` of each ``peft`` modules_to_save wrapper in ``model`` (the module it wraps
    is under ``original_module.``, each adapter's trained copy under
    ``modules_to_save.<adapter>.``), innermost first."""
    found = [
        f"{name}."
        for name, m in model.named_modules()
        if isinstance(m._modules.get("original_module"), nn.Module)
        and isinstance(m._modules.get("modules_to_save"), nn.ModuleDict)
    ]
    return sorted(found, key=len, reverse=True)


def unwrap_saved_copies(name: str, prefixes: list[str]) -> str:
    """The name of a tensor inside modules_to_save wrappers (:func:`saved_copy_prefixes`)
    in the model without them: the original and its trained copies both name the base
    layer's tensor, which is what a checkpoint of the base model holds."""
    for prefix in prefixes:
        if not name.startswith(prefix):
            continue
        rest = name[len(prefix) :]
        if rest.startswith("original_module."):
            name = prefix + rest[len("original_module.") :]
        elif rest.startswith("modules_to_save."):
            name = prefix + rest[len("modules_to_save.") :].partition(".")[2]
    return name


def lora_profile(config: PretrainedConfig | dict[str, Any], options: LoraOptions) -> ModelProfile:
    """The planner's profile of ``config``'s model with ``options``' adapters, trained alone.

    Built on the meta device (no weights): every weight, adapters included, is paged;
    only the adapters count as trained.
    """
    from accelerate import init_empty_weights
    from transformers import AutoModelForCausalLM

    from bb_lightning.engine.hf_quirks import resolve_model
    from bb_lightning.probe import model_profile_from_module

    config = resolve_model(config).config
    with init_empty_weights(include_buffers=False), torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
        wrapped = wrap_lora(model, options)
    return model_profile_from_module(wrapped.get_base_model())
