"""Checkpoints as ``save_pretrained`` writes them load equal to ``from_pretrained``.

On-disk dtypes (fp32 / bf16 / fp16), one file or sharded, tied heads missing from
the files, MoE experts stored per expert and fused in the module; each parameter is
read from the tensors it is made of, alone; ``convert`` writes the same parameters.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import zarr
from safetensors import safe_open
from safetensors.torch import load_file
from transformers import AutoConfig, AutoModelForCausalLM

from bb_lightning.hf.convert import convert_checkpoint
from bb_lightning.hf.hf_load import HFCheckpoint, check_supported, empty_model, weight_files

from ..tiny import saved

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def _on_disk(path: Path) -> dict[str, torch.dtype]:
    out = {}
    for key, file in weight_files(path).items():
        with safe_open(str(file), framework="pt") as f:
            out[key] = f.get_tensor(key).dtype
    return out


def _assert_equal_to_from_pretrained(path: Path, dtype: torch.dtype | None = None) -> None:
    reference = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    model = empty_model(AutoConfig.from_pretrained(path))
    reader = HFCheckpoint(path, model)
    reads: list[str] = []
    read = reader._read

    def counted(key: str) -> torch.Tensor:
        reads.append(key)
        return read(key)

    reader._read = counted  # type: ignore[method-assign]
    names = [n for n, _ in model.named_parameters()]
    assert names == [n for n, _ in reference.named_parameters()]
    for name in names:
        before = len(reads)
        got = reader.get(name, torch.float32)
        # only the tensors this parameter is made of (none again for the later parts of a
        # split tensor: one read serves them all)
        assert set(reads[before:]) <= set(reader.source_keys(name)), name
        want = reference.get_parameter(name).detach().float()
        torch.testing.assert_close(got, want, rtol=0, atol=0, msg=name)
    assert sorted(reads) == sorted(set(reads))  # nothing read twice
    assert set(reads) == {k for n in names for k in reader.source_keys(n)}


@pytest.mark.parametrize("dtype", sorted(DTYPES))
@pytest.mark.parametrize("family", ["llama", "qwen2_tied", "mixtral_moe"])
def test_sharded_checkpoints_in_each_dtype_load_like_from_pretrained(
    family: str, dtype: str, tmp_path: Path
) -> None:
    config = AutoConfig.from_pretrained(saved(family, tmp_path / "cfg"))
    torch.manual_seed(1)
    model = AutoModelForCausalLM.from_config(config).to(DTYPES[dtype])
    model.save_pretrained(tmp_path / "ckpt", max_shard_size="20KB")
    path = tmp_path / "ckpt"
    assert len(list(path.glob("*.safetensors"))) >= 3  # sharded, with an index
    assert set(_on_disk(path).values()) == {DTYPES[dtype]}
    _assert_equal_to_from_pretrained(path, DTYPES[dtype])


@pytest.mark.parametrize("family", ["mixtral_moe", "qwen2_moe", "olmoe"])
def test_per_expert_moe_checkpoint_loads_fused_like_from_pretrained(
    family: str, tmp_path: Path
) -> None:
    path = saved(family, tmp_path / "ckpt", max_shard_size="30KB")
    keys = list(_on_disk(path))
    assert any(".experts.3." in k for k in keys)  # one tensor per expert on disk
    model = empty_model(AutoConfig.from_pretrained(path))
    fused = [n for n, p in model.named_parameters() if p.dim() == 3]
    assert fused and all(n not in keys for n in fused)  # fused in the module
    reader = HFCheckpoint(path, model)
    for name in fused:  # each fused parameter is assembled from all 4 experts' tensors
        sources = reader.source_keys(name)
        assert len(sources) % 4 == 0 and all(".experts." in k for k in sources), name
    _assert_equal_to_from_pretrained(path)


def test_fused_tensors_on_disk_split_into_module_parameters(tmp_path: Path) -> None:
    """hrm_text stores ``gqkv_proj`` / ``gate_up_proj`` fused; the module has them split."""
    config = AutoConfig.for_model(
        "hrm_text", vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, head_dim=8, num_layers_per_stack=1, max_position_embeddings=64,
    )  # fmt: skip
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "ckpt")
    path = tmp_path / "ckpt"
    keys = set(_on_disk(path))
    model = empty_model(AutoConfig.from_pretrained(path))
    reader = HFCheckpoint(path, model)
    split = [n for n, _ in model.named_parameters() if n not in keys]
    assert any(n.endswith("self_attn.k_proj.weight") for n in split)
    for name in split:  # each split part comes from one fused tensor
        (source,) = reader.source_keys(name)
        assert source.endswith(("gqkv_proj.weight", "gate_up_proj.weight", "attn.o_proj.weight"))
    _assert_equal_to_from_pretrained(path)


@pytest.mark.parametrize("family", ["gpt2_tied", "qwen2_tied"])
def test_base_model_checkpoint_loads_under_the_causal_lm_prefix(
    family: str, tmp_path: Path
) -> None:
    """Keys without the base model prefix (``h.0...`` for ``transformer.h.0...``), head tied."""
    full = AutoModelForCausalLM.from_pretrained(saved(family, tmp_path / "full"))
    getattr(full, full.base_model_prefix).save_pretrained(tmp_path / "base")
    path = tmp_path / "base"
    assert not any(k.startswith(full.base_model_prefix + ".") for k in _on_disk(path))
    (tmp_path / "base" / "config.json").write_text((tmp_path / "full" / "config.json").read_text())
    _assert_equal_to_from_pretrained(path)


@pytest.mark.parametrize("shards", [1, 2])
def test_torch_bin_checkpoint_loads_like_from_pretrained(shards: int, tmp_path: Path) -> None:
    """``pytorch_model.bin`` (one file, or shards with an index), memory-mapped."""
    path = saved("mixtral_moe", tmp_path / "ckpt")
    state = dict(load_file(str(path / "model.safetensors")))
    (path / "model.safetensors").unlink()
    if shards == 1:
        torch.save(state, path / "pytorch_model.bin")
    else:
        keys = sorted(state)
        parts = {"pytorch_model-1.bin": keys[::2], "pytorch_model-2.bin": keys[1::2]}
        for file, names in parts.items():
            torch.save({k: state[k] for k in names}, path / file)
        weight_map = {k: file for file, names in parts.items() for k in names}
        index = {"metadata": {}, "weight_map": weight_map}
        (path / "pytorch_model.bin.index.json").write_text(json.dumps(index))
    assert HFCheckpoint.holds_weights(path)
    _assert_equal_to_from_pretrained(path)
    report = convert_checkpoint(path, tmp_path / "z", progress=False)  # the same path
    assert report.written == len(list(empty_model(AutoConfig.from_pretrained(path)).parameters()))


def test_tied_head_absent_from_the_files_is_the_embedding(tmp_path: Path) -> None:
    path = saved("gemma_tied", tmp_path / "ckpt")
    assert not any("lm_head" in k for k in _on_disk(path))
    model = empty_model(AutoConfig.from_pretrained(path))
    assert model.get_output_embeddings().weight is model.get_input_embeddings().weight
    _assert_equal_to_from_pretrained(path)


def _zarr_tensor(array: Any) -> torch.Tensor:
    values = torch.from_numpy(np.ascontiguousarray(array[...]))
    if array.attrs.get("torch_dtype") == "bfloat16":
        return values.view(torch.bfloat16)
    return values


def test_convert_writes_the_module_parameters_of_a_per_expert_checkpoint(tmp_path: Path) -> None:
    path = saved("mixtral_moe", tmp_path / "ckpt", max_shard_size="30KB")
    report = convert_checkpoint(path, tmp_path / "z", dtype="bfloat16", progress=False)
    reference = AutoModelForCausalLM.from_pretrained(path)
    params = dict(reference.named_parameters())
    assert report.written == len(params)
    group = zarr.open_group(str(tmp_path / "z"), mode="r")
    assert sorted(group.array_keys()) == sorted(params)
    for name, p in params.items():
        want = p.detach().to(torch.bfloat16)
        assert torch.equal(_zarr_tensor(group[name]), want), name


def test_a_checkpoint_missing_a_parameter_is_refused_at_construction(tmp_path: Path) -> None:
    path = saved("llama", tmp_path / "ckpt")
    config = AutoConfig.from_pretrained(path)
    config.num_hidden_layers = 3  # the files hold two layers
    with pytest.raises(ValueError, match=r"lacks \d+ parameters .*model.layers.2"):
        HFCheckpoint(path, empty_model(config))


@pytest.mark.parametrize(
    ("changes", "needle"),
    [
        ({"quantization_config": {"quant_method": "bitsandbytes"}}, "is quantized"),
        ({"auto_map": {"AutoModelForCausalLM": "x.Y"}}, "needs remote code"),
    ],
)
def test_unsupported_models_are_refused_in_one_line(
    changes: dict[str, Any], needle: str, tmp_path: Path
) -> None:
    config = AutoConfig.from_pretrained(saved("llama", tmp_path / "ckpt"))
    for key, value in changes.items():
        setattr(config, key, value)
    with pytest.raises(ValueError, match=needle) as err:
        check_supported(config)
    assert "\n" not in str(err.value)
