"""A store written by ``bb-lightning convert``, used as a model's source of weights.

``bb-lightning convert HF_DIR STORE`` (:mod:`bb_lightning.hf.convert`) writes a zarr v3
group with one checksummed array per parameter (named by its module name, a tied
parameter once), the model's ``config.json`` / ``generation_config.json`` in the group's
attributes and beside the arrays, the tokenizer files beside them, and a description
under the attribute :data:`FORMAT_ATTR`: the store's format version, the dtype of its
floating-point tensors and the checkpoint it was converted from.

:func:`converted_store` recognises such a directory (None for any other path) and
refuses, in one line, a store of a format version this release does not read.
:class:`StoreCheckpoint` serves each parameter of the model by module name, the way
:class:`~bb_lightning.hf.hf_load.HFCheckpoint` serves a Hugging Face directory: each read
opens the tensor's chunk file read-only, checks its CRC-32C and returns it. Nothing is
ever written into the store: no lock file, no partial file, no attribute.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn
from transformers import CONFIG_MAPPING, PretrainedConfig, PreTrainedModel

from bb_lightning.hf.hf_load import checkpoint_names, empty_model, tie_aliases
from storage.checksum import crc32c
from storage.chunk_io import ArraySpec, NvmeError, check_crc
from storage.external import FilePiece
from storage.nvme import parse_array

__all__ = [
    "FORMAT_ATTR",
    "FORMAT_VERSION",
    "ConvertedStore",
    "StoreCheckpoint",
    "converted_store",
    "load_converted",
    "store_config",
]

FORMAT_ATTR = "balance_beam_converted"
"""Group attribute describing a converted store (format version, dtype, source)."""
FORMAT_VERSION = 1
"""Format version this release writes and reads."""
CONFIG_ATTR = "hf_config"
"""Group attribute holding the model's ``config.json``."""


@dataclass(frozen=True)
class ConvertedStore:
    """What a converted store says about itself (its group attributes)."""

    path: Path
    """The store directory."""
    config: dict[str, Any]
    """The model's ``config.json``."""
    dtype: str | None
    """The dtype of its floating-point tensors (``"bfloat16"``, ...); None when mixed."""
    source: str
    """The checkpoint directory it was converted from (as given to convert)."""

    def describe(self) -> str:
        """What the store holds, for a message: model type and dtype."""
        kind = self.config.get("model_type", "?")
        return f"a {kind} model in {self.dtype or 'mixed dtypes'}"


def converted_store(path: str | os.PathLike[str]) -> ConvertedStore | None:
    """The description of the converted store at ``path``; None when ``path`` is not a
    directory holding a zarr group written by ``bb-lightning convert``.

    Raises ``ValueError`` (one line, naming the store, its version and the fix) for a
    store of another format version, or one convert did not finish describing.
    """
    root = Path(path)
    group = root / "zarr.json"
    if not group.is_file():
        return None
    try:
        doc = json.loads(group.read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError) as err:  # RecursionError: nested too deep
        raise ValueError(
            f"store {root}: {group} is not readable JSON ({type(err).__name__}): copy the store "
            "again or run 'bb-lightning convert' into a new directory"
        ) from None
    attrs = doc.get("attributes") if isinstance(doc, dict) else None
    if not isinstance(doc, dict) or doc.get("node_type") != "group" or not isinstance(attrs, dict):
        return None
    info = attrs.get(FORMAT_ATTR)
    config = attrs.get(CONFIG_ATTR)
    if info is None and config is None:
        return None  # a run's store or another zarr group: not a model source
    version = info.get("format_version") if isinstance(info, dict) else None
    if version != FORMAT_VERSION or not isinstance(config, dict):
        raise ValueError(
            f"store {root} has converted-store format version {version!r}; this release reads "
            f"version {FORMAT_VERSION}: run 'bb-lightning convert' into it again (complete "
            "tensors are kept) or use the release that wrote it"
        )
    assert isinstance(info, dict)
    dtype = info.get("dtype")
    return ConvertedStore(
        path=root,
        config=config,
        dtype=dtype if isinstance(dtype, str) else None,
        source=str(info.get("source", "")),
    )


