"""What differs between Hugging Face model families, in one place.

The rest of balance_beam finds a model's parts by structure
(:mod:`bb_lightning.hf.structure`); what it cannot find that way, the ways
families and transformers versions spell the same thing, lives here, and
nowhere else:

* **config spellings** — :data:`CONFIG_ALIASES`: each field balance_beam reads
  (width, heads, context, experts, ...) and every config attribute that names it
  (``hidden_size`` / ``n_embd`` / ``d_model``, ...); read with :func:`config_value`,
  :func:`config_int`, :func:`model_context`;
* **forward options** — :data:`CACHE_KWARGS`, the keyword arguments through which
  layers take a KV cache, :func:`forward_options`, how a model's forward takes
  one and whether it takes ``logits_to_keep``, and :func:`unread_outputs_off`;
* **model specs** — :func:`resolve_model`: a built-in name, a checkpoint directory, a
  ``config.json``, a config dict or object, or a hub id -> the config and where the
  weights are;
* **checkpoint files** — the file names ``save_pretrained`` writes
  (:data:`SAFETENSORS_SINGLE`, :data:`SAFETENSORS_INDEX`, ...), :func:`read_weight_index`
  (the one reader of a sharded checkpoint's ``*.index.json``) and
  :data:`SAFETENSORS_DTYPES` (the dtype names of the safetensors header);
* **what is refused** — :func:`check_supported` (quantized, remote-code and
  encoder-decoder models), :func:`check_generation` (no static cache), and
  :func:`static_cache_limit` (the longest sequences a family generates right on a static
  KV cache);
* **tracing** — :func:`no_pad_token` (GPT-2 reads its pad token from the input ids) and
  :func:`activation_checkpointing` (the attribute moved in transformers 5), turned off
  and on again around a ``trainer.*`` call by :func:`activation_checkpointing_off` /
  :func:`activation_checkpointing_on`;
* **the head** — :func:`head_logits_of` (what a family does to the head's output before
  the loss: Gemma's soft cap, Cohere's scale, Granite's divisor) and
  :func:`unchunked_head` (a head transform the chunked loss does not reproduce);
* **captured outputs** — :class:`CapturedOutputs` and :func:`recording`: the tensors
  transformers' output capture records from inside a block (``output_router_logits`` for
  an MoE's auxiliary loss, ``output_attentions``), which a block recomputed in backward
  must return and record again.

Families differ here only by entries in these tables and checks, all behind the same
functions (one adapter for every family, keyed by how configs and files spell things,
not by model names).

A new family quirk is an entry here, exercised in ``tests/bb_lightning/test_hf_quirks.py``.
This module imports only the standard library, torch and transformers, so the engine
(:mod:`bb_lightning.engine`) may use it as well as the layers above it.
"""

from __future__ import annotations

import inspect
import json
import os
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn
from transformers import AutoConfig, PretrainedConfig, PreTrainedModel, StaticCache

try:  # transformers 5: forward hooks append to the collector this context variable holds
    from transformers.utils.output_capturing import _active_collector
except ImportError:  # pragma: no cover - an older transformers returns them from the blocks
    _active_collector = None  # type: ignore[assignment]

__all__ = [
    "CACHE_KWARGS",
    "CONFIG_ALIASES",
    "SAFETENSORS_DTYPES",
    "SAFETENSORS_INDEX",
    "SAFETENSORS_SHARDS",
    "SAFETENSORS_SINGLE",
    "TORCH_INDEX",
    "TORCH_SINGLE",
    "WEIGHT_FILES",
    "CapturedOutputs",
    "ResolvedModel",
    "activation_checkpointing",
    "activation_checkpointing_off",
    "activation_checkpointing_on",
    "check_generation",
    "check_supported",
    "config_int",
    "config_value",
    "forward_options",
    "head_logits_of",
    "model_context",
    "no_pad_token",
    "read_config",
    "read_weight_index",
    "recording",
    "resolve_model",
    "static_cache_limit",
    "unchunked_head",
    "unread_outputs_off",
]

