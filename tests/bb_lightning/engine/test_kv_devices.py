"""KV-cache compaction where the layers' buffers lie on different devices (an offloading cache)."""

from __future__ import annotations

from functools import partial
from typing import Any

import pytest
import torch
from torch.overrides import TorchFunctionMode

from bb_lightning.engine.kv import KVCache

from ..tiny import tiny_llama


class _IndexDevices(TorchFunctionMode):
    """Records (buffer device, index device) of every ``index_select``."""

    def __init__(self) -> None:
        super().__init__()
        self.pairs: list[tuple[torch.device, torch.device]] = []

    def __torch_function__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None
    ) -> Any:
        if func in (torch.Tensor.index_select, torch.index_select):
            self.pairs.append((args[0].device, args[2].device))
        return func(*args, **(kwargs or {}))


def test_compact_selects_rows_where_each_buffer_lies() -> None:
    model = tiny_llama().eval()
    kv = KVCache(model.config, rows=4, max_len=16, device=torch.device("cpu"))
    ids = torch.randint(0, 128, (4, 5), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        model(input_ids=ids, past_key_values=kv.cache, use_cache=True)
    layers: list[Any] = list(kv.cache.layers)
    before = [(layer.keys.clone(), layer.values.clone()) for layer in layers]
    # like transformers' offloading cache between passes: one layer elsewhere than the rest
    layers[1].keys, layers[1].values = layers[1].keys.to("meta"), layers[1].values.to("meta")
    keep = torch.tensor([1, 3])
    with _IndexDevices() as seen:
        kv.compact(keep)
    assert seen.pairs and all(buf == idx for buf, idx in seen.pairs), seen.pairs
    for i, layer in enumerate(layers):
        assert layer.batch_size == 2 and layer.keys.shape[0] == 2 == layer.values.shape[0]
        if i != 1:
            torch.testing.assert_close(layer.keys, before[i][0][keep], rtol=0, atol=0)
            torch.testing.assert_close(layer.values, before[i][1][keep], rtol=0, atol=0)
    assert layers[1].keys.is_meta
    kv.reset()  # every row back, at the buffers' full size
    assert all(layer.keys.shape[0] == 4 and layer.batch_size == 4 for layer in layers)


@pytest.mark.parametrize("host_attention", [True, False])
def test_a_host_cache_lives_in_a_mapping_of_its_own(host_attention: bool) -> None:
    """Each layer's keys and values are allocated as :func:`storage.io.mapped_zeros`
    allocates (a private mapping of their own, ``MADV_DONTFORK``: "dc" in
    ``/proc/self/smaps``), zeroed, and hold what the model wrote (the first five positions of
    every row). With attention on the host it asks for huge pages ("hg": decode attention
    reads it whole each step); on a CPU device not (the kernel zeroes each 4 KiB page as the
    prefill first writes it)."""
    from ...storage.test_host_buffers import _vm_flags

    model = tiny_llama().eval()
    where = {"host_attention": True} if host_attention else {"device": torch.device("cpu")}
    kv = KVCache(model.config, rows=64, max_len=512, **where)  # type: ignore[arg-type]
    ids = torch.randint(0, 128, (64, 5), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        model(input_ids=ids, past_key_values=kv.cache, use_cache=True)
    for layer in kv.cache.layers:
        for buf in (layer.keys, layer.values):
            assert buf.device.type == "cpu" and buf.nbytes >= 2 << 20
            flags = _vm_flags(buf.data_ptr())
            assert "dc" in flags and ("hg" in flags) == host_attention
            assert buf[:, :, :5].abs().sum() > 0 and not buf[:, :, 5:].any()


def test_a_host_layer_writes_what_the_class_writes_and_leaves_the_rest_to_it() -> None:
    """A layer on the host writes its new rows as slices: the same buffers and counter as
    transformers' ``index_copy_`` update, over a prefill and two decode steps; a layer on
    meta, or rows of another dtype, runs the class's update (and its error)."""
    from transformers.cache_utils import StaticLayer

    model = tiny_llama().eval()
    ids = torch.randint(0, 128, (3, 6), generator=torch.Generator().manual_seed(1))
    ours = KVCache(model.config, rows=3, max_len=10, device=torch.device("cpu"))
    theirs = KVCache(model.config, rows=3, max_len=10, device=torch.device("cpu"))
    for layer in theirs.cache.layers:
        del layer.update, layer.lazy_initialization  # the class's own (torch's zeros)
    with torch.no_grad():
        for kv in (ours, theirs):
            out = model(input_ids=ids, past_key_values=kv.cache, use_cache=True)
            for _ in range(2):
                step = out.logits[:, -1:].argmax(-1)
                out = model(input_ids=step, past_key_values=kv.cache, use_cache=True)
    for a, b in zip(ours.cache.layers, theirs.cache.layers, strict=True):
        assert int(a.cumulative_length) == int(b.cumulative_length) == 8
        torch.testing.assert_close(a.keys, b.keys, rtol=0, atol=0)
        torch.testing.assert_close(a.values, b.values, rtol=0, atol=0)
        assert a.keys[:, :, 8:].abs().sum() == 0
    layer: Any = ours.cache.layers[0]
    rows = torch.zeros(3, *layer.keys.shape[1:2], 1, layer.keys.shape[-1], dtype=torch.float64)
    one = torch.zeros(1, *layer.keys.shape[1:2], 1, layer.keys.shape[-1], dtype=layer.keys.dtype)
    for update in (layer.update, partial(StaticLayer.update, layer)):
        for bad in (rows, one):  # index_copy_'s: rows of another dtype; one row, not three
            with pytest.raises(RuntimeError):
                update(bad, bad)
    meta = KVCache(model.config, rows=3, max_len=10, device=torch.device("meta"))
    with torch.no_grad():
        model.to("meta")(input_ids=ids.to("meta"), past_key_values=meta.cache, use_cache=True)
    assert all(layer.keys.is_meta for layer in meta.cache.layers)
