"""Model introspection against counts taken from real, materialised Hugging Face models."""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from transformers import (
    AutoModelForCausalLM,
    GPT2Config,
    GPTNeoXConfig,
    LlamaConfig,
    MistralConfig,
    OPTConfig,
    PhiConfig,
    PretrainedConfig,
    Qwen2Config,
)
from transformers.pytorch_utils import Conv1D

from bb_lightning.hf.structure import find_parts
from bb_lightning.planner.profile import ModelProfile
from bb_lightning.probe import model_profile_from_config, model_profile_from_module


@dataclass(frozen=True)
class Family:
    """A tiny config and where its parts are, written down from the model's source."""

    config: PretrainedConfig
    blocks: str
    embed: tuple[str, ...]
    final: tuple[str, ...]
    kv_heads: int


FAMILIES: dict[str, Family] = {
    "llama": Family(
        LlamaConfig(
            hidden_size=64,
            intermediate_size=176,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            vocab_size=101,
            max_position_embeddings=128,
        ),
        "model.layers",
        ("model.embed_tokens",),
        ("model.norm",),
        2,
    ),
    "mistral": Family(
        MistralConfig(
            hidden_size=96,
            intermediate_size=128,
            num_hidden_layers=3,
            num_attention_heads=4,
            num_key_value_heads=1,
            vocab_size=101,
            head_dim=32,
        ),
        "model.layers",
        ("model.embed_tokens",),
        ("model.norm",),
        1,
    ),
    "qwen2": Family(
        Qwen2Config(
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            vocab_size=101,
            tie_word_embeddings=True,
        ),
        "model.layers",
        ("model.embed_tokens",),
        ("model.norm",),
        2,
    ),
    "opt": Family(
        OPTConfig(
            hidden_size=64,
            ffn_dim=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            vocab_size=101,
            word_embed_proj_dim=32,
            max_position_embeddings=128,
        ),
        "model.decoder.layers",
        ("model.decoder.embed_tokens", "model.decoder.embed_positions", "model.decoder.project_in"),
        ("model.decoder.final_layer_norm", "model.decoder.project_out"),
        4,
    ),
    "gpt_neox": Family(
        GPTNeoXConfig(
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            vocab_size=101,
        ),
        "gpt_neox.layers",
        ("gpt_neox.embed_in",),
        ("gpt_neox.final_layer_norm",),
        4,
    ),
    "gpt2": Family(
        GPT2Config(n_embd=64, n_layer=4, n_head=4, vocab_size=101, n_positions=128),
        "transformer.h",
        ("transformer.wte", "transformer.wpe"),
        ("transformer.ln_f",),
        4,
    ),
    "phi": Family(
        PhiConfig(
            hidden_size=128,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            vocab_size=101,
        ),
        "model.layers",
        ("model.embed_tokens",),
        ("model.final_layernorm",),
        4,
    ),
}


def numel(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def matmul_weights(module: nn.Module) -> int:
    return sum(m.weight.numel() for m in module.modules() if isinstance(m, (nn.Linear, Conv1D)))


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request: pytest.FixtureRequest) -> tuple[Family, nn.Module, ModelProfile]:
    fam = FAMILIES[request.param]
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(fam.config)  # materialised, on the CPU
    return fam, model, model_profile_from_config(fam.config)


