"""bench/train_offload.py prices the offloaded run it executes: the blocks its placement
recomputes in backward, and those it swaps, are the ones its plan priced so."""

from __future__ import annotations

import argparse
import importlib
from pathlib import Path
from types import ModuleType

import pytest

from bb_lightning.planner import HardwareProfile
from bb_lightning.probe import model_profile_from_config
from storage.tiers import Tier

BENCH = Path(__file__).resolve().parents[2] / "bench"
GIB = 1 << 30


def _bench(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    monkeypatch.syspath_prepend(str(BENCH))
    return importlib.import_module("train_offload")


def _args(*, weights_on_nvme: bool) -> argparse.Namespace:
    return argparse.Namespace(
        micro_batch=1, accumulate=4, seq=512, layers=24, hidden=1024, ffn=2816, heads=16,
        vocab=32000, resident=6, prefetch=1, weights_on_nvme=weights_on_nvme, dtype="bf16",
    )  # fmt: skip


def _cpu() -> HardwareProfile:
    return HardwareProfile(
        name="test cpu", device_type="cpu", device_memory=6 * GIB, device_flops=4e11,
        h2d_bandwidth=12e9, d2h_bandwidth=12e9, host_memory=16 * GIB,
        nvme_read_bandwidth=1.1e9, nvme_write_bandwidth=1.6e9, nvme_capacity=64 * GIB,
        host_adam_params_per_s=1.6e9, cores=2,
    )  # fmt: skip


@pytest.mark.parametrize("weights_on_nvme", [False, True])
def test_the_forced_run_recomputes_what_its_plan_priced(
    monkeypatch: pytest.MonkeyPatch, weights_on_nvme: bool
) -> None:
    bench = _bench(monkeypatch)
    args = _args(weights_on_nvme=weights_on_nvme)
    model = model_profile_from_config(bench._common.llama_config(args))
    plan, placement = bench.forced_plan(args, model, _cpu())
    assert placement.weights[:6] == (Tier.DEVICE,) * 6
    paged = tuple(range(6, 24))
    if weights_on_nvme:  # blocks paged in by copy keep their activations (swapped in place)
        assert placement.weights[6:] == (Tier.NVME,) * 18
        assert plan.recomputed_blocks() == () and plan.checkpointing
        assert plan.placement.swapped == placement.swapped == paged
        assert "blocks 0-5 keep, blocks 6-23 swap" in plan.explain()
    else:  # on a CPU device host-homed blocks are used in place and keep their activations
        assert placement.weights[6:] == (Tier.HOST,) * 18
        assert plan.recomputed_blocks() == () and not plan.checkpointing
    # the engine runs the placement's recompute list: the priced one
    in_place = frozenset((Tier.DEVICE, Tier.HOST))
    assert placement.recomputed_blocks(in_place) == plan.recomputed_blocks()
