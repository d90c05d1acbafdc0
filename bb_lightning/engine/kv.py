"""Preallocated KV caches for layer-major generation, reused across generation batches.

:class:`KVCache` wraps a transformers ``StaticCache``: every layer's keys and
values are ``[batch, heads, max_len, head_dim]`` tensors filled in place, so a
decode step allocates no cache memory. The buffers are kept between batches
of the same shape (``reset`` zeroes the lengths only) and are rebuilt only
when a batch needs more rows or more positions.

When sequences finish, :meth:`KVCache.compact` moves the rows still running
to the front of each layer's buffers and narrows the layers to views of
those rows, so finished sequences stop costing attention and projection work;
:meth:`KVCache.reset` widens the views again for the next batch.

A model with convolution or linear-attention layers (LFM2's short convolutions)
gets transformers' state layers in the same cache: a fixed-size state per row
instead of keys and values. They are compacted alike. :meth:`KVCache.reset` resets
every layer but a plain ``StaticLayer`` with the layer's own ``reset`` (a state, unlike
masked keys, would carry into the next batch; a sliding-window layer keeps its position
in a counter of its own, which left unreset placed the next batch's tokens past the
window).

Placement: with ``tier`` :attr:`Tier.HOST` and a ``store`` whose device is not the host (a
CUDA device, the CPU double of its copies, a dry run) each full-attention layer is one
tensor of the store's host tier, paged to the device around its update and written back
after it (:mod:`~bb_lightning.engine.kv_paged`: one host buffer per layer, counted in the
store's host budget, nothing allocated per step). On a CUDA device without a store (the
generator used on its own) the cache uses transformers' offloaded static layers, whose
copies allocate pinned host memory outside any budget. Elsewhere it lives on the model's
device.

With ``host_attention`` (the plan's decode attention on the host) every layer of keys and
values lives in host memory whatever the model's device: each update copies the layer's
new key and value rows to the host and writes them there (the prefill writes the cache to
its home as it goes), and the attention reads it there
(:func:`~bb_lightning.engine.attention.host_attention`). State layers stay on the model's
device (their convolution runs there, and a state is a few rows per sequence).

Where host memory ends, the last ``nvme_layers`` layers of keys and values are homed on
NVMe instead: their buffers are files under ``nvme_dir`` mapped into memory (shared, so the
kernel writes the appended rows back to the disk and reads the cache from it as the host
attention reads them; none of it is anonymous host memory). The files go with the cache.
"""

from __future__ import annotations

import math
import os
import tempfile
import weakref
from functools import partial
from pathlib import Path
from typing import Any

import torch
from torch import Tensor
from transformers import PretrainedConfig, StaticCache
from transformers.cache_utils import StaticLayer

from bb_lightning.engine.kv_paged import KVPager, PagedLayer
from storage.io import mapped_zeros
from storage.store import TieredStore
from storage.tiers import Tier

__all__ = ["KVCache"]


