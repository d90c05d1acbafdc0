"""TieredStore: named tensors on three tiers, paged onto the compute device on demand.

Each tensor has one *home* tier (``DEVICE``, ``HOST`` or ``NVME``) holding its
authoritative copy, and one :class:`ResidencyMachine` saying whether a copy
is usable on the compute device (``RELEASED -> IN_FLIGHT -> RESIDENT ->
RELEASED``). Page-ins and write-backs run off the caller's thread: on the CPU
on small thread pools, one for tensors homed on NVMe and one for copies between
memory tiers, so memory copies never wait behind disk traffic (file I/O through
the I/O backend's own threads), on
CUDA as ``non_blocking`` copies on two side streams with events, so they
overlap the caller's compute. A :class:`Ticket` is the sync point of a batch of
transfers: :meth:`Ticket.wait` orders the caller's later device work after them,
:meth:`Ticket.wait_host` makes what they wrote to host memory visible to the host
(and their host sources free to reuse). Under the CPU double of CUDA's semantics
(``StoreConfig.cuda_double``, :mod:`storage.deferred`) copies between the device
arena and host memory behave as on CUDA: a host destination holds poison until
the host synchronised on the copy.

Operations on one tensor run in the order they were issued (each waits for the
previous one), so a page-in never reads contents that a write-back in flight
is still replacing.

Memory: the device arena and the host arena are carved once at setup; a
page-in takes a temporary slot of the device arena, ``DEVICE``-home tensors a
permanent one, ``HOST``-home tensors a slot of the host arena. When the compute
device is the CPU, host and device memory are the same RAM: a page-in of a
``HOST``-home tensor still goes RELEASED -> IN_FLIGHT -> RESIDENT, but its device
copy is its home slot itself (no copy, no device slot), and its write-back is a
no-op; under the CPU double it takes a device slot and is copied as on CUDA
(:attr:`TieredStore.pages_host_in_place`). NVMe
transfers land straight in aligned slots where the backend allows (CPU; kvikio
on CUDA), else they stream through the staging pool piece by piece, so no
tensor is limited by the size of a staging buffer (see
:mod:`storage.transfers`; residency lives in :mod:`storage.residency`).

Re-opening: ``register(name, home=Tier.NVME)`` with no tensor, shape or dtype
adopts an array already in the NVMe group (as does giving its exact shape and
dtype); a different shape or dtype raises ``ValueError``.

Threads: methods may run on several threads at once for different tensors
(say, a worker thread reading and writing optimizer state with :meth:`read` /
:meth:`write` while the training loop pages blocks in and out); the arenas,
staging pool, NVMe catalogue, link meters and the per-tensor order of
operations are thread-safe, and residency checks with their transitions are
taken under one lock. Registering, moving and closing are setup steps: run
them while no other thread uses the store.
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import Future

import torch

from storage.deferred import CopyEvent
from storage.device import Slot, resolve_device
from storage.observers import TransferKind
from storage.residency import Record, ResidencyMachine, StateError, Ticket
from storage.store_config import StoreConfig
from storage.store_core import StoreCore, check_writable, padded_source
from storage.tiers import Link, Residency, Tier
from storage.transfers import (
    LINKS,
    Events,
    LinkStats,
    Work,
    done_future,
    flat_bytes,
    order_after,
    settled,
    settled_all,
)

__all__ = ["LINKS", "LinkStats", "ResidencyMachine", "StateError", "StoreConfig", "Ticket"]
__all__ += ["TieredStore", "flat_bytes", "resolve_device"]


class TieredStore(StoreCore):
    """Named tensors on DEVICE / HOST / NVME tiers with asynchronous page-in and write-back.

    Lifecycle of a non-``DEVICE`` tensor: :meth:`prefetch_async` (RELEASED ->
    IN_FLIGHT), :meth:`Ticket.wait` (-> RESIDENT), :meth:`get`, optionally
    :meth:`write_back_async`, :meth:`release` (-> RELEASED). ``DEVICE``-home
    tensors are always RESIDENT: prefetching them returns their tensor and
    releasing them is a no-op, so callers can treat every tensor alike. Construction, the
    registry (:meth:`register`), accounting and :meth:`close` are
    :class:`~storage.store_core.StoreCore`'s.
    """

    # -- paging ----------------------------------------------------------------------------

    def prefetch_async(self, names: str | Sequence[str]) -> Ticket:
        """Start copying ``names`` into device-arena slots (RELEASED -> IN_FLIGHT).

        Checks every name before starting anything. Raises
        :class:`storage.device.ArenaFullError` when the device arena cannot
        hold the tensors in flight (nothing starts then).
        """
        records = self._records_of(names)
        with self._lock:
            return self._prefetch_locked(records)

    def _prefetch_locked(self, records: list[Record]) -> Ticket:
        for rec in records:
            if rec.home is not Tier.DEVICE:
                rec.residency.check("page_in")
        ready = self._io.ready()
        slots: list[Slot] = []
        try:
            for rec in records:
                if rec.home is not Tier.DEVICE and not self._in_place(rec):
                    slots.append(self._allocate(self._device_arena, rec.spec))
        except BaseException:
            for slot in slots:
                self._device_arena.free(slot)
            raise
        entries: list[tuple[Record, Future[CopyEvent | None]]] = []
        paged = frozenset(r.spec.name for r in records if r.home is not Tier.DEVICE)
        results: dict[str, torch.Tensor] = {}
        it = iter(slots)
        for rec in records:
            if self._in_place(rec):  # the host copy is already in device memory
                rec.residency.apply("page_in")
                rec.device_slot = rec.home_slot
                entries.append((rec, self._submit(rec, lambda after: None, TransferKind.PAGE_IN)))
            elif rec.home is not Tier.DEVICE:
                slot = next(it)
                rec.residency.apply("page_in")
                rec.device_slot = slot
                work = self._page_in_work(rec, slot, ready)
                entries.append((rec, self._submit(rec, work, TransferKind.PAGE_IN)))
            else:
                entries.append((rec, rec.last or done_future()))
            results[rec.spec.name] = rec.device_view()
        return self._ticket(entries, paged=paged, results=results)

    def get(self, name: str) -> torch.Tensor:
        """The device tensor of RESIDENT tensor ``name`` (a view into the device arena).

        For a DEVICE-home tensor (or a HOST-home one paged in place on a CPU device) it
        waits for a ``write_back_async(name, src)`` in flight.
        """
        rec = self._record(name)
        if rec.residency.state is not Residency.RESIDENT:
            hint = rec.residency.hint()
            raise StateError(f"tensor {name!r} is {rec.residency.state.value.upper()}: {hint}")
        in_place = rec.home is Tier.DEVICE or rec.device_slot is rec.home_slot
        if in_place and rec.last is not None:  # a write_back_async(name, src)
            order_after(self._io.settle(rec), self.device)
        return rec.device_view()

    def release(self, names: str | Sequence[str]) -> None:
        """Free the device slots of RESIDENT ``names`` (-> RELEASED); no-op for DEVICE home.

        Waits for a write-back of the tensor still reading its device copy.
        Raises :class:`StateError` for a tensor not RESIDENT (nothing released then).
        """
        records = [r for r in self._records_of(names) if r.home is not Tier.DEVICE]
        with self._lock:
            for rec in records:
                rec.residency.check("release")
        for rec in records:
            event = self._io.settle(rec)
            # later kernels and page-ins into this slot come after it; host_view() and
            # read() still synchronise on it (a write-back lands in host memory)
            order_after(event, self.device)
            self._io.remember(rec, event)
            with self._lock:
                self._leave_device(rec, "release")

    def write_back_async(
        self, name: str, src: torch.Tensor | None = None, *, from_device: bool = False
    ) -> Ticket:
        """Copy the device copy of ``name`` (or ``src``) to its home tier, overlapped.

        The device copy stays usable; neither it nor ``src`` may be modified
        until the ticket is done. ``src`` replaces the home contents only (the
        device copy is left as it is). ``from_device``: ``src`` is the compute's own
        memory (an activation), whatever the store tells from the tensor itself (a dry
        run's ``meta`` tensors), so the copy crosses the device-to-host link.
        """
        rec = self._record(name)
        check_writable(rec, "write back")
        src_raw: torch.Tensor | None = None
        if src is None:
            if rec.residency.state is not Residency.RESIDENT:
                raise StateError(
                    f"tensor {name!r} is {rec.residency.state.value.upper()}: write-back needs "
                    f"its device copy; {rec.residency.hint()}"
                )
            out = rec.device_view()
            if rec.home is Tier.DEVICE or rec.device_slot is rec.home_slot:  # nothing to copy
                return self._ticket([(rec, rec.last or done_future())], results={name: out})
            assert rec.device_slot is not None
            data, tier, src_raw = (
                rec.device_slot.raw()[: rec.spec.nbytes],
                Tier.DEVICE,
                rec.device_slot.raw(),
            )
        else:
            self._check_like(rec, src)
            out, data = src, flat_bytes(src)
            tier = Tier.DEVICE if from_device else self._tier_of(src)
            src_raw = padded_source(src) if rec.home is Tier.NVME else None
            if data.is_cuda and self._cuda:  # used by the stream that runs the copy
                to_device = rec.home is Tier.DEVICE
                data.record_stream(
                    self._io.streams[Link.HOST_TO_DEVICE if to_device else Link.DEVICE_TO_HOST]
                )
        # host-only write-backs (a host source to a HOST or NVMe home) need no device progress
        ready = self._ready_if(self._on_device(data) or rec.home is Tier.DEVICE)
        fut = self._submit(
            rec,
            lambda after: self._io.store(rec, data, tier, src_raw, after + ready),
            TransferKind.WRITE_BACK,
        )
        return self._ticket([(rec, fut)], results={name: out})

    def copy_to_host_async(
        self, dsts: Sequence[torch.Tensor], srcs: Sequence[torch.Tensor]
    ) -> list[CopyEvent | None]:
        """Copy each contiguous tensor of ``srcs`` on the compute device into the matching
        host tensor of ``dsts`` (pinned, contiguous, same shape and dtype), after the
        caller's queued device work; on CUDA ``non_blocking`` on the stream towards the host.

        Returns the copies' events: :func:`storage.transfers.settled` on each before the
        host reads ``dsts``; ``srcs`` may be freed at once (their memory is kept for the
        copy). Counted on the ``d2h`` link.
        """
        if len(dsts) != len(srcs):
            raise ValueError(f"{len(dsts)} destinations for {len(srcs)} sources: pass pairs")
        ready = self._io.ready()
        events: list[CopyEvent | None] = []
        for dst, src in zip(dsts, srcs, strict=True):
            if dst.shape != src.shape or dst.dtype != src.dtype or not dst.is_contiguous():
                raise ValueError(
                    f"destination {tuple(dst.shape)} {dst.dtype} (contiguous: "
                    f"{dst.is_contiguous()}) does not take source {tuple(src.shape)} "
                    f"{src.dtype}: pass a contiguous host tensor like the source"
                )
            data = flat_bytes(src)
            if data.is_cuda:
                data.record_stream(self._io.streams[Link.DEVICE_TO_HOST])
            out = flat_bytes(dst)
            events.append(
                self._io.copy(out, Tier.HOST, data, Tier.DEVICE, ready, src_on_device=True)
            )
        return events

    # -- synchronous access ----------------------------------------------------------------

    def read(self, name: str, out: torch.Tensor | None = None) -> torch.Tensor:
        """The home-tier contents of ``name`` in a new (or the given) CPU tensor.

        Waits for this tensor's pending operations first. Changes made to a
        paged-in device copy show here only after a write-back. An NVMe read goes
        straight into ``out`` when ``out`` starts at a 4 KiB-aligned address and the
        tensor is a whole number of 4 KiB blocks (else through the staging buffers).
        """
        rec = self._record(name)
        if out is not None:
            self._check_out(rec, out)
        self._io.settle(rec, sync=True)
        if out is None and rec.home is Tier.NVME and rec.written and rec.spec.nbytes:
            return self._io.read_home(rec, None)
        result = torch.empty(rec.spec.shape, dtype=rec.spec.dtype) if out is None else out
        settled(self._read_into(rec, result, self._ready_if(rec.home is Tier.DEVICE)))
        return result

    def read_async(self, name: str, out: torch.Tensor) -> Ticket:
        """Start reading the home-tier contents of ``name`` into ``out`` on the copy threads.

        ``out`` is a contiguous CPU tensor of the tensor's shape and dtype; it must not be
        used until the ticket is done (:meth:`Ticket.wait` returns ``{name: out}``). The
        read runs after this tensor's pending operations (a write-back in flight lands
        first) and follows the same rules as :meth:`read`.
        """
        rec = self._record(name)
        self._check_out(rec, out)
        ready = self._ready_if(rec.home is Tier.DEVICE)  # else no device memory is read
        fut = self._submit(
            rec, lambda after: self._read_into(rec, out, after + ready), TransferKind.READ
        )
        return self._ticket([(rec, fut)], results={name: out})

    def _check_out(self, rec: Record, out: torch.Tensor) -> None:
        self._check_like(rec, out)
        if out.device.type != "cpu" or not out.is_contiguous():
            raise ValueError(
                f"tensor {rec.spec.name!r}: out must be a contiguous CPU tensor, got one on "
                f"{out.device}: pass out=None to get a new one"
            )

    def _read_into(self, rec: Record, out: torch.Tensor, after: Events) -> CopyEvent | None:
        """Copy the home contents of ``rec`` into the CPU tensor ``out``."""
        spec = rec.spec
        if not spec.nbytes:
            return None
        if rec.home is Tier.NVME:
            settled_all(after)
            if rec.written:
                self._io.read_home(rec, out)
            else:
                out.zero_()
            return None
        assert rec.home_slot is not None
        src = rec.home_slot.raw()[: spec.nbytes]
        return self._io.copy(flat_bytes(out), Tier.HOST, src, rec.home, after)

    def write(self, name: str, tensor: torch.Tensor) -> None:
        """Set the contents of ``name`` from ``tensor`` (same shape and dtype, any device).

        Updates the home tier and, when paged in, the device copy; returns
        when both hold the new contents.
        """
        rec = self._record(name)
        check_writable(rec, "write")
        self._check_like(rec, tensor)
        self._io.settle(rec, sync=True)
        data = flat_bytes(tensor)
        tier = self._tier_of(tensor)
        slot = rec.device_slot  # by identity: Slots compare their buffers' elements
        device_copy = rec.home is not Tier.DEVICE and slot is not None and slot is not rec.home_slot
        ready = self._ready_if(self._on_device(data) or rec.home is Tier.DEVICE or device_copy)
        settled(self._io.store(rec, data, tier, None, ready))
        if device_copy:
            assert rec.device_slot is not None
            dst = rec.device_slot.raw()[: rec.spec.nbytes]
            settled(self._io.copy(dst, Tier.DEVICE, data, tier, ready))

    def host_view(self, name: str) -> torch.Tensor:
        """The home contents of HOST-home ``name`` as a view of the host arena (no copy).

        Waits for this tensor's pending operations first. Changes made through the view
        are its new contents (as after :meth:`write`, without a device copy to update):
        the caller must not change it while the tensor is paged in on a CUDA device or
        while another thread reads or writes it. Raises ``ValueError`` for another home,
        and :class:`StateError` while it is paged in by copy (on CUDA, or under the double).
        """
        rec = self._record(name)
        if rec.home is not Tier.HOST:
            raise ValueError(
                f"tensor {name!r} is homed on {rec.home.value}, not host: only HOST-home "
                f"tensors have a host view; use read() and write() instead"
            )
        if not self.pages_host_in_place and rec.residency.state is not Residency.RELEASED:
            raise StateError(
                f"tensor {name!r} is {rec.residency.state.value.upper()} on {self.device}: "
                f"a host view would miss its device copy; {rec.residency.hint()}"
            )
        self._io.settle(rec, sync=True)
        assert rec.home_slot is not None
        return rec.home_slot.view(rec.spec.shape, rec.spec.dtype)

    def move(self, name: str, tier: Tier) -> None:
        """Change the home tier of ``name``, keeping its contents.

        The tensor must be RELEASED (or homed on DEVICE). The destination's
        budget is checked first; on any failure nothing changes.
        """
        rec = self._record(name)
        tier = Tier(tier)
        if tier is rec.home:
            return
        check_writable(rec, f"move to {tier.value}")
        if rec.home is not Tier.DEVICE and rec.residency.state is not Residency.RELEASED:
            raise StateError(
                f"tensor {name!r} is {rec.residency.state.value.upper()}: move() to "
                f"{tier.value} needs it RELEASED; {rec.residency.hint()}"
            )
        self._io.settle(rec, sync=True)
        new = Record(
            spec=rec.spec, home=tier, residency=rec.residency, written=False, scratch=rec.scratch
        )
        if tier is Tier.NVME:
            nvme = self._nvme_for(name)
            if nvme.contains(name):
                raise ValueError(
                    f"tensor {name!r}: the NVMe group already holds an unregistered array of "
                    f"that name: delete it from the group or rename the tensor"
                )
            nvme.create(
                name,
                rec.spec.shape,
                rec.spec.dtype,
                checksum=rec.spec.checksum,
                durable=not rec.scratch,
            )
        else:
            arena = self._device_arena if tier is Tier.DEVICE else self._host_arena
            new.home_slot = self._allocate(arena, rec.spec)
        try:
            if tier is Tier.NVME:
                assert rec.home_slot is not None
                raw = rec.home_slot.raw()
                event = self._io.store(new, raw[: rec.spec.nbytes], rec.home, raw, self._io.ready())
            else:
                assert new.home_slot is not None
                event = self._io.load(rec, new.home_slot, tier, self._io.ready())
            settled(event)
        except BaseException:
            self._drop_home(new, delete_nvme=True)
            raise
        self._drop_home(rec, delete_nvme=True)
        if rec.home is Tier.DEVICE:
            rec.residency.apply("home_off_device")
            rec.device_slot = None
        rec.home, rec.home_slot, rec.written = tier, new.home_slot, new.written
        if tier is Tier.DEVICE:
            rec.residency.apply("home_on_device")
            rec.device_slot = rec.home_slot

    # -- element ranges (one piece of a flat tensor) ---------------------------------------

    def read_range_async(self, name: str, out: torch.Tensor, start: int, count: int) -> Ticket:
        """Start reading elements ``[start, start + count)`` of the 1-D tensor ``name``'s home
        contents into the first ``count`` elements of ``out``, on the copy threads.

        ``out`` is a contiguous host tensor of the tensor's dtype with at least ``count``
        elements, untouched until the ticket is done. From an NVMe home ``start`` lies on a
        4 KiB boundary (:data:`storage.io.ALIGNMENT`, in bytes) and ``out`` holds ``count``
        elements padded to 4 KiB (the piece is read from the file alone); a tensor never
        written reads as zeros. Ordered after this tensor's pending operations, as
        :meth:`read_async`.
        """
        rec = self._record(name)
        lo, n = self._range(rec, out, start, count)
        ready = self._ready_if(rec.home is Tier.DEVICE)
        dst = flat_bytes(out)
        fut = self._submit(
            rec, lambda after: self._read_range(rec, dst, lo, n, after + ready), TransferKind.READ
        )
        return self._ticket([(rec, fut)], results={name: out[:count]})

    def write_range_async(self, name: str, src: torch.Tensor, start: int, count: int) -> Ticket:
        """Start writing the first ``count`` elements of host tensor ``src`` over elements
        ``[start, start + count)`` of the 1-D tensor ``name``'s home, on the copy threads.

        The rest of the tensor keeps its contents. ``src`` follows :meth:`read_range_async`'s
        rules for ``out`` and stays unchanged until the ticket's ``wait_host``. The tensor is
        not paged in by copy (its device copy would go stale); an NVMe home is a scratch
        array without a checksum trailer, written over its chunk in place
        (``ValueError`` otherwise: write it whole with :meth:`write_back_async`).
        """
        rec = self._record(name)
        check_writable(rec, "write a range of")
        lo, n = self._range(rec, src, start, count)
        if rec.home is not Tier.DEVICE and rec.device_slot not in (None, rec.home_slot):
            raise StateError(
                f"tensor {name!r} is {rec.residency.state.value.upper()} by copy: a range "
                f"written to its home would leave its device copy stale; {rec.residency.hint()}"
            )
        if rec.home is Tier.NVME and (rec.spec.checksum or not rec.scratch):
            raise ValueError(
                f"tensor {name!r} on nvme is written atomically with a checksum, not in "
                "pieces: write it whole with write_back_async"
            )
        data, tier = flat_bytes(src), self._tier_of(src)
        ready = self._ready_if(self._on_device(data) or rec.home is Tier.DEVICE)
        fut = self._submit(
            rec,
            lambda after: self._write_range(rec, data, tier, lo, n, after + ready),
            TransferKind.WRITE_BACK,
        )
        return self._ticket([(rec, fut)], results={name: src[:count]})

    def _range(self, rec: Record, buf: torch.Tensor, start: int, count: int) -> tuple[int, int]:
        """(byte offset, bytes) of elements ``[start, start + count)`` of ``rec`` carried by
        ``buf``; ``ValueError`` naming what does not fit."""
        spec = rec.spec
        numel = spec.shape[0] if len(spec.shape) == 1 else -1
        if buf.dtype != spec.dtype or not buf.is_contiguous() or buf.is_cuda:
            raise ValueError(
                f"tensor {spec.name!r} is {spec.dtype}: a range goes through a contiguous host "
                f"tensor of that dtype, got {buf.dtype} on {buf.device}: pass one"
            )
        if numel < 0 or start < 0 or count < 0 or start + count > numel or count > buf.numel():
            raise ValueError(
                f"tensor {spec.name!r} of shape {spec.shape}: elements [{start}, {start + count}) "
                f"through a buffer of {buf.numel()}: pass a range of a 1-D tensor and a buffer "
                "of at least count elements"
            )
        size = buf.element_size()
        return start * size, count * size

    def _read_range(
        self, rec: Record, dst: torch.Tensor, lo: int, n: int, after: Events
    ) -> CopyEvent | None:
        if n == 0:
            return None
        if rec.home is Tier.NVME:
            settled_all(after)
            if rec.written:
                self._io._nvme_read(rec, dst, Tier.HOST, lo, n)
            else:
                dst[:n].zero_()
            return None
        assert rec.home_slot is not None
        return self._io.copy(dst[:n], Tier.HOST, rec.home_slot.raw()[lo : lo + n], rec.home, after)

    def _write_range(
        self, rec: Record, data: torch.Tensor, tier: Tier, lo: int, n: int, after: Events
    ) -> CopyEvent | None:
        if n == 0:
            return None
        if rec.home is not Tier.NVME:
            assert rec.home_slot is not None
            return self._io.copy(rec.home_slot.raw()[lo : lo + n], rec.home, data[:n], tier, after)
        settled_all(after)
        nvme = self._nvme_for(rec.spec.name)
        with self._io.meters[Link.HOST_TO_NVME].timing(n):
            nvme.write_piece_async(rec.spec.name, data, offset=lo, nbytes=n).wait()
        rec.written = True
        return None

    # -- helpers ---------------------------------------------------------------------------

    def _page_in_work(self, rec: Record, slot: Slot, ready: Events) -> Work:
        return lambda after: self._io.load(rec, slot, Tier.DEVICE, after + ready)

    def __enter__(self) -> TieredStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