def test_counts_match_materialised_model(family: tuple[Family, nn.Module, ModelProfile]) -> None:
    fam, model, profile = family
    blocks = model.get_submodule(fam.blocks)
    head = model.get_output_embeddings()
    tied = head.weight is model.get_input_embeddings().weight
    assert profile.total_params == numel(model)
    assert profile.num_blocks == len(blocks)
    assert profile.block_params == numel(blocks[0])
    assert profile.embed_params == sum(numel(model.get_submodule(n)) for n in fam.embed)
    assert profile.final_params == sum(numel(model.get_submodule(n)) for n in fam.final)
    assert profile.tied_embeddings == tied
    assert profile.head_params == (
        sum(p.numel() for n, p in head.named_parameters() if n != "weight") if tied else numel(head)
    )
    assert profile.block_matmul_params == matmul_weights(blocks[0])
    assert profile.block_flops_per_token(0) == 2 * matmul_weights(blocks[0])
    heads = fam.config.num_attention_heads
    head_dim = getattr(fam.config, "head_dim", None) or fam.config.hidden_size // heads
    assert profile.block_flops_per_token(100) - profile.block_flops_per_token(0) == (
        4 * heads * head_dim * 100
    )
    assert profile.kv_bytes_per_token == 2 * fam.kv_heads * head_dim * 2
    assert profile.head_flops_per_token() == 2 * fam.config.hidden_size * fam.config.vocab_size
    assert 10 * profile.hidden_size <= profile.act_bytes_per_token_full
    assert profile.act_bytes_per_token_full <= 100 * profile.hidden_size


def test_parts_and_from_module(family: tuple[Family, nn.Module, ModelProfile]) -> None:
    fam, model, profile = family
    before = {n: p.data_ptr() for n, p in model.named_parameters()}
    attn = model.config._attn_implementation
    model.eval()
    parts = find_parts(model)
    assert parts.blocks_path == fam.blocks
    assert parts.block_names == tuple(f"{fam.blocks}.{i}" for i in range(profile.num_blocks))
    prefixes = {name.rsplit(".", 1)[0] for name in parts.embed_param_names}
    assert prefixes == set(fam.embed)
    assert {n.rsplit(".", 1)[0] for n in parts.final_param_names} == set(fam.final)
    assert parts.unused_param_names == ()
    # the trace ran on meta stand-ins: the model is untouched
    assert {n: p.data_ptr() for n, p in model.named_parameters()} == before
    assert all(p.device.type == "cpu" for p in model.parameters())
    assert model.config._attn_implementation == attn
    assert not model.training
    assert model_profile_from_module(model) == profile


def saved_bytes_per_block(model: nn.Module, blocks: nn.ModuleList, ids: torch.Tensor) -> list[int]:
    """Reference: a real bf16 CPU forward + loss with SDPA; distinct saved storages per block."""
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
    weights |= {b.untyped_storage().data_ptr() for b in model.buffers()}
    current: list[int | None] = [None]
    seen: list[dict[int, int]] = [{} for _ in blocks]

    def pack(t: torch.Tensor) -> torch.Tensor:
        if current[0] is not None:
            s = t.untyped_storage()
            if s.data_ptr() not in weights:
                seen[current[0]][s.data_ptr()] = s.nbytes()
        return t

    def enter(i: int) -> Any:
        return lambda *_: current.__setitem__(0, i)

    hooks = [b.register_forward_pre_hook(enter(i)) for i, b in enumerate(blocks)]
    hooks += [b.register_forward_hook(lambda *_: current.__setitem__(0, None)) for b in blocks]
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(input_ids=ids, labels=ids).loss
    for h in hooks:
        h.remove()
    assert loss.requires_grad
    return [sum(d.values()) for d in seen]


def test_activation_bytes_match_real_cpu_forward() -> None:
    config = LlamaConfig(
        hidden_size=128,
        intermediate_size=352,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=101,
        attn_implementation="sdpa",
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).to(torch.bfloat16).train()
    tokens = 256
    ids = torch.randint(0, 101, (1, tokens))
    reference = max(saved_bytes_per_block(model, model.model.layers, ids)) / tokens
    profile = model_profile_from_module(model)
    assert profile.act_bytes_per_token_full == pytest.approx(reference, rel=0.01)


def llama_params(h: int, layers: int, ffn: int, vocab: int) -> int:
    block = 4 * h * h + 3 * h * ffn + 2 * h  # q, k, v, o; gate, up, down; two RMSNorms
    return layers * block + 2 * vocab * h + h  # untied embedding and head, final norm