class KVCache:
    """A static KV cache of ``rows`` sequences of at most ``max_len`` tokens each."""

    def __init__(
        self,
        config: PretrainedConfig,
        *,
        rows: int,
        max_len: int,
        tier: Tier | None = None,
        device: torch.device | None = None,
        host_attention: bool = False,
        nvme_layers: int = 0,
        nvme_dir: str | Path | None = None,
        store: TieredStore | None = None,
    ) -> None:
        """Allocate nothing yet: each layer's buffers appear at its first update (prefill).

        Args:
            config: the model's configuration (layer count and types).
            rows: sequences the buffers hold (the generation batch).
            max_len: tokens per sequence, prompt and generated together.
            tier: where the plan puts the cache; HOST offloads on a CUDA device, else ignored.
            device: the model's device (None: CUDA when it is available).
            host_attention: keep every layer's keys and values on the host (decode attention
                runs there), whatever ``tier`` and the device.
            nvme_layers: with ``host_attention``, the last layers of keys and values (by
                layer index) whose buffers are memory-mapped files on NVMe (0: none).
            nvme_dir: the directory those files go under (the store's NVMe path; None: the
                system's temporary directory).
            store: the engine's store: with ``tier`` HOST and attention on the device, the
                layers' keys and values are its host tensors, paged to its device (see the
                module docstring); :meth:`close` unregisters them.
        """
        if rows < 1 or max_len < 1:
            raise ValueError(
                f"KV cache of rows={rows} x max_len={max_len} tokens: both must be >= 1"
            )
        if nvme_layers < 0 or (nvme_layers and not host_attention):
            raise ValueError(
                f"nvme_layers={nvme_layers}: a KV cache homes layers on NVMe (>= 0 of them) "
                "only with host_attention=True (the host reads them); pass 0 or host_attention"
            )
        self.rows = rows
        self.max_len = max_len
        self.tier = tier
        cuda = device.type == "cuda" if device is not None else torch.cuda.is_available()
        paged = tier is Tier.HOST and not host_attention
        paged = paged and store is not None and not store.pages_host_in_place
        offload = tier is Tier.HOST and cuda and not host_attention and store is None
        self.host_attention = host_attention
        self.nvme_layers = 0
        """Layers of keys and values homed on NVMe (the last ones)."""
        self._files: tempfile.TemporaryDirectory[str] | None = None
        self.cache = StaticCache(config=config, max_cache_len=max_len, offloading=offload)
        self.pager: KVPager | None = None
        """The paging of the layers homed in the store's host tier (None: not paged)."""
        on_cpu = device is not None and device.type == "cpu"
        for layer in self.cache.layers if not paged else ():
            if type(layer) is StaticLayer:
                layer.update = partial(_update_slices, layer)  # type: ignore[method-assign]
                if on_cpu:  # zeroed as first written, in 4 KiB pages (see _init_on_host)
                    layer.lazy_initialization = partial(  # type: ignore[method-assign]
                        _init_on_host, layer, None, _own_init(layer), huge=False
                    )
        if paged:
            assert store is not None
            self.pager = KVPager(store)
            slots: list[Any] = self.cache.layers
            for i, layer in enumerate(slots):
                if type(layer) is StaticLayer:  # sliding-window and state layers stay put
                    slots[i] = self.pager.adopt(layer)
        if host_attention:
            layers: list[Any] = list(self.cache.layers)
            keyed = [layer for layer in layers if _has_keys(layer)]
            for layer in keyed:
                layer.update = partial(_update_on_host, layer.update)
                layer.lazy_initialization = partial(_init_on_host, layer, None, _own_init(layer))
            self.nvme_layers = min(nvme_layers, len(keyed))
            if self.nvme_layers:
                root = None if nvme_dir is None else Path(nvme_dir)
                if root is not None:
                    root.mkdir(parents=True, exist_ok=True)
                files = tempfile.TemporaryDirectory(prefix="bb-kv-", dir=root)
                self._files = files
                weakref.finalize(self, files.cleanup)
                for layer in keyed[len(keyed) - self.nvme_layers :]:
                    layer.lazy_initialization = partial(
                        _init_on_host, layer, Path(files.name), _own_init(layer)
                    )
        self._full: list[dict[tuple[str, int | None], Tensor]] = []
        """Each layer's buffers of all rows, by (attribute, state index), while compacted."""

    @property
    def attends(self) -> bool:
        """Whether some layer keeps keys and values (a model of state layers only takes no
        attention mask in a decode step: a generated token is never padding, and Mamba
        multiplies its input by the mask as it is given)."""
        return any(_has_keys(layer) for layer in self.cache.layers)

    @property
    def has_states(self) -> bool:
        """Whether some layer keeps a per-row state (convolution / linear attention) whose
        prefill must see only the prompt's mask (transformers masks such a layer's padding
        with the mask's last prompt-length columns)."""
        return any(_is_state_layer(layer) for layer in self.cache.layers)

    def fits(self, rows: int, max_len: int) -> bool:
        """Whether a batch of ``rows`` sequences of ``max_len`` tokens can use these buffers.

        Positions past a batch's length are masked, so a longer cache serves it as is.
        """
        return rows == self.rows and max_len <= self.max_len

    def reset(self) -> None:
        """Forget every cached token and widen compacted layers back to all rows."""
        layers = self._plain()
        if self._full:
            for layer, full in zip(layers, self._full, strict=True):
                for slot, buf in full.items():
                    _set(layer, slot, buf)
                if _has_keys(layer):
                    layer.batch_size = self.rows
            self._full = []
        for layer in self.cache.layers:
            if type(layer) is StaticLayer:  # its unwritten positions are masked: counter only
                if layer.is_initialized:
                    layer.cumulative_length.zero_()
            else:  # every counter of its own (a sliding window's position as a Python int,
                layer.reset()  # a state's "prefill done"), and its buffers zeroed

    def compact(self, keep: Tensor) -> None:
        """Keep only the rows ``keep`` (ascending indices of the current rows), in order.

        The kept rows move to the front of each layer's buffers, which are then
        narrowed to views of them: no new cache memory.

        An offloading cache (host tier on CUDA) holds each layer on the host between
        its passes, except the layer transformers prefetches to the device on its
        ``prefetch_stream``: the rows are selected where each buffer lies (``keep``
        moved to its device), after the compute stream waited for that prefetch and
        the host for the copies to the host.
        """
        if self.pager is not None:
            self.pager.compact(keep)
        layers = self._plain()
        if getattr(self.cache, "offloading", False) and torch.cuda.is_available():
            compute = torch.cuda.current_stream()
            compute.wait_stream(self.cache.prefetch_stream)  # the prefetched layer
            compute.synchronize()  # the host buffers written by non-blocking copies
        if not self._full:
            self._full = [{slot: _get(layer, slot) for slot in _slots(layer)} for layer in layers]
        n = int(keep.numel())
        on: dict[torch.device, Tensor] = {}
        for layer in layers:
            for slot in _slots(layer):
                buf = _get(layer, slot)
                idx = on.setdefault(buf.device, keep.to(buf.device))
                buf[:n] = buf.index_select(0, idx)
                _set(layer, slot, buf[:n])
            if _has_keys(layer):
                layer.batch_size = n

    def close(self) -> None:
        """Give the store back what the cache holds there (its paged layers' slots and
        tensors); the cache is not used afterwards."""
        if self.pager is not None:
            self.pager.close()
            self.pager = None

    def _plain(self) -> list[Any]:
        """The layers whose buffers the cache holds itself (not paged through the store)."""
        return [layer for layer in self.cache.layers if not isinstance(layer, PagedLayer)]


