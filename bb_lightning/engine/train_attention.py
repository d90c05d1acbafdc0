"""A training step's bf16 attention with its backward on the CPU's matrix tiles or vectors.

torch's fused CPU attention (the flash kernel behind ``scaled_dot_product_attention``)
computes its bf16 backward in small blocks with a setup each, at a fraction of the rate of
the CPU's bf16 products (``bench/attention_grad.py`` times it against the kernel below).
``host_linear.c``'s ``bb_attention_backward_bf16`` computes the same gradients in blocks of
32 x 32 on the matrix tiles (Intel AMX), or without them on AVX-512's bf16 pair products (its
header says how), from what the forward leaves: the output and each query's log-sum-exp.

:func:`install` maps transformers' ``sdpa`` attention, for the length of a ``fit`` on a CPU
device, to :func:`training_attention`. Its forward is the same library's prefill attention,
which also gives each query's log-sum-exp (torch's fused forward ran 3.6-3.7 x slower on a
CPU without matrix tiles, ``bench/attention_grad.py``): bf16 products summed in fp32, the
softmax in fp32 with its weights rounded to bf16 as torch's fused kernel rounds them, so the
output and the loss agree with ``sdpa``'s but for the last bits of e^x and the sums, and are
as close to float64. Its backward is the compiled kernel: bf16 products summed in fp32 and
each gradient rounded once, as torch's; not bit for bit torch's gradients, and no further
from the exact ones (``tests`` compare both with fp64). Every call it does not serve runs transformers' ``sdpa`` unchanged: no gradient
to record, a mask, dropout, a position bias, a query length other than the keys', another
dtype or device, a head size that is not a multiple of 32 up to 256, more than
:data:`MAX_LEN` positions, a trace or a dispatch mode
(:func:`~bb_lightning.engine.host_norm.eager`), or no kernel (a CPU with neither the tiles
nor AVX-512's bf16 products, no compiler, ``BB_NATIVE=0``). Its backward cannot itself be
differentiated (a second derivative raises)."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from bb_lightning.engine import host_linear
from bb_lightning.engine.host_norm import eager, plain_cpu

__all__ = ["MAX_LEN", "backward_kind", "install", "training_attention"]

MAX_LEN = 4096
"""Positions up to which the kernel serves a call: each of its threads keeps a sequence's
scores and weights (forward, ``6 * MAX_LEN**2`` bytes: 96 MiB at 4096) and its weights and
score gradients (backward, ``4 * MAX_LEN**2`` bytes)."""


class _KernelAttention(torch.autograd.Function):
    """The compiled attention forward (output ``[batch, len, heads, dim]``) and backward."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, query: Tensor, key: Tensor, value: Tensor, causal: bool, scale: float | None
    ) -> Tensor:
        kern = host_linear.attention_kernel()
        assert kern is not None  # called only where it loaded
        # the given scale, else torch's 1 / sqrt(dim)
        ctx.causal = causal
        ctx.scale = scale if scale is not None else 1 / math.sqrt(query.shape[-1])
        out, lse = kern.attention_forward(query, key, value, causal, ctx.scale)
        ctx.save_for_backward(query, key, value, out, lse)
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: Tensor) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        query, key, value, out, lse = ctx.saved_tensors
        kern = host_linear.attention_kernel()
        assert kern is not None  # the forward ran only where it loaded
        with torch.no_grad():
            if grad_out.dtype != torch.bfloat16 or grad_out.stride(-1) != 1:
                grad_out = grad_out.to(torch.bfloat16).contiguous()
            # both [batch, len, heads, dim]: the kernel takes them as [batch, heads, len, dim]
            grads: tuple[Tensor, ...] = kern.attention_backward(
                query, key, value, out.transpose(1, 2), grad_out.transpose(1, 2), lse,
                ctx.causal, ctx.scale,
            )  # fmt: skip
        if torch.is_grad_enabled():  # create_graph: a derivative of these raises, as torch's
            grads = _underivable(grads)  # fused backward's does, never a silent zero
        return (*grads, None, None)


def _underivable(grads: tuple[Tensor, ...]) -> tuple[Tensor, ...]:
    """``grads`` as tensors whose own derivative raises (the gradients of a graph built with
    ``create_graph=True``)."""
    raises = torch._C._functions.DelayedError(
        b"the compiled attention backward has no derivative (a second derivative through "
        b"balance_beam's CPU attention in bf16)",
        len(grads),
    )
    return tuple(raises(*(g.detach().requires_grad_() for g in grads)))


