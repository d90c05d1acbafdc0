"""Llama-family rotary position embeddings of a forward without grad through a compiled
kernel on the host.

Hugging Face's ``apply_rotary_pos_emb`` (with its ``rotate_half``, copied word for word by
Llama, Mistral, Qwen2, Mixtral and about a hundred other model files) runs as six torch
operations per query or key tensor (a slice copy into a concatenation, a negation, three
products and a sum), each a pass over the activations. The kernel (``host_ops.c``, loaded
by :func:`~bb_lightning.engine.host_norm.kernel`) computes each row in one pass, with the
same roundings: its results equal the function's bit for bit.

The attention classes call the function by its name in their own module, so
:func:`install` swaps that module global, in each model file whose two functions read as
:data:`PLAIN_ROTARY` and :data:`PLAIN_ROTATE_HALF` (docstrings, comments, decorators and
annotations aside: :func:`~bb_lightning.engine.host_norm.reads_as`), for one that calls the
kernel where it computes what the function would (CPU tensors of fp32 or bf16 with
contiguous rows, in a dtype the build computes bit for bit, queries and keys ``[batch,
heads, tokens, dim]``, ``cos`` and ``sin`` ``[batch or 1, tokens, dim]``, torch running
eagerly: :func:`~bb_lightning.engine.host_norm.eager`) and the function itself for every
other call. Where autograd records the call (a ``fit`` on a CPU device installs it too,
:mod:`~bb_lightning.engine.train_kernels`), the kernel's embedding keeps only ``cos`` and
``sin``, and its backward is the same kernel rotating the outputs' gradients back by
``-sin``: autograd's gradients bit for bit, where ``sin``'s two halves are equal (as every
rotary embedding of transformers builds them; checked at each call, else the function
runs).
The swap is counted per model file: the original returns when the last model that installed
it restores it, unless another has replaced the global since (that replacement stays); an
install that fails midway undoes its swaps.
"""

from __future__ import annotations

import functools
import sys
import threading
import types
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn
from torch.autograd.function import once_differentiable

from bb_lightning.engine import host_norm

__all__ = ["PLAIN_ROTARY", "PLAIN_ROTATE_HALF", "backward_kind", "install", "plain_rotary"]

PLAIN_ROTARY = """
def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):
    cos = cos.unsqueeze(unsqueeze_dim)
    sin = sin.unsqueeze(unsqueeze_dim)
    q_embed = (q * cos) + (rotate_half(q) * sin)
    k_embed = (k * cos) + (rotate_half(k) * sin)
    return q_embed, k_embed
"""
"""The ``apply_rotary_pos_emb`` the kernel computes (with :data:`PLAIN_ROTATE_HALF`)."""
PLAIN_ROTATE_HALF = """
def rotate_half(x):
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)
"""
"""The ``rotate_half`` beside it (an interleaved rotation, GPT-J's, is another function)."""

_lock = threading.RLock()
_swapped: dict[int, _Swap] = {}
"""Model files whose global is swapped, by ``id`` of the module object."""


class _Swap:
    """One model file's swap: its module, the function found there, the one put there, and
    the installs holding it."""

    def __init__(self, module: types.ModuleType, original: Any, ours: Any) -> None:
        self.module, self.original, self.ours, self.count = module, original, ours, 1


_PLAIN = (host_norm.code_shape(PLAIN_ROTARY), host_norm.code_shape(PLAIN_ROTATE_HALF))


def plain_rotary(module: types.ModuleType) -> bool:
    """Whether model file ``module`` defines ``apply_rotary_pos_emb`` and ``rotate_half`` as
    :data:`PLAIN_ROTARY` and :data:`PLAIN_ROTATE_HALF` (and uses torch's ``cat``)."""
    try:
        apply, half, uses = (
            vars(module).get(name) for name in ("apply_rotary_pos_emb", "rotate_half", "torch")
        )
    except TypeError:  # no namespace of its own
        return False
    return (
        uses is torch
        and host_norm.reads_as(apply, _PLAIN[0])
        and host_norm.reads_as(half, _PLAIN[1])
    )


def _served(
    kern: host_norm._Kernel, q: Tensor, k: Tensor, cos: Tensor, sin: Tensor, unsqueeze_dim: Any
) -> bool:
    """Whether the kernel computes this call (else the function does)."""
    ts = (q, k, cos, sin)
    if unsqueeze_dim != 1 or any(type(t) is not Tensor for t in ts) or not host_norm.eager():
        return False
    if any(t.device.type != "cpu" or t.dtype != q.dtype or t.stride(-1) != 1 for t in ts):
        return False
    if q.dtype not in kern.rope_dtypes or q.ndim != 4 or k.ndim != 4:
        return False
    if cos.ndim != 3 or cos.shape != sin.shape or q.shape[-1] % 2:
        return False
    if (
        torch.is_grad_enabled()
        and any(t.requires_grad for t in ts)
        and not _differentiable(q, k, cos, sin)
    ):
        return False
    rows, tokens, width = cos.shape
    return all(rows in (1, x.shape[0]) and tokens in (1, x.shape[2]) and width == x.shape[3]
               for x in (q, k))  # fmt: skip