def _update_slices(
    layer: Any, key_states: Tensor, value_states: Tensor, *args: Any, **kwargs: Any
) -> tuple[Tensor, Tensor]:
    """``StaticLayer.update`` of a layer whose buffers are on the host: the new keys and
    values written as one slice copy each at the layer's next positions (a strided copy,
    where the class's ``index_copy_`` of the same rows indexes every row on its own). Any
    other layer (on a device, meta in a dry run, rows of another dtype or count, or past its
    length) runs the class's."""
    if not layer.is_initialized:
        layer.lazy_initialization(key_states, value_states)
    keys, values, at = layer.keys, layer.values, layer.cumulative_length
    n = key_states.shape[-2]
    host = all(t.device.type == "cpu" for t in (keys, values, at, key_states, value_states))
    same = (key_states.dtype, value_states.dtype) == (keys.dtype, values.dtype)
    rows = key_states.shape[:2] == keys.shape[:2] and value_states.shape[:2] == values.shape[:2]
    if not (host and same and rows):  # the class's update, or its error (no broadcast rows)
        return StaticLayer.update(layer, key_states, value_states, *args, **kwargs)
    start = int(at)
    if start + n > keys.shape[2]:
        return StaticLayer.update(layer, key_states, value_states, *args, **kwargs)
    at.add_(n)
    keys.narrow(2, start, n).copy_(key_states)
    values.narrow(2, start, n).copy_(value_states)
    return keys, values


def _update_on_host(
    update: Any, key_states: Tensor, value_states: Tensor, *args: Any, **kwargs: Any
) -> tuple[Tensor, Tensor]:
    """A layer's ``update`` with its new key and value rows copied to the host first, so the
    layer allocates its buffers there at its first update and keeps every token there (in
    a dry run the accountant takes the copy of meta tensors as one to host memory)."""
    key_states, value_states = key_states.to("cpu"), value_states.to("cpu")
    keys, values = update(key_states, value_states, *args, **kwargs)
    return keys, values


