"""Gradients off the device, and their sums in fp32 host memory.

:class:`GradSink` moves each block's gradients off the device to a worker thread (or, on
a CPU device, the training thread itself) that adds them into fp32 state; :func:`sum_tiles`
sums several micro-batches' gradients tile by tile, reading and writing each element of the
sum once (:class:`~bb_lightning.engine.flat_state.FlatState` and the probes' timing of it
use it); :func:`add_converted` adds a gradient of another dtype without PyTorch's slow
mixed-dtype path on the CPU. Where the host's compiled operations build
(:func:`~bb_lightning.engine.host_norm.kernel`), both sum a CPU gradient of bf16 or fp32 into
an fp32 accumulator in one pass through ``host_ops.c``'s ``bb_sum_f32``: each source widened
to fp32 in registers, the results torch's bit for bit, where torch converts a bf16 gradient
in a pass of its own before it adds (the figures: docs/benchmarks.md, "Measurements behind
design choices").
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import torch
from torch import Tensor

from bb_lightning.engine import host_norm
from bb_lightning.engine.timing import PhaseTimer
from storage.deferred import CopyEvent
from storage.host import HostBuffer
from storage.store import TieredStore
from storage.threads import limit_torch_threads
from storage.transfers import settled

__all__ = ["CONVERT_CHUNK", "LINK_CHUNK", "GradSink", "add_converted", "convert_piece", "sum_tiles"]


class GradSink:
    """Moves gradients off the device to a worker thread that adds them into fp32 host state.

    At most :attr:`max_pending` batches (one block's gradients each) wait for or run on
    the worker; :meth:`process_async` blocks the caller until one finishes beyond that,
    so gradients never pile up on the device. Where tensors on the compute device need
    a copy to reach the host (CUDA; the store's CPU double), each batch is copied
    ``non_blocking`` into one of :attr:`max_pending` reused page-locked buffers through
    the store (``TieredStore.copy_to_host_async``, counted on its ``d2h`` link),
    the worker waits on the host for those copies only (never stalling the compute
    stream), and the work converts them to fp32 as it adds them. Without a store, or on
    a CPU device, the worker takes the gradients themselves. :meth:`wait` is the one
    sync point of a backward pass.

    ``threads`` sets the intra-op (OpenMP) threads of the worker's torch ops (None: the
    process's). On a CPU device the worker runs beside the compute's own thread team
    and the engine passes 1 (:mod:`storage.threads` says why).

    The worker converts and sums in pieces of :data:`LINK_CHUNK` elements where the
    gradients arrive by copy from a device (its thread team splits each piece, and a
    1 MiB piece left each thread a sliver per op, the team's start-up cost paid twice
    per sliver), else of :data:`CONVERT_CHUNK` (:func:`convert_piece`).

    ``inline``: run each batch's work on the calling thread at once, with its thread
    team, instead of on the worker (:meth:`wait` still raises what the work raised). On
    a CPU device the compute's team already holds every core, so a worker beside it
    only takes cores from the team and leaves it waiting at its barriers: measured, a
    training step took longer with the worker than inline, and longer than plain
    Lightning's.
    """

    def __init__(
        self,
        timer: PhaseTimer | None = None,
        *,
        store: TieredStore | None = None,
        pending: int = 2,
        threads: int | None = None,
        inline: bool = False,
    ) -> None:
        if pending < 1:
            raise ValueError(f"GradSink pending={pending} must be >= 1: pass 1 or more")
        if threads is not None and threads < 1:
            raise ValueError(f"GradSink threads={threads} must be >= 1, or None (the process's)")
        copies = store is not None and store.copies_to_host
        self.piece = LINK_CHUNK if copies else CONVERT_CHUNK
        """Elements the worker converts and sums at a time (:func:`convert_piece`)."""
        init = functools.partial(_init_worker, threads, self.piece)
        self._pool = ThreadPoolExecutor(1, "bb-grads", initializer=init)
        self._futures: list[Future[object]] = []
        self._store = store
        self.max_pending = pending
        """Batches of gradients that may wait for the worker at once."""
        self._slots = threading.BoundedSemaphore(pending)
        self._buffers: list[HostBuffer] = []
        self._lock = threading.Lock()
        self._pending = 0
        self.peak_pending = 0
        """Most batches pending at once since the sink was built."""
        self.timer = timer
        """Times :meth:`wait` as phase ``wait_grads`` when set."""
        self.inline = inline
        """Whether work runs on the calling thread (see the class doc)."""

    def add_async(self, dst: Sequence[Tensor], grads: Sequence[Tensor | None]) -> None:
        """Add each gradient (any dtype, device) into the matching host fp32 view, later."""
        self.process_async(grads, lambda host: _add_all(dst, host))

    def process_async(
        self, grads: Sequence[Tensor | None], work: Callable[[Sequence[Tensor | None]], object]
    ) -> None:
        """Run ``work`` on the worker with the gradients in host memory (FIFO order).

        ``work`` gets host tensors of the gradients' dtypes, valid only while it runs.
        Blocks while :attr:`max_pending` batches are pending.
        """
        self._slots.acquire()
        with self._lock:
            self._pending += 1
            self.peak_pending = max(self.peak_pending, self._pending)
        try:
            store = self._store
            if store is not None and store.copies_to_host and any(g is not None for g in grads):
                buf = self._buffer(grads)
                views = _carve(buf.tensor, grads)
                dsts: list[Tensor] = []
                srcs: list[Tensor] = []
                for v, g in zip(views, grads, strict=True):
                    if v is not None and g is not None:
                        dsts.append(v)
                        srcs.append(g.detach())
                events = store.copy_to_host_async(dsts, srcs)
                job = functools.partial(self._on_host, views, events, buf, work)
            else:
                job = functools.partial(self._direct, grads, work)
        except BaseException:
            self._done()
            raise
        self._futures.append(_run_now(job) if self.inline else self._pool.submit(job))

    def _buffer(self, grads: Sequence[Tensor | None]) -> HostBuffer:
        """A free page-locked buffer that holds ``grads`` (grown once when too small)."""
        need = sum(_slot(g) for g in grads if g is not None)
        with self._lock:
            for k, buf in enumerate(self._buffers):
                if buf.nbytes >= need:
                    return self._buffers.pop(k)
            old = self._buffers.pop() if self._buffers else None
        if old is not None:
            old.release()
        store = self._store
        if store is None:
            return HostBuffer(need)
        return HostBuffer(need, pin=store.pins_host, node=store.host_node)

    def _direct(
        self, grads: Sequence[Tensor | None], work: Callable[[Sequence[Tensor | None]], object]
    ) -> None:
        try:
            work(grads)
        finally:
            self._done()

    def _on_host(
        self,
        views: Sequence[Tensor | None],
        events: Sequence[CopyEvent | None],
        buf: HostBuffer,
        work: Callable[[Sequence[Tensor | None]], object],
    ) -> None:
        try:
            for event in events:
                settled(event)  # the host waits for these copies only
            work(views)
        finally:
            with self._lock:
                self._buffers.append(buf)
            self._done()

    def _done(self) -> None:
        with self._lock:
            self._pending -= 1
        self._slots.release()

    def submit(self, work: Callable[[], None]) -> None:
        """Run ``work`` on the worker after every addition queued so far (FIFO order);
        inline: now, on the calling thread."""
        self._futures.append(_run_now(work) if self.inline else self._pool.submit(work))

    def wait(self, phase: str | None = "wait_grads") -> None:
        """Block until every queued task is done; re-raises a worker's exception.

        The wait is timed as ``phase`` when a timer is set (None: not timed).
        """
        futures, self._futures = self._futures, []
        with _timed(None if phase is None else self.timer, phase or ""):
            for future in futures:
                future.result()

    def close(self) -> None:
        """Finish queued work, stop the worker and unpin its buffers."""
        self.wait()
        self._pool.shutdown(wait=True)
        with self._lock:
            buffers, self._buffers = self._buffers, []
        for buf in buffers:
            buf.release()


_GRAD_ALIGN = 256
"""Byte alignment of each gradient in a sink buffer."""


def _slot(g: Tensor) -> int:
    nbytes = g.numel() * g.element_size()
    return -(-nbytes // _GRAD_ALIGN) * _GRAD_ALIGN


def _carve(buffer: Tensor, grads: Sequence[Tensor | None]) -> list[Tensor | None]:
    """Views of ``buffer`` (flat ``uint8``) shaped and typed like each gradient."""
    views: list[Tensor | None] = []
    offset = 0
    for g in grads:
        if g is None:
            views.append(None)
            continue
        nbytes = g.numel() * g.element_size()
        views.append(buffer[offset : offset + nbytes].view(g.dtype).view(g.shape))
        offset += _slot(g)
    return views


def _timed(timer: PhaseTimer | None, phase: str) -> contextlib.AbstractContextManager[None]:
    return contextlib.nullcontext() if timer is None else timer.phase(phase)


CONVERT_CHUNK = 1 << 18
"""Elements converted at a time when adding a gradient of another dtype (1 MiB of fp32):
a thread's default, and a CPU device's, whose cores the compute's team holds."""
LINK_CHUNK = 1 << 22
"""Elements a gradient worker converts and sums at a time when the gradients come by copy
from a device (16 MiB of fp32): its thread team splits each piece."""
_chunks = threading.local()


def convert_piece() -> int:
    """Elements this thread converts and sums at a time (:func:`add_converted`,
    :func:`sum_tiles`): :data:`CONVERT_CHUNK` unless its :class:`GradSink` set another."""
    piece: int = getattr(_chunks, "piece", CONVERT_CHUNK)
    return piece


def _init_worker(threads: int | None, piece: int) -> None:
    """A gradient worker's start: its intra-op threads (None: the process's), its piece."""
    if threads is not None:
        limit_torch_threads(threads)
    _chunks.piece = piece


def _add_all(dst: Sequence[Tensor], grads: Sequence[Tensor | None]) -> None:
    for view, g in zip(dst, grads, strict=True):
        if g is not None:
            add_converted(view, g.to(view.device))


def sum_tiles(
    dst: Sequence[Tensor], batches: Sequence[Sequence[Tensor | None]], *, into: bool
) -> None:
    """``dst[j] (+)= batches[0][j] + batches[1][j] + ...`` in ``dst``'s dtype, left to right.

    ``into`` adds to what ``dst`` holds; otherwise the first present gradient is copied
    in (zeros where a view has none). Contiguous fp32 CPU views whose gradients are
    contiguous CPU bf16 or fp32 are summed by the compiled kernel in one pass; other
    contiguous CPU views :func:`convert_piece` elements at a time, every batch's slice in
    turn. Either way each element of ``dst`` is read and written once whatever the number
    of batches.
    """
    kern = _sum_kernel(dst[0]) if dst else None
    for j, view in enumerate(dst):
        grads = [g for b in batches if (g := b[j]) is not None]
        if not grads:
            if not into:
                view.zero_()
            continue
        if kern is not None and kern.sum_into(view, grads, into=into):
            continue
        if view.device.type != "cpu" or not view.is_contiguous() or len(grads) == 1:
            if not into:
                view.copy_(grads[0])
            for g in grads if into else grads[1:]:
                add_converted(view, g.to(view.device))
            continue
        flat = view.view(-1)
        srcs = [g.reshape(-1) for g in grads]
        piece = convert_piece()
        for start in range(0, flat.numel(), piece):
            stop = min(start + piece, flat.numel())
            tile = flat[start:stop]
            if not into:
                tile.copy_(srcs[0][start:stop])
            for src in srcs if into else srcs[1:]:
                add_converted(tile, src[start:stop])


def _sum_kernel(dst: Tensor) -> host_norm._Kernel | None:
    """The compiled sums for an accumulator ``dst`` in host memory, where torch runs
    operations as called (:func:`~bb_lightning.engine.host_norm.eager`: a dry run's fake
    tensors have no memory to read); else None."""
    if dst.device.type != "cpu" or not host_norm.eager():
        return None
    return host_norm.kernel()


def _run_now(work: Callable[[], object]) -> Future[object]:
    """Run ``work`` on this thread; a completed future holding its result or exception."""
    future: Future[object] = Future()
    try:
        future.set_result(work())
    except BaseException as exc:  # raised again by GradSink.wait, as the worker's are
        future.set_exception(exc)
    return future


def add_converted(dst: Tensor, src: Tensor) -> None:
    """``dst += src`` with ``src`` converted to ``dst``'s dtype first.

    On the CPU, PyTorch's mixed-dtype ``add_`` (fp32 += bf16) runs several times
    slower than a conversion plus a same-dtype add, so a contiguous CPU ``src`` of
    another dtype is summed by the compiled kernel (``sum_into`` of
    :func:`~bb_lightning.engine.host_norm.kernel`), or where that declines or is not built,
    converted :func:`convert_piece` elements at a time into a per-thread buffer (no
    allocation per call) and added from there.
    """
    if (
        src.dtype == dst.dtype
        or dst.device.type != "cpu"
        or not (dst.is_contiguous() and src.is_contiguous())
        or src.shape != dst.shape
    ):
        dst.add_(src)
        return
    kern = _sum_kernel(dst)
    if kern is not None and kern.sum_into(dst, [src], into=True):
        return
    piece = convert_piece()
    buf: Tensor | None = getattr(_chunks, "buf", None)
    if buf is None or buf.dtype != dst.dtype or buf.numel() != piece:
        buf = _chunks.buf = torch.empty(piece, dtype=dst.dtype)
    flat_dst, flat_src, n = dst.view(-1), src.view(-1), dst.numel()
    for start in range(0, n, piece):
        stop = min(start + piece, n)
        part = buf[: stop - start]
        part.copy_(flat_src[start:stop])
        flat_dst[start:stop].add_(part)
