"""``bb-lightning convert``: a Hugging Face safetensors checkpoint -> an NVMe-tier zarr store.

Parameters are streamed one at a time the way ``from_pretrained`` maps the
checkpoint (:class:`bb_lightning.hf.hf_load.HFCheckpoint`: renamed keys, fused
MoE experts, tied heads) and written in pieces of at most ``piece_bytes``
through the store's I/O backend into a plain zarr v3 group
(:class:`storage.nvme.NvmeTier`): one uncompressed chunk per parameter, named
by its module name (a tied parameter once, under its first name). Each tensor's write is atomic, so an
interrupted run leaves only complete tensors; a rerun skips those (same shape
and dtype, chunk of the right size) and writes the rest. ``config.json`` and
``generation_config.json`` go into the group's attributes (``hf_config``,
``hf_generation_config``) and, with the tokenizer files, beside the arrays; the
attribute ``balance_beam_converted`` records the format version, the dtype of the
floating-point tensors and the source directory. The store is then a model source:
``CausalLMModule(STORE)`` builds the model from it and reads its weights from it
(:mod:`bb_lightning.hf.converted`).
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from bb_lightning.engine.hf_quirks import (
    SAFETENSORS_DTYPES,
    SAFETENSORS_INDEX,
    read_config,
    read_weight_index,
)
from bb_lightning.hf.converted import CONFIG_ATTR, FORMAT_ATTR, FORMAT_VERSION
from bb_lightning.hf.hf_load import HFCheckpoint, empty_model
from storage.io import IOConfig, aligned_empty, open_backend, padded
from storage.nvme import NvmeTier, parse_array
from storage.tiers import format_bytes
from storage.verify import chunk_problem

__all__ = ["ConvertReport", "checkpoint_files", "convert_checkpoint"]

_CONFIG_FILES = {"config.json": CONFIG_ATTR, "generation_config.json": "hf_generation_config"}
"""Source files copied into the group's attributes (file -> attribute name)."""
_TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "tokenizer.model",
    "vocab.json",
    "vocab.txt",
    "merges.txt",
    "chat_template.jinja",
)
"""Tokenizer files copied beside the arrays (with the config files), so that the store is
also a tokenizer directory."""
_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


@dataclass(frozen=True, kw_only=True)
class ConvertReport:
    """What one conversion did."""

    target: Path
    """The zarr store directory."""
    written: int
    """Tensors written by this run."""
    skipped: int
    """Tensors already complete in the target (left as they were)."""
    bytes_written: int
    """Bytes written by this run."""
    seconds: float
    """Wall time of the run (seconds)."""

    def summary(self) -> str:
        """One line for a person."""
        rate = self.bytes_written / self.seconds if self.seconds > 0 else 0.0
        return (
            f"converted {self.written} tensors ({format_bytes(self.bytes_written)}), skipped "
            f"{self.skipped} already complete, in {self.seconds:.1f} s "
            f"({format_bytes(int(rate))}/s) -> {self.target}"
        )


def checkpoint_files(source: str | os.PathLike[str]) -> list[Path]:
    """The safetensors files of checkpoint directory ``source``, in index order.

    Uses ``model.safetensors.index.json`` when present, else every ``*.safetensors``.
    """
    root = Path(source)
    if not root.is_dir():
        raise ValueError(f"checkpoint {root} is not a directory: pass a local checkpoint dir")
    index = root / SAFETENSORS_INDEX
    if index.is_file():
        return list(dict.fromkeys(read_weight_index(index).values()))
    files = sorted(root.glob("*.safetensors"))
    if not files:
        raise ValueError(
            f"checkpoint {root} holds no *.safetensors file: convert .bin checkpoints with "
            "transformers (save_pretrained(..., safe_serialization=True)) first"
        )
    return files


def _specs(
    reader: HFCheckpoint, model: torch.nn.Module, dtype: torch.dtype | None
) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
    """(parameter name, shape, dtype written) of each parameter, in module order."""
    specs = []
    for name, param in model.named_parameters():
        src = reader.source_dtype(name)
        if src not in SAFETENSORS_DTYPES.values():
            raise ValueError(
                f"parameter {name!r} has dtype {src} on disk, which the NVMe tier does not "
                f"store: use one of {sorted(SAFETENSORS_DTYPES)}"
            )
        out = dtype if dtype is not None and src.is_floating_point else src
        specs.append((name, tuple(param.shape), out))
    return specs


