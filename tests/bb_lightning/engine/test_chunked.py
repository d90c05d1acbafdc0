"""Chunked block execution in training: the placement's fields and their checks, the row
chunks, and the boundary inputs' place in the manifest and the store budgets."""

from __future__ import annotations

import pytest

from bb_lightning.engine.chunked import boundary_budgets, chunking_for, row_spans
from bb_lightning.placement import Placement, boundary_manifest
from storage.device import slot_bytes
from storage.store import StoreConfig, TieredStore
from storage.tiers import Tier

BASE = {"weights": (Tier.HOST,) * 2, "master": (Tier.HOST,) * 2}


def test_the_placement_carries_and_checks_chunk_rows_and_boundaries() -> None:
    p = Placement(**BASE, chunk_rows=3, boundaries=Tier.HOST)
    assert Placement.from_dict(p.to_dict()) == p
    old = p.to_dict()
    del old["chunk_rows"], old["boundaries"]  # a placement written before the fields
    assert Placement.from_dict(old) == Placement(**BASE)
    for bad in (0, -2, 1.5, True):
        with pytest.raises(ValueError, match=rf"chunk_rows={bad!r} must be an int >= 1 rows"):
            Placement(**BASE, chunk_rows=bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"boundaries='host': use Tier.DEVICE, Tier.HOST"):
        Placement(**BASE, boundaries="host")  # type: ignore[arg-type]


def test_row_spans_cover_every_row_once_the_last_chunk_shorter() -> None:
    assert row_spans(5, 2) == [(0, 2), (2, 4), (4, 5)]
    assert row_spans(4, 3) == [(0, 3), (3, 4)]
    assert row_spans(4, 9) == [(0, 4)]
    assert row_spans(3, None) == [(0, 3)]
    assert row_spans(0, None) == [(0, 0)]  # an empty micro-batch: one empty chunk


def test_boundaries_off_the_device_are_in_the_manifest_and_the_budgets() -> None:
    """One micro-batch's hidden states per block on their home, and on the device the
    slots of the block's own and ``prefetch_depth`` blocks' ahead paged in in backward."""
    numel = 5 * 12 * 64
    host = Placement(**BASE, prefetch_depth=1, chunk_rows=2, boundaries=Tier.HOST)
    entries = boundary_manifest(host, numel)
    assert [(t.name, t.numel, t.dtype, t.home) for t in entries] == [
        (f"boundary.{i}.0.0", numel, "bfloat16", Tier.HOST) for i in range(2)
    ]
    slot = slot_bytes(numel * 2)
    assert boundary_budgets(host, numel) == {Tier.DEVICE: 2 * slot, Tier.HOST: 2 * slot,
                                             Tier.NVME: 0}  # fmt: skip
    for tier in (None, Tier.DEVICE):  # autograd's saved tensors: not in the store
        placement = Placement(**BASE, chunk_rows=2, boundaries=tier)
        assert boundary_manifest(placement, numel) == ()
        assert set(boundary_budgets(placement, numel).values()) == {0}
    nvme = Placement(**BASE, boundaries=Tier.NVME)
    assert boundary_budgets(nvme, 0)[Tier.NVME] > 0  # the tier exists before a size is known


def test_nvme_boundaries_without_an_nvme_tier_are_refused() -> None:
    config = StoreConfig(device_budget=1 << 20, host_budget=1 << 20, device="cpu")
    with TieredStore(config) as store:
        assert chunking_for(Placement(**BASE), store) is None  # one piece, on the device
        with pytest.raises(ValueError, match=r"boundaries=nvme but the store has no NVMe tier"):
            chunking_for(Placement(**BASE, boundaries=Tier.NVME), store)
