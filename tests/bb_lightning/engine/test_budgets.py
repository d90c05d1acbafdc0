"""required_budgets against the store's own accounting: the tensors the engine stores must fit."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from bb_lightning.engine.pager import Placement
from bb_lightning.engine.trainer_engine import (
    SCRATCH_FP32,
    SCRATCH_SETS,
    reads_ahead,
    required_budgets,
)
from storage.store import StoreConfig, TieredStore
from storage.tiers import Tier

DTYPE = torch.bfloat16


def fill_like_the_engine(
    store: TieredStore, numels: list[int], resident: int, placement: Placement
) -> None:
    """Register what the training engine registers: per block a flat weight in the compute
    dtype, three flat fp32 states (master, two moments) and an fp32 gradient; four fp32
    resident states; the optimizer's scratch sets on the host."""
    tiers = zip(placement.weights, placement.master, placement.grad_tiers, strict=True)
    for i, (n, (w, m, g)) in enumerate(zip(numels, tiers, strict=True)):
        store.register(f"block.{i}.weight", shape=(n,), dtype=DTYPE, home=w)
        for state in ("master", "exp_avg", "exp_avg_sq"):
            store.register(f"block.{i}.{state}", shape=(n,), dtype=torch.float32, home=m)
        store.register(f"block.{i}.grad", shape=(n,), dtype=torch.float32, home=g)
    for state in ("master", "exp_avg", "exp_avg_sq", "grad"):
        store.register(f"resident.{state}", shape=(resident,), dtype=torch.float32, home=Tier.HOST)
    for k in range(SCRATCH_SETS):
        for name in SCRATCH_FP32:
            store.register(f"s.{k}.{name}", shape=(max(numels),), dtype=torch.float32,
                           home=Tier.HOST)  # fmt: skip
        store.register(f"s.{k}.cast", shape=(max(numels),), dtype=DTYPE, home=Tier.HOST)
    if reads_ahead(placement):
        for k in range(placement.read_ahead):
            for state in ("master", "exp_avg", "exp_avg_sq"):
                store.register(f"a.{k}.{state}", shape=(max(numels),), dtype=torch.float32,
                               home=Tier.HOST)  # fmt: skip


@pytest.mark.parametrize(
    ("numels", "resident"),
    [
        ([0] * 30 + [1, 3, 700, 2048, 2048, 2048], 0),  # many empty and tiny tensors
        ([5] * 40, 7),  # many tiny tensors, each one slot
        ([4096, 100_000, 100_000, 100_000, 1], 12_345),
    ],
    ids=["empty", "tiny", "mixed"],
)
def test_budgets_hold_the_engines_tensors_exactly(
    tmp_path: Path, numels: list[int], resident: int
) -> None:
    tiers = (Tier.DEVICE, Tier.HOST, Tier.NVME)
    placement = Placement(
        weights=tuple(tiers[i % 3] for i in range(len(numels))),
        master=tuple(Tier.HOST if i % 2 else Tier.NVME for i in range(len(numels))),
        prefetch_depth=2,
        read_ahead=3,
    )
    need = required_budgets(numels, resident, placement, DTYPE)
    config = StoreConfig(
        device_budget=need[Tier.DEVICE],
        host_budget=need[Tier.HOST],
        nvme_path=str(tmp_path / "nvme"),
        nvme_budget=need[Tier.NVME],
        device="cpu",
    )
    with TieredStore(config) as store:
        fill_like_the_engine(store, numels, resident, placement)
        # page in prefetch_depth + 1 of the largest paged blocks at once, as the pager may
        paged = [i for i, w in enumerate(placement.weights) if w is not Tier.DEVICE]
        largest = sorted(paged, key=lambda i: numels[i])[-(placement.prefetch_depth + 1) :]
        store.prefetch_async([f"block.{i}.weight" for i in largest]).wait()
        usage = store.usage()
    assert usage[Tier.HOST][0] == need[Tier.HOST]  # the host arena is filled to the byte
    assert usage[Tier.DEVICE][0] <= need[Tier.DEVICE]
    assert usage[Tier.NVME][0] <= need[Tier.NVME]
