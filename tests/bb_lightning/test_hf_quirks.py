"""Each entry of :mod:`bb_lightning.engine.hf_quirks` against the installed transformers.

Config spellings are read from transformers' own config classes (the families of
``tiny.py`` built by ``AutoConfig``, and ``PretrainedConfig`` holding each spelling
alone, as a config of a family transformers does not know loads); forward options and
cache keywords from the models' real signatures and forwards; model specs and weight
indexes from directories written by ``save_pretrained`` and read back by
``from_pretrained``; safetensors dtype names from files written by ``safetensors``.
"""

from __future__ import annotations

import inspect
import json
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig, StaticCache

from bb_lightning.engine.hf_quirks import (
    CACHE_KWARGS,
    CONFIG_ALIASES,
    SAFETENSORS_DTYPES,
    SAFETENSORS_INDEX,
    WEIGHT_FILES,
    activation_checkpointing,
    check_generation,
    check_supported,
    config_int,
    config_value,
    forward_options,
    model_context,
    no_pad_token,
    read_weight_index,
    resolve_model,
)
from bb_lightning.hf.structure import find_block_list

from .tiny import FAMILIES, VOCAB

LLAMA: dict[str, Any] = FAMILIES["llama"]


def _config(values: dict[str, Any]) -> PretrainedConfig:
    values = dict(values)
    return AutoConfig.for_model(values.pop("model_type"), **values)


def _meta_model(values: dict[str, Any]) -> nn.Module:
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(_config(values))


@pytest.mark.parametrize("field", sorted(CONFIG_ALIASES))
def test_each_spelling_is_read_and_the_first_one_set_wins(field: str) -> None:
    spellings = CONFIG_ALIASES[field]
    for i, name in enumerate(spellings):
        later = {n: 1000 + j for j, n in enumerate(spellings[i + 1 :])}
        config = PretrainedConfig(**{name: 7 + i}, **later)
        assert config_value(config, field) == 7 + i, name
        # unset, zero, negative and boolean values give way to the next spelling
        for unset in (None, 0, -1, True):
            config = PretrainedConfig(**{name: unset}, **later)
            assert config_value(config, field) == (1000 if later else None), (name, unset)
    assert config_value(PretrainedConfig(**{spellings[0]: 1200.0}), field) == 1200
    assert config_value(PretrainedConfig(), field) is None
    assert config_int(PretrainedConfig(), field, default=3) == 3
    with pytest.raises(ValueError, match=spellings[0]):
        config_int(PretrainedConfig(), field)


def test_an_unknown_field_is_refused() -> None:
    with pytest.raises(ValueError, match="'width' is not one of"):
        config_value(PretrainedConfig(), "width")


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_family_configs_read_as_the_built_model_is(family: str) -> None:
    values = FAMILIES[family]
    config = _config(values)
    model = _meta_model(values)
    width = model.get_input_embeddings().weight.shape[1]  # type: ignore[operator]
    assert config_int(config, "hidden_size") == width
    context = next(
        (
            values[k]
            for k in ("max_position_embeddings", "n_positions", "max_seq_len")
            if k in values
        ),
        None,
    )
    assert model_context(config) == context
    spellings = ("num_attention_heads", "n_head", "n_heads", "num_heads")
    heads = next((values[k] for k in spellings if k in values), 0)  # 0: no attention
    assert config_int(config, "num_heads", default=0) == heads
    assert config_int(config, "num_kv_heads", default=heads) == values.get(
        "num_key_value_heads", heads
    )
    experts = next(
        (
            values[k]
            for k in ("num_local_experts", "num_experts", "n_routed_experts")
            if k in values
        ),
        None,
    )
    assert config_value(config, "num_experts") == experts
    assert config_value(config, "experts_per_token") == values.get("num_experts_per_tok")


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_every_cache_keyword_of_a_family_block_is_known(family: str) -> None:
    model = _meta_model(FAMILIES[family])
    _, blocks = find_block_list(model)
    params = inspect.signature(blocks[0].forward).parameters
    cache = {p for p in params if "cache" in p or "past" in p} - {"use_cache", "cache_position"}
    assert cache and cache <= set(CACHE_KWARGS), cache


