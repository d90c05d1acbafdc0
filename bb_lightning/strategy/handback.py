"""The trained model back in the user's hands after ``trainer.fit`` / ``validate`` / ``predict``.

While the strategy runs, the paged blocks of a module hold empty parameters: their
weights live in the tensor store. At the end of each ``trainer.*`` call
:func:`hand_back` gives the module its weights again, as plain Lightning leaves it:
every parameter a host (CPU) tensor holding the trained values, in the dtype plain
Lightning leaves parameters in for the Trainer's precision (:func:`handback_dtype`:
bf16 under ``"bf16-true"``, fp32 under ``"32-true"`` and ``"bf16-mixed"``), rounded
from the fp32 master weights (after a weights-only ``validate`` / ``predict``, cast
from the compute-dtype weights); floating-point buffers in that dtype on the host, the
blocks' own forwards back. ``state_dict()``, ``save_pretrained`` (and so the size it
writes) and ``module.model.dtype`` are then those of plain Lightning. The store stays
open: the next ``trainer.*`` call on the same strategy :func:`take_back` the module (its
current parameter values loaded into the store, so edits between calls count; a
parameter still equal to its handed-back value keeps its fp32 master, so bf16 rounding
never accumulates across calls; AdamW moments and step count kept).

The weights are read and cast one block at a time, so handing back takes the model in
that dtype, never a whole fp32 copy besides. Where the weights in that dtype exceed what host
memory can hold, or what the host budget of a ``StoreConfig`` the user gave leaves beside
the store's arena (:func:`fits_host`, :func:`budget_room`), the module stays hollow and
:class:`HollowGuard` makes that loud instead of silent: ``state_dict()`` of the module,
of its Hugging Face model or of any module holding a paged block raises
:class:`WeightsInStoreError` (which names ``bb-lightning export``), and the Hugging Face
model's ``save_pretrained(dir)`` streams the weights from the store one block at a time
through :func:`bb_lightning.hf.export.export_hf` (each file written under a temporary name
and renamed when complete, so a failure leaves no partial checkpoint). Forwards still run
through the store's paged blocks.
"""

from __future__ import annotations

import contextlib
import math
import os
import re
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psutil
import torch
from torch import nn
from torch.utils.hooks import RemovableHandle
from transformers import PreTrainedModel

from bb_lightning.engine.flat import buffers_to, set_data
from bb_lightning.engine.inference import InferenceEngine
from bb_lightning.engine.trainer_engine import TrainingEngine
from storage.store import TieredStore
from storage.tiers import Tier

__all__ = [
    "HOST_SHARE",
    "HollowGuard",
    "WeightsInStoreError",
    "budget_room",
    "fits_host",
    "hand_back",
    "handback_dtype",
    "param_bytes",
    "take_back",
]

Engine = TrainingEngine | InferenceEngine

HOST_SHARE = 0.8
"""Share of the host memory available (``psutil``) that the handed-back weights may take
when no explicit limit is given."""


class WeightsInStoreError(RuntimeError):
    """The module's trained weights live in the balance_beam store, not in its parameters."""


def param_bytes(engine: Engine, dtype: torch.dtype = torch.float32) -> int:
    """Bytes of the model's parameters in ``dtype`` (each shared parameter once)."""
    paged = sum(math.prod(s) for shapes in engine.pager.shapes for s in shapes)
    numel = paged + sum(p.numel() for p in engine.resident_params)
    return numel * torch.empty((), dtype=dtype).element_size()


def fits_host(
    nbytes: int, limit: int | None, share: int = 1, room: int | None = None
) -> tuple[bool, int]:
    """Whether ``nbytes`` fit the host limit (bytes; None: :data:`HOST_SHARE` of the
    memory available now, divided among the ``share`` processes of this machine that
    each take a copy, and at most ``room``), and the limit used.

    ``room`` (bytes, None: no cap) is what the host budget the user gave the run's store
    leaves unused (:func:`budget_room`): the handed-back weights count against that
    budget as the store's arena does. An explicit ``limit`` is used as is.
    """
    if share < 1:
        raise ValueError(f"share={share} must be >= 1 (processes handing weights back)")
    if limit is None:
        limit = int(HOST_SHARE * psutil.virtual_memory().available) // share
        if room is not None:
            limit = min(limit, room)
    return nbytes <= limit, limit


def budget_room(store: TieredStore) -> int:
    """Bytes of the store's host budget its host arena leaves unused (the budget less the
    arena's slots, padded as carved): the host memory a run given that budget may still
    take. The device arena is not counted: on a CPU device its paging slots stay resident
    once used."""
    used, capacity = store.usage()[Tier.HOST]
    return max(0, capacity - used)


_TRUE_DTYPES = {"bf16-true": torch.bfloat16, "16-true": torch.float16, "64-true": torch.float64}


def handback_dtype(precision: str) -> torch.dtype:
    """The dtype plain Lightning leaves a module's parameters in under the Trainer's
    ``precision`` flag: that of a ``"*-true"`` precision, else (``"32-true"``, ``"*-mixed"``)
    fp32."""
    return _TRUE_DTYPES.get(str(precision), torch.float32)


