"""Sampling against an independent sampler: Hugging Face's own logits warpers over the
Hugging Face model's logits, then a seeded draw.

The generator's documented contract (``bb_lightning.engine.generate``): each row draws,
per step, one uniform ``torch.rand(1)`` from ``torch.Generator().manual_seed(seed)``
and takes the token at that point of the inverse CDF of the filtered distribution, its
tokens in order of falling probability. The reference below follows that contract with
transformers' ``TemperatureLogitsWarper``, ``TopKLogitsWarper`` and ``TopPLogitsWarper``
over logits of the model's plain forward (no cache, no paging, none of our code), so
the tokens are compared exactly. A second test checks the distribution itself, without
the contract: the first new token of many seeds against the warped probabilities, with
a total-variation bound that a ``torch.multinomial`` sample of the same size meets and
that a temperature 25 % off, or a top-k or top-p keeping one token more or less, fails.
"""

from __future__ import annotations

import json
import zlib
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM
from transformers.generation.logits_process import (
    LogitsProcessorList,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from bb_lightning.data import PromptsDataModule
from bb_lightning.data.tokenizer import ByteTokenizer
from bb_lightning.data.writer import JsonlPredictionWriter
from bb_lightning.engine.generate import GenerationConfig, LayerMajorGenerator
from bb_lightning.module import CausalLMModule
from bb_lightning.placement import Placement
from bb_lightning.strategy.core import BalanceBeamStrategy
from storage.tiers import Tier

from ..tiny import tiny_llama_config

VOCAB = 256
PROMPT = 8
NEW = 6
DRAWS = 8000
TV_BOUND = 0.03
"""Total variation allowed between DRAWS first tokens and the warped distribution. A
``torch.multinomial`` sample of DRAWS gives 0.017 to 0.019 over the whole vocabulary
(seeds 0 to 2), 0.005 to 0.008 over the 4 or 5 tokens top-k or top-p keep; the wrong
samplers the test names are 0.059 (top-k + 1) to 0.37 away."""

pytestmark = pytest.mark.usefixtures("one_thread")


def _model() -> torch.nn.Module:
    """A 2-block Llama whose weights are large enough (initializer range 0.3) that its
    next-token distributions are peaked: a few tokens hold most of the mass, so top-k,
    top-p and temperature each change which tokens come out."""
    config = AutoConfig.for_model(
        "llama", vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=64, initializer_range=0.3,
    )  # fmt: skip
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config).eval()


def _warpers(temperature: float, top_k: int, top_p: float) -> LogitsProcessorList:
    """Hugging Face's warpers in ``generate``'s order (temperature, top-k, top-p)."""
    warpers = LogitsProcessorList([TemperatureLogitsWarper(temperature)])
    if top_k > 0:
        warpers.append(TopKLogitsWarper(top_k))
    if top_p < 1.0:
        warpers.append(TopPLogitsWarper(top_p))
    return warpers


def _probs(model: torch.nn.Module, ids: torch.Tensor, warpers: LogitsProcessorList) -> Any:
    """Next-token probabilities after the warpers, from the plain forward over ``ids``."""
    with torch.no_grad():
        logits = model(input_ids=ids[None]).logits[:, -1].float()
    return warpers(ids[None], logits).softmax(-1)[0]


def _reference_tokens(
    model: torch.nn.Module,
    prompt: torch.Tensor,
    seed: int,
    warpers: LogitsProcessorList,
    new: int = NEW,
    eos: int | None = None,
) -> list[int]:
    """``new`` tokens by the contract (fewer, cut before ``eos``): one seeded uniform per
    step, inverse CDF over the warped probabilities in order of falling probability."""
    g = torch.Generator().manual_seed(seed)
    ids, out = prompt.clone(), []
    for _ in range(new):
        probs = _probs(model, ids, warpers)
        order = torch.argsort(probs, descending=True, stable=True)
        cdf = probs[order].cumsum(0)
        u = float(torch.rand(1, generator=g)) * float(cdf[-1])
        token = int(order[min(int((cdf < u).sum()), len(probs) - 1)])
        if token == eos:
            break
        out.append(token)
        ids = torch.cat([ids, torch.tensor([token])])
    return out


@pytest.mark.parametrize(
    ("temperature", "top_k", "top_p"),
    [(1.3, 0, 1.0), (0.7, 5, 1.0), (1.0, 0, 0.8), (1.2, 8, 0.9)],
)
def test_sampled_tokens_equal_hf_warpers_and_the_seeded_draw(
    temperature: float, top_k: int, top_p: float
) -> None:
    model = _model()
    prompts = torch.randint(3, VOCAB, (16, PROMPT), generator=torch.Generator().manual_seed(1))
    seeds = [1000 + 7 * i for i in range(len(prompts))]
    cfg = GenerationConfig(max_new_tokens=NEW, temperature=temperature, top_k=top_k, top_p=top_p)
    out = LayerMajorGenerator(model).generate(prompts, torch.ones_like(prompts), cfg, seeds=seeds)
    warpers = _warpers(temperature, top_k, top_p)
    want = [_reference_tokens(model, p, s, warpers) for p, s in zip(prompts, seeds, strict=True)]
    assert [g.token_ids for g in out] == want


