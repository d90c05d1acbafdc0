"""Layer-major generation against Hugging Face ``generate`` on tiny models, paged and not."""

from __future__ import annotations

import copy
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from bb_lightning.engine.generate import GenerationConfig, LayerMajorGenerator
from bb_lightning.engine.inference import InferenceEngine
from bb_lightning.hf.structure import find_block_list
from bb_lightning.placement import Placement
from storage.store import StoreConfig, TieredStore
from storage.tiers import Tier

VOCAB = 256
NEW = 10
CONFIGS: dict[str, dict[str, Any]] = {
    "llama": {
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 3,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 64,
    },
    "gpt2": {"n_embd": 64, "n_layer": 3, "n_head": 4, "n_positions": 64},
    "gpt_neox": {
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 3,
        "num_attention_heads": 4,
        "max_position_embeddings": 64,
    },
    "opt": {
        "hidden_size": 64,
        "ffn_dim": 128,
        "num_hidden_layers": 3,
        "num_attention_heads": 4,
        "max_position_embeddings": 64,
        "word_embed_proj_dim": 64,
    },
}
STATE_CONFIGS: dict[str, dict[str, Any]] = {  # layers with a per-row state in the cache
    "lfm2": {  # short convolutions before an attention layer; weights large enough to matter
        "hidden_size": 64,
        "intermediate_size": 128,
        "block_ff_dim": 128,
        "num_hidden_layers": 3,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 64,
        "layer_types": ["conv", "full_attention", "conv"],
        "conv_L_cache": 3,
        "initializer_range": 0.2,
    },
}


pytestmark = pytest.mark.usefixtures("one_thread")


def _model(arch: str) -> torch.nn.Module:
    config = AutoConfig.for_model(
        arch, vocab_size=VOCAB, bos_token_id=1, eos_token_id=2, pad_token_id=0,
        **{**CONFIGS, **STATE_CONFIGS}[arch],
    )  # fmt: skip
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config).eval()


def _prompts() -> tuple[torch.Tensor, torch.Tensor]:
    """Four left-padded prompts of 9, 4, 7 and 4 tokens (the last repeats the second)."""
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(3, VOCAB, (4, 9), generator=g)
    ids[3] = ids[1]
    mask = torch.ones_like(ids)
    for row, n in enumerate((9, 4, 7, 4)):
        mask[row, : 9 - n] = 0
        ids[row, : 9 - n] = 0
    return ids, mask


def _reference(model: torch.nn.Module, eos: int | None = None) -> list[list[int]]:
    """Hugging Face greedy tokens, cut before ``eos``."""
    ids, mask = _prompts()
    with torch.no_grad():
        out = model.generate(  # type: ignore[operator]
            input_ids=ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False,
            pad_token_id=0, eos_token_id=eos,
        )  # fmt: skip
    rows = out[:, ids.shape[1] :].tolist()
    return [r[: r.index(eos)] if eos in r else r for r in rows]


def _mid_eos(rows: list[list[int]]) -> int:
    """A token the model emits mid-way in the most rows (generation must stop there)."""
    counts = Counter(t for r in rows for t in set(r[1:-1]))
    return counts.most_common(1)[0][0]


@pytest.mark.parametrize("arch", sorted(CONFIGS) + sorted(STATE_CONFIGS))
def test_greedy_equals_generate_with_mid_eos(arch: str) -> None:
    """Greedy tokens equal ``generate``'s, then with EOS mid-way (the batch compacts; a
    layer's state, as a convolution keeps, is narrowed to the rows still running) on the
    same cache (a state is zeroed for the next batch)."""
    model = _model(arch)
    gen = LayerMajorGenerator(model)
    ids, mask = _prompts()
    full = gen.generate(ids, mask, GenerationConfig(max_new_tokens=NEW))
    assert [g.token_ids for g in full] == _reference(model)
    assert {g.finish_reason for g in full} == {"length"}

    eos = _mid_eos([g.token_ids for g in full])
    cut = gen.generate(ids, mask, GenerationConfig(max_new_tokens=NEW, eos_token_ids=(eos,)))
    assert [g.token_ids for g in cut] == _reference(model, eos)
    reasons = [g.finish_reason for g in cut]
    assert reasons.count("eos") >= 2  # rows 1 and 3 at least: the batch is compacted
    assert gen.steps == NEW + min(NEW, max(len(g.token_ids) for g in cut) + 1)


