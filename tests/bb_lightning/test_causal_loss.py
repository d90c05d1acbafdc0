"""The causal-LM loss in chunks (``bb_lightning.causal_loss``, ``CausalLMModule``'s
``loss_chunk_tokens``) against Hugging Face's ``model(labels=...)``: the loss and every
parameter's gradient (fp32), one chunk's logits at a time; and a fit under balance_beam
with chunks against plain Lightning with transformers' whole loss."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedModel

from bb_lightning import BalanceBeamStrategy
from bb_lightning.causal_loss import causal_lm_loss
from bb_lightning.module import CausalLMModule
from bb_lightning.placement import Placement
from bb_lightning.planner.cost import loss_chunk_tokens
from storage.tiers import Tier

from .tiny import FAMILIES

pytestmark = pytest.mark.usefixtures("one_thread")

VOCAB, BATCH, SEQ = 96, 2, 9  # 18 positions per pass


def _llama(tied: bool) -> PreTrainedModel:
    config = AutoConfig.for_model(
        "llama", hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, vocab_size=VOCAB,
        max_position_embeddings=64, tie_word_embeddings=tied,
    )  # fmt: skip
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config).float()


def _batch() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Ids, a left-padded attention mask, and labels with ignored positions: a whole row
    ignored but its last token, and two positions inside the other row."""
    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)
    mask = torch.ones_like(ids)
    mask[0, :2] = 0
    labels = ids.clone()
    labels[0, :-1] = -100
    labels[1, 3:5] = -100
    return ids, mask, labels


def _grads(net: torch.nn.Module, loss: torch.Tensor) -> dict[str, torch.Tensor]:
    named = [(n, p) for n, p in net.named_parameters() if p.requires_grad]
    got = torch.autograd.grad(loss, [p for _, p in named])
    return {n: g for (n, _), g in zip(named, got, strict=True)}


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("chunk", [1, 5, 18], ids=["one-token", "uneven", "whole"])
def test_chunked_loss_and_gradients_equal_transformers(tied: bool, chunk: int) -> None:
    net = _llama(tied)
    ids, mask, labels = _batch()
    want = net(input_ids=ids, attention_mask=mask, labels=labels).loss
    want_grads = _grads(net, want)
    seen: list[int] = []  # positions projected onto the vocabulary by each head call
    hook = net.get_output_embeddings().register_forward_hook(
        lambda _m, _a, out: seen.append(out.numel() // VOCAB)
    )
    got = causal_lm_loss(net, ids, mask, labels, chunk)
    got_grads = _grads(net, got)
    hook.remove()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=0.0)
    assert got_grads.keys() == want_grads.keys()
    for name, grad in want_grads.items():
        torch.testing.assert_close(got_grads[name], grad, rtol=1e-5, atol=1e-7, msg=name)
    # forward, then backward's recompute of every chunk but the last (whose backward runs
    # first, on what its forward kept): never more than one chunk's logits at a time
    positions = BATCH * SEQ
    last = positions - (positions - 1) // chunk * chunk
    assert max(seen) == chunk and sum(seen) == 2 * positions - last, seen


@pytest.mark.parametrize(
    "family", ["gemma2_sliding", "mixtral_aux_loss", "gpt2_tied", "mamba_state", "phi3"]
)
def test_chunked_loss_equals_transformers_across_families(family: str) -> None:
    # Gemma 2 soft-caps its logits, the MoE adds its routers' load-balancing loss, GPT-2's
    # head is a tied Conv1D model, Mamba has no attention: each as its own forward does.
    values = dict(FAMILIES[family])
    config = AutoConfig.for_model(values.pop("model_type"), **values)
    torch.manual_seed(0)
    net = AutoModelForCausalLM.from_config(config).float()
    ids = torch.randint(
        0, config.vocab_size, (BATCH, SEQ), generator=torch.Generator().manual_seed(4)
    )
    labels = ids.clone()
    labels[1, 2:6] = -100
    want = net(input_ids=ids, labels=labels).loss
    want_grads = _grads(net, want)
    got = causal_lm_loss(net, ids, None, labels, 4)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=0.0)
    for name, grad in _grads(net, got).items():
        torch.testing.assert_close(grad, want_grads[name], rtol=1e-5, atol=1e-6, msg=name)


def test_module_chunks_by_default_and_its_loss_is_transformers() -> None:
    config = _llama(False).config.to_dict()
    ids, mask, labels = _batch()
    batch = {"input_ids": ids, "attention_mask": mask, "labels": labels}
    whole = CausalLMModule(config, loss_chunk_tokens=0)
    assert whole.loss_chunk_tokens is None
    assert CausalLMModule(config).loss_chunk_tokens == 1_073_741_824 // (VOCAB * 12)
    assert loss_chunk_tokens(128_256) == 697  # 12 bytes per token per entry within 1 GiB
    chunked = CausalLMModule(config, loss_chunk_tokens=4)
    assert chunked.loss_chunk_tokens == 4
    for module in (whole, chunked):
        module.configure_model()
    assert chunked.model is not None and whole.model is not None
    chunked.model.load_state_dict(whole.model.state_dict())
    torch.testing.assert_close(chunked(batch), whole(batch), rtol=1e-5, atol=0.0)


@pytest.mark.parametrize("value", [-1, 2.5, True])
def test_a_bad_loss_chunk_is_refused_naming_it(value: Any) -> None:
    with pytest.raises(ValueError, match=r"^loss_chunk_tokens=.*must be an integer >= 0"):
        CausalLMModule("tiny-llama", loss_chunk_tokens=value)


def test_fit_with_loss_chunks_equals_plain_lightning_with_the_whole_loss(
    tiny: SimpleNamespace, tmp_path: Path
) -> None:
    # balance_beam with the head and loss in uneven chunks (64 positions in chunks of 7),
    # tied embeddings, accumulation and norm clipping, against plain Lightning with
    # transformers' loss over the whole pass
    config = {**tiny.tiny_llama(), "tie_word_embeddings": True}
    steps, kwargs = 2, {"accumulate_grad_batches": 2, "gradient_clip_val": 0.5}

    def run(strategy: Any, chunk: int) -> tuple[list[float], dict[str, torch.Tensor]]:
        module = CausalLMModule(
            config, learning_rate=1e-3, weight_decay=0.01, seed=0, loss_chunk_tokens=chunk
        )
        trainer, recorder = tiny.make_trainer(strategy, steps, **kwargs)
        trainer.fit(module, tiny.loader(steps * 2))
        if isinstance(strategy, BalanceBeamStrategy):
            state = dict(strategy.lightning_module_state_dict())
            strategy.close()
        else:
            state = {k: v.detach().clone() for k, v in module.state_dict().items()}
        return recorder.losses, state

    D, H, N = Tier.DEVICE, Tier.HOST, Tier.NVME
    placement = Placement(weights=(D, H, N, H), master=(H, H, N, H), prefetch_depth=1)
    strategy = BalanceBeamStrategy(
        placement=placement, compute_dtype="fp32", nvme_path=str(tmp_path / "nvme")
    )
    got_losses, got_state = run(strategy, 7)
    want_losses, want_state = run("auto", 0)
    torch.testing.assert_close(
        torch.tensor(got_losses), torch.tensor(want_losses), rtol=1e-5, atol=0.0
    )
    assert got_state.keys() == want_state.keys()
    for key, value in want_state.items():
        # the clip coefficient agrees to rounding only (norms summed in another order)
        torch.testing.assert_close(got_state[key], value, rtol=1e-5, atol=2e-5, msg=key)
