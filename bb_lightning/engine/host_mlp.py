"""Gated MLPs (SwiGLU) of a bf16 forward without grad through a compiled kernel on the host.

Llama's MLP (copied word for word by Mistral, Qwen2, Qwen3 and many other model files)
computes ``down_proj(act_fn(gate_proj(x)) * up_proj(x))``; with a SiLU ``act_fn`` torch runs
the activation and the product as two operations, each a pass over the ``[tokens,
intermediate]`` activations and the first writing a tensor of that size. The kernel
(``host_ops.c``, loaded by :func:`~bb_lightning.engine.host_norm.kernel`) computes both in
one pass: the SiLU looked up in a table of torch's own bf16 results for each bf16 value, the
product in fp32 rounded as torch rounds it, so its results equal torch's bit for bit (a NaN
stays a NaN).

:func:`install` gives each module of a model whose class ``forward`` reads as
:data:`PLAIN_GATED_MLP` (docstrings, comments and annotations aside:
:func:`~bb_lightning.engine.host_norm.reads_as`) an instance ``forward`` that calls the three
projections as the class does and the kernel between them where it computes what the class
would: an ``act_fn`` that is a plain SiLU (``nn.SiLU`` or a module whose ``forward`` reads as
``nn.functional.silu(input)``) without hooks, contiguous bf16 CPU projections of one shape, no
autograd graph to record, torch running eagerly
(:func:`~bb_lightning.engine.host_norm.eager`). Every other call computes the class's
expression. The inference engine installs it on a CPU device and removes it when it closes
(:class:`~bb_lightning.engine.inference.InferenceEngine`); a fit runs the same kernel with
its backward (:mod:`~bb_lightning.engine.train_mlp`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import cast

import torch
from torch import Tensor, nn
from torch.nn.modules import module as nn_module

from bb_lightning.engine import host_norm

__all__ = ["PLAIN_GATED_MLP", "install", "kernel_operands", "plain_gated_mlp", "plain_silu"]

PLAIN_GATED_MLP = """
def forward(self, x):
    down_proj = self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))
    return down_proj
"""
"""The ``forward`` whose activation and product the kernel computes."""
_PLAIN_SILU = """
def forward(self, input):
    return nn.functional.silu(input)
"""
"""A SiLU module's ``forward`` (transformers' ``SiLUActivation``) the kernel stands in for."""

_SHAPES = (host_norm.code_shape(PLAIN_GATED_MLP), host_norm.code_shape(_PLAIN_SILU))
_plain: dict[tuple[type, int], bool] = {}


def plain_gated_mlp(kind: type) -> bool:
    """Whether ``kind.forward`` reads as :data:`PLAIN_GATED_MLP`."""
    return _reads(kind, 0)


def _reads(kind: type, which: int) -> bool:
    known = _plain.get((kind, which))
    if known is None:
        forward = getattr(kind, "forward", None)
        known = _plain[(kind, which)] = host_norm.reads_as(forward, _SHAPES[which])
    return known


def plain_silu(act: object) -> bool:
    """Whether calling module ``act`` computes ``F.silu`` of its input and nothing else (no
    hooks of its own or global ones, no instance ``forward``)."""
    if not isinstance(act, nn.Module) or "forward" in vars(act):
        return False
    if not (type(act) is nn.SiLU or _reads(type(act), 1)):
        return False
    return not (
        act._forward_hooks
        or act._forward_pre_hooks
        or nn_module._global_forward_hooks
        or nn_module._global_forward_pre_hooks
    )


def kernel_operands(gate: Tensor, up: Tensor) -> bool:
    """Whether the kernel reads ``gate`` and ``up`` as torch's ``silu(gate) * up`` does:
    contiguous bf16 CPU tensors of one shape, torch running eagerly (recorded by autograd
    or not)."""
    return (
        host_norm.eager()
        and host_norm.plain_cpu(gate, up)
        and type(up) is Tensor
        and gate.dtype == up.dtype == torch.bfloat16
        and gate.shape == up.shape
        and gate.is_contiguous()
        and up.is_contiguous()
    )


def _served(gate: Tensor, up: Tensor) -> bool:
    """Whether the kernel computes ``silu(gate) * up`` (else torch does)."""
    return kernel_operands(gate, up) and not (
        torch.is_grad_enabled() and (gate.requires_grad or up.requires_grad)
    )


def _forward(kern: host_norm._Kernel, module: nn.Module, x: Tensor) -> Tensor:
    act, gate_proj, up_proj, down_proj = (
        cast(Callable[[Tensor], Tensor], getattr(module, name))
        for name in ("act_fn", "gate_proj", "up_proj", "down_proj")
    )
    gate = gate_proj(x)
    if not plain_silu(act):
        return down_proj(act(gate) * up_proj(x))
    up = up_proj(x)
    return down_proj(kern.silu_mul(gate, up) if _served(gate, up) else act(gate) * up)


def install(model: nn.Module) -> Callable[[], None]:
    """Give each gated MLP of ``model`` whose class ``forward`` reads as
    :data:`PLAIN_GATED_MLP` the kernel's ``forward``; return the function that restores the
    class ``forward`` to all of them. Nothing changes where the kernel is unavailable or
    differs from torch (:func:`~bb_lightning.engine.host_norm.kernel`)."""
    kern = host_norm.kernel()
    if kern is None or not kern.silu_mul_exact:
        return lambda: None
    return host_norm.swap_forwards(model, plain_gated_mlp, functools.partial(_forward, kern))
