"""The CPU double of CUDA's copy semantics (storage.deferred) and the two waits of a Ticket.

Under the double a copy between the device arena and host memory lands in host memory
only when the host synchronises on it (``Ticket.wait_host``, a synchronous store call),
and a host source the caller changes before then is what the copy reads, as on CUDA.
"""

from __future__ import annotations

import time

import pytest
import torch

from storage.deferred import DOUBLE_ENV, double_requested
from storage.store import StateError, StoreConfig, TieredStore
from storage.tiers import Tier
from storage.transfers import MAX_PENDING_TIMINGS

MiB = 1 << 20


def _store(**overrides: object) -> TieredStore:
    config: dict[str, object] = {
        "device_budget": 4 * MiB,
        "host_budget": 4 * MiB,
        "device": "cpu",
        "cuda_double": True,
    }
    config.update(overrides)
    return TieredStore(StoreConfig(**config))  # type: ignore[arg-type]


def _values(n: int = 1000, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, generator=torch.Generator().manual_seed(seed))


def test_the_real_semantics_are_the_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(DOUBLE_ENV, raising=False)
    with TieredStore(StoreConfig(device_budget=MiB, host_budget=MiB, device="cpu")) as store:
        assert store._io.double is None
    monkeypatch.setenv(DOUBLE_ENV, "1")
    with TieredStore(StoreConfig(device_budget=MiB, host_budget=MiB, device="cpu")) as store:
        assert store._io.double is not None
    assert double_requested(False) is False  # the config wins over the environment
    monkeypatch.setenv(DOUBLE_ENV, "maybe")
    with pytest.raises(ValueError, match="BB_CUDA_DOUBLE='maybe'"):
        double_requested(None)


def test_a_device_to_host_read_is_host_visible_only_after_wait_host() -> None:
    x = _values()
    with _store() as store:
        store.register("w", x, home=Tier.DEVICE)
        out = torch.empty_like(x)
        ticket = store.read_async("w", out)
        assert ticket.wait()["w"] is out
        assert torch.isnan(out).all()  # ordered, not landed: the host sees poison
        ticket.wait_host()
        assert torch.equal(out, x)
        out2 = torch.full_like(x, 7.0)
        ticket = store.read_async("w", out2)
        while not ticket.done():  # issued on a copy thread; done() also asks its event
            time.sleep(0.001)
        assert torch.equal(out2, x)
        assert torch.equal(store.read("w"), x)  # a synchronous read synchronises itself


def test_a_host_source_is_read_until_the_copy_completes() -> None:
    """write_back_async(name, pinned_src): changing ``src`` after the ordering wait is
    what the device copy gets; after wait_host it no longer matters."""
    x = _values()
    with _store() as store:
        store.register("w", shape=x.shape, dtype=x.dtype, home=Tier.DEVICE)
        store.register("src", shape=x.shape, dtype=x.dtype, home=Tier.HOST)
        src = store.host_view("src")
        src.copy_(x)
        store.write_back_async("w", src).wait()
        src.zero_()  # too early: the copy has not completed
        assert torch.equal(store.read("w"), torch.zeros_like(x))
        src.copy_(x)
        store.write_back_async("w", src).wait_host()
        src.zero_()
        assert torch.equal(store.read("w"), x)
        assert torch.equal(store.get("w"), x)


def test_an_ordering_wait_lands_device_destinations() -> None:
    """Device work ordered after a host-to-device write sees its data (the device view
    after Ticket.wait), while the copy into host memory of a read waits for the host."""
    x = _values(seed=1)
    with _store() as store:
        store.register("w", shape=x.shape, dtype=x.dtype, home=Tier.DEVICE)
        store.register("src", x, home=Tier.HOST)
        ticket = store.write_back_async("w", store.host_view("src"))
        assert torch.isnan(store.get("w")).all() or torch.equal(store.get("w"), x)
        ticket.wait()
        assert torch.equal(store.get("w"), x)
        ticket.wait_host()


def test_release_keeps_the_last_write_back_for_host_view() -> None:
    """A write-back of a paged-in HOST-home tensor, then release() and host_view(): the
    host view holds the written contents (the write-back's copy, only ordered by
    release(), is synchronised there). Under the double the page-in is a copy into a
    device slot, as on CUDA, so the write-back is a device-to-host copy that lands late."""
    x = _values(seed=2)
    with _store() as store:
        store.register("h", x, home=Tier.HOST)
        assert not store.pages_host_in_place
        dev = store.prefetch_async("h").wait()["h"]
        assert store.usage()[Tier.DEVICE][0] > 0  # a device slot, not the home itself
        with pytest.raises(StateError, match="'h' is RESIDENT"):
            store.host_view("h")  # paged in by copy: the view would miss the device copy
        dev.mul_(2)
        store.write_back_async("h")
        store.release("h")
        assert torch.equal(store.host_view("h"), x * 2)


