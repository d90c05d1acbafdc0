"""Residency of stored tensors: one state machine per tensor, and the record that holds it.

Each tensor of a :class:`storage.store.TieredStore` is ``RELEASED``,
``IN_FLIGHT`` or ``RESIDENT`` on the compute device, and changes state only
through :attr:`ResidencyMachine.TRANSITIONS`; any other change raises
:class:`StateError`. :class:`Record` gathers everything the store knows about
one tensor: its spec, home tier, residency, arena slots and the last
operation issued on it. A :class:`Ticket` is the sync point of transfers in
flight, with two waits that say which synchronisation they give:
:meth:`Ticket.wait` orders later device work after the transfers (page-ins become
``RESIDENT``; on CUDA the host does not wait for the copies), and
:meth:`Ticket.wait_host` blocks the host until they completed, so that host
memory they wrote may be read and host memory they read may be reused.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import ClassVar

import torch

from storage.deferred import CopyEvent
from storage.device import Slot
from storage.external import ExternalSource
from storage.nvme import ArraySpec
from storage.tiers import Residency, Tier

__all__ = ["Record", "ResidencyMachine", "StateError", "Ticket"]


class StateError(ValueError):
    """An illegal residency transition: names the tensor, its state and the attempt."""


class ResidencyMachine:
    """The residency of one tensor, changed only through the transition table."""

    TRANSITIONS: ClassVar[dict[tuple[Residency, str], Residency]] = {
        (Residency.RELEASED, "page_in"): Residency.IN_FLIGHT,
        (Residency.IN_FLIGHT, "arrive"): Residency.RESIDENT,
        (Residency.IN_FLIGHT, "fail"): Residency.RELEASED,
        (Residency.RESIDENT, "release"): Residency.RELEASED,
        (Residency.RELEASED, "home_on_device"): Residency.RESIDENT,
        (Residency.RESIDENT, "home_off_device"): Residency.RELEASED,
    }
    """``(state, event) -> next state``; any other pair is illegal."""
    _HINTS: ClassVar[dict[Residency, str]] = {
        Residency.RELEASED: "prefetch_async() it and wait on the ticket first",
        Residency.IN_FLIGHT: "wait on its ticket first",
        Residency.RESIDENT: "it is already on the device: use get(), or release() it first",
    }

    def __init__(self, name: str, state: Residency = Residency.RELEASED) -> None:
        self.name = name
        self.state = state

    def check(self, event: str) -> Residency:
        """The state ``event`` leads to; raises :class:`StateError` if illegal now."""
        nxt = self.TRANSITIONS.get((self.state, event))
        if nxt is None:
            raise StateError(
                f"tensor {self.name!r} is {self.state.value.upper()}: transition {event!r} is "
                f"illegal from that state; {self._HINTS[self.state]}"
            )
        return nxt

    def apply(self, event: str) -> Residency:
        """Take the transition ``event`` (see :attr:`TRANSITIONS`)."""
        self.state = self.check(event)
        return self.state

    def hint(self) -> str:
        """What to do before an operation that the current state does not allow."""
        return self._HINTS[self.state]


@dataclass(eq=False)
class Record:
    """Everything the store knows about one tensor."""

    spec: ArraySpec
    """Name, shape, dtype and size (bytes)."""
    home: Tier
    """The tier holding the authoritative copy."""
    residency: ResidencyMachine
    """Whether a copy is usable on the compute device."""
    home_slot: Slot | None = None
    """Its slot in the device arena (``DEVICE`` home) or host arena (``HOST`` home)."""
    device_slot: Slot | None = None
    """Its slot in the device arena while paged in (the home slot for ``DEVICE`` home)."""
    written: bool = True
    """``NVME`` home: whether its chunk file exists (never-written tensors read as zeros)."""
    scratch: bool = False
    """Registered as scratch: rewritten often, read back by this process only."""
    external: ExternalSource | None = None
    """``NVME`` home: the read-only files holding its bytes (:mod:`storage.external`)."""
    last: Future[CopyEvent | None] | None = None
    """The last operation issued on it; the next one waits for it."""

    def device_view(self) -> torch.Tensor:
        """The device copy, shaped and typed as the tensor (a view into its slot)."""
        assert self.device_slot is not None, f"{self.spec.name} has no device slot"
        return self.device_slot.view(self.spec.shape, self.spec.dtype)


class Ticket:
    """Handle of page-ins, reads or write-backs in flight.

    :meth:`wait` orders the caller's later device work after them; :meth:`wait_host`
    also blocks the host until they completed. Use :meth:`wait_host` before the host
    reads a buffer a transfer filled (``read_async``) or changes a buffer a transfer
    reads from (``write_back_async(name, src)``).
    """

    def __init__(
        self,
        entries: list[tuple[Record, Future[CopyEvent | None]]],
        *,
        paged: frozenset[str],
        results: dict[str, torch.Tensor],
        on_fail: Callable[[Record], None],
        device: torch.device,
        order: Callable[[CopyEvent | None, torch.device], None],
    ) -> None:
        self._entries = entries
        self._device = device
        self._paged = paged
        self._results = results
        self._on_fail = on_fail
        self._order = order
        self._events: list[CopyEvent] | None = None
        self._error: BaseException | None = None
        self._synced = False

    def done(self) -> bool:
        """Whether :meth:`wait_host` would return at once: every transfer issued and, on
        CUDA, its copies finished (never blocks; it does not wait, so call
        :meth:`wait_host` before touching the buffers)."""
        if not all(fut.done() for _, fut in self._entries):
            return False
        for _, fut in self._entries:
            if fut.exception() is None:
                event = fut.result()
                if event is not None and not event.query():
                    return False
        return True

    def _collect(self) -> list[CopyEvent]:
        """The transfers' events, once every transfer was issued (page-ins -> RESIDENT)."""
        if self._events is not None:
            return self._events
        events: list[CopyEvent] = []
        for rec, fut in self._entries:
            try:
                event = fut.result()
            except BaseException as exc:
                self._error = self._error or exc
                if rec.spec.name in self._paged:
                    self._on_fail(rec)
                self._results.pop(rec.spec.name, None)
                continue
            if event is not None:
                events.append(event)
            if rec.spec.name in self._paged:
                rec.residency.apply("arrive")
        self._events = events
        return events

    def wait(self) -> dict[str, torch.Tensor]:
        """Order later device work after the transfers; page-ins become ``RESIDENT``.

        Returns ``name -> tensor`` (views into the device arena for page-ins, the
        given buffer for reads and write-backs). On CUDA the caller's current stream
        waits for the copies, not the host: a buffer in host memory that a transfer
        writes or reads is not safe to touch yet (see :meth:`wait_host`). Re-raises the
        first transfer error (failed page-ins go back to ``RELEASED``).
        """
        for event in self._collect():
            self._order(event, self._device)
        self._raise_once()
        return dict(self._results)

    def wait_host(self) -> dict[str, torch.Tensor]:
        """Block the host until the transfers completed; returns as :meth:`wait`.

        After it the host may read what the transfers wrote into host memory and
        reuse the host memory they read from. The caller's stream is not made to wait
        (the copies are complete, so any later device work comes after them), so a
        worker thread waiting here never stalls the compute stream.
        """
        events = self._collect()
        if not self._synced:
            for event in events:
                event.synchronize()
            self._synced = True
        self._raise_once()
        return dict(self._results)

    def _raise_once(self) -> None:
        error, self._error = self._error, None
        if error is not None:
            raise error
