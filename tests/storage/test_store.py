"""TieredStore: contents, residency transitions, budgets, stats, reopening."""

from __future__ import annotations

import importlib.util
import itertools
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import zarr

import storage.io as sio
import storage.transfers as transfers
from storage.device import ArenaFullError
from storage.io import IOConfig
from storage.nvme import DTYPES as NVME_DTYPES
from storage.nvme import StoreLockedError
from storage.store import ResidencyMachine, StateError, StoreConfig, TieredStore
from storage.tiers import Residency, Tier

MiB = 1 << 20
DTYPES = list(NVME_DTYPES)  # every dtype the store supports (bf16, fp16, fp32, int8, ...)
TIERS = [Tier.DEVICE, Tier.HOST, Tier.NVME]


def make_config(path: Path, **overrides: object) -> StoreConfig:
    base: dict[str, object] = {
        "device_budget": 8 * MiB,
        "host_budget": 8 * MiB,
        "nvme_path": str(path / "nvme"),
        "nvme_budget": 64 * MiB,
        "staging_buffers": 2,
        "staging_bytes": 1 * MiB,
        "io": IOConfig(backend="posix", threads=2, task_size=256 << 10),
        "device": "cpu",
    }
    base.update(overrides)
    return StoreConfig(**base)  # type: ignore[arg-type]


@pytest.fixture
def store(tmp_path: Path) -> Iterator[TieredStore]:
    with TieredStore(make_config(tmp_path)) as s:
        yield s