def hand_back(engine: Engine, dtype: torch.dtype = torch.float32) -> None:
    """Put the engine's weights into the module's parameters (host, ``dtype``: see
    :func:`handback_dtype`); floating-point buffers to ``dtype``; restore forwards.

    The weights are read one block at a time and cast to ``dtype`` as read
    (:func:`_values`): the host memory taken is the model in ``dtype`` plus one block's
    fp32 values, never the whole model in fp32 (6.5 GiB more than bf16's 3.2 GiB for a
    1.74B model). The store keeps its copy (and the optimizer state); :func:`take_back`
    undoes this.
    """
    if isinstance(engine, TrainingEngine):
        engine.grads.wait()
    engine.pager.release_all_except(())
    values = _values(engine, dtype)
    engine.paged.remove()
    if isinstance(engine, InferenceEngine):
        engine.kernels_off()
    for p in engine.model.parameters():  # each shared parameter once
        set_data(p, values.pop(id(p)))
    engine.pager.handed_back = True  # reads of the store no longer unbind them
    buffers_to(engine.model, torch.device("cpu"), dtype)


def _values(engine: Engine, dtype: torch.dtype) -> dict[int, torch.Tensor]:
    """``id(parameter)`` -> its value as a host tensor of ``dtype``, read block by block:
    a training engine's fp32 masters (frozen parameters as stored), a weights-only
    engine's compute-dtype weights."""
    out: dict[int, torch.Tensor] = {}
    if isinstance(engine, TrainingEngine):
        named = dict(engine.model.named_parameters())  # the first name of a shared one
        for key, state in engine.iter_state(("master",)):  # views into scratch: copied
            out[id(named[key])] = state["master"].to(dtype, copy=True)
        for key, value in engine.iter_frozen():  # fp32 copies of one block at a time
            out[id(named[key])] = value.to(dtype)
        return out
    for i, params in enumerate(engine.pager.params):
        flat, offset = engine.store.read(engine.pager.names[i]), 0
        for p, shape in zip(params, engine.pager.shapes[i], strict=True):
            n = math.prod(shape)
            out[id(p)] = flat[offset : offset + n].view(shape).to(dtype, copy=True)
            offset += n
    for p in engine.resident_params:
        out[id(p)] = p.detach().to("cpu", dtype, copy=True)
    return out


def take_back(engine: Engine) -> None:
    """Page a handed-back module again: its current parameter values into the store, the
    blocks' parameters unbound, the other parameters and the buffers on the device in the
    compute dtype, the paged forwards installed.

    A parameter handed back below fp32 and still equal to its fp32 master rounded to its
    dtype is loaded from that master (its fp32 precision kept)."""
    values = {key: p.detach() for key, p in engine.model.named_parameters()}
    if isinstance(engine, TrainingEngine) and any(
        v.dtype != torch.float32 for v in values.values()
    ):
        masters = engine.lazy_state_dict()
        trained = masters.parameter_keys
        for key, value in values.items():
            if value.dtype == torch.float32 or key not in trained:
                continue
            master = masters[key]
            if torch.equal(master.to(value.dtype), value):
                values[key] = master
    engine.load_state_dict(values)
    engine.pager.handed_back = False
    frozen = engine.frozen_params if isinstance(engine, TrainingEngine) else []
    for p in [*engine.resident_params, *frozen]:
        set_data(p, p.detach().to(engine.device, engine.compute_dtype))
    for i in range(engine.pager.num_blocks):
        engine.pager.release(i)  # unbinds resident blocks too
    buffers_to(engine.model, engine.device, engine.compute_dtype)
    engine.paged.install()
    if isinstance(engine, InferenceEngine):
        engine.kernels_on()


_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]?I?B)\s*$", re.IGNORECASE)
_UNITS = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12}
_UNITS.update({"KIB": 1 << 10, "MIB": 1 << 20, "GIB": 1 << 30, "TIB": 1 << 40})


def shard_bytes(size: int | str) -> int:
    """``save_pretrained``'s ``max_shard_size`` (bytes, or ``"5GB"`` / ``"500MiB"``) in bytes."""
    if isinstance(size, int):
        return size
    match = _SIZE.match(size)
    if match is None:
        raise ValueError(f"max_shard_size={size!r}: pass bytes or a size such as '5GB'")
    return int(float(match.group(1)) * _UNITS[match.group(2).upper()])


