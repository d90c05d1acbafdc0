"""Host-side AdamW over flat fp32 buffers, one transformer block at a time.

Offloaded training keeps fp32 master weights and the two AdamW moments of each
block as flat, contiguous fp32 tensors (about 16 bytes per parameter with the
gradient). :class:`HostAdamW` updates one such block in place with a single
vectorised kernel: ``torch._fused_adamw_`` where the build provides it, the
``torch._foreach_*`` ops otherwise. Both compute the update of
``torch.optim.AdamW`` (Loshchilov & Hutter, "Decoupled Weight Decay
Regularization", ICLR 2019, Algorithm 2, with PyTorch's bias corrections):

    p <- p * (1 - lr * wd)
    m <- b1 * m + (1 - b1) * g
    v <- b2 * v + (1 - b2) * g^2
    p <- p - lr / (1 - b1^t) * m / (sqrt(v) / sqrt(1 - b2^t) + eps)

Gradient clipping and averaging over accumulation steps fold into one scalar,
``grad_scale``, which multiplies the gradient before the update (see
:func:`global_grad_norm` and :func:`clip_coefficient`).

On the host, :meth:`HostAdamW.step_host` runs the same update through the compiled host
library (``host_ops.c``'s ``bb_adamw``) in one pass: the gradient summed in from its fp32
accumulator and bf16 or fp32 micro-batch gradients, the update, and the weights cast to the
compute dtype. That saves the fp32 gradient's write and read-back and the cast's read of
the weights: 28 bytes an element against 40 when the gradient comes as one bf16 tensor.
Its results equal ``torch._fused_adamw_``'s bit for bit, which the library checks when it
loads.
"""

from __future__ import annotations

import ctypes
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

from bb_lightning.engine import host_norm

__all__ = [
    "AdamWConfig",
    "AdamWGroups",
    "HostAdamW",
    "adam_scalars",
    "clip_coefficient",
    "copy_bf16_",
    "global_grad_norm",
    "host_step_serves",
]

Kernel = Literal["auto", "fused", "foreach"]


@dataclass(frozen=True, kw_only=True)
class AdamWConfig:
    """Hyperparameters of AdamW with decoupled weight decay (``torch.optim.AdamW`` semantics)."""

    lr: float = 1e-4
    """Base learning rate (dimensionless step size); a scheduler may pass another per step."""
    betas: tuple[float, float] = (0.9, 0.95)
    """Decay rates of the first and second moment averages, each in [0, 1)."""
    eps: float = 1e-8
    """Term added to the denominator for numerical stability (gradient units), >= 0."""
    weight_decay: float = 0.0
    """Decoupled weight decay per unit of learning rate (parameters shrink by ``lr * wd``)."""

    def __post_init__(self) -> None:
        if not (math.isfinite(self.lr) and self.lr >= 0.0):
            raise ValueError(f"AdamW lr={self.lr!r} must be finite and >= 0: pass e.g. lr=1e-4")
        if len(self.betas) != 2 or not all(0.0 <= b < 1.0 for b in self.betas):
            raise ValueError(
                f"AdamW betas={self.betas!r} must be two values in [0, 1): pass e.g. (0.9, 0.95)"
            )
        if not (math.isfinite(self.eps) and self.eps >= 0.0):
            raise ValueError(f"AdamW eps={self.eps!r} must be finite and >= 0: pass e.g. 1e-8")
        if not (math.isfinite(self.weight_decay) and self.weight_decay >= 0.0):
            raise ValueError(
                f"AdamW weight_decay={self.weight_decay!r} must be finite and >= 0: "
                "pass 0.0 to disable it"
            )


@dataclass(frozen=True, eq=False)
class AdamWGroups:
    """AdamW hyperparameters per parameter group, as a torch optimizer's ``param_groups``
    hold them (weight decay off for norms and biases, a lower learning rate for the
    embeddings, ...).

    ``params`` None: one group holds every trainable parameter. Else a parameter in no
    group is not stepped, as torch steps only the parameters it was given.
    """

    configs: tuple[AdamWConfig, ...]
    """Each group's hyperparameters, its learning rate that of this step."""
    params: tuple[tuple[Tensor, ...], ...] | None = None
    """Each group's parameters (None: every parameter is in the one group)."""

    def __post_init__(self) -> None:
        if not self.configs:
            raise ValueError("AdamWGroups needs at least one group's AdamWConfig")
        if self.params is not None and len(self.params) != len(self.configs):
            raise ValueError(
                f"{len(self.configs)} AdamW configs but {len(self.params)} parameter groups: "
                "give one config per group"
            )

    def group_of(self) -> dict[int, int] | None:
        """``id()`` of each grouped parameter -> its group (None: all in group 0)."""
        if self.params is None:
            return None
        return {id(p): g for g, group in enumerate(self.params) for p in group}