CONFIG_ALIASES: dict[str, tuple[str, ...]] = {
    "hidden_size": ("hidden_size", "n_embd", "d_model"),
    "num_heads": ("num_attention_heads", "n_head", "num_heads"),
    "num_kv_heads": ("num_key_value_heads", "n_head_kv"),
    "head_dim": ("head_dim",),
    "context": (
        "max_position_embeddings",
        "n_positions",
        "max_sequence_length",
        "seq_length",
        "max_seq_len",
    ),
    "num_experts": ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts"),
    "experts_per_token": (
        "num_experts_per_tok",
        "experts_per_token",
        "moe_topk",
        "num_experts_per_token",
    ),
}
"""Field -> the config attributes that spell it, first match wins. ``hidden_size``: width
(GPT-2 ``n_embd``); ``num_heads``: query heads; ``num_kv_heads``: key/value heads (GQA;
absent: as many as query heads); ``head_dim``: per head (absent: width / heads);
``context``: tokens the model takes (GPT-2 ``n_positions``); ``num_experts``: routed experts
per MoE block (Mixtral ``num_local_experts``, DeepSeek ``n_routed_experts``);
``experts_per_token``: experts each token is routed to."""

CACHE_KWARGS: tuple[str, ...] = ("cache", "past_key_values", "past_key_value", "layer_past")
"""Keyword arguments through which Hugging Face layers read and write a KV cache:
transformers 5 spells it ``cache`` (GPT-NeoX layers ``layer_past``), layers written for
transformers 4 ``past_key_values`` or ``past_key_value``. A recomputed block must not write its cache a second time, so
with grad enabled they are dropped, as transformers' own gradient checkpointing does."""

SAFETENSORS_SINGLE = "model.safetensors"
"""The one weights file of an unsharded safetensors checkpoint."""
SAFETENSORS_INDEX = "model.safetensors.index.json"
"""The weight map of a sharded safetensors checkpoint (``model-0000i-of-0000n.safetensors``)."""
SAFETENSORS_SHARDS = "model*.safetensors"
"""Glob of the safetensors weight files of a checkpoint, one file or shards."""
TORCH_SINGLE = "pytorch_model.bin"
"""The one weights file of an unsharded ``torch.save`` checkpoint."""
TORCH_INDEX = "pytorch_model.bin.index.json"
"""The weight map of a sharded ``torch.save`` checkpoint."""
WEIGHT_FILES = (SAFETENSORS_SINGLE, SAFETENSORS_INDEX, TORCH_SINGLE, TORCH_INDEX)
"""Files ``from_pretrained`` loads weights from: a directory holding one has weights."""

SAFETENSORS_DTYPES: dict[str, torch.dtype] = {
    "BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32, "F64": torch.float64,
    "I8": torch.int8, "U8": torch.uint8, "I16": torch.int16, "I32": torch.int32,
    "I64": torch.int64, "BOOL": torch.bool,
}  # fmt: skip
"""safetensors header dtype name -> torch dtype (the dtypes balance_beam reads and writes)."""


def config_value(config: Any, field: str) -> int | None:
    """The first attribute of :data:`CONFIG_ALIASES` ``[field]`` that ``config`` sets to a
    positive whole number (a count, in the field's unit; ``1200.0`` reads as 1200), or None
    when it sets none (0 and negative values mean unset in some configs)."""
    spellings = CONFIG_ALIASES.get(field)
    if spellings is None:
        raise ValueError(f"config field {field!r} is not one of {sorted(CONFIG_ALIASES)}")
    for name in spellings:
        value = getattr(config, name, None)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            if value > 0 and value == int(value):
                return int(value)
    return None


def config_int(config: Any, field: str, *, default: int | None = None) -> int:
    """:func:`config_value`, else ``default``; ``ValueError`` naming the spellings when the
    config sets none and there is no default."""
    value = config_value(config, field)
    if value is not None:
        return value
    if default is None:
        raise ValueError(
            f"{type(config).__name__} has none of the attributes {list(CONFIG_ALIASES[field])}: "
            "set one of them in the config"
        )
    return default


