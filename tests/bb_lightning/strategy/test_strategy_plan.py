"""The planner drives ``Trainer(strategy="balance_beam")``: job from the Trainer, adapt."""

from __future__ import annotations

import warnings
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

import bb_lightning.strategy.session as session_module
from bb_lightning import BalanceBeamStrategy
from bb_lightning.placement import Placement
from bb_lightning.planner import HardwareProfile, PlanOverrides
from bb_lightning.probe import calibrate
from storage.tiers import Tier

from ..tiny import cpu_profile


def _assert_same(got: Any, want: Any) -> None:
    torch.testing.assert_close(torch.tensor(got[0]), torch.tensor(want[0]), rtol=1e-5, atol=1e-6)
    for key, value in want[1].items():
        torch.testing.assert_close(got[1][key], value, rtol=1e-5, atol=1e-6, msg=key)


def test_strategy_by_name_plans_from_the_first_batch(
    tiny: SimpleNamespace, monkeypatch: pytest.MonkeyPatch, reference_run: Any
) -> None:
    measured = []

    def fake_measure(**kwargs: Any) -> HardwareProfile:
        measured.append(kwargs)
        return cpu_profile()

    monkeypatch.setattr(session_module, "measure", fake_measure)
    probed: list[dict[str, Any]] = []

    def fake_probe(config: Any, hardware: HardwareProfile, **kwargs: Any) -> None:
        probed.append(kwargs)  # the model-shaped probe at the Trainer's shape, not run
        return None  # None: no calibration, the measured profile as it is

    monkeypatch.setattr(session_module, "probe_train_compute", fake_probe)
    trainer, recorder = tiny.make_trainer(
        "balance_beam", 2, accumulate_grad_batches=2, precision="32-true"
    )
    strategy = trainer.strategy
    assert isinstance(strategy, BalanceBeamStrategy)
    trainer.fit(tiny.make_module(tiny.tiny_llama()), tiny.loader(4))
    plan = strategy.plan
    assert plan is not None and measured == [{"nvme_path": None}]
    assert [(p["seq_len"], p["micro_batch"], p["dtype"]) for p in probed] == [
        (tiny.batches(1)[0]["input_ids"].shape[1], 2, torch.float32)
    ]
    assert plan.job.seq_len == tiny.batches(1)[0]["input_ids"].shape[1]
    assert plan.job.seqs_per_step == 2 * 2  # micro-batch 2 x accumulate 2
    assert (plan.micro_batch, plan.grad_accum) == (2, 2)  # the batch in use is planned
    assert not plan.placement.hold_grads  # only when the overrides ask
    assert Tier.NVME not in plan.weights + plan.master  # no nvme_path: no NVMe tier
    assert strategy.engine is not None
    assert strategy.engine.pager.placement.weights == plan.weights
    want = reference_run(tiny.tiny_llama(), 2, accumulate_grad_batches=2)
    _assert_same((recorder.losses, dict(strategy.lightning_module_state_dict())), want)
    strategy.close()


def test_overrides_force_tiers_and_depth(tiny: SimpleNamespace, reference_run: Any) -> None:
    overrides = PlanOverrides(weights_tier=Tier.HOST, master_tier=Tier.HOST, prefetch_depth=2)
    strategy = BalanceBeamStrategy(
        hardware=cpu_profile(), overrides=overrides, compute_dtype="fp32"
    )
    trainer, recorder = tiny.make_trainer(strategy, 2)
    trainer.fit(tiny.make_module(tiny.tiny_llama()), tiny.loader(2))
    assert strategy.engine is not None
    placement = strategy.engine.pager.placement
    assert placement.weights == (Tier.HOST,) * 4 and placement.master == (Tier.HOST,) * 4
    assert placement.prefetch_depth == 2
    _assert_same(
        (recorder.losses, dict(strategy.lightning_module_state_dict())),
        reference_run(tiny.tiny_llama(), 2),
    )
    strategy.close()


def test_held_gradients_train_as_plain_lightning(tiny: SimpleNamespace, reference_run: Any) -> None:
    """Asked for, the plan holds the first micro-batches' gradients and sums them once in
    the last backward: the losses and weights are plain Lightning's, accumulating 3."""
    strategy = BalanceBeamStrategy(
        hardware=cpu_profile(), overrides=PlanOverrides(hold_grads=True), compute_dtype="fp32"
    )
    trainer, recorder = tiny.make_trainer(strategy, 2, accumulate_grad_batches=3)
    trainer.fit(tiny.make_module(tiny.tiny_llama()), tiny.loader(6))
    plan = strategy.plan
    assert plan is not None and plan.grad_accum == 3
    assert plan.placement.hold_grads and "held" in plan.explain()
    _assert_same(
        (recorder.losses, dict(strategy.lightning_module_state_dict())),
        reference_run(tiny.tiny_llama(), 2, accumulate_grad_batches=3),
    )
    strategy.close()


