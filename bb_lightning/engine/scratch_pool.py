"""Host scratch buffers of the optimizer step, and the read-ahead of off-host optimizer state.

The step works through each block's flat state in pieces of ``Placement.state_piece``
elements (the whole block where it is smaller). Optimizer state homed on HOST is stepped
in place in the host arena. State homed elsewhere passes through
:data:`~bb_lightning.placement.SCRATCH_SETS` sets of scratch buffers of one piece each,
registered in the store's host arena (so the host budget covers them); writes from the
optimizer go back asynchronously on the store's copy threads, a set waiting for its
previous writes only when it is used again. When some optimizer state is homed off the
host, ``Placement.read_ahead`` more sets of three fp32 buffers of one piece let the reads
of the next pieces' state (of this block and the next ones) run on the store's threads
while a piece steps (:meth:`ScratchPool.plan_reads`).
"""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

from bb_lightning.engine.flat import register_stored
from bb_lightning.engine.flat_state import FlatState, read_piece
from bb_lightning.placement import (
    SCRATCH_FP32,
    SCRATCH_PREFIX,
    SCRATCH_SETS,
    STATE_KINDS,
    Placement,
    StoredTensor,
    read_ahead_name,
)
from storage.store import Ticket, TieredStore
from storage.tiers import Tier

__all__ = ["Piece", "Scratch", "ScratchPool"]

Piece = tuple[int, int]
"""(block, piece index) of a piece of a block's flat state."""


@dataclass
class Scratch:
    """One set of host scratch buffers and the writes still reading them."""

    fp32: dict[str, Tensor]
    """fp32 buffers by :data:`SCRATCH_FP32` name, each of one piece's elements."""
    cast: Tensor
    """A compute-dtype buffer of one piece's elements (weights being written)."""
    tickets: list[Ticket] = field(default_factory=list)
    """Asynchronous writes from these buffers not yet waited for."""
    reads: list[Ticket] = field(default_factory=list)
    """Asynchronous reads into these buffers not yet waited for."""

    def settle(self) -> None:
        """Wait on the host for the reads into and writes from these buffers (then free
        to reuse: on CUDA a copy still reading a pinned buffer must have completed)."""
        self.wait_reads()
        tickets, self.tickets = self.tickets, []
        for ticket in tickets:
            ticket.wait_host()

    def idle(self) -> bool:
        """Whether no read or write on these buffers is still running (never blocks)."""
        return all(t.done() for t in (*self.reads, *self.tickets))

    def wait_reads(self) -> None:
        """Wait on the host for the reads into these buffers (then the host may read them)."""
        reads, self.reads = self.reads, []
        for ticket in reads:
            ticket.wait_host()


