"""Slot allocator and arenas: alignment, reuse, coalescing, exhaustion."""

from __future__ import annotations

import random

import pytest
import torch

from storage.device import ArenaFullError, DeviceArena, SlotAllocator, slot_bytes
from storage.host import HostArena, StagingPool
from storage.io import ALIGNMENT

KiB = 1024


def test_slots_are_aligned_and_padded() -> None:
    alloc = SlotAllocator(64 * KiB, label="device")
    spans = [alloc.allocate(n, owner=f"t{n}") for n in (1, 4096, 4097, 0, 10_000)]
    for (offset, length), n in zip(spans, (1, 4096, 4097, 0, 10_000), strict=True):
        assert offset % ALIGNMENT == 0
        assert length % ALIGNMENT == 0 and length >= max(n, 1)
    # first fit packs them back to back
    assert [o for o, _ in spans] == [0, 4096, 8192, 16384, 20480]
    assert alloc.used == sum(length for _, length in spans)


def test_capacity_rounds_down_to_alignment() -> None:
    assert SlotAllocator(10_000, label="host").capacity == 8192
    assert SlotAllocator(100, label="host").capacity == 0


def test_freed_slot_is_reused_first_fit() -> None:
    alloc = SlotAllocator(16 * KiB, label="device")
    a = alloc.allocate(4096, owner="a")
    b = alloc.allocate(4096, owner="b")
    alloc.allocate(4096, owner="c")
    alloc.free(a[0])
    assert alloc.allocate(100, owner="d") == a
    alloc.free(b[0])
    assert alloc.allocate(4096, owner="e") == b


def test_free_coalesces_neighbours() -> None:
    alloc = SlotAllocator(32 * KiB, label="device")
    spans = [alloc.allocate(4096, owner=str(i)) for i in range(8)]
    # free 1 and 3, then 2: the three merge into one extent of 12 KiB
    for i in (1, 3, 2):
        alloc.free(spans[i][0])
    assert alloc.free_extents() == [(4096, 12 * KiB)]
    assert alloc.allocate(12 * KiB, owner="big") == (4096, 12 * KiB)
    for i in (0, 4, 5, 6, 7):
        alloc.free(spans[i][0])
    alloc.free(4096)
    assert alloc.free_extents() == [(0, 32 * KiB)]
    assert alloc.used == 0


def test_random_alloc_free_matches_a_byte_map() -> None:
    """Against an independent reference: a per-unit occupancy list."""
    units = 64
    alloc = SlotAllocator(units * ALIGNMENT, label="device")
    taken = [False] * units
    live: list[tuple[int, int]] = []
    rng = random.Random(0)
    for step in range(2000):
        if live and rng.random() < 0.45:
            offset, length = live.pop(rng.randrange(len(live)))
            alloc.free(offset)
            for u in range(offset // ALIGNMENT, (offset + length) // ALIGNMENT):
                taken[u] = False
            continue
        n = rng.randrange(0, 6 * ALIGNMENT)
        need = slot_bytes(n) // ALIGNMENT
        first_fit = next((u for u in range(units - need + 1) if not any(taken[u : u + need])), None)
        if first_fit is None:
            with pytest.raises(ArenaFullError):
                alloc.allocate(n, owner=f"s{step}")
            continue
        offset, length = alloc.allocate(n, owner=f"s{step}")
        assert offset == first_fit * ALIGNMENT and length == need * ALIGNMENT
        for u in range(first_fit, first_fit + need):
            taken[u] = True
        live.append((offset, length))
        assert alloc.used == sum(taken) * ALIGNMENT


def test_exhaustion_names_tensor_bytes_and_free() -> None:
    alloc = SlotAllocator(8 * KiB, label="device")
    alloc.allocate(4096, owner="a")
    with pytest.raises(ArenaFullError, match=r"'w'.*8192 bytes.*device.*4096 bytes") as info:
        alloc.allocate(5000, owner="w")
    assert isinstance(info.value, ValueError)
    assert "raise the device budget" in str(info.value)
    assert alloc.used == 4096  # nothing changed


def test_device_arena_slots_are_views_of_one_buffer() -> None:
    arena = DeviceArena(64 * KiB + 123, torch.device("cpu"))
    assert arena.capacity == 64 * KiB
    assert arena.buffer.data_ptr() % ALIGNMENT == 0
    slot = arena.allocate(6 * 4, owner="x")
    view = slot.view((2, 3), torch.float32)
    view.copy_(torch.arange(6, dtype=torch.float32).view(2, 3))
    assert view.data_ptr() == arena.buffer.data_ptr() + slot.offset
    assert torch.equal(
        arena.buffer[slot.offset : slot.offset + 24].view(torch.float32), view.view(-1)
    )
    assert slot.raw().numel() == ALIGNMENT and slot.raw().data_ptr() % ALIGNMENT == 0
    arena.free(slot)
    assert arena.used == 0


def test_host_arena_and_staging_pool() -> None:
    arena = HostArena(16 * KiB)
    assert arena.buffer.data_ptr() % ALIGNMENT == 0
    assert arena.pinned == torch.cuda.is_available()
    pool = StagingPool(2, 8 * KiB)
    with pool.borrow() as a, pool.borrow() as b:
        assert pool.available == 0
        assert a.data_ptr() != b.data_ptr()
        assert a.data_ptr() % ALIGNMENT == 0 and a.numel() == 8 * KiB
    assert pool.available == 2
    with pytest.raises(ValueError, match="multiple of 4096"):
        StagingPool(2, 1000)
