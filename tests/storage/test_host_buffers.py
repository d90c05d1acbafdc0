"""Host arena and staging buffers: mapped at exactly their size, released at close.

PyTorch's pinned allocator rounds a request up to a power of two and caches the block
after free, and the old +4096 alignment slack doubled budgets of exactly 2**k bytes.
"""

from __future__ import annotations

import gc
from pathlib import Path

import pytest
import torch

from storage.device import DeviceArena
from storage.host import HostArena, HostBuffer, StagingPool, mapped_bytes
from storage.io import IOConfig
from storage.store import StoreConfig, TieredStore
from storage.tiers import Tier

MiB = 1 << 20


def test_a_power_of_two_arena_maps_exactly_its_size() -> None:
    before = mapped_bytes()
    arena = HostArena(4 * MiB)
    assert arena.buffer.numel() == 4 * MiB
    assert arena.buffer.untyped_storage().nbytes() == 4 * MiB  # no +4096, no rounding
    assert arena.buffer.data_ptr() % 4096 == 0
    assert mapped_bytes() - before == 4 * MiB
    arena.release()
    assert mapped_bytes() == before and arena.host.released
    gc.collect()
    assert arena.host.unmapped  # no slot or view left: the memory is gone


def test_store_close_releases_host_arena_and_staging(tmp_path: Path) -> None:
    before = mapped_bytes()
    config = StoreConfig(
        device_budget=MiB,
        host_budget=8 * MiB,
        nvme_path=str(tmp_path / "nvme"),
        nvme_budget=8 * MiB,
        staging_buffers=2,
        staging_bytes=MiB,
        io=IOConfig(backend="posix"),
        device="cpu",
    )
    store = TieredStore(config)
    assert mapped_bytes() - before == 8 * MiB + 2 * MiB
    store.register("x", torch.arange(1000.0), home=Tier.HOST)
    assert torch.equal(store.read("x"), torch.arange(1000.0))
    store.close()
    assert mapped_bytes() == before


def test_a_released_buffer_viewed_elsewhere_stays_readable() -> None:
    """Views kept past release() still read their bytes (the mapping goes with them)."""
    buf = HostBuffer(3 * 4096 + 1)
    assert buf.nbytes == 4 * 4096
    view = buf.tensor[:10]
    view.fill_(7)
    buf.release()
    assert view.tolist() == [7] * 10 and not buf.unmapped
    del view
    gc.collect()
    assert buf.unmapped
    pool = StagingPool(2, 4096)
    pool.release()
    assert pool.available == 0


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_pinned_bytes_of_a_store_do_not_exceed_its_host_budget() -> None:
    """TieredStore(host_budget=B) pins at most B + 8 MiB of host memory (RSS and the
    torch pinned allocator), and the arena is page-locked."""
    budget = 256 * MiB
    torch.empty(1, device="cuda")  # the CUDA context first: its own host memory
    torch.cuda.synchronize()
    rss = _rss()
    key = "allocated_bytes.all.current"
    host_alloc = torch.cuda.host_memory_stats().get(key, 0)
    store = TieredStore(StoreConfig(device_budget=16 * MiB, host_budget=budget, device="cuda"))
    try:
        assert store._host_arena.pinned
        assert store._host_arena.buffer.is_pinned()
        assert _rss() - rss <= budget + 8 * MiB
        assert torch.cuda.host_memory_stats().get(key, 0) - host_alloc <= 8 * MiB
    finally:
        store.close()
    assert not store._host_arena.pinned


def _vm_flags(address: int) -> list[str]:
    """The ``VmFlags`` of this process's mapping that holds ``address`` (/proc/self/smaps)."""
    flags: list[str] | None = None
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            start, end = (int(x, 16) for x in head.split("-"))
            inside = start <= address < end
        elif inside and head == "VmFlags:":
            flags = line.split()[1:]
    assert flags is not None, f"no mapping holds {address:#x}"
    return flags


@pytest.mark.skipif(not Path("/proc/self/smaps").exists(), reason="Linux's /proc only")
def test_the_arenas_on_a_cpu_are_private_mappings_that_ask_for_huge_pages() -> None:
    """The host arena and a CPU device's arena: private mappings (a shared one is shmem,
    which the kernel's default keeps out of transparent huge pages) advised
    ``MADV_HUGEPAGE`` ("hg"), so ``O_DIRECT`` transfers pin huge pages, and
    ``MADV_DONTFORK`` ("dc"), so a forked DataLoader worker keeps no copy of them; a buffer
    smaller than a huge page is not advised huge pages."""
    host, device = HostArena(8 * MiB, pin=False), DeviceArena(8 * MiB, torch.device("cpu"))
    for arena in (host, device):
        arena.buffer[:: 1 << 12] = 1  # touched
        flags = _vm_flags(arena.buffer.data_ptr())
        assert {"hg", "dc"} <= set(flags) and "sh" not in flags, (arena, flags)
    small = HostBuffer(MiB, pin=False)
    flags = _vm_flags(small.tensor.data_ptr())
    assert "hg" not in flags and "dc" in flags
    small.release()
    host.release()
