"""A KV cache homed in the store's host tier, paged to the device layer by layer.

With the cache's tier :attr:`~storage.tiers.Tier.HOST` beside a device that is not the
host (a CUDA device; a CPU device under the double of CUDA's copy semantics; a dry run's
``meta`` device) and attention on the device, each full-attention layer of the cache is
one tensor of the :class:`~storage.store.TieredStore` homed on the host: its keys, then its
values, ``rows x heads x max_len x (key dim + value dim)`` elements in the compute dtype.
The host arena holds it (pinned beside a CUDA device), so the store's host budget counts
it and nothing is allocated per step. Two device tensors of the store (*lanes*, one layer
each, registered once) take the layers in turn.

:class:`KVPager` moves the layers as transformers' offloading cache does, through the
store's copy machinery instead of new tensors: at a layer's update it orders the device
work after the layer's copy into its lane (issued at the previous layer's update, on the
store's copy stream) and copies the next layer into the other lane, once the write-back
that last read that lane is ordered before it; after the update it writes the lane back
to the layer's host home (``write_back_async``, overlapped). A pass, the prefill too (its
copies carry the positions it does not write, masked), moves the whole cache each way
(:func:`~bb_lightning.planner.cost.offloaded_kv_bytes`; the planner prices the two lanes
on the device). The store orders copies per tensor, and a layer's copy in and its
write-back are copies of two tensors (the lane, the home): the host waits for the copy in
before the write-back replaces the home it read, and a copy in of a layer waits for its
last write-back to land.

Rows that leave the batch are compacted in the host homes (every copy finished first),
and the layers' views narrowed to the rows kept.
"""

from __future__ import annotations

import itertools
import math
from typing import Any

import torch
from torch import Tensor
from transformers.cache_utils import StaticLayer

from bb_lightning.placement import Placement
from storage.deferred import double_requested
from storage.device import slot_bytes
from storage.residency import Ticket
from storage.store import StoreConfig, TieredStore
from storage.tiers import Tier, format_bytes

__all__ = ["KVPager", "PagedLayer", "kv_budgets", "kv_layer_bytes", "paged_kv_budgets"]

_ids = itertools.count()


def kv_layer_bytes(rows: int, heads: int, max_len: int, dims: tuple[int, int], elem: int) -> int:
    """Bytes of one paged layer: ``rows x heads x max_len x (key dim + value dim)`` elements
    of ``elem`` bytes each."""
    return rows * heads * max_len * (dims[0] + dims[1]) * elem


def kv_budgets(
    placement: Placement, rows: int, positions: int, bf16_bytes_per_token: int, layers: int
) -> dict[Tier, int] | None:
    """Bytes per tier the store holds for a cache of ``rows`` sequences x ``positions`` on
    the host beside the device's attention (``placement.kv_cache`` HOST, its
    ``decode_attention`` not HOST; else None): ``layers`` layers of
    ``bf16_bytes_per_token`` per position (keys and values of one layer in bf16, scaled to
    the compute dtype) on the host, two of them as the device lanes."""
    if placement.kv_cache is not Tier.HOST or placement.decode_attention is Tier.HOST:
        return None
    per_token = bf16_bytes_per_token * placement.compute_bytes // 2
    layer = slot_bytes(rows * positions * per_token)
    return {Tier.DEVICE: 2 * layer, Tier.HOST: layers * layer, Tier.NVME: 0}


def paged_kv_budgets(
    placement: Placement,
    sizes: tuple[int, int, int, int] | None,
    device: torch.device,
    store: StoreConfig | None,
) -> dict[Tier, int] | None:
    """:func:`kv_budgets` of ``sizes`` (a plan's concurrent sequences, cache positions,
    bf16 bytes per token and layer, layers) where the store pages the cache; None: no such
    cache, no ``sizes`` (the cache then holds its own buffers, outside the store), or a CPU
    device (the cache in its RAM) but under the double of CUDA's copies (``store``'s, or
    the environment's)."""
    double = double_requested(None if store is None else store.cuda_double)
    if sizes is None or (device.type == "cpu" and not double):
        return None
    return kv_budgets(placement, *sizes)


