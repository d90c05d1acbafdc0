"""Model families as users bring them: a ``save_pretrained`` directory loaded by path.

For each family: ``trainer.fit`` under balance_beam (weights and optimizer state on
NVMe, gradient accumulation and norm clipping) against plain Lightning on the same
directory (``from_pretrained``), losses and final weights; ``trainer.predict``
(weights on NVMe, ragged left-padded prompts) against Hugging Face greedy ``generate``.
Tied heads, sliding windows, MoE blocks (per-expert tensors on disk, fused in the
module), an MoE whose routers' load-balancing loss joins the loss, recurrent layers that
keep a state in the cache (Mamba's, gated delta nets beside attention), blocks that take a
trainable per-layer input besides the hidden states, dropout and a router that samples
experts in training mode (both runs seeded alike) are among them.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader
from transformers import AutoConfig, AutoModelForCausalLM

from bb_lightning import BalanceBeamStrategy
from bb_lightning.hf.structure import find_block_list
from bb_lightning.module import CausalLMModule
from bb_lightning.placement import Placement
from bb_lightning.probe import model_profile_from_module
from storage.tiers import Tier

from .tiny import FAMILIES, VOCAB, saved

STEPS, ACCUM, NEW = 2, 2, 5
N = Tier.NVME


pytestmark = pytest.mark.usefixtures("one_thread")


def _module(path: Path) -> CausalLMModule:
    return CausalLMModule(str(path), learning_rate=1e-3, weight_decay=0.01, max_new_tokens=NEW)


def _fit(tiny: SimpleNamespace, strategy: Any, path: Path) -> tuple[list[float], dict[str, Any]]:
    torch.manual_seed(0)  # the same dropout masks and sampled experts in both runs
    module = _module(path)
    trainer, recorder = tiny.make_trainer(
        strategy, STEPS, accumulate_grad_batches=ACCUM, gradient_clip_val=0.5
    )
    data = [{"input_ids": b["input_ids"] % VOCAB} for b in tiny.batches(STEPS * ACCUM)]
    trainer.fit(module, DataLoader(data, batch_size=None))  # type: ignore[arg-type]
    if strategy == "auto":
        return recorder.losses, {k: v.detach().clone() for k, v in module.state_dict().items()}
    return recorder.losses, dict(strategy.lightning_module_state_dict())


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_family_fits_like_plain_lightning(
    family: str, tiny: SimpleNamespace, tmp_path: Path
) -> None:
    _fits_like_plain_lightning(tiny, saved(family, tmp_path / "ckpt"), tmp_path)


JAMBA: dict[str, Any] = {  # mamba and attention layers, every other one MoE
    **{k: v for k, v in FAMILIES["llama"].items() if k != "model_type"},
    "num_experts": 2,
    "num_experts_per_tok": 1,
    "expert_layer_period": 2,
    "expert_layer_offset": 1,
    "attn_layer_period": 2,
    "attn_layer_offset": 1,
    "mamba_d_state": 8,
    "mamba_dt_rank": 4,
    "use_mamba_kernels": False,
    "attention_dropout": 0.0,
}


def test_a_hybrid_family_with_layers_of_two_types_fits_like_plain_lightning(
    tiny: SimpleNamespace, tmp_path: Path
) -> None:
    """Jamba keeps mamba and attention layers, two classes, in one layer list: those are
    its blocks, paged like any others."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model("jamba", **JAMBA))
    assert len({type(layer) for layer in model.model.layers}) == 2
    model.save_pretrained(tmp_path / "ckpt")
    _fits_like_plain_lightning(tiny, tmp_path / "ckpt", tmp_path)


def test_a_model_whose_blocks_share_weights_is_refused_at_setup(
    tiny: SimpleNamespace, tmp_path: Path
) -> None:
    """Zamba's hybrid layers all run one shared attention block: a block cannot be paged
    with weights of its own, so fit is refused in one line naming the shared parameter."""
    values = {
        **{k: v for k, v in JAMBA.items() if not k.startswith(("expert", "num_experts"))},
        "num_hidden_layers": 3,
        "num_key_value_heads": 4,
        "attention_hidden_size": 64,
        "n_mamba_heads": 2,
        "layer_types": ["hybrid", "mamba", "hybrid"],
    }
    values.pop("use_mamba_kernels")
    AutoModelForCausalLM.from_config(AutoConfig.for_model("zamba", **values)).save_pretrained(
        tmp_path / "ckpt"
    )
    strategy = BalanceBeamStrategy(
        placement=Placement.uniform(3, weights=N), nvme_path=str(tmp_path / "nvme")
    )
    trainer, _ = tiny.make_trainer(strategy, 1)
    data = [{"input_ids": b["input_ids"] % VOCAB} for b in tiny.batches(1)]
    with pytest.raises(ValueError, match=r"blocks 0 and 2 of .* share the parameter") as err:
        trainer.fit(_module(tmp_path / "ckpt"), DataLoader(data, batch_size=None))  # type: ignore[arg-type]
    assert "\n" not in str(err.value) and "plain Lightning" in str(err.value)
    assert strategy.store is None  # refused before anything was paged
    strategy.close()