def adam_runs(
    params: Sequence[Tensor],
    ranges: Sequence[tuple[int, int]],
    group_of: dict[int, int] | None,
) -> list[tuple[int, int, int]]:
    """``(start, end, group)`` element ranges of a flat state whose parameters ``params``
    lie at ``ranges`` (``(start, end)`` each, in order): neighbours of one group merged,
    parameters in no group (not stepped) left out."""
    runs: list[tuple[int, int, int]] = []
    for p, (start, end) in zip(params, ranges, strict=True):
        g = 0 if group_of is None else group_of.get(id(p))
        if g is None or end <= start:
            continue
        if runs and runs[-1][2] == g and runs[-1][1] == start:
            runs[-1] = (runs[-1][0], end, g)
        else:
            runs.append((start, end, g))
    return runs


def _fused_available() -> bool:
    return hasattr(torch, "_fused_adamw_")


class HostAdamW:
    """Stateless AdamW stepper: all state lives in the caller's flat buffers.

    The stepper holds only its :class:`AdamWConfig` and the choice of kernel, so
    one instance can update every block, from any thread, in any order.
    """

    def __init__(self, config: AdamWConfig | None = None, *, kernel: Kernel = "auto") -> None:
        """Create a stepper.

        Args:
            config: hyperparameters; ``AdamWConfig()`` when None.
            kernel: ``"fused"`` (``torch._fused_adamw_``), ``"foreach"``
                (``torch._foreach_*`` ops) or ``"auto"`` (fused where available).
        """
        if kernel not in ("auto", "fused", "foreach"):
            raise ValueError(f"kernel={kernel!r} is not one of 'auto', 'fused', 'foreach'")
        if kernel == "fused" and not _fused_available():
            raise ValueError(
                f"kernel='fused' but torch {torch.__version__} has no torch._fused_adamw_: "
                "pass kernel='foreach' or 'auto'"
            )
        self.config = config if config is not None else AdamWConfig()
        self.kernel: Literal["fused", "foreach"] = (
            "foreach" if kernel == "foreach" or not _fused_available() else "fused"
        )

    def step_block(
        self,
        master: Tensor,
        grad: Tensor,
        exp_avg: Tensor,
        exp_avg_sq: Tensor,
        *,
        step: int,
        lr: float | None = None,
        grad_scale: float = 1.0,
    ) -> None:
        """Apply one AdamW update to a block's flat fp32 buffers, in place.

        Args:
            master: fp32 master weights of the block, contiguous, updated in place.
            grad: fp32 gradient, same shape; overwritten with ``grad * grad_scale``.
            exp_avg: fp32 first moment, same shape, updated in place (zeros before step 1).
            exp_avg_sq: fp32 second moment, same shape, updated in place (zeros before step 1).
            step: 1-based index of this update (the bias corrections use it).
            lr: learning rate of this step (from a scheduler); ``config.lr`` when None.
            grad_scale: factor applied to the gradient first (clip coefficient
                times 1 / accumulation steps), finite and > 0.
        """
        lr = self._checked_lr(step, lr, grad_scale)
        _check_buffers(master, grad, exp_avg, exp_avg_sq)
        if self.kernel == "fused":
            self._step_fused(master, grad, exp_avg, exp_avg_sq, step, lr, grad_scale)
        else:
            self._step_foreach(master, grad, exp_avg, exp_avg_sq, step, lr, grad_scale)

    def step_host(
        self,
        state: Sequence[Tensor],
        acc: Tensor | None,
        srcs: Sequence[Tensor],
        out: Tensor | None,
        *,
        step: int,
        lr: float | None = None,
        grad_scale: float = 1.0,
    ) -> bool:
        """:meth:`step_block` with the gradient summed in and the weights cast out, in one
        pass over host memory (the compiled library's AdamW, which equals
        ``torch._fused_adamw_`` bit for bit, checked when it loads): ``state`` is the
        master weights and two moments, the gradient ``acc + srcs[0] + srcs[1] + ...``
        (``acc`` an fp32 accumulator or None, ``srcs`` fp32 or bf16; none at all: zeros),
        and ``out`` (fp32 or bf16, or None) receives the updated weights. Nothing is
        written to the gradient. Returns False, having done nothing, where the kernel does
        not serve: not the ``"fused"`` kernel, not built, ``BB_NATIVE=0``, a dry run's fake
        tensors, a device tensor or another dtype (the caller then sums, steps and casts).
        """
        lr = self._checked_lr(step, lr, grad_scale)
        if self.kernel != "fused" or not host_norm.eager():
            return False
        kern = host_norm.kernel()
        scalars = adam_scalars(self.config, lr, step, grad_scale)
        return kern is not None and kern.adamw(state, acc, srcs, out, scalars)

    def _checked_lr(self, step: int, lr: float | None, grad_scale: float) -> float:
        """This update's learning rate (``config.lr`` when None), its arguments checked."""
        lr = self.config.lr if lr is None else float(lr)
        if step < 1:
            raise ValueError(f"step={step} must be >= 1 (the first update is step 1)")
        if not (math.isfinite(lr) and lr >= 0.0):
            raise ValueError(f"lr={lr!r} must be finite and >= 0")
        if not (math.isfinite(grad_scale) and grad_scale > 0.0):
            raise ValueError(
                f"grad_scale={grad_scale!r} must be finite and > 0: "
                "skip the step instead of scaling by 0"
            )
        return lr

    def _step_fused(
        self,
        master: Tensor,
        grad: Tensor,
        exp_avg: Tensor,
        exp_avg_sq: Tensor,
        step: int,
        lr: float,
        grad_scale: float,
    ) -> None:
        cfg = self.config
        device = master.device
        # The fused kernel divides the gradient by its `grad_scale` (the AMP
        # unscale) and stores the result back into `grad`; pass the reciprocal.
        scale = None
        if grad_scale != 1.0:
            scale = torch.tensor(1.0 / grad_scale, dtype=torch.float32, device=device)
        torch._fused_adamw_(
            [master],
            [grad],
            [exp_avg],
            [exp_avg_sq],
            [],
            [torch.tensor(float(step), dtype=torch.float32, device=device)],
            lr=lr,
            beta1=cfg.betas[0],
            beta2=cfg.betas[1],
            weight_decay=cfg.weight_decay,
            eps=cfg.eps,
            amsgrad=False,
            maximize=False,
            grad_scale=scale,
            found_inf=None,
        )

    def _step_foreach(
        self,
        master: Tensor,
        grad: Tensor,
        exp_avg: Tensor,
        exp_avg_sq: Tensor,
        step: int,
        lr: float,
        grad_scale: float,
    ) -> None:
        cfg = self.config
        beta1, beta2 = cfg.betas
        params, grads, avgs, avg_sqs = [master], [grad], [exp_avg], [exp_avg_sq]
        if grad_scale != 1.0:
            torch._foreach_mul_(grads, grad_scale)
        if cfg.weight_decay != 0.0:
            torch._foreach_mul_(params, 1.0 - lr * cfg.weight_decay)
        torch._foreach_lerp_(avgs, grads, 1.0 - beta1)
        torch._foreach_mul_(avg_sqs, beta2)
        torch._foreach_addcmul_(avg_sqs, grads, grads, 1.0 - beta2)
        bias_correction1 = 1.0 - beta1**step
        bias_correction2_sqrt = math.sqrt(1.0 - beta2**step)
        denom = torch._foreach_sqrt(avg_sqs)
        torch._foreach_div_(denom, bias_correction2_sqrt)
        torch._foreach_add_(denom, cfg.eps)
        torch._foreach_addcdiv_(params, avgs, denom, -lr / bias_correction1)


