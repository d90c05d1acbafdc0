"""required_budgets against the store's own accounting: the manifest's tensors must fit."""

from __future__ import annotations

from pathlib import Path

import pytest

from bb_lightning.engine.budgets import required_budgets
from bb_lightning.engine.flat import register_stored
from bb_lightning.placement import ModelSizes, Placement, training_manifest
from storage.store import StoreConfig, TieredStore
from storage.tiers import Tier


def fill_from_the_manifest(
    store: TieredStore, numels: list[int], resident: int, placement: Placement
) -> None:
    """Register what the training engine registers: its manifest's tensors."""
    for entry in training_manifest(ModelSizes(blocks=tuple(numels), rest=resident), placement):
        register_stored(store, entry)


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
    need = required_budgets(numels, resident, placement)
    config = StoreConfig(
        device_budget=need[Tier.DEVICE],
        host_budget=need[Tier.HOST],
        nvme_path=str(tmp_path / "nvme"),
        nvme_budget=need[Tier.NVME],
        device="cpu",
    )
    with TieredStore(config) as store:
        fill_from_the_manifest(store, numels, resident, placement)
        # page in prefetch_depth + 1 of the largest paged blocks at once, as the pager may
        paged = [i for i, w in enumerate(placement.weights) if w is not Tier.DEVICE]
        largest = sorted(paged, key=lambda i: numels[i])[-(placement.prefetch_depth + 1) :]
        store.prefetch_async([f"block.{i}.weight" for i in largest]).wait()
        usage = store.usage()
    assert usage[Tier.HOST][0] == need[Tier.HOST]  # the host arena is filled to the byte
    assert usage[Tier.DEVICE][0] <= need[Tier.DEVICE]
    assert usage[Tier.NVME][0] <= need[Tier.NVME]