def _tv(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Total variation between the empirical distribution of ``counts`` and ``probs``."""
    return 0.5 * float((counts / counts.sum() - probs).abs().sum())


@pytest.mark.parametrize(
    ("temperature", "top_k", "top_p"), [(0.7, 0, 1.0), (1.0, 4, 1.0), (1.0, 0, 0.6)]
)
def test_first_token_distribution_equals_hf_warped_probabilities(
    temperature: float, top_k: int, top_p: float
) -> None:
    model = _model()
    prompt = torch.randint(3, VOCAB, (PROMPT,), generator=torch.Generator().manual_seed(1))
    want = _probs(model, prompt, _warpers(temperature, top_k, top_p))
    # the bound separates this distribution from a plausibly wrong sampler's
    kept = int((want > 0).sum())
    wrong = []
    if not top_k:  # (among 4 tokens a temperature 25 % off moves less mass than a top-k +-1)
        wrong += [_warpers(temperature * 1.25, 0, top_p), _warpers(temperature / 1.25, 0, top_p)]
    else:
        wrong += [_warpers(temperature, top_k - 1, top_p), _warpers(temperature, top_k + 1, top_p)]
    if top_p < 1.0:  # the top-p that keeps one token less, and one more
        mass = want.sort(descending=True).values.cumsum(0)
        less, more = float(mass[kept - 2]) - 1e-4, float(mass[kept])
        wrong += [_warpers(temperature, top_k, less), _warpers(temperature, top_k, more)]
    for w in wrong:
        assert _tv(_probs(model, prompt, w), want) > 1.5 * TV_BOUND
    # a correct sampler of DRAWS draws meets the bound
    g = torch.Generator().manual_seed(0)
    sample = torch.multinomial(want, DRAWS, replacement=True, generator=g)
    assert _tv(torch.bincount(sample, minlength=VOCAB).float(), want) < TV_BOUND

    cfg = GenerationConfig(max_new_tokens=1, temperature=temperature, top_k=top_k, top_p=top_p)
    rows = prompt.expand(DRAWS, PROMPT)
    out = LayerMajorGenerator(model).generate(
        rows, torch.ones_like(rows), cfg, seeds=list(range(DRAWS))
    )
    firsts = torch.tensor([g.token_ids[0] for g in out])
    counts = torch.bincount(firsts, minlength=VOCAB).float()
    assert counts[want == 0].sum() == 0  # nothing outside the kept tokens
    assert _tv(counts, want) < TV_BOUND


def test_predict_samples_each_prompt_with_the_seed_of_its_id(tmp_path: Path) -> None:
    """The user's path: prompts from a JSONL file, ``trainer.predict`` under balance_beam
    with paged blocks; each prompt draws from ``crc32(f"{seed}\\0{id}")`` (the module's
    documented seed of a prompt), whatever its batch and neighbours."""
    config = tiny_llama_config(
        2, vocab_size=260, initializer_range=0.3, bos_token_id=257, eos_token_id=258,
        pad_token_id=256,
    )  # fmt: skip
    texts = {"q": "def ", "r2": "The quick brown", "s": "import os", "t-4": "a", "u": "xyzzy"}
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps({"id": k, "prompt": v}) + "\n" for k, v in texts.items()))
    kw: dict[str, Any] = {"temperature": 1.2, "top_k": 20, "top_p": 0.9}
    module = CausalLMModule(config, seed=4, max_new_tokens=5, tokenizer="byte", **kw)
    strategy = BalanceBeamStrategy(
        placement=Placement.uniform(2, weights=Tier.HOST, master=Tier.HOST),
        compute_dtype="fp32",
    )
    trainer = pl.Trainer(
        accelerator="cpu", devices=1, strategy=strategy, logger=False,
        enable_progress_bar=False, enable_model_summary=False,
        callbacks=[JsonlPredictionWriter(tmp_path / "out.jsonl")],
    )  # fmt: skip
    dm = PromptsDataModule(str(path), batch_size=2, max_prompt_len=32)
    trainer.predict(module, datamodule=dm, return_predictions=False)
    strategy.close()
    got = {
        r["id"]: r["token_ids"]
        for r in map(json.loads, (tmp_path / "out.jsonl").read_text().splitlines())
    }
    reference = CausalLMModule(config, seed=4)
    reference.configure_model()
    assert reference.model is not None
    model, warpers, tok = reference.model.eval(), _warpers(**kw), ByteTokenizer()
    want = {
        key: _reference_tokens(
            model, torch.tensor(tok.encode(text)), zlib.crc32(f"4\0{key}".encode()), warpers,
            new=5, eos=258,
        )
        for key, text in texts.items()
    }  # fmt: skip
    assert got == want