def test_a_page_in_ordered_after_a_write_back_reads_what_it_wrote() -> None:
    """Page-in, change, write-back (not waited), release, page-in again, several times:
    each page-in is ordered after the write-back into the home it reads, so on the GPU
    it starts once that copy has finished and sees its bytes (neither poison nor the
    bytes before it)."""
    want = _values(seed=5)
    with _store() as store:
        store.register("h", want, home=Tier.HOST)
        for _ in range(3):
            dev = store.prefetch_async("h").wait()["h"]
            assert torch.equal(dev, want)
            dev.add_(1)
            want = want + 1
            store.write_back_async("h")
            store.release("h")
        assert torch.equal(store.read("h"), want)


def test_write_updates_both_copies_of_a_paged_in_host_tensor() -> None:
    """write() of a HOST-home tensor paged in by copy: home and device copy both change."""
    x, y = _values(seed=3), _values(seed=4)
    with _store() as store:
        store.register("h", x, home=Tier.HOST)
        dev = store.prefetch_async("h").wait()["h"]
        store.write("h", y)
        assert torch.equal(dev, y) and torch.equal(store.read("h"), y)
        store.release("h")


def test_pending_timings_stay_bounded_over_10k_copies() -> None:
    """Each copy's timing events are read back as copies go: after 10k copies (each
    synchronised, and then 2k never synchronised) the list of pending timings is bounded
    and the link meters counted every copy."""
    x = _values(256)
    with _store() as store:
        store.register("w", x, home=Tier.DEVICE)
        out = torch.empty_like(x)
        before = store.stats()["d2h"].count
        for _ in range(10_000):
            store.read_async("w", out).wait_host()
        assert store._io.pending_timings <= 1
        for _ in range(2_000):
            store.read_async("w", out).wait()
        assert store._io.pending_timings <= MAX_PENDING_TIMINGS
        store._io.synchronize()
        assert store.stats()["d2h"].count - before == 12_000
        assert store._io.pending_timings == 0
        assert torch.equal(out, x)


def test_host_only_transfers_do_not_wait_for_device_progress() -> None:
    """Reads and writes between host memory and files or the host arena are not ordered
    after the caller's queued device work (only transfers that touch device memory are)."""
    with _store() as store:
        store.register("d", _values(), home=Tier.DEVICE)
        store.register("h", _values(), home=Tier.HOST)
        asked: list[int] = []
        ready = store._io.ready
        store._io.ready = lambda: (asked.append(1), ready())[1]  # type: ignore[method-assign]
        out = torch.empty(1000)
        store.read("h", out)
        store.read_async("h", out).wait_host()
        store.write_back_async("h", out).wait_host()
        assert asked == []
        store.read("d", out)
        store.read_async("d", out).wait_host()
        store.write_back_async("d", out).wait_host()
        assert len(asked) == 3


class _Mark:
    """A timing event of a copy the device has not finished: ``query`` polls, and
    ``synchronize`` (a host wait) is recorded, since the issuing thread must never call it."""

    waits = 0

    def __init__(self, at: float) -> None:
        self.at = at
        self.done = False

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        _Mark.waits += 1
        self.done = True

    def elapsed_time(self, end: _Mark) -> float:
        return (end.at - self.at) * 1e3


def test_issuing_copies_never_waits_on_those_still_running() -> None:
    """Copies issued while earlier ones still run (a gradient copy per tensor from the
    autograd thread, behind a page-in that waits on compute) never block the issuing
    thread: past MAX_PENDING_TIMINGS running copies the records of one stream merge into
    spans, finished ones behind a running one are read back, and every byte and copy is
    counted once the device catches up, with each span's time from its first start to its
    last end."""
    from storage.tiers import Link
    from storage.transfers import Transfers

    io = Transfers(torch.device("cpu"), nvme=None, staging=None, direct_device=False)
    _Mark.waits = 0
    marks: list[_Mark] = []
    copies = 4 * MAX_PENDING_TIMINGS
    try:
        blocker = _Mark(0.0), _Mark(1.0)  # an h2d copy that runs long
        io._time_copy(Link.HOST_TO_DEVICE, 4096, *blocker)
        for k in range(copies):  # 1 ms each, back to back on the stream towards the host
            start, end = _Mark(10.0 + k * 1e-3), _Mark(10.0 + (k + 1) * 1e-3)
            marks += [start, end]
            io._time_copy(Link.DEVICE_TO_HOST, 100, start, end)
            assert io.pending_timings <= MAX_PENDING_TIMINGS + 1
            if k == copies // 2:  # the first half lands, behind the running blocker
                for m in marks:
                    m.done = True
        assert _Mark.waits == 0  # no host wait on any copy
        for m in [*marks, *blocker]:
            m.done = True
        stats = io.stats()
        assert io.pending_timings == 0
        d2h = stats[Link.DEVICE_TO_HOST]
        assert d2h.count == copies and d2h.bytes == 100 * copies
        assert d2h.seconds == pytest.approx(copies * 1e-3, rel=1e-6)  # back to back: no gaps
        assert stats[Link.HOST_TO_DEVICE].count == 1
        assert stats[Link.HOST_TO_DEVICE].seconds == pytest.approx(1.0)
    finally:
        io.shutdown()