def _serves(
    module: nn.Module, query: Tensor, key: Tensor, value: Tensor, mask: Tensor | None,
    dropout: float, extra: dict[str, Any],
) -> bool:  # fmt: skip
    """Whether :func:`training_attention` computes this call (else ``sdpa`` does)."""
    tensors = (query, key, value)
    if not (
        mask is None
        and dropout == 0.0
        and extra.get("position_bias") is None
        and extra.get("softcap") is None
        and not extra.get("output_attentions", False)
        and torch.is_grad_enabled()
        and any(t.requires_grad for t in tensors)
        and plain_cpu(query, key)
        and plain_cpu(value, value)
        and all(t.dtype == torch.bfloat16 and t.ndim == 4 and t.stride(-1) == 1 for t in tensors)
        and eager()
    ):
        return False
    batch, heads, length, dim = query.shape
    kv_heads = key.shape[1]
    if not (
        key.shape == value.shape == (batch, kv_heads, length, dim)
        and 1 < length <= MAX_LEN
        and dim % 32 == 0
        and dim <= 256
        and heads % kv_heads == 0
    ):
        return False
    # sdpa repeats the keys by the module's groups: a model that says none runs it as it is
    return heads == kv_heads or getattr(module, "num_key_value_groups", 1) == heads // kv_heads


def training_attention(
    module: nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs: Any,
) -> tuple[Tensor, None]:
    """transformers' attention interface for ``sdpa`` (the same arguments and result: the
    output ``[batch, len, heads, dim]`` and no weights) with the compiled backward where
    it serves the call; transformers' ``sdpa`` for every other call."""
    if (
        torch.compiler.is_compiling()  # traced: sdpa as it is, nothing of ours in the graph
        or not _serves(module, query, key, value, attention_mask, dropout, kwargs)
        or host_linear.attention_kernel() is None
    ):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                      scaling=scaling, is_causal=is_causal, **kwargs)  # fmt: skip
    causal = bool(is_causal if is_causal is not None else getattr(module, "is_causal", True))
    scale = float(scaling) if scaling is not None else None  # passed on as sdpa passes it
    return _KernelAttention.apply(query, key, value, causal, scale), None


def backward_kind(device: torch.device, dtype: torch.dtype, head_dim: int, length: int) -> str:
    """Which backward a fit on ``device`` computing in ``dtype`` gives the ``sdpa`` attention
    of heads of ``head_dim`` over ``length`` positions: ``"tiles"`` or ``"vectors"`` (the
    kernel, on the matrix tiles or on AVX-512's bf16 pair products) or ``"sdpa"`` (torch's).
    The model-shaped probe keys its recorded rate by it."""
    kern = host_linear.attention_kernel()
    served = (
        device.type == "cpu"
        and dtype == torch.bfloat16
        and head_dim % 32 == 0
        and head_dim <= 256
        and 1 < length <= MAX_LEN
        and kern is not None
    )
    return kern.kind if served and kern is not None else "sdpa"


def install(device: torch.device) -> Callable[[], None]:
    """Map transformers' ``sdpa`` to :func:`training_attention` (for every model of the
    process) when ``device`` is the CPU, the kernel loads and the name maps to transformers'
    own function; return the function that restores the mapping. Nothing changes otherwise:
    another device, no kernel, or the name already mapped elsewhere (by the user, by
    :func:`~bb_lightning.engine.attention.decode_attention_for`, or by an outer ``install``,
    whose mapping then serves)."""
    if (
        device.type != "cpu"
        or ALL_ATTENTION_FUNCTIONS["sdpa"] is not sdpa_attention_forward
        or host_linear.attention_kernel() is None
    ):
        return lambda: None
    ALL_ATTENTION_FUNCTIONS["sdpa"] = training_attention

    def restore() -> None:
        if ALL_ATTENTION_FUNCTIONS["sdpa"] is training_attention:
            del ALL_ATTENTION_FUNCTIONS["sdpa"]  # the local entry; the global one stays
            if ALL_ATTENTION_FUNCTIONS["sdpa"] is not sdpa_attention_forward:
                ALL_ATTENTION_FUNCTIONS["sdpa"] = sdpa_attention_forward

    return restore
