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
joined along the rows, each chunk's copied into the call's output as it comes.

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

from torch import Tensor
from transformers import StaticCache
from transformers.cache_utils import StaticLayer

__all__ = ["call_in_row_chunks", "chunk_count", "cut_rows"]


def _rows(args: tuple[Any, ...], kwargs: dict[str, Any], max_tokens: int) -> tuple[int, int, int]:
    """(rows and tokens of a block call's hidden states, rows a chunk of at most
    ``max_tokens`` tokens); (0, 0, 1) where they are not a ``[rows, tokens, ...]`` tensor."""
    hidden = args[0] if args else kwargs.get("hidden_states")
    if not isinstance(hidden, Tensor) or hidden.ndim < 3:
        return 0, 0, 1
    rows, tokens = hidden.shape[:2]
    return rows, tokens, max(1, max_tokens // max(tokens, 1))


def chunk_count(args: tuple[Any, ...], kwargs: dict[str, Any], max_tokens: int) -> int:
    """Chunks :func:`call_in_row_chunks` cuts a call's rows into at ``max_tokens`` tokens a
    chunk (1 where the call runs whole for its shape; a cache that cannot be shared by row
    runs it whole too)."""
    rows, _, step = _rows(args, kwargs, max_tokens)
    return max(1, -(-rows // step))


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
    rows, per_row, step = _rows(args, kwargs, max_tokens)
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

    joined: Any = None
    for a in range(0, rows, step):
        b = min(rows, a + step)
        if window is not None:
            window.rows = (a, b)
        cut_args = tuple(cut(x, a, b) for x in args)
        out = forward(*cut_args, **{k: cut(v, a, b) for k, v in kwargs.items()})
        joined = _place(joined, out, rows, a, b)
    return joined


def _place(joined: Any, out: Any, rows: int, a: int, b: int) -> Any:
    """``out`` (a chunk's output: a tensor, or a tuple / list whose tensors have rows)
    written into rows ``[a, b)`` of ``joined``, the call's output over ``rows`` rows
    (allocated at the first chunk): each chunk's output is freed as soon as it is copied,
    so the call holds one output of all rows, not every chunk's beside their join."""
    if isinstance(out, Tensor) and out.ndim >= 1:
        if out.shape[0] != b - a:
            raise TypeError(
                f"a block returned a tensor of {out.shape[0]} rows for a chunk of {b - a}: "
                "run it whole (PagedBlocks.max_tokens = None)"
            )
        if joined is None:
            joined = out.new_empty((rows, *out.shape[1:]))
        joined[a:b] = out
        return joined
    if isinstance(out, (tuple, list)):
        parts = list(joined) if joined is not None else [None] * len(out)
        return type(out)(_place_part(p, x, rows, a, b) for p, x in zip(parts, out, strict=True))
    raise TypeError(
        f"a block returned {type(out).__name__}, which row chunks cannot join: run it "
        "whole (PagedBlocks.max_tokens = None)"
    )


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


def _place_part(joined: Any, x: Any, rows: int, a: int, b: int) -> Any:
    if isinstance(x, Tensor) and x.ndim >= 1:
        return _place(joined, x, rows, a, b)
    if isinstance(x, Tensor):
        raise TypeError("a block's output holds a tensor without rows: run it whole")
    return x if joined is None else joined


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
