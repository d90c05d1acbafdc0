"""BalanceBeamStrategy: registration, and offloaded training equal to plain Lightning training."""

from __future__ import annotations

import importlib
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from lightning.pytorch.strategies import StrategyRegistry
from transformers import AutoConfig, AutoModelForCausalLM

import bb_lightning
from bb_lightning import BalanceBeamStrategy
from bb_lightning.engine.pager import BlockPager
from bb_lightning.placement import Placement
from bb_lightning.planner import FitJob, PlanOverrides
from storage.store import StoreConfig
from storage.tiers import Tier

STEPS = 4
D, H, N = Tier.DEVICE, Tier.HOST, Tier.NVME


def test_registration_is_idempotent(tiny: SimpleNamespace) -> None:
    importlib.reload(bb_lightning)
    importlib.import_module("bb_lightning")
    assert "balance_beam" in StrategyRegistry
    trainer, _ = tiny.make_trainer("balance_beam", 1)
    assert isinstance(trainer.strategy, BalanceBeamStrategy)
    assert trainer.strategy.root_device.type == "cpu"  # make_trainer: accelerator="cpu"
    trainer, _ = tiny.make_trainer(BalanceBeamStrategy(compute_dtype="fp32"), 1)
    assert isinstance(trainer.strategy, BalanceBeamStrategy)


def test_bad_compute_dtype_names_the_choices() -> None:
    with pytest.raises(ValueError, match=r"'fp16'.*'bf16' or 'fp32'"):
        BalanceBeamStrategy(compute_dtype="fp16")  # type: ignore[arg-type]


def _fit(
    tiny: SimpleNamespace,
    config: dict[str, Any],
    placement: Placement,
    tmp_path: Path,
    **kwargs: Any,
) -> tuple[list[float], dict[str, torch.Tensor], BalanceBeamStrategy]:
    strategy = BalanceBeamStrategy(
        placement=placement, compute_dtype="fp32", nvme_path=str(tmp_path / "nvme")
    )
    module = tiny.make_module(config)
    trainer, recorder = tiny.make_trainer(strategy, STEPS, **kwargs)
    trainer.fit(module, tiny.loader(STEPS * kwargs.get("accumulate_grad_batches", 1)))
    state = dict(strategy.lightning_module_state_dict())
    strategy.close()
    return recorder.losses, state, strategy


def _assert_same(
    got: tuple[list[float], dict[str, torch.Tensor]],
    want: tuple[list[float], dict[str, torch.Tensor]],
    atol: float = 1e-6,
) -> None:
    torch.testing.assert_close(torch.tensor(got[0]), torch.tensor(want[0]), rtol=1e-5, atol=1e-6)
    assert got[1].keys() == want[1].keys()
    for key, value in want[1].items():
        torch.testing.assert_close(got[1][key], value, rtol=1e-5, atol=atol, msg=key)


PLACEMENTS = {
    "nvme": (N, N, N, N),
    "host": (H, H, H, H),
    "device": (D, D, D, D),
    "mixed": (D, H, N, H),
}


@pytest.mark.parametrize(
    "name", [pytest.param(n, marks=[pytest.mark.slow] if n == "nvme" else []) for n in PLACEMENTS]
)
def test_llama_equals_plain_lightning(
    tiny: SimpleNamespace, name: str, tmp_path: Path, reference_run: Any
) -> None:
    weights = PLACEMENTS[name]
    master = (H, N, H, D) if name == "mixed" else weights
    placement = Placement(weights=weights, master=master, prefetch_depth=1)
    losses, state, _ = _fit(tiny, tiny.tiny_llama(), placement, tmp_path)
    _assert_same((losses, state), reference_run(tiny.tiny_llama(), STEPS))


def test_accumulation_and_clipping_equal_plain_lightning(
    tiny: SimpleNamespace, tmp_path: Path, reference_run: Any
) -> None:
    placement = Placement(weights=(N, H, D, H), master=(H, H, N, H), prefetch_depth=2)
    kwargs = {"accumulate_grad_batches": 2, "gradient_clip_val": 0.5}
    got = _fit(tiny, tiny.tiny_llama(), placement, tmp_path, **kwargs)
    _assert_same(got[:2], reference_run(tiny.tiny_llama(), STEPS, **kwargs))


@pytest.mark.parametrize(
    ("name", "accumulate", "clip"),
    [
        pytest.param("nvme", 2, None, marks=pytest.mark.slow),
        ("device", 2, 0.5),
        ("host", 1, 0.5),
        ("mixed", 2, None),
    ],
)
def test_every_tier_with_accumulation_or_clipping_equals_plain_lightning(
    tiny: SimpleNamespace,
    tmp_path: Path,
    reference_run: Any,
    name: str,
    accumulate: int,
    clip: float | None,
) -> None:
    # Without clipping each block steps during backward (overlapped), with it after.
    weights = PLACEMENTS[name]
    master = (N, H, D, N) if name == "mixed" else weights
    placement = Placement(weights=weights, master=master, prefetch_depth=2)
    kwargs: dict[str, Any] = {"accumulate_grad_batches": accumulate}
    if clip is not None:
        kwargs["gradient_clip_val"] = clip
    got = _fit(tiny, tiny.tiny_llama(), placement, tmp_path, **kwargs)
    # The clip coefficient agrees to rounding only (norms summed in another order). Embedding
    # rows whose gradient is ~1e-9, below AdamW's eps of 1e-8, turn that rounding into weight
    # differences of up to ~1e-5 (measured: one element of 16384 at 8.6e-6).
    atol = 1e-6 if clip is None else 2e-5
    _assert_same(got[:2], reference_run(tiny.tiny_llama(), STEPS, **kwargs), atol=atol)


