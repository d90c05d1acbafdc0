"""Page-in waits: the wall clock where the wait blocks the host, device events on CUDA."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch

from bb_lightning.engine import timing
from bb_lightning.engine.timing import PhaseTimer
from bb_lightning.placement import Placement
from storage.store import StoreConfig, TieredStore
from storage.tiers import Tier

from ..tiny import cpu_engine, tiny_llama


class _Clock:
    """A host clock (``time.perf_counter``) and a device clock, both moved by hand."""

    def __init__(self) -> None:
        self.host = 0.0
        self.device = 0.0
        self.read_before_sync = 0

    def event(self) -> Any:
        clock = self

        class Event:
            at: float | None = None
            synced = False

            def record(self) -> None:
                self.at = clock.device

            def synchronize(self) -> None:
                self.synced = True

            def elapsed_time(self, end: Any) -> float:
                if not end.synced:
                    clock.read_before_sync += 1
                return (end.at - self.at) * 1e3  # milliseconds, as torch.cuda.Event

        return Event()


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> _Clock:
    c = _Clock()
    monkeypatch.setattr(timing.time, "perf_counter", lambda: c.host)
    return c


def test_a_cpu_wait_is_timed_by_the_wall_clock(clock: _Clock) -> None:
    timer = PhaseTimer(event=clock.event)
    timer.begin_step()
    with timer.stream_wait("wait_page_in", torch.device("cpu")):
        clock.host += 0.5  # the host blocks
        clock.device += 9.0  # no device events are read on the CPU
    clock.host += 1.0
    times = timer.end_step()
    assert times is not None
    assert times.wait_page_in == pytest.approx(0.5) and times.step == pytest.approx(1.5)


def test_a_cuda_wait_is_timed_by_events_read_after_the_step_sync(clock: _Clock) -> None:
    synced: list[bool] = []
    timer = PhaseTimer(sync=lambda: synced.append(True), event=clock.event)
    cuda = torch.device("cuda", 0)
    with timer.stream_wait("wait_page_in", cuda):  # outside a step: not timed, no events
        clock.device += 7.0
    timer.begin_step()
    for stall in (0.25, 0.5):
        with timer.stream_wait("wait_page_in", cuda):
            clock.device += stall  # the stream waits; the host goes on at once
        clock.device += 1.0
    clock.host += 2.0
    times = timer.end_step()
    assert synced == [True] and clock.read_before_sync == 0
    assert times is not None
    assert times.wait_page_in == pytest.approx(0.75)
    assert times.compute == pytest.approx(2.0 - 0.75)
    assert timer.end_step() is None and timer._pending == []
    with pytest.raises(ValueError, match="unknown phase"), timer.stream_wait("nap", cuda):
        pass


def test_the_pager_times_its_waits_on_its_device() -> None:
    model = copy.deepcopy(tiny_llama())
    store = TieredStore(StoreConfig(device_budget=8 << 20, host_budget=16 << 20, device="cpu"))
    engine = cpu_engine(model, store, Placement.uniform(3, weights=Tier.HOST, master=Tier.HOST))
    seen: list[tuple[str, torch.device]] = []
    wait = engine.timer.stream_wait

    def spy(name: str, device: torch.device) -> Any:
        seen.append((name, device))
        return wait(name, device)

    engine.timer.stream_wait = spy  # type: ignore[method-assign]
    ids = torch.randint(0, 128, (1, 8), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        engine.model(input_ids=ids)
    assert seen and set(seen) == {("wait_page_in", torch.device("cpu"))}
    engine.close()
    store.close()