def host_step_serves(
    state: Sequence[Tensor], acc: Tensor | None, srcs: Sequence[Tensor], out: Tensor | None
) -> bool:
    """Whether :meth:`HostAdamW.step_host` serves these tensors (its slices of them alike),
    the fused kernel aside."""
    kern = host_norm.kernel() if host_norm.eager() else None
    return kern is not None and kern.adamw_serves(state, acc, srcs, out)


def adam_scalars(config: AdamWConfig, lr: float, step: int, grad_scale: float) -> list[float]:
    """The ten scalars of the host library's AdamW (``bb_adamw`` in ``host_ops.c``) for one
    update: those ``torch._fused_adamw_`` derives from its arguments, in double, each rounded
    to fp32 where torch rounds it (ctypes rounds them as it passes them)."""
    beta1, beta2 = config.betas
    lerp = 1.0 - beta1
    return [
        1.0 - lr * config.weight_decay if config.weight_decay != 0.0 else 1.0,
        lerp,
        1.0 if abs(ctypes.c_float(lerp).value) < 0.5 else 0.0,  # torch compares it in fp32
        beta2,
        1.0 - beta2,
        math.sqrt(1.0 - beta2**step),
        config.eps,
        -(lr / (1.0 - beta1**step)),
        1.0 / grad_scale,
        1.0 if grad_scale != 1.0 else 0.0,
    ]