def test_forward_options_drive_a_cached_decode_step_like_the_full_forward() -> None:
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(_config(LLAMA)).eval()
    cache_kw, logits_kw = forward_options(model)
    ids = torch.randint(0, VOCAB, (2, 6))
    with torch.no_grad():
        full = model(input_ids=ids).logits
        cache = StaticCache(config=model.config, max_cache_len=8)
        extra = {"logits_to_keep": 1} if logits_kw else {}
        model(input_ids=ids[:, :5], use_cache=True, **{cache_kw: cache})
        step = model(
            input_ids=ids[:, 5:],
            position_ids=torch.full((2, 1), 5),
            cache_position=torch.tensor([5]),
            use_cache=True,
            **{cache_kw: cache},
            **extra,
        ).logits
    assert cache_kw in inspect.signature(model.forward).parameters
    assert logits_kw and step.shape == (2, 1, VOCAB)
    torch.testing.assert_close(step[:, -1], full[:, -1], rtol=1e-4, atol=1e-5)


def test_forward_options_of_a_forward_written_against_past_key_values() -> None:
    class Legacy(nn.Module):
        def forward(self, input_ids: torch.Tensor, past_key_values: Any = None) -> None:
            """A forward of transformers 4's signature."""

    assert forward_options(Legacy()) == ("past_key_values", False)


def test_resolve_model_for_every_kind_of_spec(tmp_path: Path) -> None:
    torch.manual_seed(0)
    saved = AutoModelForCausalLM.from_config(_config(LLAMA))
    saved.save_pretrained(tmp_path / "ckpt")
    got = resolve_model(tmp_path / "ckpt")
    assert got.weights == tmp_path / "ckpt"
    assert got.config.to_dict() == AutoConfig.from_pretrained(tmp_path / "ckpt").to_dict()
    loaded = AutoModelForCausalLM.from_pretrained(got.weights, config=got.config)
    for name, value in saved.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], value), name

    (tmp_path / "cfg").mkdir()
    (tmp_path / "cfg" / "config.json").write_text((tmp_path / "ckpt" / "config.json").read_text())
    (tmp_path / "cfg.json").write_text(json.dumps(LLAMA))
    table = {"tiny-one": LLAMA}
    for spec in (tmp_path / "cfg", str(tmp_path / "cfg.json"), LLAMA, saved.config, " Tiny-ONE"):
        resolved = resolve_model(spec, builtins=table)
        assert resolved.weights is None, spec
        config = resolved.config
        assert (config.model_type, config.hidden_size, config.num_hidden_layers) == ("llama", 32, 2)
    assert resolve_model(saved.config).config is saved.config
    assert not any((tmp_path / "cfg" / f).exists() for f in WEIGHT_FILES)

    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match=r"has no config\.json"):
        resolve_model(tmp_path / "empty")
    with pytest.raises(ValueError, match="does not exist"):
        resolve_model(str(tmp_path / "missing.json"))
    with pytest.raises(ValueError, match="does not exist"):
        resolve_model("./tiny-one")  # a relative path is never a built-in name or a hub id
    with pytest.raises(ValueError, match="no 'model_type'"):
        resolve_model({"hidden_size": 32})
    with pytest.raises(ValueError, match="of type int is not supported"):
        resolve_model(3)  # type: ignore[arg-type]


