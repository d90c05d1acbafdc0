"""Read a Hugging Face checkpoint one parameter at a time, the way ``from_pretrained`` maps it.

transformers 5 does not load files key by key: ``from_pretrained`` renames
checkpoint keys and converts tensors on the way in (per-expert MoE weights
fused into one ``experts.gate_up_proj``, legacy names, split or merged
projections), and ties heads that are not on disk. :class:`HFCheckpoint`
plans that mapping once, with transformers' own machinery
(``get_model_conversion_mapping``, ``rename_source_key``, the
``WeightConverter`` operations, ``all_tied_weights_keys``), and then serves
each parameter of the model by its module name: :meth:`HFCheckpoint.get`
reads only the checkpoint tensors that parameter is made of, runs the
conversion on them alone, and casts the result. Memory holds one parameter
(and, for a fused one, its sources) at a time, never the model. Files are
safetensors (one or sharded), else ``pytorch_model*.bin`` memory-mapped. A model
wrapped by ``peft`` is served under ``peft``'s names (``base_model.model.`` prefix,
``.base_layer`` in wrapped layers); its adapters are not in the checkpoint.

:func:`empty_model` builds the model on the meta device with its tied
parameters tied; :func:`check_supported` and :func:`check_generation` refuse,
in one line, models balance_beam cannot serve (quantized weights, remote code,
encoder-decoder models; generation of models with a recurrent state).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from copy import deepcopy
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn
from transformers import AutoModelForCausalLM, PretrainedConfig, PreTrainedModel
from transformers.conversion_mapping import get_model_conversion_mapping
from transformers.core_model_loading import (
    WeightConverter,
    WeightRenaming,
    dot_natural_key,
    rename_source_key,
)

from bb_lightning.engine.hf_quirks import (
    SAFETENSORS_DTYPES,
    SAFETENSORS_INDEX,
    SAFETENSORS_SHARDS,
    SAFETENSORS_SINGLE,
    TORCH_INDEX,
    TORCH_SINGLE,
    check_generation,
    check_supported,
    read_weight_index,
)
from bb_lightning.hf.lora import saved_copy_prefixes, unwrap_saved_copies
from bb_lightning.hf.safetensors_file import open_safetensors

__all__ = [
    "HFCheckpoint",
    "check_generation",
    "check_supported",
    "checkpoint_names",
    "empty_model",
    "tie_aliases",
    "weight_files",
]


def _torch_files(root: Path) -> dict[str, Path] | None:
    """Checkpoint key -> ``pytorch_model*.bin`` file, or None when there is none."""
    index = root / TORCH_INDEX
    if index.is_file():
        return read_weight_index(index)
    if not (root / TORCH_SINGLE).is_file():
        return None
    return dict.fromkeys(_torch_load(root / TORCH_SINGLE), root / TORCH_SINGLE)


def _torch_load(path: Path) -> dict[str, Tensor]:
    """A ``torch.save`` state dict, memory-mapped: tensors are read when touched."""
    try:
        return torch.load(path, mmap=True, weights_only=True, map_location="cpu")
    except RuntimeError as err:  # the legacy (non-zip) format cannot be mapped
        raise ValueError(
            f"{path} cannot be memory-mapped ({str(err).splitlines()[0]}): re-save it with "
            "save_pretrained (safetensors)"
        ) from None


def weight_files(directory: str | os.PathLike[str]) -> dict[str, Path]:
    """Checkpoint key -> the file holding it: safetensors (index, one file, or ``model*``
    shards), else ``pytorch_model*.bin`` (``torch.save`` zip format, memory-mapped).

    Raises ``ValueError`` when ``directory`` holds no such weights.
    """
    root = Path(directory)
    index = root / SAFETENSORS_INDEX
    if (
        not index.is_file()
        and not (root / SAFETENSORS_SINGLE).is_file()
        and not any(root.glob(SAFETENSORS_SHARDS))
    ):
        torch_files = _torch_files(root)
        if torch_files is not None:
            return torch_files
    if index.is_file():
        return read_weight_index(index)
    files = (
        [root / SAFETENSORS_SINGLE]
        if (root / SAFETENSORS_SINGLE).is_file()
        else sorted(root.glob(SAFETENSORS_SHARDS))
    )
    if not files:
        raise ValueError(
            f"{root} holds neither {SAFETENSORS_SINGLE} nor {SAFETENSORS_INDEX}: save the "
            "model with save_pretrained(safe_serialization=True)"
        )
    keys: dict[str, Path] = {}
    for path in files:
        with open_safetensors(path) as f:
            keys.update(dict.fromkeys(f.keys(), path))
    return keys


@contextmanager
def _parameters_on_meta() -> Iterator[None]:
    """Register every parameter created in the block on the meta device; buffers stay real.

    (What ``accelerate.init_empty_weights(include_buffers=False)`` does, without the
    dependency: computed buffers such as rotary frequencies keep their values.)
    """
    register = nn.Module.register_parameter

    def on_meta(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        register(module, name, param)
        if param is not None:
            value = module._parameters[name]
            assert value is not None
            kwargs = dict(value.__dict__, requires_grad=param.requires_grad)
            module._parameters[name] = type(value)(value.to("meta"), **kwargs)

    nn.Module.register_parameter = on_meta  # type: ignore[method-assign,assignment]
    try:
        yield
    finally:
        nn.Module.register_parameter = register  # type: ignore[method-assign]


def unbuildable(config: PretrainedConfig, err: BaseException) -> ValueError:
    """The one-line ``ValueError`` for a config transformers read but cannot build a model
    from (a value of the wrong type or range that its config class let through), naming
    where the config came from (its ``name_or_path``) when it says."""
    where = config.name_or_path or f"model_type={config.model_type!r}"
    reason = " ".join(str(err).split())[:200] or type(err).__name__
    return ValueError(
        f"{where}: transformers cannot build the model from its config ({type(err).__name__}: "
        f"{reason}): correct the field, or write the config again with save_pretrained"
    )


def empty_model(config: PretrainedConfig) -> PreTrainedModel:
    """``AutoModelForCausalLM`` of ``config`` with parameters on the meta device, tied ones tied.

    Buffers are real (computed from the config). Raises ``ValueError`` (one line)
    for a model :func:`check_supported` refuses or transformers cannot build.
    """
    check_supported(config)
    try:
        with _parameters_on_meta():
            model = AutoModelForCausalLM.from_config(config)
    except ValueError as err:  # transformers: "Unrecognized configuration class ..."
        first = str(err).splitlines()[0] if str(err) else type(err).__name__
        raise ValueError(
            f"model_type={config.model_type!r} has no causal LM in transformers: {first}"
        ) from None
    except Exception as err:
        raise unbuildable(config, err) from None
    model.tie_weights()  # _parameters_on_meta creates fresh meta parameters after the tie
    return model


@dataclass
class _Group:
    """The checkpoint tensors one parameter (or one conversion's outputs) is made of."""

    converter: WeightConverter | None
    """The conversion to run on the sources (None: the one source, renamed at most)."""
    target: str
    """The first parameter name the conversion produces (transformers' ``layer_name``)."""
    sources: list[tuple[str, str]] = field(default_factory=list)
    """(source pattern, checkpoint key) pairs in checkpoint order."""


class HFCheckpoint:
    """The parameters of ``model`` read from a local safetensors checkpoint by module name.

    Built on a (meta) model of the checkpoint's config, or on a ``peft`` model wrapping
    one (parameters then named as ``peft`` names them; adapters are not served): the key
    mapping is planned from the checkpoint's keys alone (no tensor read). ``ValueError``
    at construction names parameters the checkpoint cannot provide.
    """

    def __init__(self, directory: str | os.PathLike[str], model: nn.Module) -> None:
        self.directory = Path(directory)
        self.files = weight_files(self.directory)
        self._root = model
        net, self._names = checkpoint_names(model)
        check_supported(net.config)
        self._model = net
        mapping = get_model_conversion_mapping(net)
        renamings = [t for t in mapping if isinstance(t, WeightRenaming)]
        converters = [t for t in mapping if isinstance(t, WeightConverter)]
        by_pattern = {p: c for c in converters for p in c.source_patterns}
        meta = {self._names[k]: t for k, t in model.state_dict().items() if self._names[k]}
        prefix = net.base_model_prefix
        self._groups: dict[str, _Group] = {}
        """Parameter name -> the group producing it (a multi-output group under each name)."""
        for key in sorted(self.files, key=dot_natural_key):
            name, pattern = rename_source_key(key, renamings, converters, prefix, meta)
            if name not in meta and key in meta:
                name, pattern = key, None
            if name not in meta:
                continue  # transformers drops it too (an unexpected key)
            group = self._groups.get(name)
            if group is None:
                conv = by_pattern[pattern] if pattern is not None else None
                group = _Group(converter=conv, target=name)
                for out in _outputs(name, conv):
                    self._groups.setdefault(out, group)
            group.sources.append((pattern or key, key))
        self._aliases = tie_aliases(net, self._groups)
        self._mapped: dict[Path, dict[str, Tensor]] = {}
        """Memory-mapped ``pytorch_model*.bin`` files opened so far (nothing read until used)."""
        self._pending: dict[str, Tensor] = {}
        """Outputs of a multi-output conversion not asked for yet (served once, then dropped)."""
        missing = [
            n
            for n, _ in model.named_parameters()
            if self._names.get(n, n) is not None and self.resolve(n) is None
        ]
        if missing:
            raise ValueError(
                f"checkpoint {self.directory} lacks {len(missing)} parameters of "
                f"{type(net).__name__}, e.g. {missing[:3]}: it does not match the model config"
            )

    @classmethod
    def holds_weights(cls, directory: str | os.PathLike[str]) -> bool:
        """Whether ``directory`` is local and holds safetensors weights."""
        path = Path(directory)
        names = (SAFETENSORS_INDEX, TORCH_INDEX, TORCH_SINGLE)
        return any((path / n).is_file() for n in names) or any(path.glob(SAFETENSORS_SHARDS))

    def resolve(self, name: str) -> str | None:
        """The name the checkpoint provides parameter ``name`` under (a tied one's partner);
        None for an adapter (not in the checkpoint) or a parameter it lacks."""
        base = self._names.get(name, name)
        if base is None or base in self._groups:
            return base
        return self._aliases.get(base)

    def source_keys(self, name: str) -> list[str]:
        """Checkpoint keys parameter ``name`` is made of."""
        return [key for _, key in self._groups[self._resolved(name)].sources]

    def source_dtype(self, name: str) -> torch.dtype:
        """dtype of parameter ``name`` on disk (that of its first source tensor)."""
        key = self.source_keys(name)[0]
        path = self.files[key]
        if path.suffix == ".bin":
            return self._mapping(path)[key].dtype
        with open_safetensors(path) as f:
            return _slice_dtype(f, key)

    def get(self, name: str, dtype: torch.dtype | None = None) -> Tensor:
        """Parameter ``name`` as a CPU tensor, converted as ``from_pretrained`` would; cast to
        ``dtype`` (None: the dtype on disk). Reads only the tensors it is made of."""
        target = self._resolved(name)
        value = self._pending.pop(target, None)
        if value is None:
            value = self._assemble(target)
        expected = tuple(self._root.get_parameter(name).shape)
        if tuple(value.shape) != expected:
            raise ValueError(
                f"parameter {name!r} is {tuple(value.shape)} in checkpoint {self.directory} "
                f"but {expected} in the model: the checkpoint does not match the model config"
            )
        return value if dtype is None else value.to(dtype)

    def _resolved(self, name: str) -> str:
        target = self.resolve(name)
        if target is None and self._names.get(name, name) is None:
            raise ValueError(
                f"parameter {name!r} is an adapter (or outside the Hugging Face model), which "
                f"the checkpoint {self.directory} does not hold: it keeps the value it was "
                "built with"
            )
        if target is None:
            raise ValueError(
                f"parameter {name!r} is not in the checkpoint {self.directory} "
                f"({len(self.files)} tensors): the checkpoint does not match the model config"
            )
        return target

    def _assemble(self, target: str) -> Tensor:
        group = self._groups[target]
        if group.converter is None:
            return self._read(group.sources[0][1])
        conv = deepcopy(group.converter)
        for pattern, key in group.sources:
            # a callable, as transformers' synchronous loading passes: read at convert time
            conv.add_tensor(group.target, key, pattern, self._reader(key))  # type: ignore[arg-type]
        produced = conv.convert(group.target, model=self._model, config=self._model.config)
        out: dict[str, Tensor] = {}
        for out_name, value in produced.items():
            out[out_name] = (value[0] if isinstance(value, list) else value).contiguous()
        value = out.pop(target)
        self._pending.update(out)
        return value

    def _mapping(self, path: Path) -> dict[str, Tensor]:
        mapped = self._mapped.get(path)
        if mapped is None:
            mapped = self._mapped[path] = _torch_load(path)
        return mapped

    def _reader(self, key: str) -> Callable[[], Tensor]:
        return lambda: self._read(key)

    def _read(self, key: str) -> Tensor:
        path = self.files[key]
        if path.suffix == ".bin":
            return self._mapping(path)[key].clone()  # a copy: the mapping stays read-only
        with open_safetensors(path) as f:
            return f.get_tensor(key)


def _slice_dtype(f: Any, key: str) -> torch.dtype:
    return SAFETENSORS_DTYPES[f.get_slice(key).get_dtype()]


def _outputs(name: str, converter: WeightConverter | None) -> list[str]:
    """Every parameter a group whose first output is ``name`` produces (one-to-many: all)."""
    if converter is None or len(converter.target_patterns) < 2:
        return [name]
    first = converter.target_patterns[0]
    return [name.replace(first, t) for t in converter.target_patterns]


def tie_aliases(model: PreTrainedModel, present: Iterable[str]) -> dict[str, str]:
    """Tied parameter name -> the partner the checkpoint holds, both ways (as ``tie_weights``)."""
    have = set(present)
    aliases: dict[str, str] = {}
    for target, source in getattr(model, "all_tied_weights_keys", {}).items():
        if source in have and target not in have:
            aliases[target] = source
        elif target in have and source not in have:
            aliases[source] = target
    return aliases


def checkpoint_names(model: nn.Module) -> tuple[PreTrainedModel, dict[str, str | None]]:
    """The Hugging Face model inside ``model``, and each state-dict name of ``model`` -> that
    tensor's name in the Hugging Face model without ``peft`` layers (None: an adapter).

    ``peft`` renames what it wraps: a ``base_model.model.`` prefix (the ``PeftModel`` around
    the Hugging Face model) and ``.base_layer`` inside each wrapped layer, whose adapters
    (``lora_A``, ``lora_B``, ...) the checkpoint does not hold.
    """
    found = next(((p, m) for p, m in model.named_modules() if isinstance(m, PreTrainedModel)), None)
    if found is None:
        raise ValueError(
            f"{type(model).__name__} holds no Hugging Face model (PreTrainedModel) to map "
            "checkpoint keys onto: pass the model built from the checkpoint's config"
        )
    prefix, net = found
    tuners = sorted(
        (
            f"{p}."
            for p, m in net.named_modules()
            if isinstance(getattr(m, "base_layer", None), nn.Module)
            and hasattr(m, "adapter_layer_names")
        ),
        key=len,
        reverse=True,
    )  # innermost first: a wrapped layer may be wrapped again
    copies = saved_copy_prefixes(net)  # peft's modules_to_save: original and copies
    names: dict[str, str | None] = {}
    for key in model.state_dict(keep_vars=True):
        if prefix and not key.startswith(f"{prefix}."):
            names[key] = None  # outside the Hugging Face model: nothing to read
            continue
        name: str | None = key[len(prefix) + 1 :] if prefix else key
        for tuner in tuners:
            if name is None or not name.startswith(tuner):
                continue
            rest = name[len(tuner) :]
            name = tuner + rest[len("base_layer.") :] if rest.startswith("base_layer.") else None
        names[key] = None if name is None else unwrap_saved_copies(name, copies)
    return net, names
