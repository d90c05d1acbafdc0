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
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from bb_lightning.engine.blocks import PagedBlocks
from bb_lightning.engine.optim import AdamWConfig, HostAdamW, clip_coefficient, global_grad_norm
from bb_lightning.engine.pager import BlockPager, FlatState, GradSink, Placement, block_params
from storage.io import padded
from storage.store import TieredStore
from storage.tiers import Tier

__all__ = ["ClipConfig", "TrainingEngine", "adamw_from_optimizer", "required_budgets"]

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
    """Bytes each tier needs for this placement (each tensor padded to 4 KiB).

    Device: resident blocks' weights, ``prefetch_depth + 1`` paging slots of the
    largest block, and the parameters outside the blocks are not counted (they
    are ordinary device tensors). Host / NVMe: paged weights homed there and the
    fp32 master weights and two moments (12 bytes per parameter).
    """
    elem = torch.empty(0, dtype=compute_dtype).element_size()
    need = dict.fromkeys(Tier, 0)
    for n, w, m in zip(block_numels, placement.weights, placement.master, strict=True):
        need[w] += padded(n * elem)
        need[m] += 3 * padded(n * 4)
    need[Tier.HOST] += 3 * padded(resident_numel * 4)
    need[Tier.DEVICE] += (placement.prefetch_depth + 1) * padded(max(block_numels) * elem)
    return need


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
    ) -> None:
        self.model = model
        self.store = store
        self.device = device
        self.compute_dtype = compute_dtype
        in_blocks = {id(p) for b in blocks for _, p in block_params(b)}
        self.resident_params = [p for _, p in model.named_parameters() if id(p) not in in_blocks]
        self.resident = FlatState(store, RESIDENT_PREFIX, self.resident_params, home=Tier.HOST)
        self.pager = BlockPager(
            store, blocks, placement, compute_dtype=compute_dtype, device=device
        )
        for p in self.resident_params:
            p.data = p.data.to(device, compute_dtype)
        for module in model.modules():
            for key, buf in module._buffers.items():
                if buf is not None:
                    dtype = compute_dtype if buf.is_floating_point() else buf.dtype
                    module._buffers[key] = buf.to(device, dtype)
        self.grads = GradSink()
        self.paged = PagedBlocks(blocks, self.pager, self.grads)
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
        self.grads.add_async(self.resident.grad_views, [p.grad for p in self.resident_params])
        for p in self.resident_params:
            p.grad = None
        self.grads.wait()
        self.pager.release_all_except(())

    def grad_norm(self) -> float:
        """Global 2-norm of the accumulated gradients (fp32)."""
        self.grads.wait()
        return global_grad_norm(s.grad for s in self.states)

    def optimizer_step(self, adamw: AdamWConfig, clip: ClipConfig | None = None) -> None:
        """One AdamW step of every parameter from the accumulated gradients; zeroes them."""
        self.grads.wait()
        self.pager.release_all_except(())
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
            master = self._step_state(state, stepper, adamw.lr, scale)
            self.pager.write_weights(i, master, self._cast)
        master = self._step_state(self.resident, stepper, adamw.lr, scale)
        for p, v in zip(self.resident_params, self.resident.master_views(master), strict=True):
            p.data.copy_(v)

    def _step_state(self, state: FlatState, stepper: HostAdamW, lr: float, scale: float) -> Tensor:
        bufs = [
            self.store.read(name, out=buf[: state.numel])
            for name, buf in zip(state.state_names, self._scratch, strict=True)
        ]
        master, exp_avg, exp_avg_sq = bufs
        stepper.step_block(
            master, state.grad, exp_avg, exp_avg_sq, step=self.step_count, lr=lr, grad_scale=scale
        )
        for name, buf in zip(state.state_names, bufs, strict=True):
            self.store.write(name, buf)
        state.grad.zero_()
        return master

    def state_dict(self) -> dict[str, Tensor]:
        """The model's state dict with every parameter as its fp32 master copy (host)."""
        values: dict[int, Tensor] = {}
        for state, params in [
            *zip(self.pager.states, self.pager.params, strict=True),
            (self.resident, self.resident_params),
        ]:
            for p, v in zip(params, state.master_views(state.read_master()), strict=True):
                values[id(p)] = v.clone()
        out: dict[str, Tensor] = {}
        for key, t in self.model.state_dict(keep_vars=True).items():
            out[key] = values[id(t)] if id(t) in values else t.detach().to("cpu")
        return out

    def load_state_dict(self, state_dict: Mapping[str, Tensor]) -> None:
        """Set master weights, paged weights and resident parameters from a full state dict."""
        self.pager.release_all_except(())
        names = {id(p): k for k, p in self.model.named_parameters(remove_duplicate=False)}
        missing = [k for k in names.values() if k not in state_dict]
        if missing:
            raise ValueError(f"state dict lacks {len(missing)} parameters, e.g. {missing[:3]}")
        for i, (state, params) in enumerate(zip(self.pager.states, self.pager.params, strict=True)):
            master = self._load_master(state, params, names, state_dict)
            self.pager.write_weights(i, master, self._cast)
        master = self._load_master(self.resident, self.resident_params, names, state_dict)
        for p, v in zip(self.resident_params, self.resident.master_views(master), strict=True):
            p.data.copy_(v)

    def _load_master(
        self,
        state: FlatState,
        params: Sequence[Tensor],
        names: Mapping[int, str],
        state_dict: Mapping[str, Tensor],
    ) -> Tensor:
        flat = self._scratch[0][: state.numel]
        for p, v in zip(params, state.master_views(flat), strict=True):
            v.copy_(state_dict[names[id(p)]])
        self.store.write(state.master_name, flat)
        return flat

    def close(self) -> None:
        """Restore the blocks' forwards and stop the gradient worker (the store stays open)."""
        self.paged.remove()
        self.grads.close()