def test_the_index_reader_agrees_with_from_pretrained_on_shards(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(_config(LLAMA))
    model.save_pretrained(tmp_path, max_shard_size="20KB")
    files = read_weight_index(tmp_path / SAFETENSORS_INDEX)
    assert len(set(files.values())) > 1  # sharded
    reference = AutoModelForCausalLM.from_pretrained(tmp_path).state_dict()
    assert set(files) == set(reference)  # llama's head is untied: every tensor is on disk
    for key, path in files.items():
        with safe_open(str(path), framework="pt") as f:
            assert torch.equal(f.get_tensor(key), reference[key]), key

    first = sorted(set(files.values()))[0]
    first.rename(first.with_suffix(".moved"))
    with pytest.raises(ValueError, match=rf"shards missing .*{first.name}.*download every shard"):
        read_weight_index(tmp_path / SAFETENSORS_INDEX)
    (tmp_path / "other.index.json").write_text(json.dumps({"metadata": {}}))
    with pytest.raises(ValueError, match="no 'weight_map'"):
        read_weight_index(tmp_path / "other.index.json")


def test_safetensors_dtype_names_are_those_safetensors_writes(tmp_path: Path) -> None:
    tensors = {name: torch.zeros(2, dtype=dtype) for name, dtype in SAFETENSORS_DTYPES.items()}
    save_file(tensors, tmp_path / "t.safetensors")
    with safe_open(str(tmp_path / "t.safetensors"), framework="pt") as f:
        for name, dtype in SAFETENSORS_DTYPES.items():
            assert f.get_slice(name).get_dtype() == name
            assert f.get_tensor(name).dtype == dtype


def test_refused_configs_and_models() -> None:
    llama = _config(LLAMA)
    check_supported(llama)
    quantized = _config({**LLAMA, "quantization_config": {"quant_method": "gptq"}})
    with pytest.raises(ValueError, match=r"quantized \(gptq\)"):
        check_supported(quantized, streaming=False)
    remote = _config({**LLAMA, "auto_map": {"AutoModelForCausalLM": "m.Model"}})
    check_supported(remote, streaming=False)
    with pytest.raises(ValueError, match="needs remote code"):
        check_supported(remote)
    t5 = AutoConfig.for_model("t5", d_model=32, num_layers=1, num_heads=2, vocab_size=VOCAB)
    with pytest.raises(ValueError, match="encoder-decoder"):
        check_supported(t5)
    check_generation(_meta_model(LLAMA))  # type: ignore[arg-type]
    mamba = {"model_type": "mamba", "hidden_size": 32, "state_size": 8, "num_hidden_layers": 1}
    check_generation(_meta_model({**mamba, "vocab_size": VOCAB}))  # type: ignore[arg-type]
    compressed = {  # layer kinds transformers' StaticCache has no layer for
        **{k: v for k, v in LLAMA.items() if k != "model_type"}, "model_type": "deepseek_v4",
        "head_dim": 8, "q_lora_rank": 16, "o_lora_rank": 16, "o_groups": 2,
        "moe_intermediate_size": 32, "n_routed_experts": 4, "num_experts_per_tok": 2,
        "qk_rope_head_dim": 4, "index_n_heads": 2, "index_head_dim": 8, "index_topk": 8,
        "layer_types": ["heavily_compressed_attention", "compressed_sparse_attention"],
        "mlp_layer_types": ["moe", "moe"],
    }  # fmt: skip
    with pytest.raises(ValueError, match=r"builds no StaticCache from its config \(KeyError"):
        check_generation(_meta_model(compressed))  # type: ignore[arg-type]


def test_a_meta_forward_of_gpt2_needs_its_pad_token_hidden() -> None:
    model = _meta_model({**FAMILIES["gpt2_tied"], "pad_token_id": 0})
    ids = torch.zeros((1, 8), dtype=torch.long, device="meta")
    with pytest.raises(RuntimeError, match="meta"):
        model(input_ids=ids)  # it reads the pad token's positions from the ids
    with no_pad_token(model):
        assert model.config.pad_token_id is None
        assert model(input_ids=ids).logits.shape == (1, 8, VOCAB)
    assert model.config.pad_token_id == 0


def test_activation_checkpointing_is_read_where_transformers_keeps_it() -> None:
    model = AutoModelForCausalLM.from_config(_config(LLAMA))
    assert not activation_checkpointing(model)
    model.activation_checkpointing_enable()
    assert activation_checkpointing(model)
    model.activation_checkpointing_disable()
    assert not activation_checkpointing(model)
