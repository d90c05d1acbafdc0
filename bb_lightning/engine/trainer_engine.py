"""Offloaded training of one model: paged blocks, host gradients, per-block host AdamW.

:class:`TrainingEngine` puts a model's repeated blocks in a
:class:`storage.store.TieredStore` (weights in the compute dtype, fp32 master
weights and AdamW moments, homes per :class:`~bb_lightning.engine.pager.Placement`)
and keeps the other parameters (embedding, final norm, head) resident on the
device with ordinary autograd, their fp32 master state in the store's host
tier. Every gradient leaves the device into fp32 host accumulators.

At the accumulation boundary :meth:`TrainingEngine.optimizer_step` computes the
clipping scale over all gradients, steps each block with
:class:`~bb_lightning.engine.optim.HostAdamW`, writes the block's weights back
to their home tier in the compute dtype and zeroes the accumulators.

Without clipping the step of a block needs only that block's gradient: after
:meth:`TrainingEngine.begin_overlapped_step`, the last backward of the window
queues each block's AdamW step on the gradient worker as soon as the block's
gradient is queued, so host updates run while backward continues on earlier
blocks; :meth:`TrainingEngine.optimizer_step` then waits for them and steps
only the parameters outside the blocks.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from torch import Tensor, nn

from bb_lightning.engine.blocks import PagedBlocks
from bb_lightning.engine.optim import AdamWConfig, HostAdamW, clip_coefficient, global_grad_norm
from bb_lightning.engine.pager import (
    BlockPager,
    FlatState,
    GradSink,
    Placement,
    block_params,
    set_data,
)
from bb_lightning.engine.timing import PhaseTimer
from storage.device import slot_bytes
from storage.store import TieredStore
from storage.tiers import Tier

__all__ = ["ClipConfig", "TrainingEngine", "adamw_from_optimizer", "required_budgets"]

StateKind = Literal["master", "exp_avg", "exp_avg_sq"]
STATE_KINDS: tuple[StateKind, StateKind, StateKind] = ("master", "exp_avg", "exp_avg_sq")
"""The fp32 tensors kept per parameter: master weights, first and second AdamW moment."""

RESIDENT_PREFIX = "resident"
"""Store name prefix of the state of parameters outside the blocks."""


@dataclass(frozen=True, kw_only=True)
class ClipConfig:
    """Gradient clipping applied at the optimizer step (Lightning's ``gradient_clip_*``)."""

    value: float | None = None
    """Maximum gradient norm (``"norm"``) or magnitude (``"value"``); None disables clipping."""
    algorithm: str = "norm"
    """``"norm"`` (global 2-norm over all gradients) or ``"value"`` (element-wise clamp)."""

    def __post_init__(self) -> None:
        if self.algorithm not in ("norm", "value"):
            raise ValueError(
                f"gradient clip algorithm {self.algorithm!r} is not supported: use 'norm' or 'value'"
            )
        if self.value is not None and not (math.isfinite(self.value) and self.value > 0):
            raise ValueError(f"gradient clip value {self.value!r} must be finite and > 0")


def adamw_from_optimizer(optimizer: torch.optim.Optimizer) -> AdamWConfig:
    """AdamW hyperparameters (learning rate included) of a torch AdamW's param groups."""
    if not isinstance(optimizer, torch.optim.AdamW):
        raise ValueError(
            f"the balance_beam strategy steps AdamW on the host, but configure_optimizers "
            f"returned {type(optimizer).__name__}: return torch.optim.AdamW"
        )
    keys = ("lr", "betas", "eps", "weight_decay")
    groups = {tuple(_flat_values(g, keys)) for g in optimizer.param_groups}
    if len(groups) != 1:
        raise ValueError(
            f"AdamW has {len(optimizer.param_groups)} param groups with different "
            "hyperparameters: use one param group"
        )
    g = optimizer.param_groups[0]
    lr = g["lr"].item() if isinstance(g["lr"], Tensor) else float(g["lr"])
    b1, b2 = g["betas"]
    return AdamWConfig(
        lr=lr,
        betas=(float(b1), float(b2)),
        eps=float(g["eps"]),
        weight_decay=float(g["weight_decay"]),
    )


def _flat_values(group: Mapping[str, Any], keys: Sequence[str]) -> list[float]:
    out: list[float] = []
    for k in keys:
        v = group[k]
        out.extend(float(x) for x in (v if isinstance(v, (tuple, list)) else [v]))
    return out


def required_budgets(
    block_numels: Sequence[int],
    resident_numel: int,
    placement: Placement,
    compute_dtype: torch.dtype,
) -> dict[Tier, int]:
    """Bytes each tier needs for this placement, summed per stored tensor.

    Each tensor counts :func:`storage.device.slot_bytes` of its size, the
    arenas' accounting (padded to 4 KiB, at least 4 KiB even when empty), so
    many small tensors fit the budgets; on NVMe, which counts exact bytes,
    that is an upper bound.

    Device: resident blocks' weights, ``prefetch_depth + 1`` paging slots of the
    largest block, and the parameters outside the blocks are not counted (they
    are ordinary device tensors). Host / NVMe: paged weights homed there and the
    fp32 master weights and two moments (12 bytes per parameter).
    """
    elem = torch.empty(0, dtype=compute_dtype).element_size()
    need = dict.fromkeys(Tier, 0)
    for n, w, m in zip(block_numels, placement.weights, placement.master, strict=True):
        need[w] += slot_bytes(n * elem)
        need[m] += 3 * slot_bytes(n * 4)
    need[Tier.HOST] += 3 * slot_bytes(resident_numel * 4)
    need[Tier.DEVICE] += (placement.prefetch_depth + 1) * slot_bytes(max(block_numels) * elem)
    return need


ParamLoader = Callable[[Tensor], Tensor]
"""A (meta) parameter -> its value as a CPU tensor, read from a checkpoint."""


@dataclass
class _Overlap:
    """An optimizer step whose block updates run during the last backward of the window."""

    stepper: HostAdamW
    lr: float
    step: int
    done: set[int] = field(default_factory=set)


def _flat_from(params: Sequence[Tensor], load: ParamLoader) -> Tensor:
    """The parameters' values laid end to end in one fp32 buffer, read one tensor at a time."""
    flat = torch.empty(sum(p.numel() for p in params), dtype=torch.float32)
    offset = 0
    for p in params:
        value = load(p)
        if tuple(value.shape) != tuple(p.shape):
            raise ValueError(
                f"checkpoint tensor has shape {tuple(value.shape)} but the model expects "
                f"{tuple(p.shape)}: the checkpoint does not match the model config"
            )
        flat[offset : offset + p.numel()].copy_(value.reshape(-1))
        offset += p.numel()
        del value
    return flat


class TrainingEngine:
    """Executes a placement on a model: paged blocks plus host-side optimizer state."""

    def __init__(
        self,
        model: nn.Module,
        blocks: Sequence[nn.Module],
        store: TieredStore,
        placement: Placement,
        *,
        compute_dtype: torch.dtype,
        device: torch.device,
        loader: ParamLoader | None = None,
    ) -> None:
        """Put ``blocks`` in ``store`` and the other parameters on ``device``.

        ``loader`` gives parameter values when the model was built on the meta device
        (each block is read into the store one tensor at a time); None reads the
        parameters themselves.
        """
        self.model = model
        self.store = store
        self.device = device
        self.compute_dtype = compute_dtype
        sync = torch.cuda.synchronize if device.type == "cuda" else None
        self.timer = PhaseTimer(sync=sync)
        """Per-step phase times of the caller's thread."""
        self.optimizer_busy_s = 0.0
        """Seconds of host AdamW work since the engine was built (overlapped work included)."""
        self.overlap_starts: list[tuple[int, float]] = []
        """(block, ``time.perf_counter()``) of each overlapped block step of the last step."""
        self.backward_end = 0.0
        """``time.perf_counter()`` when the last backward pass returned."""
        self._overlap: _Overlap | None = None
        in_blocks = {id(p) for b in blocks for _, p in block_params(b)}
        self.resident_params = [p for _, p in model.named_parameters() if id(p) not in in_blocks]
        initial = None if loader is None else _flat_from(self.resident_params, loader)
        self.resident = FlatState(
            store, RESIDENT_PREFIX, self.resident_params, home=Tier.HOST, initial=initial
        )
        block_lists = [[p for _, p in block_params(b)] for b in blocks]
        self.pager = BlockPager(
            store,
            blocks,
            placement,
            compute_dtype=compute_dtype,
            device=device,
            loader=None if loader is None else (lambda i: _flat_from(block_lists[i], loader)),
            timer=self.timer,
        )
        if initial is not None:
            views = self.resident.master_views(initial)
            for p, v in zip(self.resident_params, views, strict=True):
                set_data(p, v.to(device, compute_dtype))
        else:
            for p in self.resident_params:
                p.data = p.data.to(device, compute_dtype)
        for module in model.modules():
            for key, buf in module._buffers.items():
                if buf is not None:
                    dtype = compute_dtype if buf.is_floating_point() else buf.dtype
                    module._buffers[key] = buf.to(device, dtype)
        self.grads = GradSink(self.timer)
        self.paged = PagedBlocks(blocks, self.pager, self.grads)
        self.paged.on_block_backward = self._block_backward_done
        self.paged.install()
        self.step_count = 0
        """Optimizer steps taken (the AdamW bias corrections use it)."""
        largest = max(s.numel for s in self.states)
        self._scratch = [torch.empty(largest, dtype=torch.float32) for _ in range(3)]
        self._cast = torch.empty(largest, dtype=compute_dtype)

    @property
    def states(self) -> list[FlatState]:
        """Optimizer state of every block, then of the resident parameters."""
        return [*self.pager.states, self.resident]

    def after_backward(self) -> None:
        """Move the resident parameters' gradients to the host and finish the block ones."""
        self.backward_end = time.perf_counter()
        self.grads.add_async(self.resident.grad_views, [p.grad for p in self.resident_params])
        for p in self.resident_params:
            p.grad = None
        self.grads.wait(phase="optimizer" if self._overlap is not None else "wait_grads")
        self.pager.release_all_except(())

    def begin_overlapped_step(self, adamw: AdamWConfig) -> None:
        """Step each block during the coming backward, as soon as its gradient is in.

        Call before the last backward of an accumulation window, only when no
        clipping is configured (the clip scale needs every gradient first), with
        the learning rate of this step; :meth:`optimizer_step` completes the step.
        """
        self.step_count += 1
        self.overlap_starts = []
        self._overlap = _Overlap(stepper=HostAdamW(adamw), lr=adamw.lr, step=self.step_count)

    def _block_backward_done(self, i: int) -> None:
        overlap = self._overlap
        if overlap is not None and i not in overlap.done:
            overlap.done.add(i)
            self.grads.submit(lambda: self._step_block(i, overlap))

    def _step_block(self, i: int, overlap: _Overlap) -> None:
        """One block's AdamW step and weight write-back (runs on the gradient worker)."""
        self.overlap_starts.append((i, time.perf_counter()))
        master = self._step_state(
            self.pager.states[i], overlap.stepper, overlap.lr, 1.0, overlap.step
        )
        self.pager.write_weights(i, master, self._cast)

    def apply_placement(self, placement: Placement) -> None:
        """Re-home the blocks' weights and optimizer state (between optimizer steps)."""
        self.grads.wait(phase=None)
        self.pager.apply(placement)

    def grad_norm(self) -> float:
        """Global 2-norm of the accumulated gradients (fp32)."""
        self.grads.wait()
        return global_grad_norm(s.grad for s in self.states)

    def optimizer_step(self, adamw: AdamWConfig, clip: ClipConfig | None = None) -> None:
        """One AdamW step of every parameter from the accumulated gradients; zeroes them.

        After :meth:`begin_overlapped_step` the blocks stepped during backward are only
        waited for, and ``adamw`` and ``clip`` are not read (the step's were fixed then).
        """
        with self.timer.phase("optimizer"):
            self.grads.wait(phase=None)
            self.pager.release_all_except(())
            overlap, self._overlap = self._overlap, None
            if overlap is not None:
                self._finish_overlapped(overlap)
            else:
                self._step_all(adamw, clip)

    def _finish_overlapped(self, overlap: _Overlap) -> None:
        for i in range(self.pager.num_blocks):
            if i not in overlap.done:
                self._step_block(i, overlap)
        master = self._step_state(self.resident, overlap.stepper, overlap.lr, 1.0, overlap.step)
        for p, v in zip(self.resident_params, self.resident.master_views(master), strict=True):
            p.data.copy_(v)

    def _step_all(self, adamw: AdamWConfig, clip: ClipConfig | None) -> None:
        scale = 1.0
        if clip is not None and clip.value is not None:
            if clip.algorithm == "norm":
                scale = clip_coefficient(self.grad_norm(), clip.value)
            else:
                for s in self.states:
                    s.grad.clamp_(-clip.value, clip.value)
        self.step_count += 1
        stepper = HostAdamW(adamw)
        for i, state in enumerate(self.pager.states):
            master = self._step_state(state, stepper, adamw.lr, scale, self.step_count)
            self.pager.write_weights(i, master, self._cast)
        master = self._step_state(self.resident, stepper, adamw.lr, scale, self.step_count)
        for p, v in zip(self.resident_params, self.resident.master_views(master), strict=True):
            p.data.copy_(v)

    def _step_state(
        self, state: FlatState, stepper: HostAdamW, lr: float, scale: float, step: int
    ) -> Tensor:
        start = time.perf_counter()
        bufs = [
            self.store.read(name, out=buf[: state.numel])
            for name, buf in zip(state.state_names, self._scratch, strict=True)
        ]
        master, exp_avg, exp_avg_sq = bufs
        stepper.step_block(
            master, state.grad, exp_avg, exp_avg_sq, step=step, lr=lr, grad_scale=scale
        )
        for name, buf in zip(state.state_names, bufs, strict=True):
            self.store.write(name, buf)
        state.grad.zero_()
        self.optimizer_busy_s += time.perf_counter() - start
        return master

    def named_states(self) -> list[tuple[FlatState, list[str]]]:
        """Each flat state (blocks, then resident) with its parameters' names in the model.

        A parameter shared under several names (tied embeddings) carries the first
        name :meth:`torch.nn.Module.named_parameters` gives it.
        """
        first: dict[int, str] = {}
        for key, p in self.model.named_parameters():
            first.setdefault(id(p), key)
        groups = [*self.pager.params, self.resident_params]
        return [
            (state, [first[id(p)] for p in params])
            for state, params in zip(self.states, groups, strict=True)
        ]

    def iter_state(
        self, kinds: Sequence[StateKind] = STATE_KINDS
    ) -> Iterator[tuple[str, dict[StateKind, Tensor]]]:
        """Each parameter's name and fp32 state (``master``, ``exp_avg``, ``exp_avg_sq``).

        Reads one flat state at a time into the engine's scratch buffers: the
        tensors yielded are views, valid until the next item (copy to keep them).
        """
        self.grads.wait()
        self.pager.release_all_except(())
        for state, names in self.named_states():
            views: dict[StateKind, list[Tensor]] = {}
            for kind, name, buf in zip(STATE_KINDS, state.state_names, self._scratch, strict=True):
                if kind in kinds:
                    views[kind] = state.master_views(self.store.read(name, out=buf[: state.numel]))
            for j, key in enumerate(names):
                yield key, {kind: v[j] for kind, v in views.items()}

    def load_state(
        self, fill: Callable[[str, StateKind, Tensor], None], kinds: Sequence[StateKind]
    ) -> None:
        """Set the fp32 state of every parameter; ``fill(name, kind, out)`` writes into ``out``.

        ``out`` is an fp32 host view of the parameter's shape. When ``master`` is among
        ``kinds``, the compute-dtype weights (paged and resident) are re-derived from it.
        """
        self.grads.wait()
        self.pager.release_all_except(())
        for i, (state, names) in enumerate(self.named_states()):
            for kind, name, buf in zip(STATE_KINDS, state.state_names, self._scratch, strict=True):
                if kind not in kinds:
                    continue
                flat = buf[: state.numel]
                for key, view in zip(names, state.master_views(flat), strict=True):
                    fill(key, kind, view)
                self.store.write(name, flat)
            if "master" not in kinds:
                continue
            master = self._scratch[0][: state.numel]
            if i < self.pager.num_blocks:
                self.pager.write_weights(i, master, self._cast)
            else:
                for p, v in zip(self.resident_params, state.master_views(master), strict=True):
                    p.data.copy_(v)

    def state_dict(self) -> dict[str, Tensor]:
        """The model's state dict with every parameter as its fp32 master copy (host)."""
        values = {key: s["master"].clone() for key, s in self.iter_state(("master",))}
        first = {id(p): key for key, p in reversed(list(self.model.named_parameters()))}
        out: dict[str, Tensor] = {}
        for key, t in self.model.state_dict(keep_vars=True).items():
            out[key] = values[first[id(t)]] if id(t) in first else t.detach().to("cpu")
        return out

    def load_state_dict(self, state_dict: Mapping[str, Tensor]) -> None:
        """Set master weights, paged weights and resident parameters from a full state dict.

        Raises ``ValueError`` naming the first parameter missing or of another shape.
        """
        names = [key for _, keys in self.named_states() for key in keys]
        missing = [k for k in names if k not in state_dict]
        if missing:
            raise ValueError(f"state dict lacks {len(missing)} parameters, e.g. {missing[:3]}")

        def fill(key: str, kind: StateKind, out: Tensor) -> None:
            value = state_dict[key]
            if tuple(value.shape) != tuple(out.shape):
                raise ValueError(
                    f"parameter {key!r} has shape {tuple(value.shape)} in the state dict but "
                    f"{tuple(out.shape)} in the model: load a state dict of this model"
                )
            out.copy_(value)

        self.load_state(fill, ("master",))

    def close(self) -> None:
        """Restore the blocks' forwards and stop the gradient worker (the store stays open)."""
        self.paged.remove()
        self.grads.close()
