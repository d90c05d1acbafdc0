"""Under balance_beam a checkpoint directory streams into the store, one tensor at a time."""

from __future__ import annotations

import gc
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import lightning.pytorch as pl
import pytest
import safetensors
import torch
from transformers import AutoConfig, AutoModelForCausalLM

import bb_lightning.module as module_mod
from bb_lightning import BalanceBeamStrategy
from bb_lightning.hf.hf_load import HFCheckpoint
from bb_lightning.module import CausalLMModule
from bb_lightning.placement import Placement
from storage.tiers import Tier

from ..tiny import saved

PLACEMENT = Placement(
    weights=(Tier.HOST, Tier.DEVICE, Tier.NVME, Tier.HOST), master=(Tier.HOST,) * 4
)


def _saved(tiny: SimpleNamespace, path: Path) -> dict[str, torch.Tensor]:
    cfg = dict(tiny.tiny_llama())
    torch.manual_seed(3)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(cfg.pop("model_type"), **cfg))
    model.save_pretrained(path, max_shard_size="60KB")
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_sharded_checkpoint_streams_into_the_tiers(
    tiny: SimpleNamespace, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    saved = _saved(tiny, tmp_path / "ckpt")
    assert len(list((tmp_path / "ckpt").glob("*.safetensors"))) >= 3  # sharded
    reads: list[str] = []
    get = HFCheckpoint.get

    def counted(self: HFCheckpoint, key: str) -> torch.Tensor:
        reads.append(key)
        return get(self, key)

    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("the whole model was loaded into host memory")

    monkeypatch.setattr(HFCheckpoint, "get", counted)
    monkeypatch.setattr(module_mod.AutoModelForCausalLM, "from_pretrained", refuse)
    monkeypatch.setattr(safetensors.torch, "load_file", refuse)
    module = CausalLMModule(str(tmp_path / "ckpt"))
    strategy = BalanceBeamStrategy(
        placement=PLACEMENT, compute_dtype="fp32", nvme_path=str(tmp_path / "nvme")
    )
    trainer, _ = tiny.make_trainer(strategy, 1)
    trainer.validate(module, tiny.loader(1), verbose=False)
    assert module.model is not None
    assert all(p.device.type != "meta" for p in module.model.parameters())
    # Each tensor read once, alone; nothing else read.
    assert sorted(reads) == sorted(dict(module.model.named_parameters()))
    state = dict(strategy.lightning_module_state_dict())
    for key, value in saved.items():
        torch.testing.assert_close(state[f"model.{key}"], value, rtol=0, atol=0, msg=key)
    strategy.close()


class OwnModule(pl.LightningModule):
    """A user's module holding a Hugging Face model it builds itself (materialised path)."""

    def __init__(self, path: Path) -> None:
        super().__init__()
        self.net = AutoModelForCausalLM.from_pretrained(path)

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        return self.net(input_ids=batch["input_ids"], labels=batch["input_ids"]).loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def test_own_module_with_hf_model_uses_its_materialised_weights(
    tiny: SimpleNamespace, tmp_path: Path
) -> None:
    saved = _saved(tiny, tmp_path / "ckpt")
    module = OwnModule(tmp_path / "ckpt")
    strategy = BalanceBeamStrategy(
        placement=PLACEMENT, compute_dtype="fp32", nvme_path=str(tmp_path / "nvme")
    )
    trainer, _ = tiny.make_trainer(strategy, 1)
    trainer.fit_loop.epoch_loop.max_steps = 0  # set up the engine, take no step
    trainer.fit(module, tiny.loader(1))
    assert strategy.engine is not None
    state = dict(strategy.lightning_module_state_dict())
    for key, value in saved.items():
        torch.testing.assert_close(state[f"net.{key}"], value, rtol=0, atol=0, msg=key)
    strategy.close()
    gc.collect()


@pytest.mark.parametrize("family", ["mixtral_moe", "gemma_tied"])
def test_bf16_sharded_checkpoint_streams_cast_into_the_tiers(
    family: str, tiny: SimpleNamespace, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = AutoConfig.from_pretrained(saved(family, tmp_path / "cfg"))
    torch.manual_seed(2)
    model = AutoModelForCausalLM.from_config(config).to(torch.bfloat16)
    model.save_pretrained(tmp_path / "ckpt", max_shard_size="20KB")
    want = AutoModelForCausalLM.from_pretrained(tmp_path / "ckpt").float().state_dict()

    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("the whole model was loaded into host memory")

    monkeypatch.setattr(module_mod.AutoModelForCausalLM, "from_pretrained", refuse)
    monkeypatch.setattr(safetensors.torch, "load_file", refuse)
    module = CausalLMModule(str(tmp_path / "ckpt"))
    strategy = BalanceBeamStrategy(
        placement=Placement.uniform(2, weights=Tier.NVME), compute_dtype="fp32",
        nvme_path=str(tmp_path / "nvme"),
    )  # fmt: skip
    trainer, _ = tiny.make_trainer(strategy, 1)
    data = [{"input_ids": b["input_ids"] % 128} for b in tiny.batches(1)]
    trainer.validate(module, torch.utils.data.DataLoader(data, batch_size=None), verbose=False)
    state = dict(strategy.lightning_module_state_dict())
    strategy.close()
    for key, value in want.items():  # bf16 on disk, fp32 in the store: exact
        torch.testing.assert_close(state[f"model.{key}"], value, rtol=0, atol=0, msg=key)