ZAYA: dict[str, Any] = {  # each MoE block hands its router's state to the next one
    **{k: v for k, v in FAMILIES["llama"].items() if k != "model_type"},
    "head_dim": 8,
    "num_experts": 4,
    "num_experts_per_tok": 1,
    "moe_intermediate_size": 32,
    "router_hidden_size": 16,
    "layer_types": ["hybrid", "hybrid"],
    "sliding_window": 8,
}


def test_a_block_handing_a_second_output_to_the_next_fits_like_plain_lightning(
    tiny: SimpleNamespace, tmp_path: Path
) -> None:
    """Zaya's blocks return their router's state beside the hidden states and the next
    block's router reads it: the gradient of that second output reaches the block that
    made it, as in plain Lightning."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model("zaya", **ZAYA))
    out = model.model.layers[0](
        torch.randn(1, 4, 32),
        position_embeddings=model.model.rotary_emb(torch.zeros(1), torch.arange(4)[None], "hybrid"),
    )
    assert isinstance(out, tuple) and out[1] is not None  # the state the next block reads
    model.save_pretrained(tmp_path / "ckpt")
    _fits_like_plain_lightning(tiny, tmp_path / "ckpt", tmp_path)


def _fits_like_plain_lightning(tiny: SimpleNamespace, path: Path, tmp_path: Path) -> None:
    want_losses, want = _fit(tiny, "auto", path)
    strategy = BalanceBeamStrategy(
        placement=Placement.uniform(2, weights=N, master=N, prefetch_depth=1),
        compute_dtype="fp32",
        nvme_path=str(tmp_path / "nvme"),
    )
    losses, got = _fit(tiny, strategy, path)
    engine, store = strategy.engine, strategy.store
    assert engine is not None and store is not None
    assert store.usage()[N][0] > 0  # weights and optimizer state homed on NVMe
    for block, params in zip(engine.paged.blocks, engine.pager.params, strict=True):
        # every parameter of a block (router and all experts of an MoE block) pages with it
        assert {id(p) for p in block.parameters()} == {id(p) for p in params}
    strategy.close()
    assert len(losses) == STEPS * ACCUM
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(want_losses))
    assert got.keys() == want.keys()
    for key, value in want.items():
        # elements whose gradient is far below AdamW's eps move by rounding noise
        torch.testing.assert_close(got[key], value, rtol=1e-5, atol=2e-5, msg=key)


def _prompts(seed: int = 5, lengths: tuple[int, ...] = (7, 3, 5)) -> dict[str, Any]:
    """Left-padded prompts of ``lengths`` tokens (three of 7, 3 and 5 by default)."""
    g = torch.Generator().manual_seed(seed)
    width = max(lengths)
    ids = torch.randint(3, VOCAB, (len(lengths), width), generator=g)
    mask = torch.ones_like(ids)
    for row, n in enumerate(lengths):
        ids[row, : width - n], mask[row, : width - n] = 0, 0
    return {"id": [f"{seed}-{row}" for row in range(len(lengths))], "input_ids": ids,
            "attention_mask": mask}  # fmt: skip


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_the_planner_profiles_the_family_from_its_checkpoint(family: str, tmp_path: Path) -> None:
    """The default path plans: the model's profile (a trace of one forward on meta stand-ins)
    counts every parameter of the model transformers loads, in its two blocks (priced as
    the largest block each where the blocks differ, a dense first block beside MoE ones)."""
    path = saved(family, tmp_path / "ckpt")
    model = AutoModelForCausalLM.from_pretrained(path)
    profile = model_profile_from_module(model)
    assert profile.num_blocks == 2
    total = sum(p.numel() for p in model.parameters())
    _, blocks = find_block_list(model)
    sizes = {sum(p.numel() for p in b.parameters()) for b in blocks}
    if len(sizes) == 1:
        assert profile.total_params == total
    else:
        assert profile.total_params >= total


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_family_generates_like_hf_generate(
    family: str, tiny: SimpleNamespace, tmp_path: Path
) -> None:
    path = saved(family, tmp_path / "ckpt")
    module = _module(path)
    strategy = BalanceBeamStrategy(
        placement=Placement.uniform(2, weights=N),
        compute_dtype="fp32",
        nvme_path=str(tmp_path / "nvme"),
    )
    trainer, _ = tiny.make_trainer(strategy, 1)
    # the second batch reuses the first one's cache; its sequences pass a window of 8
    batches = [_prompts(), _prompts(6, (4, 7, 6))]
    records = trainer.predict(module, DataLoader(batches, batch_size=None))
    assert strategy.store is not None and strategy.store.usage()[N][0] > 0
    strategy.close()
    assert records is not None and len(records) == len(batches)
    reference = AutoModelForCausalLM.from_pretrained(path).eval()
    stop = set(module.generation_config().eos_token_ids)
    pad = module.generation_config().pad_token_id
    for batch, got in zip(batches, records, strict=True):
        for row, record in enumerate(got):  # type: ignore[arg-type]
            ids = batch["input_ids"][row][batch["attention_mask"][row].bool()][None]
            with torch.no_grad():
                out = reference.generate(
                    input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW,
                    do_sample=False, pad_token_id=pad, eos_token_id=sorted(stop) or None,
                )[0, ids.shape[1] :].tolist()  # fmt: skip
            cut = next((i for i, t in enumerate(out) if t in stop), len(out))
            assert record["token_ids"] == out[:cut], (family, record["id"])


NO_STATIC_CACHE: dict[str, tuple[dict[str, Any], str]] = {
    "openai-gpt": (
        {"n_embd": 32, "n_layer": 2, "n_head": 4, "vocab_size": VOCAB, "n_positions": 64},
        "takes no KV cache",
    ),
    "minimax": (
        {
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_hidden_layers": 2,
            "head_dim": 8,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "vocab_size": VOCAB,
            "num_local_experts": 4,
            "num_experts_per_tok": 2,
        },
        "keeps a cache of its own",
    ),
}


@pytest.mark.parametrize("model_type", sorted(NO_STATIC_CACHE))
def test_generation_without_a_static_kv_cache_is_refused_at_setup(
    model_type: str, tiny: SimpleNamespace, tmp_path: Path
) -> None:
    """A family whose forward cannot take transformers' StaticCache is refused before any
    weight is read, in one line naming the model class, what it lacks and what to do."""
    values, why = NO_STATIC_CACHE[model_type]
    config = AutoConfig.for_model(model_type, **values)
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "ckpt")
    module = _module(tmp_path / "ckpt")
    strategy = BalanceBeamStrategy(placement=Placement.uniform(2, weights=Tier.HOST))
    trainer, _ = tiny.make_trainer(strategy, 1)
    named = rf"model_type='{model_type}' \(\w+(ForCausalLM|LMHeadModel)\) cannot generate"
    with pytest.raises(ValueError, match=named) as err:
        trainer.predict(module, DataLoader([_prompts()], batch_size=None))
    message = str(err.value)
    assert "\n" not in message and why in message and "generate with transformers" in message
    assert strategy.store is None  # refused at setup: nothing paged
    strategy.close()


@pytest.mark.parametrize(
    ("model_type", "values"),
    [
        ("xlm", {"emb_dim": 32, "n_layers": 2, "n_heads": 4, "vocab_size": VOCAB}),
        ("cpmant", {"hidden_size": 32, "dim_ff": 64, "num_hidden_layers": 2,
                    "num_attention_heads": 4, "dim_head": 8, "vocab_size": VOCAB}),
    ],
)  # fmt: skip
def test_a_family_whose_forward_breaks_on_the_static_cache_fails_in_one_line(
    model_type: str, values: dict[str, Any], tiny: SimpleNamespace, tmp_path: Path
) -> None:
    """A family whose own forward assumes another cache layout (the mask or key length
    equal to the tokens so far) stops at its first forward with one line naming the
    family, what failed and what to do, the model's error chained."""
    config = AutoConfig.for_model(model_type, **values)
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "ckpt")
    strategy = BalanceBeamStrategy(placement=Placement.uniform(2, weights=Tier.HOST))
    trainer, _ = tiny.make_trainer(strategy, 1)
    named = rf"model_type='{model_type}' \(\w+\) failed inside its own forward"
    with pytest.raises(ValueError, match=named) as err:
        trainer.predict(_module(tmp_path / "ckpt"), DataLoader([_prompts()], batch_size=None))
    assert "\n" not in str(err.value) and "generate with transformers" in str(err.value)
    assert err.value.__cause__ is not None
    strategy.close()


