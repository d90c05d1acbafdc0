"""Copy links by one name (:class:`storage.tiers.Link`) and the store's transfer observers."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest
import torch

from storage import PRICED_LINKS, Link, StoreConfig, Tier, TieredStore, TransferKind
from storage.transfers import LINKS

MiB = 1 << 20


class Seen:
    """A transfer observer that records each call with its thread."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, TransferKind, str, str]] = []
        self._lock = threading.Lock()

    def transfer_started(self, kind: TransferKind, name: str) -> None:
        with self._lock:
            self.calls.append(("start", kind, name, threading.current_thread().name))

    def transfer_finished(self, kind: TransferKind, name: str) -> None:
        with self._lock:
            self.calls.append(("end", kind, name, threading.current_thread().name))


def _store(tmp_path: Path) -> TieredStore:
    nvme = tmp_path / "nvme"
    nvme.mkdir()
    return TieredStore(
        StoreConfig(
            device_budget=4 * MiB,
            host_budget=4 * MiB,
            nvme_path=str(nvme),
            nvme_budget=16 * MiB,
            device="cpu",
        )
    )


def test_link_names_its_tiers_and_its_priced_link() -> None:
    assert LINKS == tuple(Link) and len(set(LINKS)) == 6
    # one name per link, the plan's and the hardware profile's (``h2d_bandwidth``)
    ends = {
        "nvme_read": ("nvme", "host"),
        "nvme_write": ("host", "nvme"),
        "h2d": ("host", "device"),
        "d2h": ("device", "host"),
        "nvme_read_direct": ("nvme", "device"),
        "nvme_write_direct": ("device", "nvme"),
    }
    assert {link.value for link in Link} == set(ends)
    for link in Link:
        src, dst = ends[link.value]
        assert (link.source, link.destination) == (Tier(src), Tier(dst))
        assert Link.between(Tier(src), Tier(dst)) is link
        assert link == link.value and f"{link}" == link.value  # a plain string where printed
        # a file transfer is priced as the disk's read or write, the others as themselves
        want = {"nvme": "nvme_read", "host": "nvme_write"}
        expected = want["nvme"] if src == "nvme" else want["host"] if dst == "nvme" else link
        assert link.priced_as == expected and link.priced_as in PRICED_LINKS
    assert all(Link.between(t, t) is None for t in Tier)


def test_stats_are_keyed_by_link_and_round_trip_through_json(tmp_path: Path) -> None:
    data = torch.arange(1000, dtype=torch.float32)
    with _store(tmp_path) as store:
        store.register("w", data, home=Tier.NVME)
        store.prefetch_async("w").wait()
        store.release("w")
        store.read("w")
        stats = store.stats()
    assert set(stats) == set(Link) and all(isinstance(k, Link) for k in stats)
    # a CPU device: the page-in reads into the device arena, read() into host memory
    assert stats[Link.NVME_TO_DEVICE].bytes == data.numel() * 4 == stats["nvme_read"].bytes
    text = json.dumps({link: s.bytes for link, s in stats.items()})
    assert json.loads(text) == {link.value: s.bytes for link, s in stats.items()}
    assert {Link(k): v for k, v in json.loads(text).items()} == {
        k: s.bytes for k, s in stats.items()
    }


def test_observers_see_each_transfer_on_its_copy_thread(tmp_path: Path) -> None:
    seen, late = Seen(), Seen()
    with _store(tmp_path) as store:
        store.register("a", torch.ones(256), home=Tier.NVME)
        store.register("b", torch.zeros(64), home=Tier.HOST)
        store.add_observer(seen)
        with pytest.raises(ValueError, match="already observing"):
            store.add_observer(seen)
        store.prefetch_async(["a", "b"]).wait()
        store.write_back_async("a", torch.full((256,), 2.0)).wait()
        store.release(["a", "b"])
        out = torch.empty(256)
        store.read_async("a", out).wait()
        store.add_observer(late)
        store.remove_observer(seen)
        store.prefetch_async("a").wait()
        store.release("a")
    assert torch.equal(out, torch.full((256,), 2.0))
    ends = [(kind, name) for what, kind, name, _ in seen.calls if what == "end"]
    assert sorted(ends) == sorted(
        [
            (TransferKind.PAGE_IN, "a"),
            (TransferKind.PAGE_IN, "b"),  # paged in place (host memory is the CPU device's)
            (TransferKind.WRITE_BACK, "a"),
            (TransferKind.READ, "a"),
        ]
    )
    for what, kind, name, thread in seen.calls:  # each start has its end, on one thread
        assert thread.startswith("bb-store") and thread != threading.current_thread().name
        if what == "start":
            assert ("end", kind, name, thread) in seen.calls
    assert [(c[0], c[1], c[2]) for c in late.calls] == [
        ("start", TransferKind.PAGE_IN, "a"),
        ("end", TransferKind.PAGE_IN, "a"),
    ]
