"""Each paged block's own forward under ``torch.compile``.

:func:`compile_blocks` re-installs every block's paged forward
(:class:`~bb_lightning.engine.blocks.PagedBlocks`) over its class's ``forward`` compiled
once per class: the blocks of a model share one compiled function, and each call passes
the block itself, so its parameters are graph inputs (``torch._dynamo``'s
``inline_inbuilt_nn_modules``) guarded by shape, dtype and stride only. The pager's
``p.data = view`` at each page-in then binds new storage without a recompile: a training
step compiles two graphs in all (the forward without grad, and the recomputation with
grad), whatever the number of blocks or their arena slots. The paging, prefetching and
gradient hand-off stay outside the compiled region, in eager code.

A call given a KV cache (generation, a forward with ``use_cache``) runs eager: dynamo
guards on the cache's per-layer state and the block's ``layer_idx``, so each block would
compile a graph of its own.

Whether it is faster depends on the device: on CPU builds inductor compiles for tens of
seconds, and the strategy leaves it off unless asked (``compile_blocks``);
``scripts/gpu-check.sh``'s ``compile`` step times one block eager against compiled on a
GPU.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from bb_lightning.engine.blocks import PagedBlocks
from bb_lightning.engine.hf_quirks import CACHE_KWARGS

__all__ = ["check_backend", "compile_blocks", "compiled_forward"]


def check_backend(backend: str) -> None:
    """``ValueError`` naming ``backend`` and the accepted ones when torch has no such
    ``torch.compile`` backend."""
    known = torch._dynamo.list_backends(exclude_tags=())
    if backend not in known:
        raise ValueError(
            f"compile_blocks={backend!r} is not a torch.compile backend: use one of "
            f"{', '.join(sorted(known))} (inductor compiles kernels), or None for eager"
        )


def compiled_forward(
    block: nn.Module, backend: str, cache: dict[type, Callable[..., Any]] | None = None
) -> Callable[..., Any]:
    """``block``'s class ``forward`` compiled with ``backend`` (one compiled function per
    class in ``cache``), bound to ``block``; a call given a KV cache runs it eager."""
    cache = {} if cache is None else cache
    kind = type(block)
    fn = cache.get(kind)
    if fn is None:
        fn = cache[kind] = torch.compile(kind.forward, backend=backend)
    compiled, eager = functools.partial(fn, block), kind.forward.__get__(block)

    @functools.wraps(eager)  # the signature without self, as the paged forward binds it
    def forward(*args: Any, **kwargs: Any) -> Any:
        if any(kwargs.get(name) is not None for name in CACHE_KWARGS):
            return eager(*args, **kwargs)
        return compiled(*args, **kwargs)

    return forward


def compile_blocks(paged: PagedBlocks, backend: str = "inductor") -> None:
    """Run each of ``paged``'s blocks through its class's ``forward`` compiled with
    ``backend`` (installing the paged forwards first when they are not)."""
    check_backend(backend)
    paged.install()
    cache: dict[type, Callable[..., Any]] = {}
    for i, block in enumerate(paged.blocks):
        block.forward = paged._make_forward(i, compiled_forward(block, backend, cache))  # type: ignore[method-assign]