def _check_buffers(master: Tensor, grad: Tensor, exp_avg: Tensor, exp_avg_sq: Tensor) -> None:
    named = {"master": master, "grad": grad, "exp_avg": exp_avg, "exp_avg_sq": exp_avg_sq}
    for name, t in named.items():
        if t.dtype != torch.float32:
            raise ValueError(f"{name} has dtype {t.dtype}; HostAdamW needs torch.float32 buffers")
        if t.shape != master.shape:
            raise ValueError(
                f"{name} has shape {tuple(t.shape)} but master has {tuple(master.shape)}: "
                "all four buffers of a block must have the same shape"
            )
        if t.device != master.device:
            raise ValueError(f"{name} is on {t.device} but master is on {master.device}")
        if not t.is_contiguous():
            raise ValueError(f"{name} is not contiguous: pass flat buffers (see flat.flat_views)")


def copy_bf16_(dst_bf16: Tensor, master_fp32: Tensor) -> Tensor:
    """Round fp32 master weights to nearest-even bf16 into ``dst_bf16`` (in place); returns it."""
    if dst_bf16.dtype != torch.bfloat16:
        raise ValueError(f"dst_bf16 has dtype {dst_bf16.dtype}; expected torch.bfloat16")
    if master_fp32.dtype != torch.float32:
        raise ValueError(f"master_fp32 has dtype {master_fp32.dtype}; expected torch.float32")
    if dst_bf16.numel() != master_fp32.numel():
        raise ValueError(
            f"dst_bf16 holds {dst_bf16.numel()} elements but master_fp32 holds "
            f"{master_fp32.numel()}: the buffers must describe the same block"
        )
    return dst_bf16.copy_(master_fp32.view(dst_bf16.shape))


def global_grad_norm(grads: Iterable[Tensor]) -> float:
    """Total 2-norm of all gradients taken together, accumulated in fp32.

    Matches ``torch.nn.utils.clip_grad_norm_(..., norm_type=2)``: the 2-norm of
    the per-tensor 2-norms. Blocks may pass their flat gradient buffers.
    """
    norms = [torch.linalg.vector_norm(g.detach(), 2.0, dtype=torch.float32) for g in grads]
    if not norms:
        return 0.0
    devices = {n.device for n in norms}
    if len(devices) > 1:
        norms = [n.cpu() for n in norms]
    return float(torch.linalg.vector_norm(torch.stack(norms), 2.0))


def clip_coefficient(total_norm: float, max_norm: float) -> float:
    """Factor that scales gradients of norm ``total_norm`` to at most ``max_norm``.

    ``min(1, max_norm / (total_norm + 1e-6))``, the coefficient of
    ``torch.nn.utils.clip_grad_norm_`` (used by Lightning's ``gradient_clip_val``).
    """
    if not (math.isfinite(max_norm) and max_norm > 0.0):
        raise ValueError(f"max_norm={max_norm!r} must be finite and > 0")
    if total_norm < 0.0:
        raise ValueError(f"total_norm={total_norm!r} must be >= 0 (it is a norm)")
    return min(1.0, max_norm / (total_norm + 1e-6))
