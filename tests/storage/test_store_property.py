"""Stateful property test: random operations on a TieredStore against a plain model."""

from __future__ import annotations

import shutil
import tempfile
from dataclasses import dataclass

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from storage.device import slot_bytes
from storage.io import IOConfig
from storage.store import StateError, StoreConfig, Ticket, TieredStore
from storage.tiers import Residency, Tier

NAMES = [f"t{i}" for i in range(5)]
DTYPES = [torch.float32, torch.bfloat16, torch.int8, torch.bool]
BUDGET = {Tier.DEVICE: 48 << 10, Tier.HOST: 32 << 10, Tier.NVME: 40_000}


def make(dtype: torch.dtype, size: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.rand(size, generator=g) > 0.5
    if dtype == torch.int8:
        return torch.randint(-128, 128, (size,), generator=g, dtype=torch.int8)
    return torch.randn(size, generator=g).to(dtype)


def to_np(t: torch.Tensor) -> np.ndarray:
    t = t.detach().cpu()
    return (t.view(torch.int16) if t.dtype == torch.bfloat16 else t).numpy().copy()


@dataclass
class Model:
    home: Tier
    contents: np.ndarray
    """Expected home contents."""
    device: np.ndarray | None
    """Expected contents of the device copy (RESIDENT / IN_FLIGHT), else None."""
    state: Residency
    dtype: torch.dtype
    nbytes: int


class StoreMachine(RuleBasedStateMachine):
    STAGE_NVME = False
    """Whether every NVMe transfer goes through the (one, 8 KiB) staging buffer in pieces."""

    def __init__(self) -> None:
        super().__init__()
        self.dir = tempfile.mkdtemp(prefix="bb-store-prop-")
        config = StoreConfig(
            device_budget=BUDGET[Tier.DEVICE],
            host_budget=BUDGET[Tier.HOST],
            nvme_path=f"{self.dir}/nvme",
            nvme_budget=BUDGET[Tier.NVME],
            staging_buffers=1,
            staging_bytes=8 << 10,
            stage_nvme=self.STAGE_NVME,
            io=IOConfig(backend="posix", threads=2, task_size=4096),
            device="cpu",
        )
        self.store = TieredStore(config)
        self.in_place = self.store.pages_host_in_place
        """Whether HOST-home tensors page in as their home slot (CPU, not under the double)."""
        self.model: dict[str, Model] = {}
        self.tickets: list[tuple[Ticket, list[str]]] = []

    def teardown(self) -> None:
        self.store.close()
        shutil.rmtree(self.dir, ignore_errors=True)

    # -- helpers -------------------------------------------------------------------------

    def footprint(self, tier: Tier, nbytes: int) -> int:
        return nbytes if tier is Tier.NVME else slot_bytes(nbytes)

    def used(self, tier: Tier) -> int:
        total = sum(self.footprint(tier, m.nbytes) for m in self.model.values() if m.home is tier)
        if tier is Tier.DEVICE:
            total += sum(
                slot_bytes(m.nbytes)
                for m in self.model.values()
                if m.home is not Tier.DEVICE and not self.paged_in_place(m)
                and m.state is not Residency.RELEASED
            )  # fmt: skip
        return total

    def paged_in_place(self, m: Model) -> bool:
        """HOST home paged in place: the device copy is the home slot (no device slot)."""
        return m.home is Tier.HOST and self.in_place

    def expect_budget_error(self, tier: Tier, nbytes: int, error: ValueError) -> None:
        """A tier refused ``nbytes``: over budget, or (arenas) no free extent large enough."""
        need = self.footprint(tier, nbytes)
        over = self.used(tier) + need > self.store.usage()[tier][1]
        fragmented = tier is not Tier.NVME and "largest free extent" in str(error)
        assert over or fragmented, str(error)

    # -- rules ---------------------------------------------------------------------------

    @rule(
        name=st.sampled_from(NAMES),
        home=st.sampled_from(list(Tier)),
        dtype=st.sampled_from(DTYPES),
        size=st.integers(0, 3000),
        seed=st.integers(0, 99),
        from_tensor=st.booleans(),
    )
    def register(
        self, name: str, home: Tier, dtype: torch.dtype, size: int, seed: int, from_tensor: bool
    ) -> None:
        x = make(dtype, size, seed) if from_tensor else torch.zeros(size, dtype=dtype)
        nbytes = x.numel() * x.element_size()
        try:
            if from_tensor:
                self.store.register(name, x, home=home)
            else:
                self.store.register(name, shape=(size,), dtype=dtype, home=home)
        except ValueError as error:
            if name not in self.model:
                self.expect_budget_error(home, nbytes, error)
            return
        assert name not in self.model
        resident = home is Tier.DEVICE
        self.model[name] = Model(
            home=home,
            contents=to_np(x),
            device=to_np(x) if resident else None,
            state=Residency.RESIDENT if resident else Residency.RELEASED,
            dtype=dtype,
            nbytes=nbytes,
        )

    @precondition(lambda self: self.model)
    @rule(data=st.data())
    def prefetch(self, data: st.DataObject) -> None:
        names = data.draw(st.lists(st.sampled_from(sorted(self.model)), min_size=1, unique=True))
        busy = [
            n for n in names if self.model[n].state is not Residency.RELEASED
            and self.model[n].home is not Tier.DEVICE
        ]  # fmt: skip
        try:
            ticket = self.store.prefetch_async(names)
        except StateError:
            assert busy
            return
        except ValueError as error:
            assert not busy
            need = sum(slot_bytes(self.model[n].nbytes) for n in names
                       if self.model[n].home is not Tier.DEVICE)  # fmt: skip
            over = self.used(Tier.DEVICE) + need > BUDGET[Tier.DEVICE]
            assert over or "largest free extent" in str(error), str(error)
            return
        assert not busy
        paged = [n for n in names if self.model[n].home is not Tier.DEVICE]
        for n in paged:
            self.model[n].state = Residency.IN_FLIGHT
            self.model[n].device = self.model[n].contents.copy()
        self.tickets.append((ticket, paged))

    @precondition(lambda self: self.tickets)
    @rule(index=st.integers(0, 10))
    def wait(self, index: int) -> None:
        ticket, names = self.tickets.pop(index % len(self.tickets))
        got = ticket.wait()  # DEVICE-home tensors in it stay RESIDENT and are left out here
        for n in names:
            m = self.model[n]
            m.state = Residency.RESIDENT
            assert m.device is not None
            np.testing.assert_array_equal(to_np(got[n]), m.device)

    @precondition(lambda self: self.model)
    @rule(data=st.data())
    def release(self, data: st.DataObject) -> None:
        name = data.draw(st.sampled_from(sorted(self.model)))
        m = self.model[name]
        if m.home is Tier.DEVICE:
            self.store.release(name)
        elif m.state is Residency.RESIDENT:
            self.store.release(name)
            m.state, m.device = Residency.RELEASED, None
        else:
            with pytest.raises(StateError):
                self.store.release(name)

    @precondition(lambda self: self.model)
    @rule(data=st.data())
    def mutate_device_copy(self, data: st.DataObject) -> None:
        name = data.draw(st.sampled_from(sorted(self.model)))
        m = self.model[name]
        if m.state is not Residency.RESIDENT:
            return
        dev = self.store.get(name)
        dev.copy_(dev == 0) if m.dtype == torch.bool else dev.add_(1)
        m.device = to_np(dev)
        if m.home is Tier.DEVICE or self.paged_in_place(m):
            m.contents = m.device.copy()

    @precondition(lambda self: self.model)
    @rule(data=st.data(), seed=st.integers(0, 99), given=st.booleans())
    def write_back(self, data: st.DataObject, seed: int, given: bool) -> None:
        name = data.draw(st.sampled_from(sorted(self.model)))
        m = self.model[name]
        if given:
            src = make(m.dtype, m.nbytes // torch.empty((), dtype=m.dtype).element_size(), seed)
            ticket = self.store.write_back_async(name, src)
            m.contents = to_np(src)
            if self.paged_in_place(m) and m.device is not None:
                # paged in place on the CPU: the device copy is the home itself, so it shows
                # src once the write lands; a page-in ticket waited later does not order it
                ticket.wait()
            # otherwise not waited on: later operations on the tensor order after it
            if m.home is Tier.DEVICE or (self.paged_in_place(m) and m.device is not None):
                m.device = m.contents.copy()
        elif m.state is Residency.RESIDENT:
            self.store.write_back_async(name).wait()
            assert m.device is not None
            m.contents = m.device.copy()
        else:
            with pytest.raises(StateError):
                self.store.write_back_async(name)

    @precondition(lambda self: self.model)
    @rule(data=st.data(), seed=st.integers(0, 99))
    def write(self, data: st.DataObject, seed: int) -> None:
        name = data.draw(st.sampled_from(sorted(self.model)))
        m = self.model[name]
        src = make(m.dtype, m.nbytes // torch.empty((), dtype=m.dtype).element_size(), seed)
        self.store.write(name, src)
        m.contents = to_np(src)
        if m.device is not None:
            m.device = m.contents.copy()

    @precondition(lambda self: self.model)
    @rule(data=st.data(), tier=st.sampled_from(list(Tier)))
    def move(self, data: st.DataObject, tier: Tier) -> None:
        name = data.draw(st.sampled_from(sorted(self.model)))
        m = self.model[name]
        if tier is m.home:
            self.store.move(name, tier)
            return
        if m.home is not Tier.DEVICE and m.state is not Residency.RELEASED:
            with pytest.raises(StateError):
                self.store.move(name, tier)
            return
        try:
            self.store.move(name, tier)
        except ValueError as error:
            self.expect_budget_error(tier, m.nbytes, error)
            return
        m.home = tier
        if tier is Tier.DEVICE:
            m.state, m.device = Residency.RESIDENT, m.contents.copy()
        else:
            m.state, m.device = Residency.RELEASED, None

    @precondition(lambda self: self.model)
    @rule(data=st.data())
    def read(self, data: st.DataObject) -> None:
        name = data.draw(st.sampled_from(sorted(self.model)))
        np.testing.assert_array_equal(to_np(self.store.read(name)), self.model[name].contents)

    # -- invariants ----------------------------------------------------------------------

    @invariant()
    def states_and_homes_match(self) -> None:
        assert self.store.names() == sorted(self.model)
        for name, m in self.model.items():
            assert self.store.state(name) is m.state, name
            assert self.store.home(name) is m.home, name
            if m.state is Residency.RESIDENT:
                assert m.device is not None
                np.testing.assert_array_equal(to_np(self.store.get(name)), m.device)

    @invariant()
    def usage_is_the_sum_of_sizes_within_budget(self) -> None:
        usage = self.store.usage()
        for tier in Tier:
            used, capacity = usage[tier]
            assert capacity == BUDGET[tier]
            assert used == self.used(tier) <= capacity, tier


StoreMachine.TestCase.settings = settings(
    max_examples=40,
    stateful_step_count=30,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestStoreMachine = pytest.mark.slow(StoreMachine.TestCase)


class StagedStoreMachine(StoreMachine):
    """The same model with NVMe tensors streamed through 8 KiB staging pieces."""

    STAGE_NVME = True


StagedStoreMachine.TestCase.settings = settings(
    max_examples=25,
    stateful_step_count=30,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestStagedStoreMachine = pytest.mark.slow(StagedStoreMachine.TestCase)