class HollowGuard:
    """Makes a module whose weights stay in the store refuse ``state_dict()`` and stream
    ``save_pretrained``, until :meth:`remove`.

    ``source`` returns the strategy (or engine) to stream from, None once its store is
    closed; it is held weakly so the guard never keeps a strategy alive.
    """

    def __init__(
        self, engine: Engine, source: Any, reason: str, dtype: torch.dtype | None = None
    ) -> None:
        self.reason = reason
        self.dtype = dtype
        """dtype ``save_pretrained`` writes (None: fp32 after training, else the compute dtype)."""
        self._source: Callable[[], Any] = weakref.ref(source)
        self._engine: weakref.ref[Engine] = weakref.ref(engine)
        self._closed = False
        self._hooks: list[RemovableHandle] = []
        self._saving: list[PreTrainedModel] = []
        for block in engine.paged.blocks:
            self._hooks.append(block.register_state_dict_pre_hook(self._refuse))
        net = next((m for m in engine.model.modules() if isinstance(m, PreTrainedModel)), None)
        if net is not None:
            net.save_pretrained = self._save_pretrained  # type: ignore[method-assign,assignment]
            self._saving.append(net)

    def store_closed(self) -> None:
        """The store is gone: ``save_pretrained`` raises too from now on."""
        self._closed = True

    def message(self) -> str:
        """The error text: where the weights are and how to take them home."""
        source = self._source()
        world = int(getattr(source, "world_size", 1)) if source is not None else 1
        save = (
            "model.save_pretrained(dir) (streamed from the store block by block), "
            "bb_lightning.hf.export.export_hf(strategy, dir), or"
            if world == 1
            else "model.save_pretrained(dir, is_main_process=trainer.is_global_zero) called on "
            f"every one of the {world} ranks (streamed from the store block by block), or"
        )
        where = (
            "were in the balance_beam store, which strategy.close() has closed: save them "
            "before closing, with"
            if self._closed
            else f"live in the balance_beam store, not in the module's parameters: save them with "
            f"{save}"
        )
        lazily = "lazily" if world == 1 else "lazily, on every rank in the same key order"
        return (
            f"the trained weights {where} `bb-lightning export CKPT OUT` on a checkpoint "
            f"(trainer.save_checkpoint); strategy.lightning_module_state_dict() reads them "
            f"{lazily} ({self.reason})"
        )

    def _refuse(self, module: nn.Module, prefix: str, keep_vars: bool) -> None:
        if not keep_vars:  # the engines read names and buffers with keep_vars=True
            raise WeightsInStoreError(self.message())

    def _save_pretrained(self, save_directory: str | os.PathLike[str], **kwargs: Any) -> None:
        source, engine = self._source(), self._engine()
        if self._closed or source is None or engine is None:
            raise WeightsInStoreError(self.message())
        unsupported = sorted(
            k
            for k, v in kwargs.items()
            if k not in ("max_shard_size", "safe_serialization", "is_main_process")
            and v not in (None, False)
        )
        if unsupported or kwargs.get("safe_serialization", True) is False:
            raise ValueError(
                f"save_pretrained({', '.join(unsupported) or 'safe_serialization=False'}) is "
                "not supported while the weights stream from the balance_beam store: pass "
                "only save_directory and max_shard_size (safetensors are written)"
            )
        world = int(getattr(source, "world_size", 1))
        if world > 1 and "is_main_process" not in kwargs:
            raise ValueError(
                f"save_pretrained({str(save_directory)!r}) with {world} ranks: call it on every "
                "rank with is_main_process=trainer.is_global_zero (rank 0 writes; the weights "
                "of a trained model are gathered from every rank's shard)"
            )
        shard = shard_bytes(kwargs.get("max_shard_size") or "5GB")  # checked on every rank
        main = bool(kwargs.get("is_main_process", True))
        if not isinstance(engine, TrainingEngine) or engine.comm is None:
            if main:  # weights only: every rank holds them whole, rank 0 writes
                self._export(engine, save_directory, shard)
            return
        comm = engine.comm
        failed: BaseException | None = None
        engine.gathered_states = 0  # a failure before the export's first gather
        try:
            if main:
                self._export(engine, save_directory, shard)
            else:  # the gathers of rank 0's export
                for _ in engine.iter_state(("master",)):
                    pass
        except BaseException as exc:
            failed = exc
            with contextlib.suppress(Exception):
                engine.finish_gathers(("master",))  # the others end their gathers
        if not comm.all_true(failed is None):
            if failed is not None:
                raise failed
            raise RuntimeError(
                f"save_pretrained({str(save_directory)!r}) failed on another rank: see its error"
            )

    def _export(self, engine: Engine, save_directory: str | os.PathLike[str], shard: int) -> None:
        """Rank 0's (or the only process's) streamed export into ``save_directory``."""
        from bb_lightning.hf.export import export_hf

        dtype = self.dtype
        if dtype is None:
            dtype = torch.float32 if isinstance(engine, TrainingEngine) else engine.compute_dtype
        out = export_hf(engine, save_directory, dtype=dtype, max_shard_bytes=shard)
        net = self._saving[0]
        if net.can_generate():
            net.generation_config.save_pretrained(Path(out))

    def remove(self) -> None:
        """Give the module its ordinary ``state_dict`` and ``save_pretrained`` back."""
        for handle in self._hooks:
            handle.remove()
        self._hooks = []
        for net in self._saving:
            if net.__dict__.get("save_pretrained") == self._save_pretrained:
                del net.save_pretrained
        self._saving = []
