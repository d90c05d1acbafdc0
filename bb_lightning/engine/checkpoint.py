"""Checkpoints of a :class:`~bb_lightning.engine.trainer_engine.TrainingEngine` as directories.

A checkpoint at ``path`` is a directory::

    path/
      state.zarr/                 zarr v3 group; attributes: format, version, step
        master/<param>            fp32 master weights, one array per parameter
        exp_avg/<param>           fp32 first AdamW moment (absent when weights_only)
        exp_avg_sq/<param>        fp32 second AdamW moment (absent when weights_only)
      trainer_state.json          everything else (loops, callbacks, schedulers, hyperparameters,
      trainer_state.safetensors   persistent buffers under "buffers"), stored so that loading runs
                                  no code (:mod:`bb_lightning.engine.trainer_state`)
      meta.json                   format, version, step, Hugging Face config, parameter list

``<param>`` is the parameter's name in the module (``model.model.layers.0.mlp.up_proj.weight``);
a parameter shared under several names is stored once under its first name, the others listed
as its aliases in ``meta.json``. Each subgroup is laid out as the store's NVMe tier lays out
tensors (:class:`storage.nvme.NvmeTier`: one uncompressed chunk per array, ending with its
CRC-32C), so plain ``zarr.open_group`` reads it and checks every chunk; so does every read here.

Data parallelism: a checkpoint saved by N ranks chunks each array along dim 0 by the
rows one rank holds (``ceil(rows / N)``, :class:`~bb_lightning.engine.shard.ShardLayout`)
and each rank writes its own chunks (:func:`follow_save`); plain zarr reads the arrays
whole, and so does :func:`read_array`, so the checkpoint resumes at any world size.

Format versions: 3 (this one: arrays may be chunked along dim 0; ``meta.json`` records
``world_size``); 2 (one chunk per array) loads as well; 1 (before checksums, trainer
state pickled in ``trainer_state.pt``) still loads: its arrays unverified, its pickle only
under the allowlist of :mod:`bb_lightning.engine.trainer_state` (a pickle that would run
code is refused).

Crash safety: the directory is written as ``<path>.partial-<pid>`` (every file fsynced,
``meta.json`` last), an existing ``path`` is renamed to ``<path>.old-<pid>``, the new directory
renamed onto ``path``, and only then is the old one deleted. :func:`recover` (run before every
save and load) puts an old directory back when a crash left no ``path``, and removes leftovers
of processes that are gone.
"""

from __future__ import annotations

import json
import math
import os
import shutil
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any, NoReturn

import torch
from torch import Tensor
from transformers import PreTrainedModel

from bb_lightning.engine import trainer_state as state_files
from bb_lightning.engine.checkpoint_read import (
    FORMAT,
    META,
    OLD,
    PARTIAL,
    READABLE_VERSIONS,
    STATE_DIR,
    TRAINER_STATE,
    VERSION,
    CheckpointError,
    CheckpointStateDict,
    read_array,
    read_meta,
    read_trainer_state,
    recover,
    verify_checkpoint,
)
from bb_lightning.engine.trainer_engine import TrainingEngine
from bb_lightning.placement import STATE_KINDS, StateKind
from storage.checksum import crc32c, encode
from storage.io import aligned_empty, open_backend, padded
from storage.nvme import (
    NvmeTier,
    fsync_dir,
    row_chunk_key,
    row_chunked_metadata,
    write_synced,
)

__all__ = [
    "FORMAT",
    "META",
    "OLD",
    "PARTIAL",
    "READABLE_VERSIONS",
    "STATE_DIR",
    "TRAINER_STATE",
    "VERSION",
    "CheckpointError",
    "CheckpointStateDict",
    "CheckpointWriteError",
    "follow_save",
    "load_checkpoint",
    "model_info",
    "read_array",
    "read_meta",
    "read_trainer_state",
    "recover",
    "remove_checkpoint",
    "restore_optimizer",
    "restore_weights",
    "save_checkpoint",
    "verify_checkpoint",
]


def _after_array(name: str) -> None:
    """Called after each array ``<kind>/<param>`` is written (a hook for crash tests)."""


class CheckpointWriteError(OSError):
    """A checkpoint save the disk failed (full, I/O error); the errno is kept."""


def model_info(model: torch.nn.Module) -> dict[str, Any]:
    """Prefix, class and config of the first Hugging Face model inside ``model`` (or empty)."""
    for prefix, sub in model.named_modules():
        if isinstance(sub, PreTrainedModel):
            return {
                "prefix": f"{prefix}." if prefix else "",
                "architectures": [type(sub).__name__],
                "config": json.loads(sub.config.to_json_string(use_diff=False)),
            }
    return {}


