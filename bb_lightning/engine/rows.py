"""Run one block over a large batch in row chunks of bounded tokens, sharing one KV cache.

A prefill of a whole generation batch through one block needs activations for
every prompt token at once (the MLP's intermediate alone is
``tokens * ffn * 2`` bytes). :func:`call_in_row_chunks` runs the block on chunks
of rows (sequences) of at most ``max_tokens`` tokens each, one after the other,
while its weights stay paged in: the block is still applied to every sequence
before the next block, and the activations are those of one chunk.

Arguments are cut per chunk: a tensor of two or more dimensions whose first
dimension is the batch (hidden states, position ids, masks, rotary ``cos`` /
``sin``) gives its rows of the chunk, ALiBi's ``[rows * heads, 1, tokens]`` its rows'
heads (:func:`row_factor`), tuples, lists and plain dicts of them likewise, and
anything else (1-D ``cache_position``, flags) passes whole. The outputs are
joined along the rows.

The KV cache is shared: each chunk writes its rows of the same static cache.
:class:`_RowWindow` stands in for a transformers ``StaticCache`` (not
offloading, every layer a plain ``StaticLayer``): it narrows the layer to the
chunk's rows (views of its buffers) for the write and the attention, and
replays the layer's position counter so that every chunk writes the same
positions. A call whose cache is of any other kind (offloading to the host,
sliding-window layers) runs whole, with a warning; the planner prices a
streamed cache's prefill as one micro-batch.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor
from transformers import StaticCache
from transformers.cache_utils import StaticLayer

__all__ = ["call_in_row_chunks", "cut_rows"]


def call_in_row_chunks(
    forward: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any], max_tokens: int
) -> Any:
    """``forward(*args, **kwargs)``, run in chunks of rows of at most ``max_tokens`` tokens.

    The hidden states are the first positional argument or ``hidden_states``
    (``[rows, tokens, hidden]``). A call that fits, whose cache cannot be shared
    by row (see the module docstring) or whose hidden states are not a tensor runs
    whole. ``max_tokens`` must be >= 1; a row is never split.
    """
    if max_tokens < 1:
        raise ValueError(f"max_tokens={max_tokens} must be >= 1 (tokens per chunk)")
    hidden = args[0] if args else kwargs.get("hidden_states")
    if not isinstance(hidden, Tensor) or hidden.ndim < 3:
        return forward(*args, **kwargs)
    rows = hidden.shape[0]
    per_row = hidden.shape[1]
    step = max(1, max_tokens // max(per_row, 1))
    if rows <= step:
        return forward(*args, **kwargs)
    found = [x for x in (*args, *kwargs.values()) if _is_cache(x)]
    if len({id(c) for c in found}) > 1 or (found and not _shareable(found[0])):
        warnings.warn(
            f"a batch of {rows} rows x {per_row} tokens runs through the block whole, not in "
            f"chunks of {step} rows: its {type(found[0]).__name__} cannot be shared by rows "
            "(offloading, or layers other than StaticLayer)",
            stacklevel=2,
        )
        return forward(*args, **kwargs)
    window = _RowWindow(found[0], rows) if found else None

    def cut(x: Any, a: int, b: int) -> Any:
        return window if found and x is found[0] else _cut(x, rows, a, b)

    outs = []
    for a in range(0, rows, step):
        b = min(rows, a + step)
        if window is not None:
            window.rows = (a, b)
        cut_args = tuple(cut(x, a, b) for x in args)
        outs.append(forward(*cut_args, **{k: cut(v, a, b) for k, v in kwargs.items()}))
    return _join(outs)


def cut_rows(
    args: tuple[Any, ...], kwargs: dict[str, Any], rows: int, a: int, b: int
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """Rows ``[a, b)`` of a call's arguments over ``rows`` rows, cut as the module
    docstring says (tensors of two or more dimensions whose first is ``rows``, in tuples and
    lists too; everything else whole)."""
    return tuple(_cut(x, rows, a, b) for x in args), {
        k: _cut(v, rows, a, b) for k, v in kwargs.items()
    }


def _holds(layer: Any, keys: Tensor, values: Tensor) -> bool:
    """Whether an allocated layer's buffers take these keys and values (heads, width, type)."""
    held = layer.keys, layer.values
    return all(
        b.shape[1] == x.shape[1] and b.shape[-1] == x.shape[-1] and b.dtype == x.dtype
        for b, x in zip(held, (keys, values), strict=True)
    )


def _is_cache(x: Any) -> bool:
    """A transformers cache (positional, as GPT-2 passes it, or under any keyword)."""
    return hasattr(x, "update") and hasattr(x, "layers")


