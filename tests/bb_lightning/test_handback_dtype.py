"""After ``fit`` under ``precision="bf16-true"`` the module holds bf16 parameters, as plain
Lightning leaves it: same dtype, same ``save_pretrained`` size, values within bf16
rounding; the fp32 masters stay in the store and survive the next ``trainer.*`` call."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from transformers import AutoModelForCausalLM

from bb_lightning import BalanceBeamStrategy
from bb_lightning.module import CausalLMModule
from bb_lightning.placement import Placement
from bb_lightning.strategy.handback import handback_dtype
from storage.tiers import Tier

from .tiny import save_tiny, tiny_llama_config

STEPS, LR = 3, 1e-3


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny fp32 Llama written with ``save_pretrained``."""
    path = save_tiny(tmp_path_factory.mktemp("tiny-llama-fp32"), tiny_llama_config(2), seed=2)
    return path


def _module(path: Path) -> CausalLMModule:
    return CausalLMModule(path, learning_rate=LR, seed=0)


def _size(directory: Path) -> int:
    return sum(f.stat().st_size for f in directory.glob("*.safetensors"))


def test_bf16_true_hands_back_bf16_like_plain_lightning(
    tiny: SimpleNamespace, ckpt: Path, tmp_path: Path
) -> None:
    ref = _module(ckpt)
    trainer, _ = tiny.make_trainer("auto", STEPS, precision="bf16-true")
    trainer.fit(ref, tiny.loader(STEPS))
    assert ref.model is not None and ref.model.dtype == torch.bfloat16

    module = _module(ckpt)
    placement = Placement(weights=(Tier.NVME, Tier.HOST), master=(Tier.HOST, Tier.NVME))
    strategy = BalanceBeamStrategy(placement=placement, nvme_path=str(tmp_path / "nvme"),
                                   adapt_tolerance=None)  # fmt: skip
    trainer, _ = tiny.make_trainer(strategy, STEPS, precision="bf16-true")
    trainer.fit(module, tiny.loader(STEPS))
    net = module.model
    assert net is not None and net.dtype == torch.bfloat16
    masters = {k: v.clone() for k, v in strategy.lightning_module_state_dict().items()}

    want, got = ref.model.state_dict(), net.state_dict()
    initial = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.bfloat16).state_dict()
    assert got.keys() == want.keys()
    for key, value in want.items():
        mine = got[key]
        assert mine.dtype == value.dtype and mine.device.type == "cpu", key
        # Each parameter is its fp32 master rounded once to bf16.
        assert torch.equal(mine, masters[f"model.{key}"].to(value.dtype)), key
        # Plain Lightning steps bf16 weights directly: an update below half a bf16 spacing
        # rounds away there (the norms' weights near 1 never move) but accumulates in the
        # fp32 master here; Adam's first steps are +-LR, so a near-zero gradient of the
        # other sign costs up to 2 LR a step. Within that, and far closer on average
        # than either moved.
        torch.testing.assert_close(mine.float(), value.float(), rtol=2**-7,
                                   atol=2 * STEPS * LR, msg=key)  # fmt: skip
        moved = (value.float() - initial[key].float()).abs().mean()
        if moved > 0:
            assert (mine.float() - value.float()).abs().mean() < 0.1 * moved, key
    net.save_pretrained(tmp_path / "ours")
    ref.model.save_pretrained(tmp_path / "plain")
    assert _size(tmp_path / "ours") == _size(tmp_path / "plain") < 4 * net.num_parameters()

    # The next call pages the module from the store's fp32 masters, not from its bf16 copy.
    trainer.validate(module, tiny.loader(1), verbose=False)
    after = strategy.lightning_module_state_dict()
    for key, value in masters.items():
        assert torch.equal(after[key], value), key
    assert net.dtype == torch.bfloat16
    strategy.close()


def test_handback_dtype_follows_the_precision_flag() -> None:
    assert handback_dtype("bf16-true") is torch.bfloat16
    assert handback_dtype("32-true") is torch.float32
    assert handback_dtype("bf16-mixed") is torch.float32  # plain Lightning keeps fp32 weights
