"""Export trained weights as a Hugging Face model directory (``from_pretrained`` loads it).

:func:`export_hf` reads fp32 master weights from a balance_beam checkpoint directory or
from a live strategy / engine, one parameter (checkpoint) or one block (engine) at a time,
and streams them into safetensors files: each shard's header is written first (shapes
are known up front), then every tensor's bytes as it arrives, so memory holds one block
at most, never the model. Above ``max_shard_bytes`` the weights are split into
``model-0000i-of-0000n.safetensors`` shards with a ``model.safetensors.index.json``.
A parameter shared under several names (tied embeddings) is written once, under its
first name; ``from_pretrained`` ties the others.
"""

from __future__ import annotations

import json
import math
import os
import struct
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, BinaryIO

import torch
from torch import Tensor

from bb_lightning.engine import checkpoint as ckpt
from bb_lightning.engine.hf_quirks import SAFETENSORS_DTYPES
from bb_lightning.engine.inference import InferenceEngine
from bb_lightning.engine.trainer_engine import TrainingEngine

__all__ = ["export_hf"]

DEFAULT_SHARD_BYTES = 5 << 30
"""Largest safetensors shard written by default, in bytes (Hugging Face's default, 5 GiB)."""

_ST_DTYPES: dict[torch.dtype, str] = {dtype: name for name, dtype in SAFETENSORS_DTYPES.items()}
"""safetensors dtype names."""

Entry = tuple[str, tuple[int, ...], torch.dtype]
"""A tensor to export: Hugging Face name, shape, dtype in the file."""


def _nbytes(entry: Entry) -> int:
    numel = 1
    for d in entry[1]:
        numel *= d
    return numel * torch.empty((), dtype=entry[2]).element_size()


def _plan_shards(entries: Sequence[Entry], max_shard_bytes: int) -> list[list[Entry]]:
    """Consecutive runs of ``entries`` of at most ``max_shard_bytes`` (a larger tensor alone)."""
    shards: list[list[Entry]] = [[]]
    size = 0
    for entry in entries:
        n = _nbytes(entry)
        if shards[-1] and size + n > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(entry)
        size += n
    return shards