def model_context(config: Any) -> int | None:
    """The model's context length in tokens (``max_position_embeddings`` or its spellings),
    or None when the config sets no limit."""
    return config_value(config, "context")


def forward_options(model: nn.Module) -> tuple[str, bool]:
    """How the model's forward takes a KV cache (``cache`` or ``past_key_values``) and whether
    it takes ``logits_to_keep`` (the generator asks for the last token's logits only)."""
    params = inspect.signature(model.forward).parameters
    return ("cache" if "cache" in params else "past_key_values"), "logits_to_keep" in params


def unread_outputs_off(model: nn.Module) -> dict[str, bool]:
    """Keyword arguments switching off what a generation step never reads: the routers'
    logits an MoE config asks for (``output_router_logits``), whose load-balancing loss
    the forward would compute from a KV-cache-long attention mask and fail."""
    params = inspect.signature(model.forward).parameters
    return {"output_router_logits": False} if "output_router_logits" in params else {}


@dataclass(frozen=True)
class ResolvedModel:
    """What a model spec names: its configuration, and where its weights are."""

    config: PretrainedConfig
    """The Hugging Face configuration (the network can be built from it alone)."""
    weights: Path | str | None
    """A local checkpoint directory, a hub id, or None (no weights: initialise randomly)."""


def _config_from_dict(values: Mapping[str, Any]) -> PretrainedConfig:
    """A config from a dict holding ``model_type`` (what ``config.json`` holds)."""
    values = dict(values)
    model_type = values.pop("model_type", None)
    if not isinstance(model_type, str):
        raise ValueError(
            f"model config dict has no 'model_type' (keys: {sorted(values)}): "
            "add e.g. 'model_type': 'llama'"
        )
    return AutoConfig.for_model(model_type, **values)


def read_config(location: str | os.PathLike[str]) -> PretrainedConfig:
    """The config in ``location``: a model directory (its ``config.json``) or a JSON file.

    ``ValueError`` naming the file, the reason and the fix when the file is not UTF-8 JSON,
    not an object with a string ``model_type``, or holds values transformers refuses (its
    config classes refuse with ``TypeError``, ``ValueError`` or their own validation
    errors, which are reported the same way).
    """
    path = Path(location)
    directory = path.is_dir()
    path = path / "config.json" if directory else path
    fix = "write it again with save_pretrained, or correct the field"
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, RecursionError) as exc:  # not UTF-8, not JSON, nested too deep
        raise ValueError(f"{path} is not UTF-8 JSON ({exc}): {fix}") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("model_type"), str):
        raise ValueError(
            f"{path} holds no object with a string 'model_type' (e.g. \"model_type\": "
            f'"llama"): {fix}'
        )
    try:
        return AutoConfig.from_pretrained(location) if directory else _config_from_dict(doc)
    except OSError:
        raise
    except Exception as exc:
        reason = " ".join(str(exc).split())[:300] or type(exc).__name__
        raise ValueError(f"{path} is not a usable model config ({reason}): {fix}") from None


