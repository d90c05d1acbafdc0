"""KV-cache compaction where the layers' buffers lie on different devices (an offloading cache)."""

from __future__ import annotations

from typing import Any

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


def test_a_host_cache_lives_in_a_mapping_that_asks_for_huge_pages() -> None:
    """With attention on the host, each layer's keys and values are allocated as
    :func:`storage.io.mapped_zeros` allocates (a private mapping advised ``MADV_HUGEPAGE``,
    "hg" in ``/proc/self/smaps``: decode attention reads it whole each step), zeroed, and
    hold what the model wrote (the first five positions of every row)."""
    from ...storage.test_host_buffers import _vm_flags

    model = tiny_llama().eval()
    kv = KVCache(model.config, rows=64, max_len=512, host_attention=True)
    ids = torch.randint(0, 128, (64, 5), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        model(input_ids=ids, past_key_values=kv.cache, use_cache=True)
    for layer in kv.cache.layers:
        for buf in (layer.keys, layer.values):
            assert buf.device.type == "cpu" and buf.nbytes >= 2 << 20
            assert "hg" in _vm_flags(buf.data_ptr())
            assert buf[:, :, :5].abs().sum() > 0 and not buf[:, :, 5:].any()
