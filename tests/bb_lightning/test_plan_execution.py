"""Plan = execution: what a plan says (recompute, homes, batch shape) is what the engine runs."""

from __future__ import annotations

import functools
from collections import Counter
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from transformers.models.llama.modeling_llama import LlamaDecoderLayer

from bb_lightning import BalanceBeamStrategy
from bb_lightning.planner import (
    FitJob,
    HardwareProfile,
    PlanError,
    PlanOverrides,
    cost,
    make_plan,
    preset,
)
from bb_lightning.probe import model_profile_from_module
from storage.tiers import Tier

from .tiny import cpu_profile

D, H, N = Tier.DEVICE, Tier.HOST, Tier.NVME
JOB = FitJob(seq_len=32, global_batch_seqs=2)


def _cpu() -> HardwareProfile:
    """The tests' small CPU machine with an 8 GiB NVMe tier."""
    return cpu_profile(nvme=8 << 30)


CASES: dict[str, dict[str, Any]] = {
    "free": {},
    "nvme": {"weights_tier": N, "master_tier": H},
    "half-resident": {"resident_blocks": 2, "weights_tier": N, "master_tier": H},
    "host": {"weights_tier": H, "master_tier": N},
    "host-checkpointed": {"weights_tier": H, "master_tier": H, "checkpointing": True},
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_engine_runs_what_the_plan_says(
    case: str, tiny: SimpleNamespace, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    module = tiny.make_module(tiny.tiny_llama())
    module.configure_model()
    assert module.model is not None
    layers = list(module.model.model.layers)
    calls: Counter[int] = Counter()
    forward = LlamaDecoderLayer.forward

    @functools.wraps(forward)  # the engine reads the signature for the hidden states
    def counted(self: LlamaDecoderLayer, *args: Any, **kwargs: Any) -> Any:
        calls[layers.index(self)] += 1
        return forward(self, *args, **kwargs)

    class FromTheStep(pl.Callback):  # the planner's profiling passes are not counted
        def on_train_batch_start(self, *args: Any) -> None:
            calls.clear()

    monkeypatch.setattr(LlamaDecoderLayer, "forward", counted)
    strategy = BalanceBeamStrategy(
        job=JOB, hardware=_cpu(), overrides=PlanOverrides(**CASES[case]),
        nvme_path=str(tmp_path / "nvme"), compute_dtype="fp32",
    )  # fmt: skip
    trainer, _ = tiny.make_trainer(strategy, 1)
    trainer.callbacks.append(FromTheStep())
    trainer.fit(module, tiny.loader(1))  # one micro-batch of 2 x 32 tokens
    plan, engine = strategy.plan, strategy.engine
    assert plan is not None and engine is not None
    recomputed = set(plan.recomputed_blocks())
    ran_twice = set(recomputed)
    if not engine.store.pages_host_in_place:  # the CPU double pages HOST-home blocks by
        ran_twice |= {i for i, w in enumerate(plan.weights) if w is H}  # copy, as CUDA does
    # each block's forward ran once, and once more in backward where the plan recomputes
    assert calls == Counter({i: 2 if i in ran_twice else 1 for i in range(len(layers))})
    # a CPU device keeps a copied block's activations while its weights are paged out
    # (swapped) rather than recomputing it; only a forced checkpointing recomputes
    swapped = set(plan.placement.swapped or ())
    copied = {i for i, w in enumerate(plan.weights) if w is N}
    assert swapped == copied and not recomputed & copied
    assert plan.checkpointing == bool(recomputed | swapped)
    home = engine.store.home
    assert tuple(home(f"block.{i}.weight") for i in range(4)) == plan.weights
    assert tuple(home(f"block.{i}.master") for i in range(4)) == plan.master
    assert tuple(home(f"block.{i}.grad") for i in range(4)) == plan.grads
    assert (plan.micro_batch, plan.grad_accum) == (2, trainer.accumulate_grad_batches)
    assert engine.pager.placement.prefetch_depth == plan.prefetch_depth
    text = plan.explain()
    kept = f", {len(swapped)} swapped" if swapped else ""
    assert f"({len(recomputed)} of 4 blocks recomputed{kept};" in text
    strategy.close()


@pytest.mark.parametrize("hardware", ["a100-80gb", "t4"])
def test_the_search_offers_only_runnable_checkpointing(hardware: str, tiny: Any) -> None:
    """Over the plans the search makes, checkpointing off means no block is copied in, and
    the FLOPs priced are those of the blocks the plan says are recomputed."""
    module = tiny.make_module(tiny.tiny_llama())
    module.configure_model()
    model = model_profile_from_module(module.model)
    hw = preset(hardware)
    for overrides in [PlanOverrides(**kw) for kw in CASES.values()]:
        plan = make_plan(model, hw, JOB, overrides=overrides)
        copied = [w for w in plan.weights if w not in plan.in_place_tiers()]
        assert plan.checkpointing == bool(copied) or overrides.checkpointing is True
        n_re = len(plan.recomputed_blocks())
        assert n_re == (len(copied) or 4 if plan.checkpointing else 0)
        want = cost.train_flops_per_token(model, JOB.seq_len, plan.checkpointing, 4.0 - n_re)
        assert plan.roofline.flops_per_token == pytest.approx(want)
    with pytest.raises(PlanError, match="checkpointing off needs every block used in place"):
        make_plan(model, hw, JOB, overrides=PlanOverrides(weights_tier=N, checkpointing=False))
    assert torch.is_grad_enabled()


@pytest.mark.parametrize(
    "overrides",
    [{"weights_tier": H, "master_tier": H}, {"resident_blocks": 2, "weights_tier": H}],
    ids=["host", "half-resident"],
)
def test_a_gpu_plan_run_on_the_cpu_recomputes_what_it_says(
    overrides: dict[str, Any], tiny: SimpleNamespace, tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    """Planned for a GPU preset (HOST-home blocks paged in by copy, so recomputed) and run
    on the CPU (where the same blocks could be used in place): the engine recomputes the
    blocks the plan prices as recomputed, no more and no fewer."""
    module = tiny.make_module(tiny.tiny_llama())
    module.configure_model()
    assert module.model is not None
    layers = list(module.model.model.layers)
    calls: Counter[int] = Counter()
    forward = LlamaDecoderLayer.forward

    @functools.wraps(forward)
    def counted(self: LlamaDecoderLayer, *args: Any, **kwargs: Any) -> Any:
        calls[layers.index(self)] += 1
        return forward(self, *args, **kwargs)

    class FromTheStep(pl.Callback):
        def on_train_batch_start(self, *args: Any) -> None:
            calls.clear()

    monkeypatch.setattr(LlamaDecoderLayer, "forward", counted)
    strategy = BalanceBeamStrategy(
        job=JOB, hardware="a100-80gb", overrides=PlanOverrides(**overrides),
        nvme_path=str(tmp_path / "nvme"), compute_dtype="fp32",
    )  # fmt: skip
    trainer, _ = tiny.make_trainer(strategy, 1)
    trainer.callbacks.append(FromTheStep())
    trainer.fit(module, tiny.loader(1))
    plan = strategy.plan
    assert plan is not None and plan.hardware.device_type == "cuda"
    assert strategy.root_device.type == "cpu"
    recomputed = set(plan.recomputed_blocks())
    assert recomputed == {i for i, w in enumerate(plan.weights) if w is H} != set()
    assert calls == Counter({i: 2 if i in recomputed else 1 for i in range(len(layers))})
    strategy.close()


def test_a_plan_keeping_a_copied_block_bound_is_refused() -> None:
    """A CPU plan (HOST blocks used in place, not recomputed) on a GPU device, where HOST
    blocks are copied in and must be recomputed: refused naming the blocks and the fix."""
    from bb_lightning.engine.recompute import planned_autograd_blocks
    from bb_lightning.placement import Placement

    cpu_plan = Placement(weights=(D, H, N), master=(H, H, H), recomputed=(2,))
    assert planned_autograd_blocks(cpu_plan, {D, H}) == {0, 1}
    with pytest.raises(ValueError, match=r"blocks \[1\] \(homed on \['host'\]\).*hardware="):
        planned_autograd_blocks(cpu_plan, {D})


def test_a_gpu_plan_leaves_room_for_its_activations_beside_the_store(
    tiny: SimpleNamespace, tmp_path: Path
) -> None:
    """The store's device arena holds the placement's blocks and the plan's headroom, not
    the whole device budget: the activations and logits the plan prices on the device are
    allocated beside it, and a GPU allocates the arena whole (on an H200 the arena took
    the budget and the first forward ran out of device memory). Planned for a GPU whose
    budget holds half of the model's training state, run on the CPU."""
    seq, seqs = 64, 4  # the model's whole context
    module = tiny.make_module(tiny.tiny_llama(8))
    module.configure_model()
    assert module.model is not None
    profile = model_profile_from_module(module.model)
    state = 18 * sum(
        p.numel() for p in module.model.parameters()
    )  # bf16, fp32 master, AdamW, grads
    budget = state // 2 + cost.activation_bytes(profile, seqs, seq, True)
    hw = preset("a100-80gb").replace(device_memory=int((budget + (1 << 30)) / 0.9))
    strategy = BalanceBeamStrategy(
        job=FitJob(seq_len=seq, global_batch_seqs=seqs), hardware=hw,
        overrides=PlanOverrides(micro_batch=seqs, grad_accum=1),
        nvme_path=str(tmp_path / "nvme"), compute_dtype="fp32",
    )  # fmt: skip
    trainer, _ = tiny.make_trainer(strategy, 1)
    g = torch.Generator().manual_seed(0)
    data = [{"input_ids": torch.randint(0, 256, (seqs, seq), generator=g)}]
    trainer.fit(module, torch.utils.data.DataLoader(data, batch_size=None))  # type: ignore[arg-type,var-annotated]
    plan = strategy.plan
    assert plan is not None and strategy.store is not None
    assert set(plan.weights) != {D}  # the budget binds: some blocks are paged
    device = next(m for m in plan.memory if m.tier is D)
    # what the plan puts on the device outside the store, at the least
    outside = cost.activation_bytes(profile, seqs, seq, plan.checkpointing) + cost.logits_bytes(
        profile, seqs * seq
    )
    arena = strategy.store.usage()[D][1]
    mib = 1 << 20
    assert arena + outside <= device.budget + mib, (arena / mib, outside / mib, device)
    strategy.close()