def resolve_model(
    spec: str | os.PathLike[str] | Mapping[str, Any] | PretrainedConfig,
    *,
    builtins: Mapping[str, Mapping[str, Any]] | None = None,
) -> ResolvedModel:
    """The configuration ``spec`` names and where its weights are.

    ``spec`` is a ``PretrainedConfig``, a dict with ``model_type``, a local checkpoint
    directory (``config.json``, with or without :data:`WEIGHT_FILES`), a ``config.json``
    path, a name in ``builtins`` (case-insensitive; name -> config dict), or a hub id
    (needs the network; its weights are the hub's). ``ValueError`` for a directory
    without ``config.json``, a path that does not exist, or a spec of another type.
    """
    if isinstance(spec, PretrainedConfig):
        return ResolvedModel(spec, None)
    if isinstance(spec, Mapping):
        return ResolvedModel(_config_from_dict(spec), None)
    if not isinstance(spec, (str, os.PathLike)):
        raise ValueError(
            f"model spec of type {type(spec).__name__} is not supported: pass a "
            "PretrainedConfig, a dict with 'model_type', a config.json path, a model "
            "directory, a built-in name or a hub id"
        )
    path = Path(spec)
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ValueError(f"model directory {path} has no config.json: pass a checkpoint dir")
        has_weights = any((path / f).is_file() for f in WEIGHT_FILES)
        return ResolvedModel(read_config(path), path if has_weights else None)
    if path.is_file():
        return ResolvedModel(read_config(path), None)
    text = os.fspath(spec)
    builtin = (builtins or {}).get(text.strip().lower())
    if builtin is not None:
        return ResolvedModel(_config_from_dict(builtin), None)
    if path.is_absolute() or text.startswith((".", "~")) or text.endswith(".json"):
        raise ValueError(
            f"model path {text!r} does not exist: pass an existing checkpoint directory, "
            "a config.json, a built-in name or a hub id"
        )
    return ResolvedModel(AutoConfig.from_pretrained(text), text)


def read_weight_index(index: str | os.PathLike[str]) -> dict[str, Path]:
    """Checkpoint key -> the shard holding it, from a sharded checkpoint's weight map
    (:data:`SAFETENSORS_INDEX` or :data:`TORCH_INDEX`), in the order the map lists them.

    Shards are named relative to the index's directory. ``ValueError`` when the file has
    no ``weight_map`` or names shards missing from the directory.
    """
    path = Path(index)
    with path.open(encoding="utf-8") as f:
        doc = json.load(f)
    weight_map = doc.get("weight_map") if isinstance(doc, dict) else None
    if not isinstance(weight_map, dict):
        raise ValueError(
            f"{path} has no 'weight_map' object: write the checkpoint again with save_pretrained"
        )
    root = path.parent
    missing = sorted({v for v in weight_map.values() if not (root / v).is_file()})
    if missing:
        raise ValueError(
            f"{path} lists shards missing from {root}: {missing[:3]}: download every shard"
        )
    return {key: root / name for key, name in weight_map.items()}


def check_supported(config: PretrainedConfig, *, streaming: bool = True) -> None:
    """Refuse, with one ``ValueError`` line naming why, a model balance_beam cannot serve.

    Quantized weights and encoder-decoder models are refused always; remote code only
    when ``streaming`` (the model is built here from its config, not handed over).
    """
    kind = getattr(config, "model_type", "?")
    quant = getattr(config, "quantization_config", None)
    if quant is not None:
        method = quant.get("quant_method") if isinstance(quant, dict) else quant
        raise ValueError(
            f"model_type={kind!r} is quantized ({method}): balance_beam streams unquantized "
            "fp32/bf16/fp16 weights; load a dequantized checkpoint"
        )
    if streaming and getattr(config, "auto_map", None):
        raise ValueError(
            f"model_type={kind!r} needs remote code (auto_map): balance_beam loads only "
            "model families of the installed transformers"
        )
    if getattr(config, "is_encoder_decoder", False):
        raise ValueError(
            f"model_type={kind!r} is an encoder-decoder model: balance_beam runs decoder-only "
            "causal LMs (AutoModelForCausalLM)"
        )


CACHE_ARGUMENTS = ("cache", "past_key_values")
"""Names under which a transformers forward takes a KV cache (newest first)."""


def static_cache_gap(model: nn.Module) -> str | None:
    """Why ``model`` cannot generate on a transformers ``StaticCache`` (None: it can).

    Layer-major generation (:mod:`bb_lightning.engine.generate`) hands the model a
    ``StaticCache`` and a padding mask as long as that cache, through the model's own
    forward; this reads what the model class itself declares (its forward's parameters,
    transformers' ``_supports_default_dynamic_cache``), no family names.
    """
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
    try:
        config: Any = getattr(model, "config", None)
        StaticCache(config=config, max_cache_len=1)  # allocates nothing
    except Exception as err:  # any failure means the same to the user
        return f"transformers builds no StaticCache from its config ({type(err).__name__}: {err})"
    return None


