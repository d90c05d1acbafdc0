"""export_hf: Hugging Face directories from checkpoints and live strategies."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoConfig, AutoModelForCausalLM

from bb_lightning import BalanceBeamStrategy
from bb_lightning.engine.checkpoint import CheckpointError
from bb_lightning.hf.export import export_hf
from bb_lightning.placement import Placement
from storage.tiers import Tier


def _trained(
    tiny: SimpleNamespace, config: dict[str, object], layers: int, tmp: Path
) -> tuple[BalanceBeamStrategy, dict[str, torch.Tensor], torch.Tensor]:
    """A strategy after 2 steps, its fp32 state dict, and its module's logits on a batch."""
    placement = Placement.uniform(layers, weights=Tier.NVME, master=Tier.HOST)
    strategy = BalanceBeamStrategy(placement=placement, compute_dtype="fp32", nvme_path=str(tmp))
    trainer, _ = tiny.make_trainer(strategy, 2)
    trainer.fit(tiny.make_module(config), tiny.loader(2))
    module = strategy.lightning_module
    assert module is not None
    with torch.no_grad():
        logits = module.model(input_ids=tiny.batches(1, seed=5)[0]["input_ids"]).logits.cpu()
    return strategy, dict(strategy.lightning_module_state_dict()), logits


def _logits(out: Path, tiny: SimpleNamespace) -> torch.Tensor:
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    with torch.no_grad():
        return model(input_ids=tiny.batches(1, seed=5)[0]["input_ids"]).logits


def test_checkpoint_export_sharded_fp32_loads_with_equal_logits(
    tiny: SimpleNamespace, tmp_path: Path
) -> None:
    strategy, state, want = _trained(tiny, tiny.tiny_llama(), 4, tmp_path / "nvme")
    assert strategy.lightning_module is not None
    strategy.lightning_module.trainer.save_checkpoint(tmp_path / "c.ckpt")
    strategy.close()
    out = export_hf(
        tmp_path / "c.ckpt", tmp_path / "hf", dtype=torch.float32, max_shard_bytes=1 << 16
    )
    index = json.loads((out / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 2 and files[0] == f"model-00001-of-{len(files):05d}.safetensors"
    loaded: dict[str, torch.Tensor] = {}
    for f in files:
        loaded.update(load_file(out / f))
    assert loaded.keys() == {k.removeprefix("model.") for k in state}
    for key, value in loaded.items():
        assert value.dtype == torch.float32
        torch.testing.assert_close(value, state["model." + key], rtol=0, atol=0, msg=key)
    torch.testing.assert_close(_logits(out, tiny), want, rtol=1e-5, atol=1e-5)


def test_live_export_bf16_tied_gpt2(tiny: SimpleNamespace, tmp_path: Path) -> None:
    strategy, state, want = _trained(tiny, tiny.tiny_gpt2(), 3, tmp_path / "nvme")
    out = export_hf(strategy, tmp_path / "hf")
    strategy.close()
    assert not (out / "model.safetensors.index.json").exists()
    weights = load_file(out / "model.safetensors")
    assert "transformer.wte.weight" in weights and "lm_head.weight" not in weights
    for key, value in weights.items():
        assert value.dtype == torch.bfloat16
        torch.testing.assert_close(value, state["model." + key].to(torch.bfloat16), rtol=0, atol=0)
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["GPT2LMHeadModel"] and config["dtype"] == "bfloat16"
    # reference: the trained weights rounded to bf16, in a model built from the config
    cfg = dict(tiny.tiny_gpt2())
    ref = AutoModelForCausalLM.from_config(AutoConfig.for_model(cfg.pop("model_type"), **cfg))
    rounded = {k.removeprefix("model."): v.to(torch.bfloat16).float() for k, v in state.items()}
    ref.load_state_dict(rounded)
    with torch.no_grad():
        ref_logits = ref(input_ids=tiny.batches(1, seed=5)[0]["input_ids"]).logits
    torch.testing.assert_close(_logits(out, tiny), ref_logits, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(ref_logits, want, atol=1e-4)  # the rounding is visible


def test_bad_sources_are_named(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match=r"missing.*does not exist"):
        export_hf(tmp_path / "missing", tmp_path / "out")
    with pytest.raises(ValueError, match="neither a checkpoint directory"):
        export_hf(42, tmp_path / "out")
    with pytest.raises(ValueError, match="max_shard_bytes=0"):
        export_hf(tmp_path, tmp_path / "out", max_shard_bytes=0)
