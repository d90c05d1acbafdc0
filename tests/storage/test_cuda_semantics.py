"""CUDA races of the store, with the device kept busy: ``torch.cuda._sleep`` is queued
on the compute stream before each operation, and nothing calls ``synchronize()``; only
the store's own waits stand between the copies and the host.

Each test fails when a copy is only ordered on a stream where the host needed to
wait for it (read into pinned memory, pinned source reused), or when a side-stream
copy is not ordered after the compute stream.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from storage.store import StoreConfig, TieredStore
from storage.tiers import Tier
from storage.transfers import MAX_PENDING_TIMINGS

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

MiB = 1 << 20
N = 16 * MiB  # fp32 elements: 64 MiB per tensor (small tensors hide the races)
BUSY = int(2e8)  # GPU cycles of the sleep kernel (about 0.1 s)


@pytest.fixture
def store() -> Iterator[TieredStore]:
    with TieredStore(
        StoreConfig(device_budget=512 * MiB, host_budget=512 * MiB, device="cuda")
    ) as s:
        yield s


def _values(seed: int = 0) -> torch.Tensor:
    return torch.randn(N, generator=torch.Generator().manual_seed(seed))


def test_read_async_of_a_device_home_tensor_waits_on_the_host(store: TieredStore) -> None:
    x = _values()
    store.register("w", x, home=Tier.DEVICE)
    out = torch.empty(N).pin_memory()
    torch.cuda._sleep(BUSY)
    store.read_async("w", out).wait_host()
    assert torch.equal(out, x)


def test_host_view_after_write_back_and_release(store: TieredStore) -> None:
    x = _values(1)
    store.register("h", x, home=Tier.HOST)
    store.prefetch_async("h").wait()
    torch.cuda._sleep(BUSY)
    store.get("h").mul_(2)  # queued behind the sleep
    store.write_back_async("h")
    store.release("h")
    assert torch.equal(store.host_view("h"), x * 2)


def test_a_pinned_source_may_change_once_its_write_completed(store: TieredStore) -> None:
    x = _values(2)
    store.register("w", shape=(N,), dtype=torch.float32, home=Tier.DEVICE)
    store.register("src", x, home=Tier.HOST)
    src = store.host_view("src")
    torch.cuda._sleep(BUSY)
    store.write_back_async("w", src).wait_host()
    src.zero_()
    assert torch.equal(store.get("w").cpu(), x)


def test_register_from_a_cuda_tensor_comes_after_its_producer(store: TieredStore) -> None:
    x = torch.empty(N, device="cuda")
    torch.cuda._sleep(BUSY)
    x.fill_(3.0)  # queued behind the sleep: the copy must wait for it
    store.register("r", x, home=Tier.HOST)
    assert torch.equal(store.read("r"), torch.full((N,), 3.0))


def test_a_freed_cuda_source_is_kept_for_its_device_write(store: TieredStore) -> None:
    store.register("w", shape=(N,), dtype=torch.float32, home=Tier.DEVICE)
    src = torch.full((N,), 5.0, device="cuda")
    torch.cuda._sleep(BUSY)
    ticket = store.write_back_async("w", src)
    del src
    torch.zeros(N, device="cuda")  # would take the freed block without record_stream
    ticket.wait_host()
    assert torch.equal(store.get("w").cpu(), torch.full((N,), 5.0))


def test_timing_events_stay_bounded_over_10k_copies(store: TieredStore) -> None:
    store.register("small", torch.arange(256.0), home=Tier.DEVICE)
    out = torch.empty(256).pin_memory()
    for _ in range(10_000):
        store.read_async("small", out).wait()
    assert store._io.pending_timings <= MAX_PENDING_TIMINGS
    store._io.synchronize()
    assert torch.equal(out, torch.arange(256.0))
    assert store.stats()["d2h"].count >= 10_000