def _complete(tier: NvmeTier, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> bool:
    """Whether ``name`` is in ``tier`` with this shape and dtype and its whole chunk written
    and sound (its CRC-32C checked: a resumed convert reads what it keeps)."""
    if not tier.contains(name):
        return False
    spec = tier.spec(name)
    if spec.shape != shape or spec.dtype != dtype:
        return False
    return spec.nbytes == 0 or chunk_problem(name, spec, tier.chunk_path(name)) is None


def convert_checkpoint(
    source: str | os.PathLike[str],
    target: str | os.PathLike[str],
    *,
    dtype: str | None = None,
    capacity: int | None = None,
    io: IOConfig | None = None,
    piece_bytes: int = 64 << 20,
    progress: bool = True,
) -> ConvertReport:
    """Convert checkpoint directory ``source`` into the zarr store at ``target``.

    Args:
        dtype: ``"bfloat16"``, ``"float16"`` or ``"float32"`` for the floating-point
            tensors; None keeps the checkpoint's dtypes (integer tensors are kept).
        capacity: bytes the store may hold; None: the converted tensors' total.
        io: I/O backend settings (None: the default, kvikio where a CUDA driver exists).
        piece_bytes: bytes written per I/O call (bounds the host buffer); a multiple of 4096.
        progress: show a progress bar (bytes) on stderr.
    """
    if dtype is not None and dtype not in _DTYPES:
        raise ValueError(f"dtype={dtype!r}: use one of {sorted(_DTYPES)} or None (keep)")
    if piece_bytes <= 0 or piece_bytes % 4096:
        raise ValueError(f"piece_bytes={piece_bytes} must be a positive multiple of 4096 bytes")
    if not HFCheckpoint.holds_weights(source):
        checkpoint_files(source)  # raises, naming what is missing
    if not (Path(source) / "config.json").is_file():
        raise ValueError(f"checkpoint {source} has no config.json: save it with save_pretrained")
    model = empty_model(read_config(source))
    reader = HFCheckpoint(source, model)
    specs = _specs(reader, model, _DTYPES[dtype] if dtype else None)
    sizes = [_nbytes(shape, dt) for _, shape, dt in specs]
    total = sum(sizes)
    if capacity is not None and capacity < total:
        raise ValueError(
            f"capacity {format_bytes(capacity)} ({capacity} bytes) < the checkpoint's "
            f"{format_bytes(total)} ({total} bytes): raise --capacity or omit it"
        )
    from tqdm.auto import tqdm

    start = time.perf_counter()
    written = skipped = moved = 0
    piece = min(piece_bytes, padded(max(sizes, default=1)))
    buf = aligned_empty(piece)
    backend = open_backend(io)
    try:
        room = capacity or total + _stored_bytes(Path(target))  # changed tensors are replaced
        with NvmeTier(target, capacity=room, backend=backend) as tier:
            bar = tqdm(total=total, unit="B", unit_scale=True, disable=not progress)
            for (key, shape, dt), size in zip(specs, sizes, strict=True):
                bar.set_postfix_str(key[-40:], refresh=False)
                if _complete(tier, key, shape, dt):
                    skipped += 1
                    bar.update(size)
                    continue
                if tier.contains(key):
                    tier.delete(key)
                tier.create(key, shape, dt)
                value = reader.get(key, dt).contiguous()
                _write_tensor(tier, key, value, buf, piece, bar.update)
                written += 1
                moved += size
            bar.close()
    finally:
        backend.close()
    floats = {str(dt).removeprefix("torch.") for _, _, dt in specs if dt.is_floating_point}
    _describe(Path(source), Path(target), floats.pop() if len(floats) == 1 else None)
    return ConvertReport(
        target=Path(target),
        written=written,
        skipped=skipped,
        bytes_written=moved,
        seconds=time.perf_counter() - start,
    )


def _stored_bytes(target: Path) -> int:
    """Bytes of the arrays already in the store at ``target`` (0 when it does not exist)."""
    if not target.is_dir():
        return 0
    metas = [d / "zarr.json" for d in target.iterdir() if (d / "zarr.json").is_file()]
    return sum(parse_array(m.parent.name, m)[0].nbytes for m in metas)


def _describe(source: Path, target: Path, dtype: str | None) -> None:
    """Describe the model in ``target``: config files in the group attributes and beside
    the arrays with the tokenizer files, and the store's format, dtype (of its floating-point
    tensors; None: mixed) and source (each file replaced atomically)."""
    group = target / "zarr.json"
    doc = json.loads(group.read_text(encoding="utf-8"))
    attrs = doc.get("attributes")
    if not isinstance(attrs, dict):  # damaged: what convert describes is written whole below
        attrs = doc["attributes"] = {}
    for name, attr in _CONFIG_FILES.items():
        if (source / name).is_file():
            attrs[attr] = json.loads((source / name).read_text(encoding="utf-8"))
    attrs[FORMAT_ATTR] = {
        "format_version": FORMAT_VERSION,
        "dtype": dtype,
        "source": str(source.absolute()),
    }
    for name in (*_CONFIG_FILES, *_TOKENIZER_FILES):
        if (source / name).is_file():
            _replace(target / name, (source / name).read_bytes())
    _replace(group, json.dumps(doc, indent=1).encode())


def _replace(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` atomically (a temporary file renamed onto it)."""
    tmp = path.with_name(f"{path.name}.tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def _nbytes(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    n = 1
    for d in shape:
        n *= d
    return n * torch.empty((), dtype=dtype).element_size()


def _write_tensor(
    tier: NvmeTier,
    name: str,
    tensor: torch.Tensor,
    buf: torch.Tensor,
    piece: int,
    advance: Callable[[int], object],
) -> None:
    """Write ``tensor`` as ``name`` in pieces through ``buf`` (aligned host bytes), atomically."""
    data = tensor.reshape(-1).view(torch.uint8)
    with tier.begin_write(name) as write:
        for offset in range(0, data.numel(), piece):
            count = min(piece, data.numel() - offset)
            buf[:count].copy_(data[offset : offset + count])
            write.write_async(buf, offset=offset, nbytes=count).wait()
            advance(count)
        write.commit()
