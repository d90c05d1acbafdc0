"""Generation with the KV cache homed on the host and decode attention run there, against
Hugging Face greedy ``generate`` (fp32) across the family matrix: dense, tied, sliding window
(both batches past it), MoE and hybrid recurrent; ragged prompts, EOS mid-way (the batch
compacts), and a second batch on the same cache; the batch as one group, as two groups of
sequences in flight and as three uneven ones (2, 1 and 1 rows), each with its own cache."""

from __future__ import annotations

import gc
import threading
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch

import bb_lightning.engine.attention as attention
from bb_lightning.engine import native
from bb_lightning.engine.generate import GenerationConfig, LayerMajorGenerator
from bb_lightning.engine.kv import KVCache
from storage.tiers import Tier

from ..tiny import FAMILIES, VOCAB, tiny_model

NEW = 10
MATRIX = ("llama", "qwen2_tied", "mistral_sliding", "mixtral_moe", "lfm2_conv")
"""Dense, tied head, sliding window of 8 (prompts of up to 7 + 10 new tokens pass it),
MoE, hybrid recurrent (short convolutions beside attention)."""
BATCHES = ((1, (7, 3, 5, 6)), (2, (4, 7, 6, 2)))
"""(seed, prompt lengths) of two batches of four ragged prompts: the same cache serves both."""
GROUPS = (1, 2, 3)
"""Groups of sequences in flight: the batch whole, two groups of 2 rows, three of 2, 1, 1."""

pytestmark = pytest.mark.usefixtures("one_thread")


def _model(family: str) -> torch.nn.Module:
    """The family's tiny model with strong weights (initializer range 0.2: no greedy ties)."""
    return tiny_model({**FAMILIES[family], "initializer_range": 0.2}).eval()