def _group_json(path: Path, attributes: dict[str, Any]) -> None:
    path.mkdir(exist_ok=True)
    doc = {"zarr_format": 3, "node_type": "group", "attributes": attributes}
    write_synced(path / "zarr.json", json.dumps(doc, indent=2).encode())


def _write_state(
    engine: TrainingEngine, root: Path, kinds: tuple[StateKind, ...], items: Iterator[Any]
) -> None:
    """Every parameter's state in ``kinds`` (``items``: ``engine.iter_state(kinds)``) as
    arrays of subgroups of ``root`` (fp32)."""
    named = engine.named_states()
    total = sum(padded(s.full_numel * 4) for s, _ in named)
    largest = max(math.prod(shape) for s, _ in named for shape in s.shapes)
    buf = aligned_empty(padded(largest * 4))
    backend = open_backend()
    tiers = {k: NvmeTier(root / k, capacity=total, backend=backend) for k in kinds}
    try:
        for name, state in items:
            for kind, value in state.items():
                tier = tiers[kind]
                tier.create(name, tuple(value.shape), torch.float32)
                nbytes = value.numel() * 4
                buf[:nbytes].copy_(value.contiguous().view(-1).view(torch.uint8))
                tier.write_async(name, buf).wait()
                _after_array(f"{kind}/{name}")
    finally:
        for tier in tiers.values():
            tier.close()
        backend.close()


def save_checkpoint(
    engine: TrainingEngine,
    path: str | os.PathLike[str],
    trainer_state: Mapping[str, Any],
    *,
    weights_only: bool = False,
) -> Path:
    """Write the engine's state and ``trainer_state`` as a checkpoint directory at ``path``.

    ``trainer_state`` is Lightning's checkpoint dict; its ``state_dict`` entry contributes
    only the persistent buffers (parameters come from the engine, streamed one flat state
    at a time). ``weights_only`` leaves out the AdamW moments. Returns the final path.

    A save that fails (a full disk...) removes what it wrote and leaves the previous
    checkpoint at ``path`` whole; a disk error raises :class:`CheckpointWriteError`.

    Under data parallelism (``engine.comm``) rank 0 calls this while every other rank
    calls :func:`follow_save` with the same ``weights_only``: every array is chunked along
    dim 0 by its shard rows and each rank writes its own chunks into rank 0's partial
    directory (:func:`_save_sharded`); ``meta.json`` records the world size.
    """
    final = Path(path).absolute()
    if engine.comm is not None:
        return _save_sharded(engine, final, trainer_state, weights_only)
    kinds: tuple[StateKind, ...] = ("master",) if weights_only else STATE_KINDS
    items = engine.iter_state(kinds)
    try:
        return _save(engine, final, trainer_state, weights_only, items)
    except BaseException as exc:
        recover(final)  # drops this save's partial directory, puts back a checkpoint moved aside
        _raise_as_write_error(exc, repr(str(final)))


def _raise_as_write_error(exc: BaseException, where: str) -> NoReturn:
    """Raise ``exc``, a disk error (``OSError``) as a :class:`CheckpointWriteError`."""
    if isinstance(exc, OSError) and not isinstance(exc, CheckpointWriteError):
        raise CheckpointWriteError(
            exc.errno,
            f"cannot save checkpoint {where}: {exc}; nothing of this save is left and the "
            "previous checkpoint at that path (if any) is whole",
        ) from exc
    raise exc


def follow_save(engine: TrainingEngine, *, weights_only: bool = False) -> None:
    """A rank other than 0's part of a data-parallel :func:`save_checkpoint`: it writes
    this rank's chunks of every array into the directory rank 0 names."""
    _save_sharded(engine, None, None, weights_only)