def test_a_local_attention_family_refuses_prompts_longer_than_its_window(
    tiny: SimpleNamespace, tmp_path: Path
) -> None:
    """GPT-Neo cuts its local window out of a mask by the cache's length, right only while
    the static cache is no longer than the window: a prompt that would need more positions
    (with its new tokens) comes back with one error line naming the limit and what to do;
    the others run, as Hugging Face ``generate`` runs them."""
    values = {**FAMILIES["gpt_neo_local"], "window_size": 8}
    config = AutoConfig.for_model(values.pop("model_type"), **values)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "ckpt")
    module = _module(tmp_path / "ckpt")
    strategy = BalanceBeamStrategy(
        placement=Placement.uniform(2, weights=N), nvme_path=str(tmp_path / "nvme")
    )
    trainer, _ = tiny.make_trainer(strategy, 1)
    batch = _prompts()  # 7, 3 and 5 tokens; + NEW (5) new ones: 12, 8 and 10 > 8 positions
    records = trainer.predict(module, DataLoader([batch], batch_size=None))
    strategy.close()
    assert records is not None
    got = records[0]  # type: ignore[index]
    for row in (0, 2):
        error = got[row]["error"]
        assert "window_size=8" in error and "8 positions" in error and "\n" not in error
        assert "shorten the prompt to 3 tokens" in error
    reference = AutoModelForCausalLM.from_pretrained(tmp_path / "ckpt").eval()
    ids = batch["input_ids"][1][batch["attention_mask"][1].bool()][None]
    with torch.no_grad():
        out = reference.generate(
            input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW,
            do_sample=False, pad_token_id=0,
        )[0, ids.shape[1] :].tolist()  # fmt: skip
    stop = set(module.generation_config().eos_token_ids)
    cut = next((i for i, t in enumerate(out) if t in stop), len(out))
    assert got[1]["token_ids"] == out[:cut]