def _differentiable(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor) -> bool:
    """Whether :class:`_Rotary` records this call for autograd: only the queries and keys
    need a gradient, and ``sin``'s two halves are equal (as ``cat((freqs, freqs))`` makes
    them), so that the rotation back by ``-sin`` rounds as autograd through the function's
    operations does."""
    if cos.requires_grad or sin.requires_grad:  # (torch runs eagerly: _served)
        return False
    half = sin.shape[-1] // 2
    return bool(torch.equal(sin[..., :half], sin[..., half:]))


def _rope(kern: host_norm._Kernel, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """The kernel's rotary embedding of ``x`` ``[rows, heads, tokens, dim]`` by ``cos`` and
    ``sin`` ``[rows or 1, tokens or 1, dim]``."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    c, s = (t.unsqueeze(1).expand(x.shape) for t in (cos, sin))
    return kern.rope(x, c, s)


class _Rotary(torch.autograd.Function):
    """The kernel's rotary embedding under autograd: the gradient of a rotation by ``sin``
    is the rotation of the output's gradient by ``-sin``, the same kernel (its roundings
    autograd's through the function's products, cat and sum, where ``sin``'s halves are
    equal: :func:`_differentiable`)."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, kern: host_norm._Kernel, q: Tensor, k: Tensor, cos: Tensor, sin: Tensor
    ) -> tuple[Tensor, Tensor]:
        ctx.kern = kern
        ctx.save_for_backward(cos, sin)
        return _rope(kern, q, cos, sin), _rope(kern, k, cos, sin)

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, dq: Tensor | None, dk: Tensor | None) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        cos, sin = ctx.saved_tensors
        back = -sin
        wants_q, wants_k = ctx.needs_input_grad[1:3]
        gq = _rope(ctx.kern, dq, cos, back) if wants_q and dq is not None else None
        gk = _rope(ctx.kern, dk, cos, back) if wants_k and dk is not None else None
        return None, gq, gk, None, None


def _rotary(
    kern: host_norm._Kernel, original: Callable[..., Any], q: Tensor, k: Tensor, cos: Tensor,
    sin: Tensor, unsqueeze_dim: int = 1,
) -> tuple[Tensor, Tensor]:  # fmt: skip
    if not _served(kern, q, k, cos, sin, unsqueeze_dim):
        return original(q, k, cos, sin, unsqueeze_dim)  # type: ignore[no-any-return]
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad):
        return _Rotary.apply(kern, q, k, cos, sin)  # type: ignore[no-any-return]
    return _rope(kern, q, cos, sin), _rope(kern, k, cos, sin)


def backward_kind(device: torch.device, dtype: torch.dtype) -> str:
    """Which backward a fit on ``device`` computing in ``dtype`` gives a plain rotary
    embedding: ``"kernel"`` or ``"autograd"`` (the model-shaped probe keys its recorded rate
    by it)."""
    kern = host_norm.kernel()
    served = device.type == "cpu" and kern is not None and dtype in kern.rope_dtypes
    return "kernel" if served else "autograd"


def install(model: nn.Module) -> Callable[[], None]:
    """Swap ``apply_rotary_pos_emb`` for the kernel's in each model file that defines a module
    of ``model`` and reads as plain (:func:`plain_rotary`); return the function that undoes
    this install (the original returns with the last install of that file undone). Nothing
    changes where the kernel is unavailable (:func:`~bb_lightning.engine.host_norm.kernel`)."""
    kern = host_norm.kernel()
    if kern is None:
        return lambda: None
    names = {type(m).__module__ for m in model.modules()}
    held: list[_Swap] = []

    def restore() -> None:
        with _lock:
            for swap in held:
                swap.count -= 1
                if swap.count == 0:
                    del _swapped[id(swap.module)]
                    if vars(swap.module).get("apply_rotary_pos_emb") is swap.ours:
                        setattr(swap.module, "apply_rotary_pos_emb", swap.original)  # noqa: B010
            held.clear()  # a file patched by another since keeps that patch

    with _lock:
        try:
            for name in sorted(names):
                module = sys.modules.get(name)
                if module is None:
                    continue
                swap = _swapped.get(id(module))
                if swap is not None:
                    swap.count += 1
                elif plain_rotary(module):
                    original = vars(module)["apply_rotary_pos_emb"]
                    ours = functools.partial(_rotary, kern, original)
                    swap = _swapped[id(module)] = _Swap(module, original, ours)
                    setattr(module, "apply_rotary_pos_emb", ours)  # noqa: B010
                else:
                    continue
                held.append(swap)
        except BaseException:  # the files swapped so far go back
            restore()
            raise
    return restore