@pytest.fixture(params=[Tier.DEVICE, Tier.HOST, Tier.NVME], ids=lambda t: t.value)
def paged(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[tuple[Any, Any, list[int]]]:
    """A Llama whose blocks' weights alone are paged from one tier, its unpaged twin, and
    the blocks acquired."""
    reference = _model("llama")
    model = copy.deepcopy(reference)
    tier: Tier = request.param
    store = TieredStore(
        StoreConfig(
            device_budget=16 << 20,
            host_budget=16 << 20,
            nvme_path=str(tmp_path / "nvme") if tier is Tier.NVME else None,
            nvme_budget=16 << 20 if tier is Tier.NVME else 0,
            staging_bytes=1 << 20,
            device="cpu",
        )
    )
    _, blocks = find_block_list(model)
    engine = InferenceEngine(
        model,
        list(blocks),
        store,
        Placement.uniform(len(blocks), weights=tier, master=Tier.HOST, compute_dtype="float32"),
        device=torch.device("cpu"),
    )
    acquired: list[int] = []
    acquire = engine.pager.acquire

    def counting(i: int) -> list[torch.Tensor]:
        acquired.append(i)
        return acquire(i)

    engine.pager.acquire = counting  # type: ignore[method-assign]
    assert sorted(store.names()) == [f"block.{i}.weight" for i in range(len(blocks))]
    yield model, reference, acquired
    engine.close()
    store.close()
    for key, value in reference.state_dict().items():  # the module has its weights back
        torch.testing.assert_close(model.state_dict()[key], value, rtol=0, atol=0)


def test_paged_greedy_equals_generate_each_block_once_per_step(paged: Any) -> None:
    model, reference, acquired = paged
    gen = LayerMajorGenerator(model)
    ids, mask = _prompts()
    out = gen.generate(ids, mask, GenerationConfig(max_new_tokens=NEW))
    assert [g.token_ids for g in out] == _reference(reference)
    assert gen.steps == NEW  # prefill + NEW - 1 decode steps, the whole batch in each
    assert acquired == [0, 1, 2] * gen.steps


def _sample(gen: LayerMajorGenerator, seeds: list[int], **kw: Any) -> list[list[int]]:
    ids, mask = _prompts()
    cfg = GenerationConfig(max_new_tokens=NEW, temperature=kw.pop("temperature", 1.3), **kw)
    return [g.token_ids for g in gen.generate(ids, mask, cfg, seeds=seeds)]


def test_sampling_is_seeded_per_prompt() -> None:
    gen = LayerMajorGenerator(_model("llama"))
    first = _sample(gen, [1, 2, 3, 4], top_k=50, top_p=0.9)
    assert _sample(gen, [1, 2, 3, 4], top_k=50, top_p=0.9) == first
    assert _sample(gen, [5, 6, 7, 8], top_k=50, top_p=0.9) != first
    # a prompt's tokens depend on its own seed, not on its place or neighbours in the batch
    ids, mask = _prompts()
    cfg = GenerationConfig(max_new_tokens=NEW, temperature=1.3, top_k=50, top_p=0.9)
    alone = gen.generate(ids[2:3, 2:], mask[2:3, 2:], cfg, seeds=[3])
    assert alone[0].token_ids == first[2]


def test_degenerate_sampling_is_greedy() -> None:
    model = _model("gpt2")
    gen = LayerMajorGenerator(model)
    greedy = _reference(model)
    assert _sample(gen, [1, 2, 3, 4], top_k=1) == greedy
    assert _sample(gen, [1, 2, 3, 4], top_p=1e-6) == greedy


def _one_char_per_token(ids: list[int]) -> str:
    return "".join(chr(0x100 + t) for t in ids)


def test_stop_string_cuts_text_and_tokens() -> None:
    gen = LayerMajorGenerator(_model("llama"))
    decode = _one_char_per_token
    ids, mask = _prompts()
    full = gen.generate(ids, mask, GenerationConfig(max_new_tokens=NEW), decode=decode)
    target = full[0].token_ids
    assert full[0].text == decode(target)
    stop = decode(target[4:6])
    cfg = GenerationConfig(max_new_tokens=NEW, stop_strings=(stop,))
    out = gen.generate(ids, mask, cfg, decode=decode)
    text = decode(target)
    assert out[0].finish_reason == "stop"
    assert out[0].text == text[: text.find(stop)]
    assert out[0].token_ids == target[: text.find(stop)]  # one char per token
    assert [g.token_ids for g in out[1:]] == [g.token_ids for g in full[1:]] or any(
        g.finish_reason == "stop" for g in out[1:]
    )


def test_context_limit_and_bad_input() -> None:
    gen = LayerMajorGenerator(_model("llama"))  # context 64 tokens
    ids = torch.randint(3, VOCAB, (2, 60), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    out = gen.generate(ids, mask, GenerationConfig(max_new_tokens=NEW))
    assert [len(g.token_ids) for g in out] == [5, 5]  # positions 60..64: the context ends
    assert {g.finish_reason for g in out} == {"context"}
    assert gen.check_prompt(64) is not None and "context of 64" in str(gen.check_prompt(64))
    too_long = torch.ones(1, 64, dtype=torch.long)
    with pytest.raises(ValueError, match="64 tokens >= the model's context of 64"):
        gen.generate(too_long, too_long, GenerationConfig(max_new_tokens=1))
    with pytest.raises(ValueError, match="one seed per row"):
        gen.generate(ids, mask, GenerationConfig(temperature=1.0))
    with pytest.raises(ValueError, match=r"top_p=0\.0"):
        GenerationConfig(top_p=0.0)


def test_inference_engine_loads_a_state_dict(tmp_path: Path) -> None:
    model, other = _model("llama"), _model("llama")
    with torch.no_grad():
        for p in other.parameters():
            p.mul_(1.5)
    store = TieredStore(StoreConfig(device_budget=16 << 20, host_budget=16 << 20, device="cpu"))
    _, blocks = find_block_list(model)
    engine = InferenceEngine(
        model,
        list(blocks),
        store,
        Placement.uniform(len(blocks), weights=Tier.HOST, compute_dtype="float32"),
        device=torch.device("cpu"),
    )
    engine.load_state_dict(other.state_dict())
    ids, mask = _prompts()
    out = LayerMajorGenerator(model).generate(ids, mask, GenerationConfig(max_new_tokens=NEW))
    assert [g.token_ids for g in out] == _reference(other)
    bad = dict(other.state_dict(), **{"lm_head.weight": torch.zeros(3, 3)})
    with pytest.raises(ValueError, match=r"'lm_head.weight' has shape \(3, 3\)"):
        engine.load_state_dict(bad)
    engine.close()
    store.close()


@pytest.mark.parametrize("arch", sorted(CONFIGS))
@pytest.mark.parametrize("max_tokens", [2, 18])
def test_row_chunked_blocks_equal_generate(arch: str, max_tokens: int) -> None:
    """Blocks run on chunks of rows (prefill of 9-token prompts: 1 or 2 rows a chunk; decode
    steps: 2 rows a chunk, or whole) while paged in once per step; greedy tokens stay
    ``generate``'s, then with EOS mid-way (the batch compacts)."""
    reference = _model(arch)
    model = copy.deepcopy(reference)
    store = TieredStore(StoreConfig(device_budget=16 << 20, host_budget=16 << 20, device="cpu"))
    _, blocks = find_block_list(model)
    engine = InferenceEngine(
        model, list(blocks), store,
        Placement.uniform(len(blocks), weights=Tier.HOST, compute_dtype="float32"),
        device=torch.device("cpu"),
    )  # fmt: skip
    engine.paged.max_tokens = max_tokens
    acquired: list[int] = []
    acquire = engine.pager.acquire
    engine.pager.acquire = lambda i: acquired.append(i) or acquire(i)  # type: ignore[method-assign,func-returns-value]
    rows_seen: list[tuple[int, int]] = []  # (rows, tokens) of each call inside block 0

    def record(_: Any, args: tuple[Any, ...]) -> None:
        if args and isinstance(args[0], torch.Tensor) and args[0].ndim == 3:
            rows_seen.append(tuple(args[0].shape[:2]))  # type: ignore[arg-type]

    leaves = [m for m in blocks[0].modules() if not list(m.children())]
    handles = [m.register_forward_pre_hook(record) for m in leaves]
    gen = LayerMajorGenerator(model)
    ids, mask = _prompts()
    out = gen.generate(ids, mask, GenerationConfig(max_new_tokens=NEW))
    assert [g.token_ids for g in out] == _reference(reference)
    assert acquired == [0, 1, 2] * gen.steps  # each block paged in once per step
    per_chunk = max(1, max_tokens // 9)
    assert max(r for r, t in rows_seen if t == 9) == per_chunk  # prefill ran chunked
    assert max(r for r, t in rows_seen if t == 1) == min(4, max_tokens)
    for h in handles:
        h.remove()
    eos = _mid_eos([g.token_ids for g in out])
    cut = gen.generate(ids, mask, GenerationConfig(max_new_tokens=NEW, eos_token_ids=(eos,)))
    assert [g.token_ids for g in cut] == _reference(reference, eos)
    engine.close()
    store.close()