def sample(dtype: torch.dtype, shape: tuple[int, ...] = (5, 37), seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.rand(shape, generator=g) > 0.5
    if dtype.is_floating_point:
        return (torch.randn(shape, generator=g) * 3).to(dtype)
    info = torch.iinfo(dtype)
    return torch.randint(max(info.min, -1000), min(info.max, 1000), shape, generator=g).to(dtype)


def zarr_contents(store_dir: Path, name: str) -> np.ndarray:
    """The tensor as plain zarr reads it (bf16 is stored as uint16)."""
    return np.asarray(zarr.open_array(str(store_dir / "nvme" / name), mode="r")[...])


def as_numpy(t: torch.Tensor) -> np.ndarray:
    return (t.view(torch.uint16) if t.dtype == torch.bfloat16 else t).numpy()


@pytest.mark.parametrize("home", TIERS, ids=lambda t: t.value)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_round_trip_every_dtype_and_tier(
    store: TieredStore, home: Tier, dtype: torch.dtype
) -> None:
    x = sample(dtype)
    store.register("w", x, home=home)
    assert store.home("w") is home
    assert torch.equal(store.read("w"), x)
    expected_state = Residency.RESIDENT if home is Tier.DEVICE else Residency.RELEASED
    assert store.state("w") is expected_state
    got = store.prefetch_async("w").wait()["w"]
    assert got.dtype == dtype and got.shape == x.shape and torch.equal(got, x)
    assert torch.equal(store.get("w"), x)
    store.release("w")
    assert store.state("w") is expected_state


@pytest.mark.parametrize("shape", [(), (0,), (3, 0, 2), (4097,)], ids=str)
@pytest.mark.parametrize("home", TIERS, ids=lambda t: t.value)
def test_odd_shapes(store: TieredStore, home: Tier, shape: tuple[int, ...]) -> None:
    x = sample(torch.float32, shape)
    store.register("w", x, home=home)
    assert torch.equal(store.read("w"), x)
    assert torch.equal(store.prefetch_async(["w"]).wait()["w"], x)


@pytest.mark.parametrize("home", TIERS, ids=lambda t: t.value)
def test_register_from_shape_is_zeros(store: TieredStore, tmp_path: Path, home: Tier) -> None:
    store.register("z", shape=(3, 1000), dtype=torch.bfloat16, home=home)
    zeros = torch.zeros(3, 1000, dtype=torch.bfloat16)
    assert store.spec("z").nbytes == 6000
    if home is Tier.NVME:  # metadata only until the first write
        assert not (tmp_path / "nvme" / "z" / "c").exists()
        assert zarr.open_array(str(tmp_path / "nvme" / "z"), mode="r").shape == (3, 1000)
    assert torch.equal(store.read("z"), zeros)
    assert torch.equal(store.prefetch_async("z").wait()["z"], zeros)


def test_page_in_lifecycle_and_several_tickets(store: TieredStore) -> None:
    xs = {f"t{i}": sample(torch.float32, (64, 100), seed=i) for i in range(6)}
    for i, (name, x) in enumerate(xs.items()):
        store.register(name, x, home=Tier.NVME if i % 2 else Tier.HOST)
    tickets = [store.prefetch_async(["t0", "t1"]), store.prefetch_async("t2"),
               store.prefetch_async(("t3", "t4", "t5"))]  # fmt: skip
    assert {store.state(n) for n in xs} == {Residency.IN_FLIGHT}
    got: dict[str, torch.Tensor] = {}
    for ticket in reversed(tickets):
        got.update(ticket.wait())
        assert ticket.done()
    assert {store.state(n) for n in xs} == {Residency.RESIDENT}
    for name, x in xs.items():
        assert torch.equal(got[name], x) and torch.equal(store.get(name), x)
    ptrs = {t.data_ptr() for t in got.values()}
    assert len(ptrs) == 6  # distinct slots
    store.release(list(xs))
    assert {store.state(n) for n in xs} == {Residency.RELEASED}
    assert store.usage()[Tier.DEVICE][0] == 0


def test_illegal_transitions_raise(store: TieredStore) -> None:
    store.register("a", sample(torch.float32), home=Tier.NVME)
    with pytest.raises(StateError, match=r"'a' is RELEASED.*'release'"):
        store.release("a")
    with pytest.raises(StateError, match=r"'a' is RELEASED"):
        store.get("a")
    with pytest.raises(StateError, match=r"'a' is RELEASED"):
        store.write_back_async("a")
    ticket = store.prefetch_async("a")
    with pytest.raises(StateError, match=r"'a' is IN_FLIGHT.*'release'.*wait on its ticket"):
        store.release("a")
    with pytest.raises(StateError, match=r"'a' is IN_FLIGHT.*'page_in'"):
        store.prefetch_async("a")
    with pytest.raises(StateError, match=r"'a' is IN_FLIGHT"):
        store.get("a")
    with pytest.raises(StateError, match=r"'a' is IN_FLIGHT.*move"):
        store.move("a", Tier.HOST)
    ticket.wait()
    with pytest.raises(StateError, match=r"'a' is RESIDENT.*'page_in'"):
        store.prefetch_async("a")
    with pytest.raises(StateError, match=r"'a' is RESIDENT.*move"):
        store.move("a", Tier.HOST)
    # a failed check in a batch starts nothing
    store.register("b", sample(torch.float32), home=Tier.HOST)
    with pytest.raises(StateError):
        store.prefetch_async(["b", "a"])
    assert store.state("b") is Residency.RELEASED
    assert issubclass(StateError, ValueError)
    with pytest.raises(KeyError, match="'nope' is not registered"):
        store.get("nope")


def test_transition_table_is_the_only_way() -> None:
    events = {event for _, event in ResidencyMachine.TRANSITIONS}
    for state, event in itertools.product(Residency, events):
        machine = ResidencyMachine("x", state)
        nxt = ResidencyMachine.TRANSITIONS.get((state, event))
        if nxt is None:
            with pytest.raises(StateError, match=rf"'x' is {state.value.upper()}.*'{event}'"):
                machine.apply(event)
            assert machine.state is state
        else:
            assert machine.apply(event) is nxt


def test_device_home_is_always_resident(store: TieredStore) -> None:
    x = sample(torch.float16)
    store.register("d", x, home=Tier.DEVICE)
    first = store.get("d")
    assert torch.equal(store.prefetch_async("d").wait()["d"], x)
    store.release("d")  # a no-op for DEVICE home
    assert store.state("d") is Residency.RESIDENT
    assert store.get("d").data_ptr() == first.data_ptr()


@pytest.mark.parametrize("home", TIERS, ids=lambda t: t.value)
def test_write_back_then_read(store: TieredStore, tmp_path: Path, home: Tier) -> None:
    x = sample(torch.bfloat16, (33, 65))
    store.register("w", x, home=home)
    dev = store.prefetch_async("w").wait()["w"]
    dev.mul_(2)
    store.write_back_async("w").wait()
    assert torch.equal(store.get("w"), x * 2)  # the device copy stays usable
    assert torch.equal(store.read("w"), x * 2)
    y = sample(torch.bfloat16, (33, 65), seed=9)
    store.write_back_async("w", y).wait()
    assert torch.equal(store.read("w"), y)
    if home is Tier.NVME:
        np.testing.assert_array_equal(zarr_contents(tmp_path, "w"), as_numpy(y))


@pytest.mark.parametrize("scratch", [False, True])
def test_page_in_waits_for_write_back_in_flight(store: TieredStore, scratch: bool) -> None:
    """A page-in issued right after a write-back must see the new contents (a scratch
    tensor's second write goes over its chunk in place)."""
    for rnd in range(3):
        x = sample(torch.float32, (1024, 1024), seed=rnd)  # 4 MiB: several I/O tasks
        name = f"big{rnd}"
        store.register(name, shape=x.shape, dtype=x.dtype, home=Tier.NVME, scratch=scratch)
        store.write_back_async(name, x)  # not waited on
        assert torch.equal(store.prefetch_async(name).wait()[name], x)
        dev = store.get(name)
        dev.add_(1)
        store.write_back_async(name)
        store.release(name)  # waits for the write-back still reading the slot
        assert torch.equal(store.prefetch_async(name).wait()[name], x + 1)
        store.release(name)


@pytest.mark.parametrize("scratch", [False, True])
@pytest.mark.parametrize("home", [Tier.HOST, Tier.NVME])
@pytest.mark.parametrize("shape", [(128, 1024), (33, 65)])
def test_read_async_after_write_back_in_flight(
    store: TieredStore,
    monkeypatch: pytest.MonkeyPatch,
    home: Tier,
    shape: tuple[int, ...],
    scratch: bool,
) -> None:
    """read_async lands after a write-back issued before it; a whole number of aligned
    4 KiB blocks is read straight into an aligned out, anything else through staging."""
    staged: list[int] = []
    original = transfers.Transfers._staged_read

    def counting(self: object, rec: object, *args: object) -> object:
        staged.append(1)
        return original(self, rec, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(transfers.Transfers, "_staged_read", counting)
    store.register("never", shape=shape, dtype=torch.float32, home=home)
    out = torch.full(shape, 7.0)
    assert torch.equal(store.read_async("never", out).wait()["never"], torch.zeros(shape))
    for rnd in range(3):
        x = sample(torch.float32, shape, seed=rnd)
        name = f"t{rnd}"
        store.register(name, shape=shape, dtype=torch.float32, home=home, scratch=scratch)
        store.write_back_async(name, -x)
        store.write_back_async(name, x)  # not waited on; a scratch tensor's goes in place
        aligned = sio.aligned_empty(x.numel() * 4).view(torch.float32)[: x.numel()].view(shape)
        got = store.read_async(name, aligned).wait()[name]
        assert got.data_ptr() == aligned.data_ptr() and torch.equal(got, x)
        offset = torch.empty(x.numel() + 1)[1:].view(shape)  # 4 bytes past an aligned start
        assert torch.equal(store.read(name, out=offset), x)
    if home is Tier.NVME:
        whole = shape == (128, 1024)
        # aligned and whole: direct (staged only for the offset out); else staged each time
        assert len(staged) == (3 if whole else 6)
    with pytest.raises(ValueError, match="contiguous CPU tensor"):
        store.read_async("t0", torch.empty(shape[::-1]).t())


def test_scratch_tensors_are_written_back_over_their_own_chunks(tmp_path: Path) -> None:
    """Registered as scratch (on NVMe, moved there, or adopted again), a tensor's chunk is
    written over in place; any other NVMe tensor's write is a new file renamed onto it."""
    x = sample(torch.int32, (256, 1024))

    def inode(name: str) -> int:
        return (tmp_path / "nvme" / name / "c" / "0" / "0").stat().st_ino  # the one chunk

    with TieredStore(make_config(tmp_path)) as store:
        store.register("state", x, home=Tier.NVME, scratch=True)
        store.register("weights", x, home=Tier.NVME)
        store.register("later", x, home=Tier.HOST, scratch=True)
        store.move("later", Tier.NVME)
        before = {name: inode(name) for name in ("state", "weights", "later")}
        for k in (1, 2):
            for name in before:
                store.prefetch_async(name).wait()[name].add_(1)
                store.write_back_async(name).wait()
                store.release(name)
                if name == "weights" and k == 1:
                    assert inode(name) != before[name]
        for name in before:
            assert torch.equal(store.read(name), x + 2)
        assert inode("state") == before["state"] and inode("later") == before["later"]
    with TieredStore(make_config(tmp_path)) as store:
        store.register("state", home=Tier.NVME, scratch=True)
        store.write("state", -x)
        assert torch.equal(store.read("state"), -x) and inode("state") == before["state"]
    np.testing.assert_array_equal(zarr_contents(tmp_path, "state"), as_numpy(-x))


def test_write_updates_home_and_device_copy(store: TieredStore, tmp_path: Path) -> None:
    store.register("w", sample(torch.int64), home=Tier.NVME)
    store.prefetch_async("w").wait()
    y = sample(torch.int64, seed=3)
    store.write("w", y)
    assert torch.equal(store.get("w"), y)
    assert torch.equal(store.read("w"), y)
    np.testing.assert_array_equal(zarr_contents(tmp_path, "w"), y.numpy())
    out = torch.empty_like(y)
    assert store.read("w", out) is out and torch.equal(out, y)
    with pytest.raises(ValueError, match=r"shape \(5, 37\).*given tensor has \(2,\)"):
        store.write("w", torch.zeros(2, dtype=torch.int64))


@pytest.mark.parametrize(("src", "dst"), list(itertools.permutations(TIERS, 2)),
                         ids=lambda t: t.value)  # fmt: skip
def test_move_keeps_contents(store: TieredStore, tmp_path: Path, src: Tier, dst: Tier) -> None:
    x = sample(torch.bfloat16, (17, 300))
    store.register("m", x, home=src)
    before = store.usage()
    store.move("m", dst)
    after = store.usage()
    footprint = {Tier.DEVICE: 12288, Tier.HOST: 12288, Tier.NVME: 17 * 300 * 2}  # 4 KiB slots
    assert after[src][0] == before[src][0] - footprint[src]
    assert after[dst][0] == before[dst][0] + footprint[dst]
    assert store.home("m") is dst
    assert torch.equal(store.read("m"), x)
    expected = Residency.RESIDENT if dst is Tier.DEVICE else Residency.RELEASED
    assert store.state("m") is expected
    assert torch.equal(store.prefetch_async("m").wait()["m"], x)
    if dst is Tier.NVME:
        np.testing.assert_array_equal(zarr_contents(tmp_path, "m"), as_numpy(x))
    if src is Tier.NVME:
        assert not (tmp_path / "nvme" / "m").exists()


def test_over_budget_register_and_move_change_nothing(tmp_path: Path) -> None:
    config = make_config(tmp_path, device_budget=64 << 10, host_budget=64 << 10,
                         nvme_budget=70_000)  # fmt: skip
    with TieredStore(config) as store:
        x = sample(torch.float32, (100, 100))  # 40000 bytes
        store.register("a", x, home=Tier.HOST)
        store.register("n", x, home=Tier.NVME)
        usage = store.usage()
        with pytest.raises(ValueError, match=r"'b'.*40960 bytes.*host.*24576 bytes"):
            store.register("b", x, home=Tier.HOST)
        with pytest.raises(ValueError, match=r"'c' needs.*40000 bytes.*nvme.*30000 bytes"):
            store.register("c", torch.zeros(10_000), home=Tier.NVME)
        store.register("d", x, home=Tier.DEVICE)
        with pytest.raises(ValueError, match=r"'e'.*40960 bytes.*device.*24576 bytes"):
            store.register("e", shape=(100, 100), dtype=torch.float32, home=Tier.DEVICE)
        with pytest.raises(ValueError, match=r"'a'.*40960 bytes.*device.*24576 bytes"):
            store.move("a", Tier.DEVICE)
        with pytest.raises(ValueError, match=r"'d' needs.*40000 bytes.*nvme.*30000 bytes"):
            store.move("d", Tier.NVME)
        with pytest.raises(ValueError, match=r"'n'.*40960 bytes.*host.*24576 bytes"):
            store.move("n", Tier.HOST)
        assert store.names() == ["a", "d", "n"]
        assert store.usage()[Tier.HOST] == usage[Tier.HOST]
        assert store.usage()[Tier.NVME] == usage[Tier.NVME]
        assert store.home("a") is Tier.HOST and store.home("d") is Tier.DEVICE
        assert all(torch.equal(store.read(n), x) for n in ("a", "d", "n"))
        # page-ins beyond the device arena fail before anything starts
        store.register("s", torch.ones(10), home=Tier.NVME)  # host-home ones page in place
        with pytest.raises(ArenaFullError, match=r"'n'.*40960 bytes.*device arena.*20480 bytes"):
            store.prefetch_async(["s", "n"])
        assert store.state("s") is Residency.RELEASED and store.usage()[Tier.DEVICE][0] == 40960


@pytest.mark.parametrize("stage", [False, True], ids=["direct", "staged"])
def test_page_in_allocates_no_tensors(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, stage: bool
) -> None:
    """Page-ins land in arena slots (through staging buffers): no tensor is allocated."""
    with TieredStore(make_config(tmp_path, stage_nvme=stage)) as store:
        xs = {"h": sample(torch.float32, (300, 100)), "n": sample(torch.bfloat16, (700, 1000))}
        store.register("h", xs["h"], home=Tier.HOST)
        store.register("n", xs["n"], home=Tier.NVME)  # 1.4 MB: two 1 MiB staging pieces
        calls: list[str] = []

        def forbidden(what: str) -> object:
            def allocate(*args: object, **kwargs: object) -> torch.Tensor:
                calls.append(what)
                raise AssertionError(f"{what} called on the page-in path")

            return allocate

        for module, attr in [(torch, "empty"), (torch, "empty_like"), (torch, "zeros"),
                             (sio, "aligned_empty"), (transfers, "aligned_empty")]:  # fmt: skip
            monkeypatch.setattr(module, attr, forbidden(f"{module.__name__}.{attr}"))
        got = store.prefetch_async(["h", "n"]).wait()
        store.release(["h", "n"])
        monkeypatch.undo()
        assert calls == []
        assert torch.equal(got["h"], xs["h"]) and torch.equal(got["n"], xs["n"])


def test_write_backs_in_flight_land_in_issue_order(
    store: TieredStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two write-backs of one tensor in flight: the second one issued is the one kept."""
    store.register("w", shape=(1000,), dtype=torch.int32, home=Tier.NVME)
    nvme = store._nvme
    assert nvme is not None
    real = nvme.backend.write_async
    second_started, second_landed = threading.Event(), threading.Event()
    started: list[int] = []

    def slow_first(path: object, src: torch.Tensor, *args: object, **kwargs: object) -> object:
        pattern = int(src[:4].view(torch.int32)[0])  # 1: the first write, 0: the second
        started.append(pattern)
        if pattern == 1:  # the first write gives the second a window to start, which it
            # takes only when they are not ordered (a correct store lets the window pass:
            # it bounds what the test detects, and cannot fail a correct store)
            if second_started.wait(timeout=0.3):
                assert second_landed.wait(timeout=120)  # and lands after it
            return real(path, src, *args, **kwargs)  # type: ignore[arg-type]
        second_started.set()
        done = real(path, src, *args, **kwargs)  # type: ignore[arg-type]
        done.wait()
        second_landed.set()
        return done

    monkeypatch.setattr(nvme.backend, "write_async", slow_first)
    first, second = torch.full((1000,), 1, dtype=torch.int32), torch.arange(1000, dtype=torch.int32)
    t1 = store.write_back_async("w", first)
    t2 = store.write_back_async("w", second)
    t2.wait()
    t1.wait()
    assert started == [1, 0]
    assert torch.equal(store.read("w"), second)


def test_worker_thread_reads_and_writes_while_pages_move(tmp_path: Path) -> None:
    """read()/write() on one thread while another pages other tensors in and out."""
    config = make_config(tmp_path, stage_nvme=True, staging_buffers=2, copy_threads=2)
    with TieredStore(config) as store:
        shape = (64, 1000)  # 256 KB each
        for i in range(4):
            home = Tier.NVME if i % 2 else Tier.HOST
            store.register(f"opt{i}", sample(torch.int32, shape, seed=i), home=home)
            store.register(f"blk{i}", sample(torch.int32, shape, seed=10 + i), home=home)
        errors: list[BaseException] = []

        def worker() -> None:
            try:
                buf = torch.empty(shape, dtype=torch.int32)
                for _ in range(15):
                    for i in range(4):
                        store.read(f"opt{i}", out=buf)
                        buf.add_(1)
                        store.write(f"opt{i}", buf)
            except BaseException as exc:  # reported by the main thread
                errors.append(exc)

        thread = threading.Thread(target=worker)
        thread.start()
        bumps = dict.fromkeys(range(4), 0)
        while thread.is_alive() or not bumps[0]:
            for i in range(4):
                name = f"blk{i}"
                dev = store.prefetch_async(name).wait()[name]
                dev.add_(1)
                store.write_back_async(name)
                store.release(name)
                bumps[i] += 1
        thread.join()
        assert errors == []
        for i in range(4):
            assert torch.equal(store.read(f"opt{i}"), sample(torch.int32, shape, seed=i) + 15)
            expected = sample(torch.int32, shape, seed=10 + i) + bumps[i]
            assert torch.equal(store.read(f"blk{i}"), expected)


def test_stats_count_bytes_per_link(store: TieredStore) -> None:
    h, n = sample(torch.float32, (100, 50)), sample(torch.int8, (3000,))
    store.register("h", h, home=Tier.HOST)
    store.register("n", n, home=Tier.NVME)
    before = store.stats()
    store.prefetch_async(["h", "n"]).wait()
    store.write_back_async("h").wait_host()  # its timing is read once it completed
    store.write_back_async("n").wait()
    store.read("n")
    after = store.stats()
    moved = {k: (after[k].bytes - before[k].bytes, after[k].count - before[k].count)
             for k in after}  # fmt: skip
    host = (0, 0) if store.pages_host_in_place else (20000, 1)
    assert moved == {
        "h2d": host,
        "nvme_read_direct": (3000, 1),
        "d2h": host,
        "nvme_write_direct": (3000, 1),
        "nvme_read": (3000, 1),
        "nvme_write": (0, 0),
    }
    assert after["nvme_read_direct"].seconds > before["nvme_read_direct"].seconds


def test_reopen_adopts_nvme_tensors(tmp_path: Path) -> None:
    x, y = sample(torch.bfloat16, (8, 9)), sample(torch.bool, (4,))
    with TieredStore(make_config(tmp_path)) as first:
        first.register("x", x, home=Tier.NVME)
        first.register("y", y, home=Tier.NVME)
        first.register("z", shape=(2,), dtype=torch.int8, home=Tier.NVME)  # never written
        with pytest.raises(StoreLockedError):
            TieredStore(make_config(tmp_path))
    with TieredStore(make_config(tmp_path)) as second:
        second.register("x", home=Tier.NVME)  # spec from the group
        second.register("y", shape=(4,), dtype=torch.bool, home=Tier.NVME)
        second.register("z", home=Tier.NVME)
        with pytest.raises(ValueError, match=r"'x' is already registered"):
            second.register("x", home=Tier.NVME)
        assert torch.equal(second.read("x"), x) and torch.equal(second.read("y"), y)
        assert torch.equal(second.prefetch_async("z").wait()["z"], torch.zeros(2, dtype=torch.int8))
        assert second.usage()[Tier.NVME][0] == 8 * 9 * 2 + 4 + 2
    with TieredStore(make_config(tmp_path)) as third:
        with pytest.raises(ValueError, match=r"holds it with shape \(8, 9\).*not \(9, 8\)"):
            third.register("x", shape=(9, 8), dtype=torch.bfloat16, home=Tier.NVME)
        assert third.names() == []


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"device_budget": -1}, r"device_budget=-1 must be an int >= 0"),
        ({"nvme_path": None}, r"nvme_budget=.* but nvme_path is None"),
        ({"nvme_budget": 0}, r"nvme_budget=0 bytes.*budget > 0"),
        ({"staging_bytes": 5000}, r"staging_bytes=5000.*multiple of 4096.*8192"),
        ({"device": "tpu"}, r"device='tpu'"),
        ({"copy_threads": 0}, r"copy_threads=0"),
    ],
)
def test_config_validation(tmp_path: Path, overrides: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        make_config(tmp_path, **overrides)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a CPU-only machine")
def test_cuda_device_without_cuda_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="CUDA is not available: use 'cpu'"):
        make_config(tmp_path, device="cuda")


def test_without_nvme_tier(tmp_path: Path) -> None:
    config = make_config(tmp_path, nvme_path=None, nvme_budget=0)
    with TieredStore(config) as store:
        with pytest.raises(ValueError, match=r"'w' cannot be homed on nvme.*nvme_path"):
            store.register("w", sample(torch.float32), home=Tier.NVME)
        assert store.usage()[Tier.NVME] == (0, 0)


def test_closed_store_refuses_work(tmp_path: Path) -> None:
    store = TieredStore(make_config(tmp_path))
    store.register("w", sample(torch.float32), home=Tier.NVME)
    store.write_back_async("w", sample(torch.float32, seed=5))
    store.close()
    store.close()  # idempotent
    with pytest.raises(ValueError, match="closed"):
        store.read("w")
    with TieredStore(make_config(tmp_path)) as again:  # lock released, write completed
        again.register("w", home=Tier.NVME)
        assert torch.equal(again.read("w"), sample(torch.float32, seed=5))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("home", TIERS, ids=lambda t: t.value)
def test_cuda_round_trip_and_write_back(tmp_path: Path, home: Tier) -> None:
    with TieredStore(make_config(tmp_path, device="cuda", io=IOConfig())) as store:
        x = sample(torch.bfloat16, (256, 513))
        store.register("w", x, home=home)
        dev = store.prefetch_async("w").wait()["w"]
        assert dev.is_cuda and torch.equal(dev.cpu(), x)
        dev.mul_(3)  # on the current stream; the write-back must wait for it
        store.write_back_async("w").wait()
        store.release("w")
        assert torch.equal(store.read("w"), x * 3)
        assert torch.equal(store.prefetch_async("w").wait()["w"].cpu(), x * 3)
        assert store.stats()["d2h"].count + store.stats()["nvme_write_direct"].count >= 0


def test_overlap_benchmark_smoke(tmp_path: Path) -> None:
    """bench/overlap.py runs end to end at a tiny size (timings not checked)."""
    path = Path(__file__).resolve().parents[2] / "bench" / "overlap.py"
    spec = importlib.util.spec_from_file_location("bench_overlap", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    threads = torch.get_num_threads()
    try:
        args = ["--total-gib", "0.004", "--tensors", "4", "--repeats", "1", "--dir", str(tmp_path)]
        result = module.main(args)
    finally:
        torch.set_num_threads(threads)
    assert set(result) == {"io", "compute", "wall", "ratio"}
    assert all(v > 0 for v in result.values())


def test_cpu_page_in_of_host_tensor_is_a_view_of_its_home(tmp_path: Path) -> None:
    """On a CPU device a HOST-home page-in copies nothing and takes no device slot."""
    x = sample(torch.float32, (64, 32))
    with TieredStore(make_config(tmp_path, device="cpu", cuda_double=False)) as store:
        store.register("h", x, home=Tier.HOST)
        view = store.prefetch_async("h").wait()["h"]
        assert store.state("h") is Residency.RESIDENT
        assert store.usage()[Tier.DEVICE][0] == 0
        home = store.host_view("h")
        assert view.data_ptr() == home.data_ptr() and torch.equal(view, x)
        view.mul_(2)  # changes through the resident copy are the home contents
        store.write_back_async("h").wait()  # nothing to copy
        store.release("h")
        assert store.state("h") is Residency.RELEASED
        torch.testing.assert_close(store.read("h"), x * 2)
        store.write("h", x)
        assert torch.equal(store.prefetch_async("h").wait()["h"], x)
        store.release("h")
        store.register("n", x, home=Tier.NVME)
        with pytest.raises(ValueError, match=r"'n' is homed on nvme.*read\(\) and write\(\)"):
            store.host_view("n")


def test_write_back_from_an_aligned_host_buffer_goes_direct(tmp_path: Path) -> None:
    """A write-back from an arena view leaves by direct I/O; an unaligned source is staged."""
    x = sample(torch.float32, (3000,))
    with TieredStore(make_config(tmp_path, device="cpu")) as store:
        store.register("buf", shape=(3001,), dtype=torch.float32, home=Tier.HOST)
        store.register("n", shape=(3000,), dtype=torch.float32, home=Tier.NVME)
        buf = store.host_view("buf")
        for src, staged in ((buf[:3000], False), (buf[1:], True)):
            src.copy_(x)
            before = store.stats()
            store.write_back_async("n", src).wait()
            after = store.stats()
            moved = {k: after[k].count - before[k].count for k in after}
            assert moved["d2h"] == int(staged)  # the copy into a staging buffer
            assert moved["nvme_write_direct" if not staged else "nvme_write"] == 1
            assert torch.equal(store.read("n"), x)
            x = x + 1


def test_memory_copies_do_not_queue_behind_disk_traffic(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With every disk thread held up by NVMe write-backs, copies between memory tiers
    (a write-back to a device-home tensor, a page-in from host) still complete; and each
    tensor's operations stay in order."""
    gate = threading.Event()
    with TieredStore(make_config(tmp_path, copy_threads=1)) as s:
        original = s._io.store

        def held(rec: Any, *args: Any) -> Any:
            if rec.home is Tier.NVME:
                assert gate.wait(timeout=120)  # a hang guard only
            return original(rec, *args)

        monkeypatch.setattr(s._io, "store", held)
        x, y = sample(torch.float32, seed=1), sample(torch.float32, seed=2)
        for name, home in (("disk", Tier.NVME), ("dev", Tier.DEVICE), ("host", Tier.HOST)):
            s.register(name, shape=x.shape, dtype=torch.float32, home=home)
        slow = [s.write_back_async("disk", x), s.write_back_async("disk", y)]
        assert torch.equal(s.write_back_async("dev", y).wait()["dev"], y)
        s.write("host", x)
        assert torch.equal(s.prefetch_async("host").wait()["host"], x)
        assert not any(t.done() for t in slow)  # the disk lane is still held
        gate.set()
        for t in slow:
            t.wait()
        assert torch.equal(s.read("disk"), y)  # the two disk writes landed in order


@pytest.mark.parametrize("home", TIERS, ids=lambda t: t.value)
def test_unregister_frees_the_home_for_a_tensor_of_another_shape(
    store: TieredStore, tmp_path: Path, home: Tier
) -> None:
    """A tensor registered again with another shape (a micro-batch of other rows) takes the
    bytes the first one freed; one still paged in is refused, nothing removed."""
    big = 6 * MiB // 4 if home is not Tier.NVME else 48 * MiB // 4  # most of the tier
    store.register("b", shape=(big,), dtype=torch.float32, home=home)
    if home is Tier.HOST:
        store.prefetch_async("b").wait()
        with pytest.raises(StateError, match=r"'b' is RESIDENT: unregister\(\) needs it RELEASED"):
            store.unregister("b")
        store.release("b")
    before = store.usage()[home][0]
    store.unregister("b")
    assert "b" not in store.names() and store.usage()[home][0] < before
    if home is Tier.NVME:
        assert not (tmp_path / "nvme" / "b").exists()
    x = sample(torch.float32, (big // 2 + 1,))
    store.register("b", x, home=home)  # fits only because the first one's bytes are free
    store.register("c", shape=(big // 3,), dtype=torch.float32, home=home)
    assert torch.equal(store.read("b"), x)