def test_wrong_profile_triggers_a_replan_toward_the_measurement(tiny: SimpleNamespace) -> None:
    wrong = cpu_profile(device_flops=5e12)  # 100x too fast for these cores
    strategy = BalanceBeamStrategy(hardware=wrong, compute_dtype="fp32", warmup_steps=3)
    trainer, _ = tiny.make_trainer(strategy, 4)
    trainer.fit(tiny.make_module(tiny.tiny_llama()), tiny.loader(4))
    assert len(strategy.plan_history) == 2
    first, second = strategy.plan_history
    metrics = strategy.plan_metrics
    measured = metrics["bb/measured_compute_s"]
    assert metrics["bb/predicted_compute_s"] == first.predicted.compute
    assert metrics["bb/replanned_predicted_compute_s"] == second.predicted.compute
    assert second.hardware.compute_efficiency < 1.0
    assert abs(second.predicted.compute - measured) < abs(first.predicted.compute - measured)
    assert strategy.plan is second
    assert strategy.engine is not None
    assert strategy.engine.pager.placement.weights == second.weights
    strategy.close()


def test_tolerance_none_only_reports(tiny: SimpleNamespace) -> None:
    strategy = BalanceBeamStrategy(
        hardware=cpu_profile(device_flops=5e12),
        compute_dtype="fp32",
        warmup_steps=2,
        adapt_tolerance=None,
    )
    trainer, _ = tiny.make_trainer(strategy, 2)
    trainer.fit(tiny.make_module(tiny.tiny_llama()), tiny.loader(2))
    assert len(strategy.plan_history) == 1
    assert strategy.plan_metrics["bb/measured_step_s"] > 0
    strategy.close()


def test_bad_warmup_and_tolerance_raise() -> None:
    with pytest.raises(ValueError, match="warmup_steps=0"):
        BalanceBeamStrategy(warmup_steps=0)
    with pytest.raises(ValueError, match="adapt_tolerance=-1"):
        BalanceBeamStrategy(adapt_tolerance=-1)


def test_gather_full_model_and_close_on_collection(tiny: SimpleNamespace, tmp_path: Any) -> None:
    placement = Placement(
        weights=(Tier.NVME, Tier.HOST, Tier.HOST, Tier.DEVICE), master=(Tier.HOST,) * 4
    )
    strategy = BalanceBeamStrategy(placement=placement, compute_dtype="fp32")
    module = tiny.make_module(tiny.tiny_llama())
    trainer, _ = tiny.make_trainer(strategy, 2)
    trainer.fit(module, tiny.loader(2))
    assert strategy.store is not None and strategy._slot.tmpdir is not None
    nvme_dir = Path(strategy._slot.tmpdir.name)
    assert nvme_dir.is_dir()
    want = dict(strategy.lightning_module_state_dict())
    gathered = strategy.gather_full_model()
    assert strategy.engine is None and strategy.store is None and not nvme_dir.exists()
    for key, p in gathered.named_parameters():
        torch.testing.assert_close(p.detach(), want[key], rtol=0, atol=0, msg=key)
    # The module runs on its own again, as Hugging Face would run these weights.
    batch = tiny.batches(1, seed=5)[0]
    with torch.no_grad():
        loss = float(gathered(batch))
    assert torch.isfinite(torch.tensor(loss))

    # A strategy dropped without close() has its store closed by a finalizer that runs
    # when the strategy is collected (or at exit).
    other = BalanceBeamStrategy(placement=placement, compute_dtype="fp32")
    trainer, _ = tiny.make_trainer(other, 1)
    trainer.fit(tiny.make_module(tiny.tiny_llama()), tiny.loader(1))
    assert other._slot.tmpdir is not None and other.store is not None
    other_dir, store, finalizer = Path(other._slot.tmpdir.name), other.store, other._slot.finalizer
    assert finalizer is not None and finalizer.alive and finalizer.atexit
    assert finalizer.peek() is not None and finalizer.peek()[0] is other  # type: ignore[index]
    finalizer()
    assert not other_dir.exists() and store._closed


@pytest.mark.parametrize(("fp32", "warned"), [(8e10, True), (1e10, False)])
def test_a_bf16_fit_on_a_cpu_that_multiplies_fp32_faster_is_told_to_use_fp32(
    tiny: SimpleNamespace, monkeypatch: pytest.MonkeyPatch, fp32: float, warned: bool
) -> None:
    """A CPU without bf16 matrix instructions (AVX2 only) multiplies fp32 about 8 x faster
    than bf16: a bf16-true fit there hears so, with the setting that fixes it; a CPU
    whose bf16 products are the faster (AVX-512 bf16, AMX) hears nothing."""
    monkeypatch.setattr(session_module, "measure", lambda **_: cpu_profile())
    rates = {torch.bfloat16: 1e10, torch.float32: fp32}
    monkeypatch.setattr(calibrate, "product_rate", lambda dtype, device, n=1024: rates[dtype])
    # the advice comes before the model-shaped probe, which is not run (None: no calibration)
    monkeypatch.setattr(session_module, "probe_train_compute", lambda *a, **k: None)
    trainer, _ = tiny.make_trainer("balance_beam", 1, precision="bf16-true")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(tiny.make_module(tiny.tiny_llama()), tiny.loader(1))
    told = [str(w.message) for w in caught if "bf16 matrices" in str(w.message)]
    if warned:
        assert len(told) == 1, told
        assert "8.0 x the speed" in told[0] and "precision='32-true'" in told[0]
    else:
        assert told == []
    trainer.strategy.close()
