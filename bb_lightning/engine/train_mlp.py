"""A training step's bf16 gated-MLP activation (SwiGLU) with its backward through a compiled
kernel on the host.

Llama's MLP computes ``down_proj(act_fn(gate_proj(x)) * up_proj(x))``. autograd records
the SiLU and the product as two operations: the forward writes the SiLU's output, a tensor of
the ``[tokens, intermediate]`` activations' size, and keeps it with both projections; the
backward runs a product for each input's gradient and the SiLU's backward, five passes over
tensors of that size. ``host_ops.c``'s ``bb_silu_mul`` computes the forward in one pass (its
results torch's bit for bit, as the generator's :mod:`~bb_lightning.engine.host_mlp` uses it)
and ``bb_silu_mul_backward`` both gradients in one more, from the two projections alone.

:func:`install` gives each gated MLP of a model whose class ``forward`` reads as
:data:`~bb_lightning.engine.host_mlp.PLAIN_GATED_MLP`, for the length of a ``fit`` on a CPU
device, an instance ``forward`` that calls the three projections as the class does and the
kernels between them where autograd would record the activation: a plain SiLU ``act_fn``,
contiguous bf16 CPU projections of one shape, torch running eagerly
(:func:`~bb_lightning.engine.host_norm.eager`). Every other call computes the class's
expression. The output and the up projection's gradient equal torch's bit for bit; the gate
projection's gradient is computed in fp32 and rounded once, where autograd rounds the
product of the output's gradient and the up projection to bf16 first: as close to the exact
gradient or closer (``tests`` compare both with fp64). Its backward cannot itself be
differentiated (a second derivative raises).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, cast

import torch
from torch import Tensor, nn
from torch.autograd.function import once_differentiable

from bb_lightning.engine import host_mlp, host_norm

__all__ = ["backward_kind", "install"]


class _SiluMul(torch.autograd.Function):
    """``silu(gate) * up`` through the kernel, its backward the kernel's."""

    @staticmethod
    def forward(ctx: Any, gate: Tensor, up: Tensor) -> Tensor:  # type: ignore[override]
        kern = host_norm.kernel()
        assert kern is not None  # served only where it loaded
        ctx.save_for_backward(gate, up)
        return kern.silu_mul(gate, up)

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, Tensor | None]:  # type: ignore[override]
        gate, up = ctx.saved_tensors
        kern = host_norm.kernel()
        assert kern is not None
        if grad.dtype != torch.bfloat16 or not grad.is_contiguous():
            grad = grad.to(torch.bfloat16).contiguous()
        dg, du = kern.silu_mul_backward(gate, up, grad)
        wants_g, wants_u = ctx.needs_input_grad
        return (dg if wants_g else None, du if wants_u else None)


def _serves(gate: Tensor, up: Tensor) -> bool:
    """Whether the kernels compute ``silu(gate) * up`` and its backward (else torch does)."""
    # the operands first (torch running eagerly): a trace reads the rest as constants
    return (
        host_mlp.kernel_operands(gate, up)
        and torch.is_grad_enabled()
        and (gate.requires_grad or up.requires_grad)
    )


def _forward(module: nn.Module, x: Tensor) -> Tensor:
    act, gate_proj, up_proj, down_proj = (
        cast(Callable[[Tensor], Tensor], getattr(module, name))
        for name in ("act_fn", "gate_proj", "up_proj", "down_proj")
    )
    gate = gate_proj(x)
    if not host_mlp.plain_silu(act):
        return down_proj(act(gate) * up_proj(x))
    up = up_proj(x)
    if _serves(gate, up):
        return down_proj(cast(Tensor, _SiluMul.apply(gate, up)))
    return down_proj(act(gate) * up)


def _kernel() -> host_norm._Kernel | None:
    kern = host_norm.kernel()
    return kern if kern is not None and kern.silu_mul_exact else None


def backward_kind(device: torch.device, dtype: torch.dtype) -> str:
    """Which backward a fit on ``device`` computing in ``dtype`` gives a plain gated MLP's
    activation: ``"kernel"`` or ``"autograd"`` (the model-shaped probe keys its recorded rate
    by it)."""
    served = device.type == "cpu" and dtype == torch.bfloat16 and _kernel() is not None
    return "kernel" if served else "autograd"


def install(device: torch.device, model: nn.Module) -> Callable[[], None]:
    """Give each gated MLP of ``model`` whose class ``forward`` reads as
    :data:`~bb_lightning.engine.host_mlp.PLAIN_GATED_MLP` (with no instance ``forward`` of its
    own) the serving ``forward`` when ``device`` is the CPU and the kernel loads and computes
    torch's forward; return the function that takes them back. Nothing changes otherwise."""
    if device.type != "cpu" or _kernel() is None:
        return lambda: None
    return host_norm.swap_forwards(model, host_mlp.plain_gated_mlp, _forward)