class ScratchPool:
    """The scratch sets and read-ahead sets of one training engine's optimizer step.

    ``states`` are the blocks' flat states, stepped in pieces of ``piece`` elements (each
    fp32 buffer holds one piece, or the largest state where that is smaller; each cast
    buffer likewise, of ``cast_numel``); ``entries`` the engine's manifest by name, from
    which the sets are registered in ``store``. Scratch sets are taken in turn by one
    thread at a time (:meth:`take`); read-ahead sets move between a free list and the
    pieces whose state they hold, under a lock (the gradient worker and the training
    thread both step blocks).
    """

    def __init__(
        self,
        store: TieredStore,
        states: Sequence[FlatState],
        entries: Mapping[str, StoredTensor],
        *,
        compute_dtype: torch.dtype,
        cast_numel: int,
        piece: int,
    ) -> None:
        largest = max(s.numel for s in states)
        if largest > piece and store.config.scratch_checksums:
            raise ValueError(
                f"a block's optimizer state ({largest} elements) is stepped in pieces of "
                f"{piece}, but scratch_checksums writes NVMe tensors whole: set "
                f"Placement.state_piece >= {largest} or scratch_checksums=False"
            )
        self.store = store
        self.states = states
        self.compute_dtype = compute_dtype
        self.piece = piece
        """Elements of the pieces a block's state is stepped in (``Placement.state_piece``)."""
        self.largest = min(largest, piece)
        """Elements of each fp32 buffer: one piece, or the largest state where smaller."""
        self.cast_numel = min(cast_numel, piece)
        """Elements of each set's compute-dtype buffer (one piece of a block's weights)."""
        self.sets = [self._scratch_set(k, entries) for k in range(SCRATCH_SETS)]
        """The scratch sets, taken in turn."""
        self._next_set = 0
        self._free_ahead: list[Scratch] = []
        """Read-ahead sets not holding a piece's state (a set may still be writing)."""
        self._ahead_sets = 0
        """Read-ahead sets registered in the store (only grows)."""
        self._ahead: dict[Piece, Scratch] = {}
        """Pieces whose state is being (or has been) read ahead, and the set it is read into."""
        self._queue: list[Piece] = []
        """Pieces still to step in this optimizer step, in step order, not yet read ahead."""
        self._limit: int | None = None
        """Read-ahead sets whose reads may run at once (:meth:`limit_reads`; None: all)."""
        self._lock = threading.Lock()

    def _scratch_set(self, k: int, entries: Mapping[str, StoredTensor]) -> Scratch:
        store, prefix = self.store, f"{SCRATCH_PREFIX}.{k}"
        for name in (*SCRATCH_FP32, "cast"):
            entry = entries[f"{prefix}.{name}"]
            want = self.cast_numel if name == "cast" else self.largest  # cast: weights
            assert entry.numel == want, (entry, want)
            register_stored(store, entry)
        return Scratch(
            fp32={name: store.host_view(f"{prefix}.{name}") for name in SCRATCH_FP32},
            cast=store.host_view(f"{prefix}.cast"),
        )

    def ensure_ahead_sets(self, placement: Placement, entries: Mapping[str, StoredTensor]) -> None:
        """Register read-ahead sets up to ``placement.read_ahead`` when state is off the host."""
        if not placement.reads_ahead:
            return
        while self._ahead_sets < placement.read_ahead:
            self._free_ahead.append(self._ahead_set(self._ahead_sets, entries))
            self._ahead_sets += 1

    def _ahead_set(self, k: int, entries: Mapping[str, StoredTensor]) -> Scratch:
        store = self.store
        for name in STATE_KINDS:
            entry = entries[read_ahead_name(k, name)]
            assert entry.numel == self.largest, (entry, self.largest)
            register_stored(store, entry)
        views: dict[str, Tensor] = {n: store.host_view(read_ahead_name(k, n)) for n in STATE_KINDS}
        return Scratch(fp32=views, cast=torch.empty(0, dtype=self.compute_dtype))

    def plan_reads(self, order: Sequence[int]) -> None:
        """Blocks ``order`` will step in this order: start reading their off-host state,
        piece by piece (pieces already read ahead are kept)."""
        with self._lock:
            self._queue = [
                (i, k)
                for i in order
                if any(self.store.home(n) is not Tier.HOST for n in self.states[i].state_names)
                for k in range(len(self.states[i].pieces(self.piece)))
                if (i, k) not in self._ahead
            ]
        self.read_ahead()

    def read_ahead(self) -> None:
        """Issue state reads of the next queued pieces into free read-ahead sets whose
        earlier writes are done (never waits: a set still writing is taken later); under
        :meth:`limit_reads`' limit, no more sets than it in this call, and none beyond
        those the sets still reading leave room for."""
        with self._lock:
            issued = 0
            while (
                self._queue
                and self._free_ahead
                and self._free_ahead[0].idle()
                and (
                    self._limit is None or (issued < self._limit and self._reading() < self._limit)
                )
            ):
                issued += 1
                key = self._queue.pop(0)
                if key in self._ahead:
                    continue
                buf = self._free_ahead.pop(0)
                buf.settle()  # collects the finished writes
                state = self.states[key[0]]
                a, b = state.pieces(self.piece)[key[1]]
                for kind, name in zip(STATE_KINDS, state.state_names, strict=True):
                    if self.store.home(name) is not Tier.HOST:
                        buf.reads.append(read_piece(self.store, name, buf.fp32[kind], a, b))
                self._ahead[key] = buf

    def take_ahead(self, key: Piece | None) -> Scratch | None:
        """The read-ahead set holding piece ``key``'s state (None: none; the piece leaves
        the queue either way), then the next reads are issued."""
        with self._lock:
            ahead = self._ahead.pop(key, None) if key is not None else None
            if key in self._queue:
                self._queue.remove(key)
        self.read_ahead()  # the next pieces' reads run while this one steps
        return ahead

    def give_back(self, ahead: Scratch) -> None:
        """Return a read-ahead set from :meth:`take_ahead` to the free list (its writes may
        still run) and issue the next reads."""
        with self._lock:
            self._free_ahead.append(ahead)
        self.read_ahead()

    def limit_reads(self, sets: int | None) -> None:
        """Let at most ``sets`` read-ahead sets' reads run at once (0: none starts, those
        running run on; None: no limit, the next ones issued now). Under a limit, each
        :meth:`read_ahead` call issues at most ``sets`` sets, what the finished reads leave
        room for (the caller calls it as work goes on). :meth:`end_reads` lifts the
        limit."""
        with self._lock:
            self._limit = sets
        self.read_ahead()

    def _reading(self) -> int:
        """Read-ahead sets whose reads still run (under the lock)."""
        return sum(1 for buf in self._ahead.values() if not all(t.done() for t in buf.reads))

    def end_reads(self) -> None:
        """Drop what is left of this step's read-ahead (sets back to the free list)."""
        with self._lock:
            self._limit = None
            self._queue = []
            for buf in self._ahead.values():
                buf.wait_reads()
                self._free_ahead.append(buf)
            self._ahead = {}

    def take(self) -> Scratch:
        """The next scratch set, its earlier writes done (one thread at a time uses sets)."""
        scratch = self.sets[self._next_set]
        self._next_set = (self._next_set + 1) % len(self.sets)
        scratch.settle()
        return scratch

    def settle(self) -> None:
        """End the read-ahead and wait for every set's reads and writes."""
        self.end_reads()
        for scratch in [*self.sets, *self._free_ahead]:
            scratch.settle()