class PagedLayer(StaticLayer):
    """A transformers ``StaticLayer`` whose keys and values live in a store tensor, paged
    to the device by its :class:`KVPager` around each update. ``keys`` and ``values`` are
    views of the device lane it is paged into (stale once the next layer updates)."""

    def __init__(self, max_cache_len: int, pager: KVPager, index: int) -> None:
        super().__init__(max_cache_len=max_cache_len)
        self.pager = pager
        self.index = index
        """Position among the pager's layers (the order a forward updates them in)."""
        self.name = ""
        """The store tensor of its keys and values (set at its first update)."""
        self.rows = 0
        """Rows of the batch still running (the views' first dimension)."""
        self.full_rows = 0
        """Rows the store tensor holds."""

    def lazy_initialization(self, key_states: Tensor, value_states: Tensor) -> None:
        """Register the layer's store tensor for all rows (zeros), shaped by its first keys
        and values; the device views appear at each update."""
        self.device = key_states.device
        self.batch_size, self.num_heads = key_states.shape[:2]
        self.k_head_dim, self.v_head_dim = key_states.shape[-1], value_states.shape[-1]
        self.rows = self.full_rows = self.batch_size
        self.name = self.pager.register(self, key_states.dtype)
        self.cumulative_length = self.cumulative_length.to(self.device)
        self.is_initialized = True

    def update(
        self, key_states: Tensor, value_states: Tensor, *args: Any, **kwargs: Any
    ) -> tuple[Tensor, Tensor]:
        """Page the layer in, write the new positions as ``StaticLayer`` does, write the
        layer back to its host home (overlapped); the device views it attends over."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self.keys, self.values = self.pager.enter(self)
        out: tuple[Tensor, Tensor] = super().update(key_states, value_states, *args, **kwargs)
        self.pager.leave(self)
        return out

    def views(self, flat: Tensor) -> tuple[Tensor, Tensor]:
        """The keys and values of the rows still running, as views of the flat tensor."""
        shape = (self.full_rows, self.num_heads, self.max_cache_len)
        n_k = math.prod(shape) * self.k_head_dim
        keys = flat[:n_k].view(*shape, self.k_head_dim)
        values = flat[n_k:].view(*shape, self.v_head_dim)
        return keys[: self.rows], values[: self.rows]

    def reset(self) -> None:
        """Forget the cached tokens: the position counter only (unwritten positions are
        masked), the rows widened back to all."""
        if self.is_initialized:
            self.cumulative_length.zero_()
        self.rows = self.full_rows
        self.batch_size = self.full_rows


class KVPager:
    """The store tensors of a cache's :class:`PagedLayer` s and their paging (see the
    module docstring). One pager per cache; :meth:`close` unregisters its tensors."""

    def __init__(self, store: TieredStore) -> None:
        self.store = store
        self.layers: list[PagedLayer] = []
        """The paged layers, in update order."""
        self._prefix = f"kv-cache.{next(_ids)}"
        self._names: list[str] = []
        """Every tensor registered: the layers' host homes, then the device lanes."""
        self._homes: dict[str, Tensor] = {}
        """Each layer's host home (a view of the host arena), by tensor name."""
        self._lanes: dict[tuple[int, torch.dtype], tuple[str, str]] = {}
        """The two device tensors layers of each (elements, dtype) are paged into."""
        self._in: dict[str, tuple[int, Ticket]] = {}
        """Layers paged into a lane (or on their way): (lane, the copy's ticket)."""
        self._out: dict[str, Ticket] = {}
        """Write-backs issued and not yet ordered before later device work, by layer."""
        self._written: dict[str, Ticket] = {}
        """Each layer's last write-back, until a page-in of the layer waited for it."""

    def adopt(self, layer: StaticLayer) -> PagedLayer:
        """A paged layer in place of the plain ``StaticLayer`` ``layer`` (not initialized)."""
        paged = PagedLayer(layer.max_cache_len, self, len(self.layers))
        self.layers.append(paged)
        return paged

    def register(self, layer: PagedLayer, dtype: torch.dtype) -> str:
        """Register ``layer``'s host home (zeros) and, at the first layer of its size, the
        two device lanes; its name. ``ValueError`` in one line when the store cannot hold
        them."""
        name = f"{self._prefix}.{layer.index}"
        elem = torch.empty((), dtype=dtype).element_size()
        dims = (layer.k_head_dim, layer.v_head_dim)
        nbytes = kv_layer_bytes(layer.full_rows, layer.num_heads, layer.max_cache_len, dims, elem)
        numel = nbytes // elem
        todo = [(name, Tier.HOST)]
        if (numel, dtype) not in self._lanes:
            lanes = (
                f"{self._prefix}.lane{len(self._lanes)}a",
                f"{self._prefix}.lane{len(self._lanes)}b",
            )
            self._lanes[(numel, dtype)] = lanes
            todo += [(lanes[0], Tier.DEVICE), (lanes[1], Tier.DEVICE)]
        for tensor, tier in todo:
            try:
                self.store.register(tensor, shape=(numel,), dtype=dtype, home=tier)
            except ValueError as err:
                used, cap = self.store.usage()[tier]
                raise ValueError(
                    f"KV cache layer {layer.index} of {layer.full_rows} rows x "
                    f"{layer.max_cache_len} positions needs {format_bytes(nbytes)} of the "
                    f"store's {tier.value} tier ({format_bytes(cap - used)} free of "
                    f"{format_bytes(cap)}): plan the job (its plan sizes the store for the "
                    f"cache) or generate fewer sequences at once ({err})"
                ) from err
            self._names.append(tensor)
        self._homes[name] = self.store.host_view(name)
        return name

    def enter(self, layer: PagedLayer) -> tuple[Tensor, Tensor]:
        """Before ``layer``'s update: its device views, ordered after its page-in; the next
        layer paged into the other lane, after the write-back that lane's last layer read."""
        lanes = self._lanes_of(layer)
        if layer.name not in self._in:
            busy = {lane for lane, _ in self._in.values()}
            self._page_in(layer, 1 if busy == {0} else 0)
        lane, ticket = self._in[layer.name]
        ticket.wait()
        flat = self.store.get(lanes[lane])
        for name in [n for n in self._in if n != layer.name]:
            del self._in[name]  # its lane is the next layer's now
        nxt = self._next(layer)
        if nxt is not None:
            self._page_in(nxt, 1 - lane)
        return layer.views(flat)

    def leave(self, layer: PagedLayer) -> None:
        """After ``layer``'s update: write its lane back to its host home, overlapped (the
        lane stays readable: nothing is paged into it before this copy is ordered)."""
        lane, page_in = self._in[layer.name]
        # the write-back replaces the host home the page-in read: the store orders copies per
        # tensor, and these are two, so the page-in is finished first (on CUDA it ran before
        # the update, which the write-back follows; the host waits at most for that)
        page_in.wait_host()
        src = self.store.get(self._lanes_of(layer)[lane])
        ticket = self.store.write_back_async(layer.name, src, from_device=True)
        self._out[layer.name] = self._written[layer.name] = ticket

    def settle(self) -> None:
        """Finish every copy (the host homes then hold every layer, and no copy reads them)
        and forget what the lanes hold."""
        for _, ticket in self._in.values():
            ticket.wait_host()
        for ticket in self._written.values():
            ticket.wait_host()
        self._in, self._out, self._written = {}, {}, {}

    def compact(self, keep: Tensor) -> None:
        """Keep rows ``keep`` (ascending indices of the current rows) of every layer, moved
        to the front of its host home; the device views narrowed to them."""
        self.settle()
        idx = keep.to("cpu")
        n = int(idx.numel())
        for layer in self.layers:
            if not layer.name:
                continue
            for buf in layer.views(self._homes[layer.name]):
                buf[:n] = buf.index_select(0, idx)
            layer.rows = layer.batch_size = n

    def close(self) -> None:
        """Unregister every tensor (the cache is not used after; a closed store took them
        with it)."""
        if not self.store.closed:
            self.settle()
            for name in self._names:
                self.store.unregister(name)
        self._names, self._homes, self._lanes = [], {}, {}
        self._in, self._out, self._written = {}, {}, {}

    def _lanes_of(self, layer: PagedLayer) -> tuple[str, str]:
        return self._lanes[(self._homes[layer.name].numel(), self._homes[layer.name].dtype)]

    def _next(self, layer: PagedLayer) -> PagedLayer | None:
        """The layer updated after ``layer`` (the first one after the last), where its
        tensor is registered (None in the first prefill, before its first update)."""
        nxt = self.layers[(layer.index + 1) % len(self.layers)]
        return nxt if nxt.name and nxt is not layer else None

    def _page_in(self, layer: PagedLayer, lane: int) -> None:
        """Copy ``layer``'s host home into device lane ``lane``, after the device work
        queued so far (the lane's last reader) and once the layer's last write-back landed
        in host memory (issued a pass earlier: done by now, but another tensor's copy is
        not ordered after it by the store)."""
        for out in self._out.values():  # the write-backs reading the lanes
            out.wait()
        self._out = {}
        written = self._written.pop(layer.name, None)
        if written is not None:
            written.wait_host()
        dst = self._lanes_of(layer)[lane]
        self._in[layer.name] = (lane, self.store.write_back_async(dst, self._homes[layer.name]))