def _own_init(layer: Any) -> Any:
    """The class's own ``lazy_initialization`` of ``layer``, bound to it."""
    return type(layer).lazy_initialization.__get__(layer)


def _init_on_host(
    layer: Any, directory: Path | None, own: Any, *keys_values: Tensor, huge: bool = True,
    **states: Any,
) -> None:  # fmt: skip
    """A static layer's first-update allocation (transformers' ``lazy_initialization``): its
    keys and values ``[batch, heads, max_cache_len, dim]`` zeroed in host memory
    (:func:`storage.io.mapped_zeros`: decode attention reads faster from huge pages), or with a
    ``directory`` as shared memory maps of zeroed files there (a dry run's accountant takes
    host allocations as host memory). A hybrid layer's convolution and recurrent states
    (called with them as keywords: Falcon-H1's mamba beside attention) go to ``own``, the
    layer's own allocation, on the device beside the model's state layers.

    On a CPU device the cache's own layers (``huge=False``) are allocated here too, as
    anonymous memory the kernel zeroes page by page as the prefill first writes it, where
    torch's zeros write every byte once more before that; in 4 KiB pages, whose first touch
    costs less than a fresh huge page's. A meta layer (a dry run's device cache) keeps its own."""
    if states or len(keys_values) != 2 or (not huge and keys_values[0].device.type != "cpu"):
        own(*keys_values, **states)
        return
    key_states, value_states = keys_values
    layer.device = torch.device("cpu")
    layer.batch_size, layer.num_heads = key_states.shape[:2]
    layer.k_head_dim, layer.v_head_dim = key_states.shape[-1], value_states.shape[-1]
    for name, dim, dtype in (
        ("keys", layer.k_head_dim, key_states.dtype),
        ("values", layer.v_head_dim, value_states.dtype),
    ):
        shape = (layer.batch_size, layer.num_heads, layer.max_cache_len, dim)
        if directory is None:  # huge pages; a dry run's accountant counts torch's zeros
            meta = key_states.device.type == "meta"
            on_host = torch.zeros(shape, dtype=dtype, device="cpu") if meta else None
            zeros = mapped_zeros(shape, dtype, huge=huge) if on_host is None else on_host
            setattr(layer, name, zeros)
            continue
        path = directory / f"{id(layer)}.{name}"
        numel = math.prod(shape)
        with open(path, "wb") as f:
            os.truncate(f.fileno(), numel * torch.empty((), dtype=dtype).element_size())
        buf = torch.from_file(str(path), shared=True, size=numel, dtype=dtype)
        setattr(layer, name, buf.view(shape))
    layer.cumulative_length = layer.cumulative_length.to("cpu")
    layer.is_initialized = True


def _is_state_layer(layer: Any) -> bool:
    """A transformers cache layer with per-row states (``conv_states`` /
    ``recurrent_states``, as its linear-attention layers keep), keys beside them or not."""
    return hasattr(layer, "conv_states") and hasattr(layer, "recurrent_states")


def _has_keys(layer: Any) -> bool:
    """A transformers cache layer holding keys and values (a state beside them or not)."""
    return isinstance(layer, StaticLayer)


def _slots(layer: Any) -> list[tuple[str, int | None]]:
    """Where ``layer`` keeps per-row buffers: its keys and values, its initialized states."""
    slots: list[tuple[str, int | None]] = []
    if _has_keys(layer):
        slots += [("keys", None), ("values", None)]
    if _is_state_layer(layer):
        slots += [
            (attr, i)
            for attr in ("conv_states", "recurrent_states")
            for i, buf in getattr(layer, attr).items()
            if isinstance(buf, Tensor)
        ]
    return slots


def _get(layer: Any, slot: tuple[str, int | None]) -> Tensor:
    attr, i = slot
    value = getattr(layer, attr)
    return value if i is None else value[i]


def _set(layer: Any, slot: tuple[str, int | None], buf: Tensor) -> None:
    attr, i = slot
    if i is None:
        setattr(layer, attr, buf)
    else:
        getattr(layer, attr)[i] = buf