def _header(shard: Sequence[Entry]) -> bytes:
    doc: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for entry in shard:
        n = _nbytes(entry)
        doc[entry[0]] = {
            "dtype": _ST_DTYPES[entry[2]],
            "shape": list(entry[1]),
            "data_offsets": [offset, offset + n],
        }
        offset += n
    raw = json.dumps(doc, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw


class _ShardWriter:
    """Writes planned shards in order, one tensor at a time.

    Each file is written under a ``.partial`` name and renamed by :meth:`finish` once
    every tensor is in; :meth:`abort` removes the partial files (no half-written
    checkpoint is left behind).
    """

    def __init__(self, out_dir: Path, shards: list[list[Entry]]) -> None:
        self.out_dir = out_dir
        self.shards = shards
        many = len(shards) > 1
        self.files = [
            f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" if many else "model.safetensors"
            for i in range(len(shards))
        ]
        self.order = [(i, e) for i, shard in enumerate(shards) for e in shard]
        self._next = 0
        self._file: BinaryIO | None = None
        self._shard = -1

    def write(self, name: str, value: Tensor) -> None:
        index, (want, shape, dtype) = self.order[self._next]
        if name != want or tuple(value.shape) != shape:
            raise ValueError(
                f"tensor {name!r} {tuple(value.shape)} arrived where {want!r} {shape} was planned"
            )
        if index != self._shard:
            self._close_file()
            self._file = open(self._partial(index), "wb")
            self._file.write(_header(self.shards[index]))
            self._shard = index
        data = value.detach().to("cpu", dtype).contiguous().reshape(-1).view(torch.uint8)
        assert self._file is not None
        self._file.write(data.numpy().tobytes())
        self._next += 1

    def _partial(self, index: int) -> Path:
        return self.out_dir / (self.files[index] + ".partial")

    def _close_file(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None

    def abort(self) -> None:
        """Close and remove the files written so far."""
        self._close_file()
        for i in range(len(self.files)):
            self._partial(i).unlink(missing_ok=True)

    def finish(self) -> None:
        self._close_file()
        if self._next != len(self.order):
            raise ValueError(f"{len(self.order) - self._next} planned tensors were not written")
        for i, name in enumerate(self.files):
            os.replace(self._partial(i), self.out_dir / name)
        if len(self.shards) > 1:
            index = {
                "metadata": {"total_size": sum(_nbytes(e) for _, e in self.order)},
                "weight_map": {e[0]: self.files[i] for i, e in self.order},
            }
            text = json.dumps(index, indent=2)
            (self.out_dir / "model.safetensors.index.json").write_text(text, encoding="utf-8")


def _engine_of(source: Any) -> TrainingEngine | InferenceEngine | None:
    """The engine of a strategy (its training engine, else its weights-only one) or engine."""
    for engine in (getattr(source, "engine", None), getattr(source, "inference", None), source):
        if isinstance(engine, (TrainingEngine, InferenceEngine)):
            return engine
    return None


Spec = tuple[str, tuple[int, ...], "torch.dtype | None"]
"""A tensor of a source: name in the module, shape, own dtype (None: exported in ``dtype``)."""


def _buffers(model: torch.nn.Module) -> list[tuple[str, Tensor]]:
    """``model``'s state-dict entries that are no parameter under any of its names (its
    buffers), detached, in state-dict order."""
    names = {k for k, _ in model.named_parameters(remove_duplicate=False)}
    return [(k, b.detach()) for k, b in model.state_dict(keep_vars=True).items() if k not in names]


def _source(source: Any) -> tuple[dict[str, Any], list[Spec], Iterator[tuple[str, Tensor]]]:
    """(model info, specs, iterator of (name, tensor)) of a source, parameters then buffers."""
    engine = _engine_of(source)
    if isinstance(engine, InferenceEngine):
        return _inference_source(engine)
    if engine is not None and (engine.frozen_params or any(engine.pager.frozen)):
        raise ValueError(
            "export_hf writes every weight from the optimizer state, but this model has "
            "frozen parameters (a LoRA base) that carry none: gather the module "
            "(strategy.gather_full_model()) and save the adapter with "
            "module.model.save_pretrained(dir), or merge it with merge_and_unload() first"
        )
    if engine is not None:
        params = [
            (key, tuple(shape))
            for state, keys in engine.named_states()
            for key, shape in zip(keys, state.shapes, strict=True)
        ]
        buffers = _buffers(engine.model)
        masters = ((k, s["master"]) for k, s in engine.iter_state(("master",)))
        return ckpt.model_info(engine.model), _specs(params, buffers), _chain(masters, buffers)
    if not isinstance(source, (str, os.PathLike)):
        raise ValueError(
            f"export_hf source {type(source).__name__} is neither a checkpoint directory nor a "
            "BalanceBeamStrategy after fit nor a TrainingEngine: pass one of those"
        )
    meta = ckpt.read_meta(source)
    params = [(p["name"], tuple(p["shape"])) for p in meta["parameters"]]
    state = ckpt.read_trainer_state(source)
    buffers = list(state.get("buffers", {}).items())
    masters = ((k, ckpt.read_array(source, "master", k)) for k, _ in params)
    return meta["model"], _specs(params, buffers), _chain(masters, buffers)


def _inference_source(
    engine: InferenceEngine,
) -> tuple[dict[str, Any], list[Spec], Iterator[tuple[str, Tensor]]]:
    """A weights-only engine's compute-dtype weights, one block read at a time."""
    first: dict[int, str] = {}
    for key, p in engine.model.named_parameters():
        first.setdefault(id(p), key)
    blocks = [[first[id(p)] for p in params] for params in engine.pager.params]
    params = [(k, s) for keys, shapes in zip(blocks, engine.pager.shapes, strict=True)
              for k, s in zip(keys, shapes, strict=True)]  # fmt: skip
    params += [(first[id(p)], tuple(p.shape)) for p in engine.resident_params]
    buffers = _buffers(engine.model)

    def weights() -> Iterator[tuple[str, Tensor]]:
        engine.pager.release_all_except(())
        for i, keys in enumerate(blocks):
            flat = engine.store.read(engine.pager.names[i])
            offset = 0
            for key, shape in zip(keys, engine.pager.shapes[i], strict=True):
                n = math.prod(shape)
                yield key, flat[offset : offset + n].view(shape)
                offset += n
        for p in engine.resident_params:
            yield first[id(p)], p.detach()

    return ckpt.model_info(engine.model), _specs(params, buffers), _chain(weights(), buffers)


def _specs(
    params: list[tuple[str, tuple[int, ...]]], buffers: list[tuple[str, Tensor]]
) -> list[Spec]:
    own = [(k, tuple(b.shape), None if b.is_floating_point() else b.dtype) for k, b in buffers]
    return [(k, s, None) for k, s in params] + own


def _chain(
    first: Iterator[tuple[str, Tensor]], rest: list[tuple[str, Tensor]]
) -> Iterator[tuple[str, Tensor]]:
    yield from first
    yield from rest


def export_hf(
    source: str | os.PathLike[str] | Any,
    out_dir: str | os.PathLike[str],
    *,
    dtype: torch.dtype = torch.bfloat16,
    max_shard_bytes: int = DEFAULT_SHARD_BYTES,
) -> Path:
    """Write ``config.json`` and safetensors weights that ``from_pretrained`` loads.

    Args:
        source: a balance_beam checkpoint directory, a ``BalanceBeamStrategy`` after
            ``fit`` (its engine; after a weights-only ``validate`` / ``predict``, its
            compute-dtype weights), a ``TrainingEngine`` or an ``InferenceEngine``.
        out_dir: directory to write (created; existing files of the same names replaced).
        dtype: dtype of the floating-point weights in the files (``torch.bfloat16`` or
            ``torch.float32``); buffers that are not floating point keep theirs.
        max_shard_bytes: largest shard, in bytes (> 0); a tensor larger than this gets
            a shard of its own.

    Returns:
        ``out_dir`` as a :class:`~pathlib.Path`.
    """
    if dtype not in (torch.bfloat16, torch.float32, torch.float16):
        raise ValueError(
            f"export dtype {dtype} is not supported: pass torch.bfloat16, torch.float16 or "
            "torch.float32"
        )
    if max_shard_bytes <= 0:
        raise ValueError(f"max_shard_bytes={max_shard_bytes} must be > 0 bytes: pass e.g. 5 << 30")
    info, specs, tensors = _source(source)
    if not info:
        raise ValueError(
            f"{source!r} holds no Hugging Face model (no PreTrainedModel in the module): "
            "export_hf needs a module built on AutoModelForCausalLM"
        )
    prefix: str = info["prefix"]
    entries: list[Entry] = [
        (key.removeprefix(prefix), shape, own or dtype)
        for key, shape, own in specs
        if key.startswith(prefix)
    ]
    if not entries:
        raise ValueError(f"{source!r} holds no tensors under the model prefix {prefix!r}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    writer = _ShardWriter(out, _plan_shards(entries, max_shard_bytes))
    try:
        for key, value in tensors:
            if key.startswith(prefix):
                writer.write(key.removeprefix(prefix), value)
        writer.finish()
    except BaseException:
        writer.abort()
        raise
    config = dict(info["config"])
    config["architectures"] = info["architectures"]
    config["dtype"] = str(dtype).removeprefix("torch.")
    (out / "config.json").write_text(json.dumps(config, indent=2), encoding="utf-8")
    return out