def _shareable(cache: Any) -> bool:
    """A static cache whose layers each write in place at a position counter."""
    return (
        isinstance(cache, StaticCache)
        and not getattr(cache, "offloading", False)
        and all(type(layer) is StaticLayer for layer in cache.layers)
    )


def row_factor(t: Tensor, rows: int) -> int:
    """How many of ``t``'s first-dimension entries each of a call's ``rows`` rows owns: 1 for
    a tensor of two or more dimensions whose first is ``rows`` (masks, position ids, rotary
    tables), ``f`` for ALiBi's ``[rows * heads, 1, tokens]`` (BLOOM, Falcon: the heads folded
    into the rows, row-major), 0 for anything passed whole."""
    if t.ndim < 2 or rows < 1:
        return 0
    first = t.shape[0]
    if first == rows:
        return 1
    if t.ndim == 3 and t.shape[1] == 1 and first > rows and first % rows == 0:
        return first // rows
    return 0


def _cut(x: Any, rows: int, a: int, b: int) -> Any:
    if isinstance(x, Tensor):
        f = row_factor(x, rows)
        return x[a * f : b * f] if f else x
    if isinstance(x, tuple):
        return tuple(_cut(y, rows, a, b) for y in x)
    if isinstance(x, list):
        return [_cut(y, rows, a, b) for y in x]
    if type(x) is dict:  # masks by kind (Zaya's causal and convolution masks)
        return {k: _cut(v, rows, a, b) for k, v in x.items()}
    return x


def _join(outs: list[Any]) -> Any:
    """The chunks' outputs joined by rows: a tensor, or a tuple / list whose tensors are."""
    first = outs[0]
    if isinstance(first, Tensor) and first.ndim >= 1:
        return torch.cat(outs)
    if isinstance(first, (tuple, list)):
        parts = [_join_part([o[j] for o in outs]) for j in range(len(first))]
        return type(first)(parts)
    raise TypeError(
        f"a block returned {type(first).__name__}, which row chunks cannot join: run it "
        "whole (PagedBlocks.max_tokens = None)"
    )


def _join_part(items: list[Any]) -> Any:
    if all(isinstance(x, Tensor) and x.ndim >= 1 for x in items):
        return torch.cat(items)
    if any(isinstance(x, Tensor) for x in items):
        raise TypeError("a block's output holds a tensor without rows: run it whole")
    return items[0]


class _RowWindow:
    """A static cache seen through rows ``rows`` of every layer (see the module docstring)."""

    def __init__(self, cache: StaticCache, batch: int) -> None:
        self.cache = cache
        self.batch = batch
        self.rows = (0, batch)
        self._start: dict[int, Tensor] = {}
        """Each layer's position counter before the first chunk wrote it."""

    def update(
        self, keys: Tensor, values: Tensor, layer_idx: int, *args: Any, **kwargs: Any
    ) -> tuple[Tensor, Tensor]:
        """Write the chunk's keys and values at the positions of the whole call; return the
        chunk's rows of the layer's keys and values."""
        layer: Any = self.cache.layers[layer_idx]
        if not layer.is_initialized or not _holds(layer, keys, values):
            self._allocate(layer_idx, keys, values)
        if layer_idx not in self._start:
            self._start[layer_idx] = layer.cumulative_length.clone()
        start = self._start[layer_idx]
        full = layer.keys, layer.values
        a, b = self.rows
        layer.keys, layer.values = full[0][a:b], full[1][a:b]
        layer.cumulative_length.copy_(start)
        try:
            out: tuple[Tensor, Tensor] = layer.update(keys, values, *args, **kwargs)
        finally:
            layer.keys, layer.values = full
        return out

    def _allocate(self, layer_idx: int, keys: Tensor, values: Tensor) -> None:
        """Allocate the layer's buffers for every row, not the chunk's.

        At the first allocation every layer not yet allocated gets buffers shaped like
        this one's, back to back, before the prefill's activations come between them:
        allocated one per layer as the prefill reaches it, the cache and the activations
        interleave on the host heap, and each block's output then takes fresh pages,
        which slowed a prefill measurably. A layer whose keys or values
        turn out shaped otherwise is allocated again at its own first update.
        """
        layers: list[Any] = list(self.cache.layers)
        first = not any(layer.is_initialized for layer in layers)
        k = keys[:1].expand(self.batch, *keys.shape[1:])
        v = values[:1].expand(self.batch, *values.shape[1:])
        for j in range(len(layers)) if first else [layer_idx]:
            layers[j].lazy_initialization(k, v)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.cache, name)
