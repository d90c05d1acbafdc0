"""TieredStore used from two threads at once, on disjoint tensors (the training engine's pattern).

The engine's gradient worker reads and writes one block's optimizer state and weights
(``read`` / ``write``) while the training thread pages other blocks in and out
(``prefetch_async`` / ``wait`` / ``get`` / ``release``). Shared parts of the store (copy
threads, staging pool, NVMe tier, link meters) must keep every tensor's contents intact.
"""

from __future__ import annotations

import threading
from pathlib import Path

import torch

from storage.io import IOConfig
from storage.observers import TransferKind
from storage.store import StoreConfig, TieredStore
from storage.tiers import Residency, Tier

MiB = 1 << 20
N = 6
"""Tensors per side (worker side and paging side), homes alternating HOST / NVME."""
ROUNDS = 40


def _home(i: int) -> Tier:
    return Tier.NVME if i % 2 else Tier.HOST


def test_worker_read_write_while_main_thread_pages(tmp_path: Path) -> None:
    config = StoreConfig(
        device_budget=8 * MiB,
        host_budget=8 * MiB,
        nvme_path=str(tmp_path / "nvme"),
        nvme_budget=64 * MiB,
        staging_buffers=2,
        staging_bytes=64 << 10,  # smaller than a tensor: staged transfers go piece by piece
        stage_nvme=True,
        io=IOConfig(backend="posix", threads=2, task_size=16 << 10),
        device="cpu",
    )
    numel = 50_000  # 200 kB each, four staging pieces
    g = torch.Generator().manual_seed(0)
    paged = [torch.randn(numel, generator=g) for _ in range(N)]
    with TieredStore(config) as store:
        for i in range(N):
            store.register(f"w{i}", torch.zeros(numel), home=_home(i))
            store.register(f"p{i}", paged[i], home=_home(i))
        errors: list[BaseException] = []

        def worker() -> None:  # read-modify-write, as a block's optimizer step does
            try:
                buf = torch.empty(numel)
                for r in range(ROUNDS):
                    i = r % N
                    store.read(f"w{i}", out=buf)
                    buf.add_(1.0)
                    store.write(f"w{i}", buf)
            except BaseException as exc:
                errors.append(exc)

        thread = threading.Thread(target=worker)
        thread.start()
        pages = 0
        while thread.is_alive() or pages < ROUNDS:
            i = pages % N
            ticket = store.prefetch_async([f"p{i}"])
            got = ticket.wait()[f"p{i}"]
            assert torch.equal(got, paged[i]) and store.state(f"p{i}") is Residency.RESIDENT
            assert torch.equal(store.get(f"p{i}"), paged[i])
            store.release([f"p{i}"])
            pages += 1
        thread.join()
        assert errors == []
        counts = [len(range(i, ROUNDS, N)) for i in range(N)]  # increments each tensor got
        for i in range(N):
            torch.testing.assert_close(store.read(f"w{i}"), torch.full((numel,), float(counts[i])))
            assert torch.equal(store.read(f"p{i}"), paged[i])
        assert store.usage()[Tier.DEVICE][0] == 0


class _ThreadCounts:
    """Records the copy thread's torch intra-op thread count at each transfer."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, int]] = []
        self._lock = threading.Lock()

    def transfer_started(self, kind: object, name: str) -> None:
        with self._lock:
            self.seen.append((name, torch.get_num_threads()))

    def transfer_finished(self, kind: object, name: str) -> None:
        pass


def _cpu_store(tmp_path: Path) -> StoreConfig:
    """A CPU store with 8 MiB device and host tiers, NVMe under ``tmp_path``, two disk threads."""
    return StoreConfig(
        device_budget=8 * MiB,
        host_budget=8 * MiB,
        nvme_path=str(tmp_path / "nvme"),
        nvme_budget=64 * MiB,
        io=IOConfig(backend="posix", threads=2),
        device="cpu",
    )


def test_copy_threads_of_a_cpu_store_run_torch_ops_on_one_thread(tmp_path: Path) -> None:
    """On a CPU device the copy threads form no OpenMP teams of their own beside the
    compute's (see storage/threads.py); every other thread keeps the process's count."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        config = _cpu_store(tmp_path)
        counts = _ThreadCounts()
        with TieredStore(config) as store:
            store.add_observer(counts)
            for home in (Tier.DEVICE, Tier.HOST, Tier.NVME):
                x = torch.randn(10_000)
                store.register(home.value, torch.zeros_like(x), home=home)
                store.write(home.value, x)  # a write-back from a host tensor
                assert torch.equal(store.read(home.value), x)
                got = store.prefetch_async([home.value]).wait()[home.value]
                assert torch.equal(got, x)
                store.release([home.value])
            later: list[int] = []
            thread = threading.Thread(target=lambda: later.append(torch.get_num_threads()))
            thread.start()
            thread.join()
        assert {"host", "nvme"} <= {name for name, _ in counts.seen}
        assert {n for _, n in counts.seen} == {1}
        assert torch.get_num_threads() == 2 and later == [2]
    finally:
        torch.set_num_threads(before)


def test_a_page_in_does_not_queue_behind_disk_write_backs(tmp_path: Path) -> None:
    """While every disk thread of the store is busy writing optimizer-state-like tensors
    back to NVMe, a block's page-in from NVMe still runs: the compute waits only for its
    own weights, not for the disk traffic queued before them."""
    threads = 2
    config = _cpu_store(tmp_path)
    numel = 50_000
    weights = torch.arange(numel, dtype=torch.float32)
    gate = threading.Event()
    started = threading.Semaphore(0)

    class HoldWriteBacks:  # a disk slow enough that the write-backs are still running
        def transfer_started(self, kind: TransferKind, name: str) -> None:
            if kind is TransferKind.WRITE_BACK:
                started.release()
                gate.wait(timeout=60)

        def transfer_finished(self, kind: TransferKind, name: str) -> None:
            pass

    with TieredStore(config) as store:
        store.register("block", weights, home=Tier.NVME)
        for i in range(threads + 2):
            store.register(f"state{i}", torch.zeros(numel), home=Tier.NVME)
        store.add_observer(HoldWriteBacks())
        held = [store.write_back_async(f"state{i}", torch.full((numel,), float(i)))
                for i in range(threads + 2)]  # fmt: skip
        for _ in range(threads):  # every disk thread for write-backs is now held
            assert started.acquire(timeout=60)
        got: dict[str, torch.Tensor] = {}
        paging = threading.Thread(target=lambda: got.update(store.prefetch_async("block").wait()))
        paging.start()
        paging.join(timeout=60)
        page_in_done = not paging.is_alive()
        write_backs_running = not any(t.done() for t in held)
        gate.set()
        paging.join()
        for ticket in held:
            ticket.wait()
        assert page_in_done, "the page-in waited for the write-backs queued before it"
        assert write_backs_running
        assert torch.equal(got["block"].view(torch.float32)[:numel], weights)
        store.release("block")
        for i in range(threads + 2):
            assert torch.equal(store.read(f"state{i}"), torch.full((numel,), float(i)))