def static_cache_limit(config: Any) -> tuple[int, str] | None:
    """The most positions a static KV cache of ``config``'s model may have, and why (None:
    no limit but the context).

    Local attention that cuts its window out of a mask by the length of the keys it is
    given (GPT-Neo's ``attention_layers`` with ``"local"`` entries and ``window_size``)
    assumes that length is the tokens so far, as a growing cache gives it; a static cache
    gives the cache's length, which moves the window by the unwritten positions and hides
    keys the window holds once the cache is longer than the window. Within the window the
    mask cuts nothing, so generation is exact up to a cache of ``window_size`` positions.
    """
    layers = getattr(config, "attention_layers", None)
    window = getattr(config, "window_size", None)
    if not isinstance(window, int) or not layers or "local" not in list(layers):
        return None
    return window, (
        f"its local attention cuts its window (window_size={window}) out of a mask by the "
        "length of the KV cache, which is right on a static cache no longer than the window"
    )


def check_generation(model: PreTrainedModel) -> None:
    """Refuse (one ``ValueError`` line) a model that cannot generate on a static cache
    (:func:`static_cache_gap`).

    Every layer kind of transformers' ``StaticCache`` is carried by layer-major generation
    (:class:`~bb_lightning.engine.kv.KVCache`): keys and values (full, sliding-window,
    indexed), per-row states of recurrent and convolution layers (Mamba, gated delta
    nets), both in one layer (Falcon-H1, Zamba 2), and none (an MLP-only layer).
    """
    if (gap := static_cache_gap(model)) is not None:
        raise ValueError(
            f"model_type={model.config.model_type!r} ({type(model).__name__}) cannot generate "
            f"on balance_beam's static KV cache: {gap}; fit and validate it, or generate with "
            "transformers (model.generate) under plain Lightning"
        )


def activation_checkpointing_off(model: nn.Module) -> list[nn.Module]:
    """Turn transformers' activation checkpointing off in ``model``; the modules it was on
    in (their flag only: :func:`activation_checkpointing_on` puts it back as it was, with
    the checkpoint function and its options the model was given)."""
    on = [m for m in model.modules() if getattr(m, "gradient_checkpointing", False) is True]
    for m in on:
        setattr(m, "gradient_checkpointing", False)  # noqa: B010 (nn.Module attribute typing)
    return on


def activation_checkpointing_on(modules: list[nn.Module]) -> None:
    """Turn activation checkpointing back on in ``modules`` (from
    :func:`activation_checkpointing_off`)."""
    for m in modules:
        setattr(m, "gradient_checkpointing", True)  # noqa: B010 (nn.Module attribute typing)


def activation_checkpointing(model: nn.Module) -> bool:
    """Whether ``model`` has activation (gradient) checkpointing on (transformers >= 5:
    ``is_activation_checkpointing``; earlier: ``is_gradient_checkpointing``)."""
    if hasattr(type(model), "is_activation_checkpointing"):
        return bool(model.is_activation_checkpointing)
    return bool(getattr(model, "is_gradient_checkpointing", False))


@contextmanager
def no_pad_token(model: nn.Module) -> Iterator[None]:
    """The model's config without a pad token inside the block (restored on exit), for a
    trace on the meta device: some models (GPT-2) look for it in the input ids, a data
    read that meta tensors cannot serve."""
    config = getattr(model, "config", None)
    pad = getattr(config, "pad_token_id", None)
    if pad is None:
        yield
        return
    config.pad_token_id = None  # type: ignore[union-attr]
    try:
        yield
    finally:
        config.pad_token_id = pad  # type: ignore[union-attr]


