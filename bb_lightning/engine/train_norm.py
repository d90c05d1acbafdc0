"""A training step's bf16 RMS norms with their backward through a compiled kernel on the host.

autograd differentiates Hugging Face's ``LlamaRMSNorm`` (and every class whose ``forward``
reads as :data:`~bb_lightning.engine.host_norm.PLAIN_RMS_NORM`: Mistral's, Qwen2's, Qwen3's,
...) through its seven operations: about a dozen passes over the activations in backward,
several in fp32, as long as the forward's products of a block on a CPU of few cores.
``host_ops.c``'s ``bb_rms_norm_backward`` computes the input's and the weight's gradients in
one pass over each row, in fp32, rounded once (its header gives the arithmetic).

:func:`install` gives each such norm of a model, for the length of a ``fit`` on a CPU device,
an instance ``forward`` that runs the class's own operations without recording them (the
same output, bit for bit, and the same loss) and saves only the bf16 input for the kernel's
backward. It serves a call where autograd would record one: bf16 input and weight on the CPU,
contiguous, and no trace, function transform or dispatch mode
(:func:`~bb_lightning.engine.host_norm.eager`); every other call (fp32, no gradient, no kernel:
another CPU, no compiler, ``BB_NATIVE=0``) runs the class ``forward`` as it is. The gradients
are not bit for bit autograd's (it rounds each product to bf16 first), and no further from
the exact ones (``tests`` compare both with fp64). Its backward cannot itself be
differentiated (a second derivative raises).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn
from torch.autograd.function import once_differentiable

from bb_lightning.engine import host_norm
from bb_lightning.engine.host_norm import eager, plain_cpu, plain_rms_norm

__all__ = ["backward_kind", "install"]


class _NormBackward(torch.autograd.Function):
    """The class's norm, unrecorded; the kernel as its backward."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, x: Tensor, weight: Tensor, module: nn.Module, eps: float
    ) -> Tensor:
        out: Tensor = type(module).forward(module, x)  # grad is off inside a Function's forward
        ctx.save_for_backward(x, weight)
        ctx.eps = eps
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        x, weight = ctx.saved_tensors
        kern = host_norm.kernel()
        assert kern is not None  # the forward ran only where it loaded
        if grad.dtype != torch.bfloat16 or not grad.is_contiguous():
            grad = grad.to(torch.bfloat16).contiguous()
        dx, dw = kern.norm_backward(x, weight, grad, ctx.eps)
        wants_x, wants_w = ctx.needs_input_grad[:2]
        return (dx if wants_x else None, dw.to(weight.dtype) if wants_w else None, None, None)


def _serves(module: nn.Module, x: Tensor) -> bool:
    """Whether the kernel's backward serves this call of ``module`` (else its class does)."""
    w, eps = getattr(module, "weight", None), getattr(module, "variance_epsilon", None)
    return (
        not torch.compiler.is_compiling()
        and eager()  # first: a trace reads the checks below as constants
        and isinstance(w, Tensor)
        and isinstance(eps, float)
        and torch.is_grad_enabled()
        and (x.requires_grad or w.requires_grad)
        and plain_cpu(x, w)
        and x.dtype == torch.bfloat16
        and w.dtype == torch.bfloat16
        and w.ndim == 1
        and x.ndim >= 1
        and x.shape[-1] == w.numel()
        and x.is_contiguous()
        and w.is_contiguous()
    )


def _forward(module: nn.Module, hidden_states: Tensor) -> Tensor:
    if not _serves(module, hidden_states) or host_norm.kernel() is None:
        return type(module).forward(module, hidden_states)  # type: ignore[no-any-return]
    eps = float(module.variance_epsilon)  # type: ignore[arg-type]
    return _NormBackward.apply(hidden_states, module.weight, module, eps)  # type: ignore[no-any-return]


def backward_kind(device: torch.device, dtype: torch.dtype) -> str:
    """Which backward a fit on ``device`` computing in ``dtype`` gives a plain RMS norm:
    ``"kernel"`` or ``"autograd"`` (the model-shaped probe keys its recorded rate by it)."""
    served = device.type == "cpu" and dtype == torch.bfloat16 and host_norm.kernel() is not None
    return "kernel" if served else "autograd"


def install(device: torch.device, model: nn.Module) -> Callable[[], None]:
    """Give each plain RMS norm of ``model`` (:func:`~bb_lightning.engine.host_norm.
    plain_rms_norm`, with no instance ``forward`` of its own) the serving ``forward`` when
    ``device`` is the CPU and the kernel loads; return the function that takes them back.
    Nothing changes otherwise."""
    if device.type != "cpu" or host_norm.kernel() is None:
        return lambda: None
    return host_norm.swap_forwards(model, plain_rms_norm, _forward)
