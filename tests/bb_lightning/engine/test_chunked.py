"""Chunked block execution in training: the placement's fields and their checks."""

from __future__ import annotations

import pytest

from bb_lightning.placement import Placement
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