@pytest.mark.parametrize(
    ("h", "layers", "heads", "ffn", "expected"),
    [(6656, 60, 52, 17920, 32.5e9), (1024, 24, 16, 2816, 0.37e9), (2048, 24, 16, 5632, 1.36e9)],
)
def test_llama_shapes(h: int, layers: int, heads: int, ffn: int, expected: float) -> None:
    cfg = LlamaConfig(
        hidden_size=h,
        intermediate_size=ffn,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        vocab_size=32000,
    )
    profile = model_profile_from_config(cfg)
    assert profile.total_params == llama_params(h, layers, ffn, 32000)
    assert profile.total_params == pytest.approx(expected, rel=0.03)
    assert profile.block_matmul_params == 4 * h * h + 3 * h * ffn
    assert profile.head_params == profile.embed_params == 32000 * h


def test_opt_30b_shape() -> None:
    h, layers, ffn, vocab, positions = 7168, 48, 28672, 50272, 2048
    cfg = OPTConfig(
        hidden_size=h,
        ffn_dim=ffn,
        num_hidden_layers=layers,
        num_attention_heads=56,
        vocab_size=vocab,
        word_embed_proj_dim=h,
        max_position_embeddings=positions,
    )
    profile = model_profile_from_config(cfg)
    block = 4 * (h * h + h) + (h * ffn + ffn) + (ffn * h + h) + 2 * 2 * h
    embed = vocab * h + (positions + 2) * h  # OPT's learned positions carry an offset of 2
    assert profile.block_params == block
    assert profile.embed_params == embed
    assert profile.total_params == layers * block + embed + 2 * h  # tied head, final LayerNorm
    assert profile.total_params == pytest.approx(30e9, rel=0.02)
    assert profile.tied_embeddings and profile.head_params == 0


def test_json_round_trip_and_config_sources(tmp_path: Path) -> None:
    cfg = FAMILIES["llama"].config
    profile = model_profile_from_config(cfg)
    assert ModelProfile.from_dict(json.loads(json.dumps(profile.to_dict()))) == profile
    cfg.to_json_file(str(tmp_path / "config.json"))
    from_file = model_profile_from_config(tmp_path / "config.json")
    from_dir = model_profile_from_config(str(tmp_path))
    from_dict = model_profile_from_config(cfg.to_dict())
    for other in (from_file, from_dir, from_dict):
        assert other.to_dict() | {"name": ""} == profile.to_dict() | {"name": ""}
    with pytest.raises(ValueError, match="model_type"):
        model_profile_from_config({"hidden_size": 64})
    with pytest.raises(ValueError, match="unknown ModelProfile field"):
        ModelProfile.from_dict(profile.to_dict() | {"bogus": 1})


def test_a_pad_token_does_not_stop_the_trace() -> None:
    """GPT-2 looks for its pad token in the input ids, which meta tensors cannot read."""
    cfg = copy.deepcopy(FAMILIES["gpt2"].config)
    cfg.pad_token_id = 0
    with_pad = model_profile_from_config(cfg)
    assert cfg.pad_token_id == 0  # given back
    cfg.pad_token_id = None
    assert with_pad == model_profile_from_config(cfg)


class NoBlocks(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 4)
        self.layers = nn.ModuleList([nn.Linear(4, 4), nn.LayerNorm(4)])  # mixed types

    def get_input_embeddings(self) -> nn.Module:
        return self.embed


def test_no_block_list_raises() -> None:
    with pytest.raises(ValueError, match=r"NoBlocks .*nn\.ModuleList"):
        find_parts(NoBlocks())


def test_gradient_checkpointing_refused() -> None:
    model = AutoModelForCausalLM.from_config(FAMILIES["llama"].config)
    enable = getattr(model, "activation_checkpointing_enable", None)
    (enable or model.gradient_checkpointing_enable)()
    with pytest.raises(ValueError, match="checkpointing enabled"):
        model_profile_from_module(model)
