"""The engine factory without a Trainer: the store sized for a placement, the engine built."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import LlamaForCausalLM

from bb_lightning.engine.inference import InferenceEngine
from bb_lightning.hf.structure import find_block_list
from bb_lightning.placement import Placement
from bb_lightning.strategy.assembly import EngineSlot, build_engine, engine_calls, store_config
from storage.store import StoreConfig
from storage.tiers import Tier

from ..tiny import tiny_llama_config, tiny_model

MIB = 1 << 20


def _model() -> LlamaForCausalLM:
    model = tiny_model(tiny_llama_config(3, vocab_size=260)).eval()
    assert isinstance(model, LlamaForCausalLM)
    return model


def test_store_config_adds_a_mib_and_makes_a_temporary_nvme_directory() -> None:
    need = {Tier.DEVICE: 10, Tier.HOST: 20, Tier.NVME: 30}
    config, tmpdir = store_config(need, None, torch.device("cpu"))
    assert tmpdir is not None and Path(tmpdir.name).is_dir()
    assert (config.device_budget, config.host_budget) == (10 + MIB, 20 + MIB)
    assert config.nvme_budget == 30 + MIB and config.nvme_path == tmpdir.name
    tmpdir.cleanup()
    config, tmpdir = store_config({**need, Tier.NVME: 0}, "/unused", torch.device("cpu"))
    assert tmpdir is None and config.nvme_path is None and config.nvme_budget == 0


def test_a_weights_only_engine_serves_the_models_weights_and_gives_them_back() -> None:
    model = _model()
    want = {k: v.clone() for k, v in model.state_dict().items()}
    _, blocks = find_block_list(model)
    placement = Placement.uniform(3, weights=Tier.HOST, master=Tier.HOST, compute_dtype="float32")
    built = build_engine(model, list(blocks), placement, training=False,
                         device=torch.device("cpu"), loader=None)  # fmt: skip
    assert isinstance(built.engine, InferenceEngine) and built.tmpdir is None
    # one weights tensor per block, no master weights or moments
    assert sorted(built.store.names()) == [f"block.{i}.weight" for i in range(3)]
    got = engine_calls(built.engine).checkpoint_state_dict()
    assert got.keys() == want.keys()
    for key, value in want.items():
        torch.testing.assert_close(got[key], value, rtol=0, atol=0, msg=key)
    slot = EngineSlot()
    slot.hold(built, owner=model)
    slot.close()
    assert slot.store is None and slot.engine is None
    for key, value in model.state_dict().items():  # the module has its parameters again
        torch.testing.assert_close(value, want[key], rtol=0, atol=0, msg=key)


def test_budgets_too_small_fail_before_the_store_opens(tmp_path: Path) -> None:
    model = _model()
    _, blocks = find_block_list(model)
    placement = Placement.uniform(3, weights=Tier.HOST, master=Tier.HOST, compute_dtype="float32")
    small = StoreConfig(device_budget=MIB, host_budget=MIB, device="cpu")
    with pytest.raises(ValueError, match=r"host budget \d+ bytes < \d+ bytes needed"):
        build_engine(model, list(blocks), placement, training=True,
                     device=torch.device("cpu"), loader=None, store=small)  # fmt: skip
    assert all(p.device.type == "cpu" and not p.is_meta for p in model.parameters())