def test_gpt2_blocks_found_and_equal(
    tiny: SimpleNamespace, tmp_path: Path, reference_run: Any
) -> None:
    placement = Placement.uniform(3, weights=H, master=H, prefetch_depth=1)
    got = _fit(tiny, tiny.tiny_gpt2(), placement, tmp_path)
    # GPT-2's key bias has zero gradient in exact arithmetic (softmax ignores a shift per
    # query), so AdamW turns rounding noise of either backward into steps of about lr: those
    # elements agree to a few 1e-6 only.
    _assert_same(got[:2], reference_run(tiny.tiny_gpt2(), STEPS), atol=2e-5)


def _hf_loss(config: dict[str, Any], state: dict[str, torch.Tensor], batch: Any) -> float:
    cfg = dict(config)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(cfg.pop("model_type"), **cfg))
    model.load_state_dict({k.removeprefix("model."): v for k, v in state.items()})
    with torch.no_grad():
        return float(model(input_ids=batch["input_ids"], labels=batch["input_ids"]).loss)


def test_fit_validate_fit_reuses_the_engine(tiny: SimpleNamespace, tmp_path: Path) -> None:
    placement = Placement.uniform(4, weights=H, master=H, prefetch_depth=1)
    strategy = BalanceBeamStrategy(placement=placement, compute_dtype="fp32")
    module = tiny.make_module(tiny.tiny_llama())
    trainer, recorder = tiny.make_trainer(strategy, 2)
    trainer.fit(module, tiny.loader(2))
    engine = strategy.engine
    assert engine is not None
    forwards = [b.forward for b in engine.paged.blocks]
    val = tiny.batches(1, seed=7)
    (metrics,) = trainer.validate(module, tiny.loader(1, seed=7), verbose=False)
    want = _hf_loss(tiny.tiny_llama(), dict(strategy.lightning_module_state_dict()), val[0])
    assert metrics["val_loss"] == pytest.approx(want, rel=1e-5)
    trainer.fit_loop.epoch_loop.max_steps = 4
    trainer.fit(module, tiny.loader(4))
    assert strategy.engine is engine and engine.step_count == 4
    assert [b.forward for b in engine.paged.blocks] == forwards
    assert len(recorder.losses) == 4 and all(torch.isfinite(torch.tensor(recorder.losses)))
    strategy.close()


def test_blocks_larger_than_device_budget_train(
    tiny: SimpleNamespace, monkeypatch: pytest.MonkeyPatch, reference_run: Any, tmp_path: Path
) -> None:
    module = tiny.make_module(tiny.tiny_llama())
    module.configure_model()
    assert module.model is not None
    block_bytes = sum(p.numel() for p in module.model.model.layers[0].parameters()) * 4
    budget = 2 * (block_bytes + 4096) + 4096  # prefetch depth 1: two paging slots
    assert budget < 4 * block_bytes
    # weights on NVMe: on a CPU device HOST-home blocks page in place, without device slots
    store = StoreConfig(
        device_budget=budget,
        host_budget=64 << 20,
        nvme_path=str(tmp_path / "nvme"),
        nvme_budget=64 << 20,
    )
    placement = Placement.uniform(4, weights=Tier.NVME, master=H, prefetch_depth=1)
    strategy = BalanceBeamStrategy(store=store, placement=placement, compute_dtype="fp32")
    peak = [0]
    trainer, recorder = tiny.make_trainer(strategy, STEPS)
    acquire = BlockPager.acquire

    def sampled(self: BlockPager, i: int) -> list[torch.Tensor]:
        views = acquire(self, i)
        peak[0] = max(peak[0], self.store.usage()[Tier.DEVICE][0])
        return views

    monkeypatch.setattr(BlockPager, "acquire", sampled)
    trainer.fit(module, tiny.loader(STEPS))
    want = reference_run(tiny.tiny_llama(), STEPS)
    _assert_same((recorder.losses, dict(strategy.lightning_module_state_dict())), want)
    assert 0 < peak[0] <= budget
    strategy.close()


def test_planner_placement_trains(tiny: SimpleNamespace, reference_run: Any) -> None:
    job = FitJob(seq_len=32, global_batch_seqs=2)
    overrides = PlanOverrides(weights_tier=H, master_tier=H)
    strategy = BalanceBeamStrategy(
        job=job, overrides=overrides, hardware="a100-80gb", compute_dtype="fp32"
    )
    trainer, recorder = tiny.make_trainer(strategy, 2)
    trainer.fit(tiny.make_module(tiny.tiny_llama()), tiny.loader(2))
    assert strategy.engine is not None
    assert strategy.engine.pager.placement.weights == (H,) * 4
    _assert_same(
        (recorder.losses, dict(strategy.lightning_module_state_dict())),
        reference_run(tiny.tiny_llama(), 2),
    )
    strategy.close()