def _save_sharded(
    engine: TrainingEngine,
    final: Path | None,
    trainer_state: Mapping[str, Any] | None,
    weights_only: bool,
) -> Path:
    """The data-parallel save, on every rank (``final`` and ``trainer_state`` on rank 0).

    Rank 0 names the partial directory and broadcasts it; every rank writes its chunks
    and fsyncs them; when every rank succeeded, rank 0 writes the arrays' metadata, the
    trainer state and ``meta.json`` last, and renames the directory onto ``final`` (the
    crash-safe protocol of :func:`save_checkpoint`). A failure on any rank fails the save
    on every rank, and rank 0 removes what was written.
    """
    comm = engine.comm
    assert comm is not None
    rank = comm.rank
    kinds: tuple[StateKind, ...] = ("master",) if weights_only else STATE_KINDS
    error: BaseException | None = None
    tmp: Path | None = None
    if rank == 0:
        assert final is not None and trainer_state is not None
        try:
            final.parent.mkdir(parents=True, exist_ok=True)
            recover(final)
            tmp = final.with_name(f"{final.name}{PARTIAL}{os.getpid()}")
            tmp.mkdir()
            _group_json(tmp / STATE_DIR, _attributes(engine))
            for kind in kinds:
                _group_json(tmp / STATE_DIR / kind, {})
        except BaseException as exc:
            error = exc
    named = comm.broadcast_object(None if tmp is None or error else str(tmp))
    if named is None:
        raise error or CheckpointWriteError(
            0, "the checkpoint save failed on rank 0 before any rank wrote: see rank 0's error"
        )
    where = Path(str(named))
    try:
        _write_chunks(engine, where / STATE_DIR, kinds, rank)
    except BaseException as exc:
        error = exc
    if comm.all_true(error is None) and rank == 0:
        assert final is not None and trainer_state is not None
        try:
            _finish_save(engine, where, final, trainer_state, weights_only, kinds)
        except BaseException as exc:
            error = exc
    if not comm.all_true(error is None):
        if rank == 0 and final is not None:
            recover(final)  # drops the partial directory, puts back a checkpoint moved aside
        if error is None:
            raise CheckpointWriteError(
                0,
                f"the checkpoint save failed on another rank (this is rank {rank}): see its "
                "error; nothing of this save is left and the previous checkpoint is whole",
            )
        _raise_as_write_error(error, f"on rank {rank}")
    return final if final is not None else where


def _attributes(engine: TrainingEngine) -> dict[str, Any]:
    return {"format": FORMAT, "version": VERSION, "step": engine.step_count}


def _write_chunks(
    engine: TrainingEngine, root: Path, kinds: tuple[StateKind, ...], rank: int
) -> None:
    """This rank's chunks of every parameter's arrays under ``root`` (fsynced); rank 0
    also writes each array's ``zarr.json`` (chunked along dim 0 by the shard rows)."""
    dirs: set[Path] = set()
    for state, names, flats in engine.iter_shards(kinds):
        layout = state.layout
        assert layout is not None
        for piece, name, shape in zip(layout.pieces, names, state.shapes, strict=True):
            lo, hi = piece.rows_of(rank)
            for kind, shard in flats.items():
                array = root / kind / name
                array.mkdir(parents=True, exist_ok=True)
                if rank == 0:
                    meta = row_chunked_metadata(shape, torch.float32, piece.chunk)
                    write_synced(array / "zarr.json", json.dumps(meta, indent=2).encode())
                if hi <= lo:
                    continue  # fewer rows than ranks: this rank holds none of them
                rows = layout.rows_in_shard(piece, shard).contiguous()
                data = rows.view(-1).view(torch.uint8)
                chunk = array.joinpath(*row_chunk_key(rank if shape else 0, len(shape)).split("/"))
                chunk.parent.mkdir(parents=True, exist_ok=True)
                write_synced(chunk, data.numpy().tobytes() + encode(crc32c(data)))
                dirs.add(chunk.parent)
                _after_array(f"{kind}/{name}")
    for d in dirs:
        fsync_dir(d)


def _save(
    engine: TrainingEngine,
    final: Path,
    trainer_state: Mapping[str, Any],
    weights_only: bool,
    items: Iterator[Any],
) -> Path:
    final.parent.mkdir(parents=True, exist_ok=True)
    recover(final)
    tmp = final.with_name(f"{final.name}{PARTIAL}{os.getpid()}")
    tmp.mkdir()
    kinds: tuple[StateKind, ...] = ("master",) if weights_only else STATE_KINDS
    _group_json(tmp / STATE_DIR, _attributes(engine))
    _write_state(engine, tmp / STATE_DIR, kinds, items)

    return _finish_save(engine, tmp, final, trainer_state, weights_only, kinds)