def _prompts(seed: int, lengths: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    width = max(lengths)
    ids = torch.randint(3, VOCAB, (len(lengths), width), generator=g)
    mask = torch.ones_like(ids)
    for row, n in enumerate(lengths):
        ids[row, : width - n], mask[row, : width - n] = 0, 0
    return ids, mask


def _reference(model: torch.nn.Module, ids: torch.Tensor, mask: torch.Tensor) -> list[list[int]]:
    """Hugging Face greedy tokens of each prompt alone (no padding), ``NEW`` of them."""
    rows = []
    for row in range(ids.shape[0]):
        one = ids[row][mask[row].bool()][None]
        with torch.no_grad():
            out = model.generate(  # type: ignore[operator]
                input_ids=one, attention_mask=torch.ones_like(one), max_new_tokens=NEW,
                do_sample=False, pad_token_id=0, eos_token_id=None,
            )  # fmt: skip
        rows.append(out[0, one.shape[1] :].tolist())
    return rows


def _mid_eos(rows: list[list[int]]) -> int:
    """The token found mid-way (not first, not last) in the most rows."""
    counts = Counter(t for r in rows for t in set(r[1:-1]))
    return counts.most_common(1)[0][0]


def _cut(rows: list[list[int]], eos: int) -> list[list[int]]:
    return [r[: r.index(eos)] if eos in r else r for r in rows]


class _Spy:
    """Records the attention calls of decode steps: each reads a host cache of the generator,
    the cache of the group whose rows it attends for, on that group's own thread."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.decode_calls: list[tuple[int, int]] = []
        """(group whose cache was read, thread) of each decode step's attention call."""
        self.gen: LayerMajorGenerator | None = None
        real = attention.host_attention

        def spy(module: Any, query: torch.Tensor, key: torch.Tensor, *a: Any, **k: Any) -> Any:
            if query.shape[2] == 1:
                assert self.gen is not None and self.gen._kvs
                owner = {
                    layer.keys.untyped_storage().data_ptr(): g
                    for g, kv in enumerate(self.gen._kvs)
                    for layer in kv.cache.layers
                    if getattr(layer, "keys", None) is not None
                }
                assert key.device.type == "cpu"
                group = owner.get(key.untyped_storage().data_ptr())
                assert group is not None, "attends over the host cache"
                assert key.shape[0] == query.shape[0] <= self.gen._kvs[group].rows
                self.decode_calls.append((group, threading.get_ident()))
            return real(module, query, key, *a, **k)

        monkeypatch.setattr(attention, "host_attention", spy)


@pytest.mark.parametrize("family", MATRIX)
def test_host_cache_and_host_attention_generate_like_hf(
    family: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = _model(family)
    gens = {
        g: LayerMajorGenerator(model, kv_tier=Tier.HOST, attention_tier=Tier.HOST,
                               attention_groups=g)
        for g in GROUPS
    }  # fmt: skip
    spy = _Spy(monkeypatch)
    compactions: list[KVCache] = []
    real_compact = KVCache.compact

    def compact(self: KVCache, keep: torch.Tensor) -> None:
        compactions.append(self)
        real_compact(self, keep)

    monkeypatch.setattr(KVCache, "compact", compact)
    caches: dict[int, list[list[KVCache]]] = {g: [] for g in GROUPS}
    for seed, lengths in BATCHES:
        ids, mask = _prompts(seed, lengths)
        full = _reference(model, ids, mask)
        eos = _mid_eos(full)
        want = _cut(full, eos)
        reasons = ["eos" if eos in r else "length" for r in full]
        for groups, gen in gens.items():
            spy.gen, spy.decode_calls = gen, []
            out = gen.generate(
                ids, mask, GenerationConfig(max_new_tokens=NEW, eos_token_ids=(eos,))
            )
            assert [o.token_ids for o in out] == want, (family, seed, groups)
            assert [o.finish_reason for o in out] == reasons, (family, seed, groups)
            assert [kv.rows for kv in gen._kvs] == [[4], [2, 2], [2, 1, 1]][groups - 1]
            caches[groups].append(list(gen._kvs))
            # each group attended over its own cache; the first group on this thread, and
            # while several are in flight the others beside it, on threads of their own
            assert len({group for group, _ in spy.decode_calls}) >= min(groups, 2)
            main = threading.get_ident()
            assert {t for group, t in spy.decode_calls if group == 0} == {main}
            beside = {t != main for group, t in spy.decode_calls if group > 0}
            assert (True in beside) == (groups > 1), (family, groups)
    for groups, (first, second) in caches.items():
        assert first == second, f"{family}: the second batch reuses the {groups} group caches"
        assert all(kv.host_attention for kv in first)
        keys = [
            layer.keys for kv in first for layer in kv.cache.layers
            if getattr(layer, "keys", None) is not None
        ]  # fmt: skip
        assert keys and all(k.device.type == "cpu" for k in keys)
    compacted = {id(kv) for kv in compactions}
    assert id(caches[1][0][0]) in compacted, f"{family}: EOS mid-way in half the rows compacts"
    assert any(id(kv) in compacted for kv in caches[2][0]), f"{family}: a group compacts alone"


def test_bf16_gqa_heads_on_the_matrix_tiles_generate_as_torch_s_products(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A bf16 Llama with four query heads of 32 a key/value head, its cache and decode
    attention on the host: on the CPU's matrix tiles (where it has them) the greedy tokens
    equal those of the kernel's vector products and of torch's products (``BB_NATIVE=0``);
    prompts of 9-40 tokens, so the cache passes blocks of 32 and 16 positions and a tail."""
    kernel = native.kernel()
    if kernel is None or not kernel.set_tiles(True):
        pytest.skip("no matrix tiles on this CPU")
    config = {**FAMILIES["llama"], "hidden_size": 256, "num_attention_heads": 8,
              "num_key_value_heads": 2, "initializer_range": 0.2}  # fmt: skip
    model = tiny_model(config).to(torch.bfloat16).eval()
    assert kernel.on_tiles(4, 40, 32, 32, torch.bfloat16)
    ids, mask = _prompts(3, (40, 9, 33, 17))
    runs = []
    for tiles, products in ((True, "1"), (False, "1"), (True, "0")):
        kernel.set_tiles(tiles)
        monkeypatch.setenv("BB_NATIVE", products)
        gen = LayerMajorGenerator(model, kv_tier=Tier.HOST, attention_tier=Tier.HOST)
        try:
            out = gen.generate(ids, mask, GenerationConfig(max_new_tokens=NEW))
        finally:
            kernel.set_tiles(True)
        runs.append([o.token_ids for o in out])
    assert runs[0] == runs[1] == runs[2]
    assert all(len(r) == NEW for r in runs[0])


def test_host_attention_needs_the_cache_on_the_host_and_sdpa() -> None:
    model = _model("llama")
    with pytest.raises(
        ValueError, match=r"attention_tier=host with kv_tier=None.*kv_tier=Tier.HOST"
    ):
        LayerMajorGenerator(model, attention_tier=Tier.HOST)
    eager = tiny_model(FAMILIES["llama"], attn_implementation="eager")
    gen = LayerMajorGenerator(eager, kv_tier=Tier.HOST, attention_tier=Tier.HOST)
    ids, mask = _prompts(1, (3, 2))
    with pytest.raises(ValueError, match=r"attn_implementation='eager'.*'sdpa'"):
        gen.generate(ids, mask, GenerationConfig(max_new_tokens=2))


@pytest.mark.parametrize(("family", "spilled"), [("llama", 1), ("mistral_sliding", 2)])
def test_a_kv_cache_spilled_to_nvme_generates_like_hf(
    family: str, spilled: int, tmp_path: Path
) -> None:
    """The last ``spilled`` layers' keys and values in files under the NVMe directory (both
    layers of the sliding-window model), two batches on the same cache."""
    model = _model(family)
    gen = LayerMajorGenerator(
        model, kv_tier=Tier.HOST, attention_tier=Tier.HOST, kv_nvme_layers=spilled,
        kv_nvme_dir=str(tmp_path),
    )  # fmt: skip
    for seed, lengths in BATCHES:
        ids, mask = _prompts(seed, lengths)
        full = _reference(model, ids, mask)
        eos = _mid_eos(full)
        out = gen.generate(ids, mask, GenerationConfig(max_new_tokens=NEW, eos_token_ids=(eos,)))
        assert [o.token_ids for o in out] == _cut(full, eos), (family, seed)
        kv = gen._kv
        assert kv is not None and kv.nvme_layers == spilled
        layers: list[Any] = list(kv.cache.layers)
        files = sorted(p for p in tmp_path.rglob("*") if p.is_file())
        assert len(files) == 2 * spilled  # keys and values of each spilled layer
        for layer in layers[len(layers) - spilled :]:
            for buf in (layer.keys, layer.values):
                # the layer's buffer is the file: what attention wrote is on disk
                path = Path(str(buf.untyped_storage().filename))
                assert path in files and buf.untyped_storage().nbytes() == path.stat().st_size
                on_disk = torch.from_file(str(path), size=buf.numel(), dtype=buf.dtype)
                torch.testing.assert_close(on_disk.view(buf.shape), buf, rtol=0, atol=0)
                assert on_disk.abs().sum() > 0
        for layer in layers[: len(layers) - spilled]:
            assert layer.keys.untyped_storage().filename is None
    del gen, kv, layers
    gc.collect()
    assert not any(p.is_file() for p in tmp_path.rglob("*")), "the files go with the cache"


def test_a_layer_of_keys_and_states_keeps_its_keys_on_the_host() -> None:
    """Falcon-H1: one cache layer holds attention keys and values and a mamba layer's
    convolution and recurrent states; the keys and values go to the host, the states are
    the layer's own; two batches in two groups, against ``generate``."""
    model = _model("falcon_h1_state_and_keys")
    gen = LayerMajorGenerator(model, kv_tier=Tier.HOST, attention_tier=Tier.HOST,
                              attention_groups=2)  # fmt: skip
    for seed, lengths in BATCHES:
        ids, mask = _prompts(seed, lengths)
        full = _reference(model, ids, mask)
        eos = _mid_eos(full)
        out = gen.generate(ids, mask, GenerationConfig(max_new_tokens=NEW, eos_token_ids=(eos,)))
        assert [o.token_ids for o in out] == _cut(full, eos), seed
    layers: list[Any] = [layer for kv in gen._kvs for layer in kv.cache.layers]
    assert all(layer.keys.device.type == "cpu" for layer in layers)
    assert all(layer.is_conv_states_initialized[0] for layer in layers)
