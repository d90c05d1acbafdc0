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
heads, tokens, dim]``, ``cos`` and ``sin`` ``[batch or 1, tokens, dim]``, no autograd graph
to record, torch running eagerly: :func:`~bb_lightning.engine.host_norm.eager`) and the
function itself for every other call.
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

from bb_lightning.engine import host_norm

__all__ = ["PLAIN_ROTARY", "PLAIN_ROTATE_HALF", "install", "plain_rotary"]

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
    if torch.is_grad_enabled() and any(t.requires_grad for t in ts):
        return False
    rows, tokens, width = cos.shape
    return all(rows in (1, x.shape[0]) and tokens in (1, x.shape[2]) and width == x.shape[3]
               for x in (q, k))  # fmt: skip


def _rotary(
    kern: host_norm._Kernel, original: Callable[..., Any], q: Tensor, k: Tensor, cos: Tensor,
    sin: Tensor, unsqueeze_dim: int = 1,
) -> tuple[Tensor, Tensor]:  # fmt: skip
    if not _served(kern, q, k, cos, sin, unsqueeze_dim):
        return original(q, k, cos, sin, unsqueeze_dim)  # type: ignore[no-any-return]
    out = []
    for x in (q, k):
        c, s = (t.unsqueeze(1).expand(x.shape) for t in (cos, sin))
        out.append(kern.rope(x, c, s))
    return out[0], out[1]


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