def _finish_save(
    engine: TrainingEngine,
    tmp: Path,
    final: Path,
    trainer_state: Mapping[str, Any],
    weights_only: bool,
    kinds: tuple[StateKind, ...],
) -> Path:
    """Trainer state and ``meta.json`` (last) into ``tmp``, then ``tmp`` onto ``final``."""
    named = engine.named_states()
    params = {key for _, keys in named for key in keys}
    attributes = _attributes(engine)
    rest = {k: v for k, v in trainer_state.items() if k != "state_dict"}
    sd = trainer_state.get("state_dict", {})
    aliases: dict[str, list[str]] = {key: [] for key in params}
    first = {id(p): key for key, p in reversed(list(engine.model.named_parameters()))}
    for key, p in engine.model.named_parameters(remove_duplicate=False):
        if key != first[id(p)]:
            aliases[first[id(p)]].append(key)
    alias_names = {a for names in aliases.values() for a in names}
    # Frozen parameters (a LoRA base) are not written: they come from the base model.
    alias_names |= {k for k, p in engine.model.named_parameters(remove_duplicate=False)
                    if not p.requires_grad}  # fmt: skip
    # Only the keys that are not parameters are read: a lazy state dict (the strategy's
    # EngineStateDict) never materialises the parameters here.
    rest["buffers"] = {
        k: sd[k].detach().cpu() for k in list(sd) if k not in params and k not in alias_names
    }
    state_files.write(tmp, rest)
    meta = {
        **attributes,
        "weights_only": weights_only,
        "world_size": engine.world_size,
        "model": model_info(engine.model),
        "parameters": [
            {"name": key, "shape": list(shape), "aliases": aliases[key]}
            for state, keys in named
            for key, shape in zip(keys, state.shapes, strict=True)
        ],
    }
    write_synced(tmp / META, json.dumps(meta, indent=2).encode())
    fsync_dir(tmp)

    old = final.with_name(f"{final.name}{OLD}{os.getpid()}")
    if final.exists():
        os.replace(final, old)
    os.replace(tmp, final)
    fsync_dir(final.parent)
    shutil.rmtree(old, ignore_errors=True)
    return final


def load_checkpoint(
    path: str | os.PathLike[str], *, weights_only: bool | None = None
) -> dict[str, Any]:
    """Lightning's checkpoint dict, with a lazy :class:`CheckpointStateDict` as ``state_dict``.

    Loading runs no code from the checkpoint, whatever ``weights_only`` says (it is accepted
    for Lightning's signature): see :func:`read_trainer_state`.
    """
    state = read_trainer_state(path)
    state["state_dict"] = CheckpointStateDict(path, state.pop("buffers", {}))
    return state


def _check_matches(engine: TrainingEngine, meta: Mapping[str, Any], path: Path) -> None:
    want = [
        (key, tuple(shape))
        for state, keys in engine.named_states()
        for key, shape in zip(keys, state.shapes, strict=True)
    ]
    got = [(p["name"], tuple(p["shape"])) for p in meta["parameters"]]
    for i in range(max(len(want), len(got))):
        w = want[i] if i < len(want) else None
        g = got[i] if i < len(got) else None
        if w != g:
            raise CheckpointError(
                f"checkpoint {str(path)!r} does not match the model: parameter {i} is {g} in "
                f"the checkpoint but {w} in the model: load it into the model it was saved from"
            )


def restore_weights(engine: TrainingEngine, state_dict: CheckpointStateDict) -> None:
    """Masters (and the compute-dtype weights derived from them) and buffers from disk."""
    _check_matches(engine, state_dict.meta, state_dict.path)

    def fill(key: str, kind: StateKind, out: Tensor) -> None:
        out.copy_(read_array(state_dict.path, kind, key))

    engine.load_state(fill, ("master",))
    for key, value in state_dict.buffers.items():
        engine.model.get_buffer(key).copy_(value)


def restore_optimizer(engine: TrainingEngine, state_dict: CheckpointStateDict) -> None:
    """AdamW moments and step count from disk; :class:`CheckpointError` if weights only."""
    if state_dict.meta["weights_only"]:
        raise CheckpointError(
            f"checkpoint {str(state_dict.path)!r} holds weights only, no optimizer state: "
            "resume from a full checkpoint or load it with trainer.validate / predict"
        )
    _check_matches(engine, state_dict.meta, state_dict.path)

    def fill(key: str, kind: StateKind, out: Tensor) -> None:
        out.copy_(read_array(state_dict.path, kind, key))

    engine.load_state(fill, ("exp_avg", "exp_avg_sq"))
    engine.step_count = int(state_dict.meta["step"])


def remove_checkpoint(path: str | os.PathLike[str]) -> None:
    """Delete the checkpoint directory at ``path`` (and leftovers of interrupted saves)."""
    final = Path(path)
    recover(final)
    if final.is_dir():
        # renamed aside first: a kill during the deletion leaves a leftover for recover(),
        # never a half-deleted checkpoint under the final name
        doomed = final.with_name(f"{final.name}{PARTIAL}{os.getpid()}")
        os.replace(final, doomed)
        fsync_dir(final.parent)
        shutil.rmtree(doomed)
    elif final.exists():
        final.unlink()