class CapturedOutputs:
    """What transformers' output capture records while one block runs.

    A model asked for ``output_router_logits`` (an MoE's auxiliary loss) or
    ``output_attentions`` records those tensors from forward hooks on modules inside its
    blocks, into a collector of the model's forward. :meth:`tensors` are those recorded
    since this object was made, in order; :meth:`replace` puts others (the same values,
    carrying a gradient) in their places; :meth:`layout` is what :func:`recording` needs
    to record them again (no tensor in it).
    """

    def __init__(self, collector: dict[str, Any] | None) -> None:
        self._collector = collector
        self._start = {k: len(v) for k, v in (collector or {}).items() if isinstance(v, list)}

    @classmethod
    def since_now(cls) -> CapturedOutputs:
        """The recording of the model forward running now (none outside one)."""
        return cls(_active_collector.get() if _active_collector is not None else None)

    def _slots(self) -> list[tuple[str, int]]:
        found = self._collector or {}
        return [
            (key, j)
            for key, start in self._start.items()
            for j in range(start, len(found[key]))
            if isinstance(found[key][j], torch.Tensor)
        ]

    def tensors(self) -> list[torch.Tensor]:
        """The tensors recorded since this object was made."""
        found = self._collector or {}
        return [found[key][j] for key, j in self._slots()]

    def replace(self, tensors: list[torch.Tensor]) -> None:
        """Put ``tensors`` in the places of :meth:`tensors`, in order."""
        found = self._collector or {}
        for (key, j), tensor in zip(self._slots(), tensors, strict=True):
            found[key][j] = tensor

    def layout(self) -> dict[str, Any] | None:
        """The collector with its lists empty (None: no model forward is recording)."""
        if self._collector is None:
            return None
        return {k: ([] if isinstance(v, list) else v) for k, v in self._collector.items()}


@contextmanager
def recording(layout: dict[str, Any] | None) -> Iterator[CapturedOutputs]:
    """Record what ``layout`` (:meth:`CapturedOutputs.layout`) asks for while a block runs
    again outside its model's forward (recomputed in backward)."""
    if layout is None or _active_collector is None:
        yield CapturedOutputs(None)
        return
    fresh = {k: (list(v) if isinstance(v, list) else v) for k, v in layout.items()}
    token = _active_collector.set(fresh)
    try:
        yield CapturedOutputs(fresh)
    finally:
        _active_collector.reset(token)


HEAD_TRANSFORMS_UNCHUNKED = ("logits_soft_cap", "output_multiplier", "final_logits_bias")
"""Config attributes of head transforms :func:`head_logits_of` does not reproduce (Recurrent
Gemma's cap, a multiplier before the cap, a bias added to the logits): such a model's loss
runs whole, through its own forward."""


def _text_config(config: Any) -> Any:
    """The text part of ``config`` (its own ``get_text_config()`` where it has one)."""
    get = getattr(config, "get_text_config", None)
    return get() if callable(get) else config


def head_logits_of(config: Any, logits: torch.Tensor) -> torch.Tensor:
    """What the family's causal-LM forward does to the head's output before the loss, as
    transformers does it: ``logits * logit_scale`` (Cohere), ``logits / logits_scaling``
    (Granite), then ``tanh(logits / cap) * cap`` for ``final_logit_softcapping`` (Gemma 2,
    3, 3n); the logits unchanged for every other family."""
    text = _text_config(config)
    scale = getattr(text, "logit_scale", None)
    if isinstance(scale, (int, float)) and not isinstance(scale, bool):
        logits = logits * scale
    divisor = getattr(text, "logits_scaling", None)
    if isinstance(divisor, (int, float)) and not isinstance(divisor, bool):
        logits = logits / divisor
    cap = getattr(text, "final_logit_softcapping", None)
    if isinstance(cap, (int, float)) and not isinstance(cap, bool):
        logits = torch.tanh(logits / cap) * cap
    return logits


def unchunked_head(config: Any) -> str | None:
    """The config attribute of a head transform :func:`head_logits_of` does not reproduce
    (:data:`HEAD_TRANSFORMS_UNCHUNKED`), or None when the loss may run in chunks."""
    text = _text_config(config)
    for name in HEAD_TRANSFORMS_UNCHUNKED:
        if getattr(text, name, None) is not None or getattr(config, name, None) is not None:
            return name
    return None