LOOPED = {  # a model whose forward runs its middle blocks twice (recurrent depth)
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 3,
    "n_input_layers": 1,
    "n_output_layers": 1,
    "n_recurrent_loops": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 8,
    "vocab_size": VOCAB,
    "sliding_window": 16,
}


@pytest.mark.parametrize("call", ["fit", "predict"])
def test_a_model_running_a_block_twice_per_forward_is_refused_at_setup(
    call: str, tiny: SimpleNamespace, tmp_path: Path
) -> None:
    """A family whose forward loops over some of its blocks cannot be paged one block per
    pass: refused before anything is paged, naming the class and the blocks run twice
    (found by running its forward, not by its name)."""
    config = AutoConfig.for_model("dory", **LOOPED)
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "ckpt")
    module = _module(tmp_path / "ckpt")
    strategy = BalanceBeamStrategy(placement=Placement.uniform(3, weights=Tier.HOST))
    trainer, _ = tiny.make_trainer(strategy, 1)
    with pytest.raises(ValueError, match=r"\w+ForCausalLM runs blocks \[1\] more than once") as err:
        if call == "fit":
            trainer.fit(module, tiny.loader(1))
        else:
            trainer.predict(module, DataLoader([_prompts()], batch_size=None))
    assert "\n" not in str(err.value) and "without balance_beam" in str(err.value)
    assert strategy.store is None  # refused at setup: nothing paged
    strategy.close()


def test_a_quantized_checkpoint_is_refused_at_setup(tiny: SimpleNamespace, tmp_path: Path) -> None:
    path = saved("llama", tmp_path / "ckpt")
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "bitsandbytes", "load_in_8bit": True}
    (path / "config.json").write_text(json.dumps(config))
    strategy = BalanceBeamStrategy(placement=Placement.uniform(2, weights=Tier.HOST))
    trainer, _ = tiny.make_trainer(strategy, 1)
    with pytest.raises(
        ValueError, match=r"model_type='llama' is quantized \(bitsandbytes\)"
    ) as err:
        trainer.fit(_module(path), tiny.loader(1))
    assert "\n" not in str(err.value)
    strategy.close()
