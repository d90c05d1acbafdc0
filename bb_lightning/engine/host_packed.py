"""A block's bf16 linear layers on prepacked weights while a prefill runs it in row chunks.

Each call of ``nn.Linear`` on the CPU hands its weight to oneDNN, which lays the weight out
in the blocks its matrix kernel reads before it multiplies. A prefill that runs a paged block
in row chunks (:attr:`~bb_lightning.engine.blocks.PagedBlocks.max_tokens`: 16 prompts of 128
tokens a chunk, eight chunks for 128 prompts) calls each of the block's projections once a
chunk on the same weight, so that layout is rebuilt once a chunk. :func:`packed_linears` lays
each weight out once for the whole call (``torch.ops.mkldnn._reorder_linear_weight``) and
multiplies every chunk on it (``torch.ops.mkldnn._linear_pointwise``): the same kernel on the
same blocks of the weight, without the rebuild. Only a call cut into two chunks or more
takes it (:func:`~bb_lightning.engine.rows.chunk_count`): laying a weight out and multiplying once is no faster than
``F.linear``, and slower at a decode pass's few rows, whose weights arrive fresh each pass.

Where it applies: ``nn.Linear`` modules of the class's own ``forward`` or
:mod:`~bb_lightning.engine.host_linear`'s (whose kernel keeps the calls of at most
:data:`~bb_lightning.engine.host_linear.MAX_ROWS` rows: it needs no layout at all), without
hooks (their own or global), whose bf16 weight (and bias, if any) are strided CPU tensors, called without
an autograd graph to record, torch running eagerly
(:func:`~bb_lightning.engine.host_norm.eager`), with a bf16 CPU input; every other call runs
the class's ``forward``. The first call of each shape (rows, in, out, bias) in a process also
computes ``F.linear`` and keeps the packed product for that shape only if the two are equal
bit for bit; a shape whose products differ runs ``F.linear`` from then on. ``BB_NATIVE=0``
turns it off with the compiled kernels.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.modules import module as nn_module

from bb_lightning.engine import host_linear, host_norm

__all__ = ["available", "pack_weight", "packed_linears", "packed_product"]

_exact: dict[tuple[int, int, int, bool], bool] = {}
"""Per product shape (rows, in, out, bias): whether the packed product equals ``F.linear``."""


def available() -> bool:
    """Whether this torch has oneDNN's packed linear on the CPU and ``BB_NATIVE`` is not 0."""
    if os.environ.get("BB_NATIVE", "1") == "0" or not torch.backends.mkldnn.is_available():
        return False
    ops = torch.ops.mkldnn
    return hasattr(ops, "_reorder_linear_weight") and hasattr(ops, "_linear_pointwise")


def pack_weight(weight: Tensor, tokens: int) -> Tensor:
    """``weight`` (``[out, in]``) laid out for oneDNN's products of ``tokens`` rows."""
    packed: Tensor = torch.ops.mkldnn._reorder_linear_weight(weight, tokens)
    return packed


def packed_product(x: Tensor, packed: Tensor, bias: Tensor | None) -> Tensor:
    """``F.linear(x, weight, bias)`` on ``weight`` laid out by :func:`pack_weight`."""
    out: Tensor = torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
    return out


def _plain_linear(kind: type) -> bool:
    return kind is nn.Linear


def _served(module: nn.Linear, x: Tensor) -> bool:
    weight, bias = module.weight, module.bias
    return (
        not torch.is_grad_enabled()
        and host_norm.eager()
        and host_norm.plain_cpu(x, weight)
        and x.dtype == weight.dtype == torch.bfloat16
        and weight.is_contiguous()
        and (bias is None or (host_norm.plain_cpu(x, bias) and bias.dtype == torch.bfloat16))
        and not (
            module._forward_hooks
            or module._forward_pre_hooks
            or nn_module._global_forward_hooks
            or nn_module._global_forward_pre_hooks
        )
    )


@contextlib.contextmanager
def packed_linears(block: nn.Module, tokens: int) -> Iterator[None]:
    """Within the ``with`` block, ``block``'s plain ``nn.Linear`` modules multiply on their
    weights laid out once, on first use, for products of ``tokens`` rows (see the module
    docstring); the class ``forward`` runs again after it. Nothing changes where
    :func:`available` is False."""
    if not available():
        yield
        return
    packed: dict[int, Tensor] = {}
    few: dict[int, Callable[[Tensor], Tensor]] = {  # layers host_linear's kernel holds
        id(m): vars(m)["forward"]
        for m in block.modules()
        if type(m) is nn.Linear and host_linear.installed(vars(m).get("forward"))
    }

    def forward(module: nn.Linear, x: Tensor) -> Tensor:
        weight, bias = module.weight, module.bias
        rows = x.numel() // max(x.shape[-1], 1)
        kept = few.get(id(module))
        if kept is not None and rows <= host_linear.MAX_ROWS:
            return kept(x)  # host_linear's kernel serves it, or the class's forward
        if not _served(module, x):
            return F.linear(x, weight, bias)
        key = (rows, weight.shape[1], weight.shape[0], bias is not None)
        exact = _exact.get(key)
        if exact is False:
            return F.linear(x, weight, bias)
        w = packed.get(id(module))
        if w is None:
            w = packed[id(module)] = pack_weight(weight, tokens)
        out = packed_product(x, w, bias)
        if exact is None:
            plain = F.linear(x, weight, bias)
            _exact[key] = torch.equal(out, plain)  # two threads may both check: the same answer
            return plain
        return out

    restore = host_norm.swap_forwards(block, _plain_linear, forward, over=host_linear.installed)
    try:
        yield
    finally:
        restore()
        packed.clear()
        few.clear()