class StoreCheckpoint:
    """The parameters of ``model`` read from a converted store by module name (read-only).

    Built on a (meta) model of the store's config, or a ``peft`` model wrapping one (its
    adapters are not in the store). ``ValueError`` at construction names the parameters
    the store lacks or holds with another shape: a store of another model.
    """

    def __init__(self, store: ConvertedStore, model: nn.Module) -> None:
        self.store = store
        self.directory = store.path
        net, self._names = checkpoint_names(model)
        self._arrays: dict[str, tuple[ArraySpec, Path]] = {}
        for entry in sorted(os.scandir(store.path), key=lambda e: e.name):
            meta = Path(entry.path, "zarr.json")
            if entry.is_dir() and meta.is_file():
                try:
                    self._arrays[entry.name] = parse_array(entry.name, meta)
                except NvmeError as err:
                    raise ValueError(f"store {store.path}: {err}") from None
        self._aliases = tie_aliases(net, self._arrays)
        self._shapes = {k: tuple(t.shape) for k, t in model.state_dict(keep_vars=True).items()}
        wrong = []
        for name, param in model.named_parameters():
            base = self._names.get(name, name)
            if base is None:
                continue  # an adapter: built with its value
            key = self.resolve(name)
            if key is None or self._arrays[key][0].shape != tuple(param.shape):
                got = "missing" if key is None else str(self._arrays[key][0].shape)
                wrong.append(f"{base} {got} (model {tuple(param.shape)})")
        if wrong:
            raise ValueError(
                f"store {store.path} ({store.describe()}) does not hold {len(wrong)} parameters "
                f"of the {type(net).__name__} the run builds, e.g. {wrong[:2]}: it was converted "
                "from another model; convert this model into a new directory"
            )

    def resolve(self, name: str) -> str | None:
        """The array name parameter ``name`` is stored under (a tied one's partner); None
        for an adapter or a parameter the store lacks."""
        base = self._names.get(name, name)
        if base is None or base in self._arrays:
            return base
        return self._aliases.get(base)

    def piece(self, name: str, dtype: torch.dtype) -> FilePiece | None:
        """The chunk file holding parameter ``name``'s bytes when it stores them in
        ``dtype`` (read in place, read-only; its CRC-32C trailer checked on read); None
        for an adapter, a parameter the store lacks or holds in another dtype."""
        key = self.resolve(name)
        if key is None:
            return None
        spec, chunk = self._arrays[key]
        if spec.dtype != dtype:
            return None
        return FilePiece(path=chunk, nbytes=spec.nbytes, checksum=spec.checksum)

    def source_dtype(self, name: str) -> torch.dtype:
        """dtype of parameter ``name`` in the store."""
        return self._arrays[self._resolved(name)][0].dtype

    def get(self, name: str, dtype: torch.dtype | None = None) -> Tensor:
        """Parameter ``name`` as a CPU tensor read from its chunk (CRC-32C checked), cast to
        ``dtype`` (None: the stored dtype)."""
        spec, chunk = self._arrays[self._resolved(name)]
        value = _read_chunk(spec, chunk, self.directory)
        return value if dtype is None else value.to(dtype)

    def _resolved(self, name: str) -> str:
        key = self.resolve(name)
        if key is None:
            raise ValueError(
                f"parameter {name!r} is not in the store {self.directory}: it is an adapter "
                "(it keeps the value it was built with) or the store holds another model"
            )
        return key


def _read_chunk(spec: ArraySpec, chunk: Path, store: Path) -> Tensor:
    """The tensor ``spec`` from chunk file ``chunk``, read-only, its checksum verified."""
    buf = torch.empty(spec.nbytes, dtype=torch.uint8)
    if spec.nbytes:
        view = memoryview(buf.numpy().data)
        got = 0
        try:
            with open(chunk, "rb", buffering=0) as f:
                while got < spec.nbytes:
                    n = f.readinto(view[got:])
                    if not n:
                        break
                    got += n
        except FileNotFoundError:
            got = -1
        if got != spec.nbytes:
            raise ValueError(
                f"store {store}: tensor {spec.name!r} has "
                f"{'no chunk file' if got < 0 else f'{got} of its {spec.nbytes} bytes'} "
                f"({chunk}): the conversion did not finish; run 'bb-lightning convert' again"
            )
        if spec.checksum:
            try:
                check_crc(spec, chunk, crc32c(buf), store)
            except NvmeError as err:
                raise ValueError(str(err)) from None
    return buf.view(spec.dtype).reshape(spec.shape)


def store_config(store: ConvertedStore) -> PretrainedConfig:
    """The model configuration a converted store holds (as ``from_pretrained`` reads it)."""
    model_type = store.config.get("model_type")
    if not isinstance(model_type, str) or model_type not in CONFIG_MAPPING:
        raise ValueError(
            f"store {store.path} holds a model of type {model_type!r}, which this transformers "
            "does not know: upgrade transformers or convert another model"
        )
    try:
        config = CONFIG_MAPPING[model_type].from_dict(dict(store.config))
    except Exception as err:
        reason = " ".join(str(err).split())[:200] or type(err).__name__
        raise ValueError(
            f"store {store.path}: its model config is not usable ({reason}): convert the "
            "model again"
        ) from None
    config.name_or_path = str(store.path)  # named by a refusal to build the model
    return config


def load_converted(store: ConvertedStore, config: PretrainedConfig) -> PreTrainedModel:
    """The model of ``config`` with its weights read from ``store`` (as stored, like
    ``from_pretrained`` keeping a checkpoint's dtype), tied parameters tied."""
    model = empty_model(config)
    reader = StoreCheckpoint(store, model)
    values = {name: reader.get(name) for name, _ in model.named_parameters()}
    model.load_state_dict(values, strict=False, assign=True)
    model.tie_weights()
    return model
