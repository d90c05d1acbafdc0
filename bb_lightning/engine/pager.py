"""Page blocks' weights in and out of the device through a :class:`storage.store.TieredStore`.

The pager owns the mapping from a block to the names of its tensors in the
store. The store owns residency (RESIDENT / IN_FLIGHT / RELEASED); the pager
only keeps the tickets of page-ins it has issued and asks the store for state.

Per block ``i`` the store holds, each as one flat 1-D tensor:

- ``<prefix>.<i>.weight``: the block's parameters in the compute dtype, laid end
  to end (home: ``Placement.weights[i]``; DEVICE means resident);
- ``<prefix>.<i>.master``, ``.exp_avg``, ``.exp_avg_sq``: fp32 master weights and
  AdamW moments (home: ``Placement.master[i]``), see :class:`FlatState`;
- ``<prefix>.<i>.grad``: the fp32 gradient accumulator (home: ``Placement.grads[i]``),
  summed over the micro-batches of an accumulation window. On HOST it is summed in
  place; elsewhere it is read into a scratch buffer, summed and written back, and
  only when the sum must outlive the backward pass (see :meth:`FlatState.accumulate`).

Frozen parameters (``requires_grad=False``, say the base weights under LoRA adapters)
are kept apart in training: ``<prefix>.<i>.weight`` and the :class:`FlatState` hold only
the block's trainable parameters, and ``<prefix>.<i>.frozen`` (registered only when the
block has frozen parameters) holds the others in the compute dtype, homed with the
block's weights and paged in with them, but never written back: no master weights,
moments or gradient accumulator exist for them.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import math
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import torch
from torch import Tensor, nn

from bb_lightning.engine.observers import BlockObserver
from bb_lightning.engine.shard import ShardComm, ShardLayout, digest
from bb_lightning.engine.timing import PhaseTimer
from bb_lightning.placement import Placement, StoredTensor
from storage.deferred import CopyEvent
from storage.device import slot_bytes
from storage.external import FilePiece
from storage.host import HostBuffer
from storage.observers import added, removed
from storage.store import Ticket, TieredStore
from storage.threads import limit_torch_threads
from storage.tiers import Residency, Tier
from storage.transfers import settled

__all__ = [
    "BlockLoader",
    "BlockPager",
    "FlatState",
    "GradSink",
    "Placement",
    "block_params",
    "dtype_name",
    "flatten_fp32",
    "register_stored",
    "set_data",
    "store_budgets",
    "torch_dtype",
]

BlockLoader = Callable[[int], Tensor]
"""Block index -> the block's parameters as one flat fp32 CPU tensor, laid out like its
:class:`FlatState` (used to fill the store from a checkpoint one block at a time)."""


def register_stored(store: TieredStore, entry: StoredTensor, value: Tensor | None = None) -> None:
    """Register manifest ``entry`` in ``store``: ``value`` (flat, cast to the entry's dtype)
    or zeros. Raises ``ValueError`` when ``value`` has another number of elements.

    Every tensor an engine stores is the store's scratch: this run writes it (here, from
    the module, a checkpoint or zeros) before reading it, and only this run reads it, so
    on NVMe it goes without a CRC-32C trailer unless ``StoreConfig.scratch_checksums``;
    the checksum pass would otherwise cost a core-second per ~6 GB read or written, on
    every weight pass and optimizer step. Checkpoints carry their own checksums.
    """
    dtype = getattr(torch, entry.dtype)
    if value is None:
        store.register(entry.name, shape=(entry.numel,), dtype=dtype, home=entry.home, scratch=True)
        return
    if value.numel() != entry.numel:
        raise ValueError(
            f"{entry.name!r} has {value.numel()} elements but the manifest {entry.numel}: "
            "build the manifest from this model's sizes"
        )
    store.register(entry.name, value.reshape(-1).to(dtype), home=entry.home, scratch=True)


def store_budgets(manifest: Sequence[StoredTensor], placement: Placement) -> dict[Tier, int]:
    """Bytes each tier needs to hold ``manifest`` and page its blocks as ``placement`` says.

    Each tensor counts :func:`storage.device.slot_bytes` of its size on its home, the
    arenas' accounting (padded to 4 KiB, at least 4 KiB even when empty), so many small
    tensors fit; on NVMe, which counts exact bytes, that is an upper bound. The device
    also holds ``prefetch_depth + 1`` paging slots of the largest block's compute-dtype
    weights. The parameters outside the blocks are ordinary device tensors, not counted.
    """
    need = dict.fromkeys(Tier, 0)
    per_block: dict[int, int] = {}
    for t in manifest:
        need[t.home] += slot_bytes(t.nbytes)
        if t.block is not None:
            per_block[t.block] = per_block.get(t.block, 0) + slot_bytes(t.nbytes)
    need[Tier.DEVICE] += (placement.prefetch_depth + 1) * max(per_block.values(), default=0)
    return need


def torch_dtype(placement: Placement) -> torch.dtype:
    """The torch dtype of ``placement.compute_dtype``."""
    dtype = getattr(torch, placement.compute_dtype)
    assert isinstance(dtype, torch.dtype)
    return dtype


def dtype_name(dtype: torch.dtype) -> str:
    """The name :attr:`Placement.compute_dtype` gives ``dtype`` (``torch.bfloat16`` ->
    ``"bfloat16"``)."""
    return str(dtype).removeprefix("torch.")


def block_params(module: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """Named parameters of ``module`` in registration order, shared ones once."""
    return list(module.named_parameters(remove_duplicate=True))


class FlatState:
    """fp32 master weights, AdamW moments and gradient accumulator, in the store.

    ``params`` are laid end to end in one flat buffer of ``numel`` elements.
    The master weights are initialised from ``initial`` (flat fp32) when given,
    else from the parameters' current values (which may then not be on the meta device).
    Its four tensors (``<name>.master``, ``.exp_avg``, ``.exp_avg_sq``, ``.grad``) are
    registered as the ``manifest`` entries of those names say (homes, sizes, dtypes).

    With ``comm`` (data parallelism, :mod:`bb_lightning.engine.shard`) the four hold this
    rank's shard only: :attr:`numel` is the shard's elements, :attr:`full_numel` the
    parameters'; :meth:`accumulate` reduce-scatters the gradients first, and
    :meth:`gather` gives the whole flat state from every rank's shard.
    """

    def __init__(
        self,
        store: TieredStore,
        name: str,
        params: Sequence[Tensor],
        *,
        manifest: Mapping[str, StoredTensor],
        initial: Tensor | None = None,
        comm: ShardComm | None = None,
    ) -> None:
        self.store = store
        self.name = name
        self.comm = comm
        """The collectives of data parallelism (None: one process holds the whole state)."""
        self.shapes = [tuple(p.shape) for p in params]
        self.full_numel = sum(math.prod(s) for s in self.shapes)
        """Elements of the parameters laid end to end."""
        self.layout = None if comm is None else ShardLayout(self.shapes, comm.world_size)
        """Where each parameter's rows lie in a shard (None without ``comm``)."""
        self.numel = self.full_numel if self.layout is None else self.layout.shard_numel
        """Elements of each stored tensor (this rank's shard under ``comm``)."""
        master = initial if initial is not None else flatten_fp32(params)
        if master.shape != (self.full_numel,) or master.dtype != torch.float32:
            raise ValueError(
                f"initial values of {name!r} have shape {tuple(master.shape)} and {master.dtype}; "
                f"expected ({self.full_numel},) and torch.float32: lay the parameters end to end"
            )
        self.digest = digest(master) if comm is not None else None
        """CRC-32C of the initial values under ``comm`` (checked equal on every rank)."""
        if comm is not None:
            master = self.local(master, torch.empty(self.numel, dtype=torch.float32))
        zeros = torch.zeros(self.numel, dtype=torch.float32)
        register_stored(store, manifest[self.master_name], master)
        register_stored(store, manifest[f"{name}.exp_avg"], zeros)
        register_stored(store, manifest[f"{name}.exp_avg_sq"], zeros)
        register_stored(store, manifest[self.grad_name])
        self.grad_pending = False
        """Whether the accumulator holds gradients since the last :meth:`clear_grad`."""
        self.held: list[Sequence[Tensor | None]] = []
        """Gradients of earlier micro-batches kept as they came (:meth:`hold`), not yet
        summed into the accumulator."""

    @property
    def grad_name(self) -> str:
        """Store name of the flat fp32 gradient accumulator."""
        return f"{self.name}.grad"

    def accumulate(
        self, grads: Sequence[Tensor | None], scratch: Tensor | None, *, persist: bool = True
    ) -> Tensor:
        """Add per-parameter gradients (any dtype, host) to the accumulator; the flat sum.

        A HOST-home accumulator is summed in place (``scratch`` unused). Otherwise the
        sum is formed in ``scratch`` (fp32, at least ``numel`` elements; the stored sum
        is read first when one is pending) and, with ``persist``, written to its home
        before returning (the gradient worker calls it; the training thread only where
        nothing is homed on NVMe, see ``TrainingEngine._inline_grads``).
        Without ``persist`` the sum lives only in ``scratch`` (the caller steps from it).
        Gradients :meth:`hold` kept are summed first, in the order they came.
        """
        if self.comm is not None:  # this rank's shard of the mean over the ranks
            assert self.layout is not None
            reduced = self.comm.reduce_scatter(grads, self.layout)
            return self._sum([[reduced]], [(self.numel,)], scratch, persist)
        return self._sum([*self.held, grads], self.shapes, scratch, persist)

    def hold(self, grads: Sequence[Tensor | None]) -> None:
        """Keep ``grads`` (host tensors the caller no longer touches) to sum later.

        Adding a micro-batch's gradient to an fp32 accumulator reads and writes the
        accumulator each time (``compute bytes + 8`` per element); held gradients are
        summed once, tile by tile, when the next :meth:`accumulate` or :meth:`gradient`
        needs the sum (``compute bytes`` per element each, plus 4 for the sum), in the
        same order and fp32 arithmetic, so the sum is the same. Each held micro-batch
        keeps its gradients' memory until then. Not under ``comm``: the ranks reduce
        every micro-batch's gradient.
        """
        if self.comm is not None:
            raise ValueError(
                f"{self.name!r} is sharded over {self.comm.world_size} ranks: its gradients "
                "are reduce-scattered as they come; call accumulate"
            )
        self.held.append(grads)

    def _sum(
        self,
        batches: Sequence[Sequence[Tensor | None]],
        shapes: Sequence[tuple[int, ...]],
        scratch: Tensor | None,
        persist: bool,
    ) -> Tensor:
        """The accumulator plus ``batches`` (each one gradient per view), stored as
        :meth:`accumulate` says; forgets the held gradients."""
        first = not self.grad_pending
        if self.store.home(self.grad_name) is Tier.HOST:
            flat = self.store.host_view(self.grad_name)
            persist = False
        else:
            if scratch is None or scratch.numel() < self.numel:
                raise ValueError(
                    f"{self.grad_name!r} is homed on {self.store.home(self.grad_name).value}: "
                    f"pass an fp32 scratch buffer of at least {self.numel} elements"
                )
            flat = scratch[: self.numel]
            if not first:
                self.store.read(self.grad_name, out=flat)
        # nothing to add to: the first gradients are copied in (absent ones as zeros)
        sum_tiles(_views(flat, shapes), batches, into=not first)
        self.held = []
        self.grad_pending = True
        if persist:
            self.store.write(self.grad_name, flat)
        return flat

    def gradient(self, scratch: Tensor | None = None) -> Tensor:
        """The accumulated gradient (zeros when none is pending), flat fp32 on the host.

        A HOST-home accumulator is returned as a view of its home (no copy), the held
        gradients summed into it; another is read into ``scratch`` (a new tensor when
        None) and the held gradients are added there, still held (nothing is written).
        """
        if self.store.home(self.grad_name) is Tier.HOST:
            if self.held:
                return self._sum(self.held, self.shapes, None, False)
            flat = self.store.host_view(self.grad_name)
            return flat if self.grad_pending else flat.zero_()
        out = torch.empty(self.numel) if scratch is None else scratch[: self.numel]
        if self.held:
            if self.grad_pending:
                self.store.read(self.grad_name, out=out)
            sum_tiles(_views(out, self.shapes), self.held, into=self.grad_pending)
            return out
        if self.grad_pending:
            return self.store.read(self.grad_name, out=out)
        return out.zero_()

    def clear_grad(self) -> None:
        """Forget the accumulated and held gradients (after the optimizer step); nothing
        is written."""
        self.grad_pending = False
        self.held = []

    @property
    def master_name(self) -> str:
        """Store name of the flat fp32 master weights."""
        return f"{self.name}.master"

    @property
    def state_names(self) -> tuple[str, str, str]:
        """Store names of master weights, first and second moment."""
        return (self.master_name, f"{self.name}.exp_avg", f"{self.name}.exp_avg_sq")

    def read_master(self, out: Tensor | None = None) -> Tensor:
        """The fp32 master weights as a flat host tensor (into ``out`` when given)."""
        return self.store.read(self.master_name, out=out)

    def ranges(self) -> list[tuple[int, int]]:
        """Where each parameter's elements lie in a stored tensor, ``(start, end)``: end to
        end, or under ``comm`` its rows in this rank's shard (with their padding)."""
        if self.layout is None:
            ends = list(itertools.accumulate(math.prod(s) for s in self.shapes))
            return list(zip([0, *ends], ends, strict=False))
        return [(q.offset, q.offset + q.chunk * q.row) for q in self.layout.pieces]

    def master_views(self, flat: Tensor) -> list[Tensor]:
        """Per-parameter views of a whole flat buffer laid out like this state (under
        ``comm`` a shard must be gathered first: :meth:`gather`)."""
        return _views(flat, self.shapes)

    def gather(self, shard: Tensor, buf: Tensor | None = None, out: Tensor | None = None) -> Tensor:
        """The whole flat state (:attr:`full_numel` elements) from every rank's ``shard``.

        Without ``comm`` that is ``shard`` itself. Under ``comm`` it is a collective:
        every rank calls it for the same state in the same order; the shards arrive in
        ``buf`` (at least ``world_size * numel`` elements of ``shard``'s dtype) and are
        unpacked into ``out`` (at least ``full_numel``); None allocates either.
        """
        if self.comm is None:
            return shard[: self.full_numel]
        assert self.layout is not None
        if buf is None:
            buf = torch.empty(self.numel * self.comm.world_size, dtype=shard.dtype)
        if out is None:
            out = torch.empty(self.full_numel, dtype=shard.dtype)
        gathered = self.comm.all_gather(shard[: self.numel], buf)
        return self.layout.unpack(gathered, out)

    def local(self, full: Tensor, out: Tensor) -> Tensor:
        """This rank's shard of the whole flat ``full`` written into ``out`` (``numel``
        elements, zero-padded); without ``comm`` that is ``full`` copied."""
        if self.comm is None or self.layout is None:
            return out[: self.numel].copy_(full[: self.numel])
        return self.layout.take(full, self.comm.rank, out)

    def move(self, home: Tier, grad_home: Tier | None = None) -> None:
        """Change the home tier of the master weights and moments (they must be released)
        and of the gradient accumulator (None: ``home``)."""
        for name in self.state_names:
            self.store.move(name, home)
        self.store.move(self.grad_name, home if grad_home is None else grad_home)


def set_data(param: Tensor, value: Tensor) -> None:
    """``param.data = value``, also for a parameter on the meta device (swapped in place,
    so the parameter object and every reference to it stay the same)."""
    if param.is_meta and not value.is_meta:
        # a parameter of its own holding ``value``: ``nn.Parameter(value)`` would share
        # value's version counter, as an alias does, so parameters bound to one tensor (the
        # empty stand-in of unbound ones) would share one, and an in-place change to one
        # (peft's parametrization of fused experts) would void the others' saved tensors
        new = nn.Parameter(
            torch.empty(0, dtype=value.dtype, device=value.device),
            requires_grad=param.requires_grad,
        )
        new.data = value
        torch.utils.swap_tensors(param, new)
    else:
        param.data = value


def flatten_fp32(params: Sequence[Tensor]) -> Tensor:
    """The parameters laid end to end as one flat fp32 CPU tensor."""
    if any(p.is_meta for p in params):
        raise ValueError(
            "parameters are on the meta device and no initial values were given: "
            "load the weights (or pass a BlockLoader) before paging the model"
        )
    return _cat([p.detach() for p in params])


def flat_from(params: Sequence[Tensor], load: Callable[[Tensor], Tensor]) -> Tensor:
    """The values ``load(p)`` of ``params`` laid end to end in one fp32 CPU buffer.

    Reads one tensor at a time (a checkpoint never needs to be whole in memory);
    raises ``ValueError`` when a loaded value's shape differs from its parameter's.
    """
    flat = torch.empty(sum(p.numel() for p in params), dtype=torch.float32)
    offset = 0
    for p in params:
        value = load(p)
        if tuple(value.shape) != tuple(p.shape):
            raise ValueError(
                f"checkpoint tensor has shape {tuple(value.shape)} but the model expects "
                f"{tuple(p.shape)}: the checkpoint does not match the model config"
            )
        flat[offset : offset + p.numel()].copy_(value.reshape(-1))
        offset += p.numel()
        del value
    return flat


def buffers_to(model: nn.Module, device: torch.device, compute_dtype: torch.dtype) -> None:
    """Move the model's buffers to ``device``; floating-point ones in ``compute_dtype``."""
    for module in model.modules():
        for key, buf in module._buffers.items():
            if buf is not None:
                dtype = compute_dtype if buf.is_floating_point() else buf.dtype
                module._buffers[key] = buf.to(device, dtype)


def _cat(views: Sequence[Tensor]) -> Tensor:
    """Tensors laid end to end as one flat fp32 CPU tensor (empty for none)."""
    if not views:
        return torch.empty(0, dtype=torch.float32)
    return torch.cat([v.reshape(-1).to("cpu", torch.float32) for v in views])


def _split_frozen(flat: Tensor, params: Sequence[Tensor]) -> tuple[Tensor, Tensor]:
    """A block's flat values (laid out like ``params``) as two flat fp32 tensors: those of
    the trainable parameters, then those of the frozen ones, each in ``params`` order."""
    views = _views(flat, [tuple(p.shape) for p in params])
    trained = [v for p, v in zip(params, views, strict=True) if p.requires_grad]
    frozen = [v for p, v in zip(params, views, strict=True) if not p.requires_grad]
    return _cat(trained), _cat(frozen)


def _views(flat: Tensor, shapes: Sequence[tuple[int, ...]]) -> list[Tensor]:
    views = []
    offset = 0
    for shape in shapes:
        size = math.prod(shape)
        views.append(flat[offset : offset + size].view(shape))
        offset += size
    return views


class GradSink:
    """Moves gradients off the device to a worker thread that adds them into fp32 host state.

    At most :attr:`max_pending` batches (one block's gradients each) wait for or run on
    the worker; :meth:`process_async` blocks the caller until one finishes beyond that,
    so gradients never pile up on the device. Where tensors on the compute device need
    a copy to reach the host (CUDA; the store's CPU double), each batch is copied
    ``non_blocking`` into one of :attr:`max_pending` reused page-locked buffers through
    the store (``TieredStore.copy_to_host_async``, counted on its ``device->host`` link),
    the worker waits on the host for those copies only (never stalling the compute
    stream), and the work converts them to fp32 as it adds them. Without a store, or on
    a CPU device, the worker takes the gradients themselves. :meth:`wait` is the one
    sync point of a backward pass.

    ``threads`` sets the intra-op (OpenMP) threads of the worker's torch ops (None: the
    process's). On a CPU device the worker runs beside the compute's own thread team
    and the engine passes 1 (:mod:`storage.threads` says why).

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
        init = None if threads is None else functools.partial(limit_torch_threads, threads)
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
        return HostBuffer(need)

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


def _timed_wait(
    timer: PhaseTimer | None, device: torch.device
) -> contextlib.AbstractContextManager[None]:
    """Times a page-in wait: by events on ``device``'s stream on CUDA, else by the clock."""
    return contextlib.nullcontext() if timer is None else timer.stream_wait("wait_page_in", device)


CONVERT_CHUNK = 1 << 18
"""Elements converted at a time when adding a gradient of another dtype (1 MiB of fp32)."""
_chunks = threading.local()


def _add_all(dst: Sequence[Tensor], grads: Sequence[Tensor | None]) -> None:
    for view, g in zip(dst, grads, strict=True):
        if g is not None:
            add_converted(view, g.to(view.device))


def sum_tiles(
    dst: Sequence[Tensor], batches: Sequence[Sequence[Tensor | None]], *, into: bool
) -> None:
    """``dst[j] (+)= batches[0][j] + batches[1][j] + ...`` in ``dst``'s dtype, left to right.

    ``into`` adds to what ``dst`` holds; otherwise the first present gradient is copied
    in (zeros where a view has none). Contiguous CPU views are summed
    :data:`CONVERT_CHUNK` elements at a time, every batch's slice in turn, so each
    element of ``dst`` is read and written once whatever the number of batches.
    """
    for j, view in enumerate(dst):
        grads = [g for b in batches if (g := b[j]) is not None]
        if not grads:
            if not into:
                view.zero_()
            continue
        if view.device.type != "cpu" or not view.is_contiguous() or len(grads) == 1:
            if not into:
                view.copy_(grads[0])
            for g in grads if into else grads[1:]:
                add_converted(view, g.to(view.device))
            continue
        flat = view.view(-1)
        srcs = [g.reshape(-1) for g in grads]
        for start in range(0, flat.numel(), CONVERT_CHUNK):
            stop = min(start + CONVERT_CHUNK, flat.numel())
            tile = flat[start:stop]
            if not into:
                tile.copy_(srcs[0][start:stop])
            for src in srcs if into else srcs[1:]:
                add_converted(tile, src[start:stop])


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
    another dtype is converted :data:`CONVERT_CHUNK` elements at a time into a
    per-thread buffer (no allocation per call) and added from there.
    """
    if (
        src.dtype == dst.dtype
        or dst.device.type != "cpu"
        or not (dst.is_contiguous() and src.is_contiguous())
        or src.shape != dst.shape
    ):
        dst.add_(src)
        return
    buf: Tensor | None = getattr(_chunks, "buf", None)
    if buf is None or buf.dtype != dst.dtype:
        buf = _chunks.buf = torch.empty(CONVERT_CHUNK, dtype=dst.dtype)
    flat_dst, flat_src, n = dst.view(-1), src.view(-1), dst.numel()
    for start in range(0, n, CONVERT_CHUNK):
        stop = min(start + CONVERT_CHUNK, n)
        part = buf[: stop - start]
        part.copy_(flat_src[start:stop])
        flat_dst[start:stop].add_(part)


class BlockPager:
    """Binds each block's parameters to paged device views of its flat weights.

    Released parameters point at one shared empty tensor, so a block costs no
    device memory until it is paged in.
    """

    def __init__(
        self,
        store: TieredStore,
        blocks: Sequence[nn.Module],
        placement: Placement,
        *,
        manifest: Mapping[str, StoredTensor],
        device: torch.device,
        prefix: str = "block",
        loader: BlockLoader | None = None,
        timer: PhaseTimer | None = None,
        weights_only: bool = False,
        comm: ShardComm | None = None,
        external: Mapping[int, Sequence[FilePiece]] | None = None,
    ) -> None:
        """Register every block's tensors in ``store`` as ``manifest`` (by name) says and
        unbind its parameters.

        Args:
            manifest: the engine's stored tensors by name
                (:func:`~bb_lightning.placement.training_manifest`, or
                :func:`~bb_lightning.placement.weights_manifest` with ``weights_only``).
            loader: block values when the parameters are on the meta device (streamed
                from a checkpoint); None reads the parameters themselves.
            timer: times waits on page-ins as phase ``wait_page_in`` when set.
            weights_only: register only the compute-dtype weights (inference): no
                :class:`FlatState` (master weights, moments, gradient accumulators);
                :attr:`states` is then empty and ``placement.master`` is not read.
            comm: data parallelism: each :class:`FlatState` holds this rank's shard.
            external: with ``weights_only``, block index -> the file pieces holding that
                block's flat compute-dtype weights, in order: the block is registered
                read-only over those files (:mod:`storage.external`), never written.
        """
        if len(placement.weights) != len(blocks):
            raise ValueError(
                f"placement covers {len(placement.weights)} blocks but the model has "
                f"{len(blocks)}: build the placement for this model"
            )
        if not weights_only and not placement.master:
            raise ValueError(
                "placement has no master tiers (a weights-only placement): give one master "
                "tier per block to train"
            )
        self.store = store
        self.placement = placement
        self.compute_dtype = compute_dtype = torch_dtype(placement)
        self.timer = timer
        every = [[p for _, p in block_params(b)] for b in blocks]
        self.params = [[p for p in ps if weights_only or p.requires_grad] for ps in every]
        """Each block's parameters in the order of its flat weights: all of them with
        ``weights_only``, else the trainable ones (those with optimizer state)."""
        self.frozen = [[p for p in ps if not (weights_only or p.requires_grad)] for ps in every]
        """Each block's frozen parameters (training only), in the order of ``<prefix>.<i>.frozen``."""
        self.names = [f"{prefix}.{i}.weight" for i in range(len(blocks))]
        self.frozen_names = [f"{prefix}.{i}.frozen" if self.frozen[i] else None
                             for i in range(len(blocks))]  # fmt: skip
        """Store name of each block's frozen weights (None: the block has none)."""
        self.states: list[FlatState] = []
        self.shapes = [[tuple(p.shape) for p in params] for params in self.params]
        """Shapes of each block's parameters, in the order of its flat weights."""
        self.frozen_shapes = [[tuple(p.shape) for p in params] for params in self.frozen]
        """Shapes of each block's frozen parameters, in the order of its frozen weights."""
        self.frozen_digests: list[int | None] = [None] * len(blocks)
        """CRC-32C of each block's frozen weights under ``comm`` (checked equal on every
        rank, as the trainable ones are through their :class:`FlatState`)."""
        self._tickets: dict[int, Ticket] = {}
        self._observers: tuple[BlockObserver, ...] | None = None
        self.handed_back = False
        """Whether the parameters hold their own values (the module was given its weights
        back, :mod:`bb_lightning.handback`): releases then leave them bound to those."""
        external = {} if external is None else dict(external)
        if external and not weights_only:
            raise ValueError("external block weights are served to a weights-only pager only")
        for i, params in enumerate(self.params):
            if i in external:  # read in place from files the run does not own
                entry = manifest[self.names[i]]
                store.register(entry.name, shape=(entry.numel,), dtype=compute_dtype,
                               home=entry.home, source=external[i])  # fmt: skip
                continue
            master = loader(i) if loader is not None else flatten_fp32(every[i])
            frozen_name = self.frozen_names[i]
            if frozen_name is not None:
                master, frozen = _split_frozen(master, every[i])
                if comm is not None:
                    self.frozen_digests[i] = digest(frozen)
                register_stored(store, manifest[frozen_name], frozen)
                del frozen
            register_stored(store, manifest[self.names[i]], master)
            if weights_only:
                del master
                continue
            state = FlatState(
                store, f"{prefix}.{i}", params, manifest=manifest, initial=master, comm=comm
            )
            self.states.append(state)
            del master
        self._empty = torch.empty(0, dtype=compute_dtype, device=device)
        for i in range(len(blocks)):
            self._unbind(i)

    @property
    def num_blocks(self) -> int:
        """Number of paged blocks."""
        return len(self.names)

    def _paged(self, i: int) -> bool:
        return self.store.home(self.names[i]) is not Tier.DEVICE

    def block_names(self, i: int) -> list[str]:
        """Store names of block ``i``'s compute-dtype weights: trainable, then frozen."""
        frozen = self.frozen_names[i]
        return [self.names[i]] if frozen is None else [self.names[i], frozen]

    def prefetch(self, indices: Sequence[int]) -> None:
        """Start page-ins of the given blocks that are neither resident nor in flight."""
        for i in indices:
            if i in self._tickets or not self._paged(i):
                continue
            if self.store.state(self.names[i]) is Residency.RELEASED:
                self._tickets[i] = self.store.prefetch_async(self.block_names(i))

    def acquire(self, i: int) -> list[Tensor]:
        """Page block ``i`` in (waiting for its prefetch) and bind its parameters; the views
        of its (trainable) parameters."""
        if self._observers is not None:
            for o in self._observers:
                o.block_acquiring(i)
        names = self.block_names(i)
        ticket = self._tickets.pop(i, None)
        if ticket is None and self.store.state(names[0]) is Residency.RELEASED:
            ticket = self.store.prefetch_async(names)
        if ticket is not None:
            with _timed_wait(self.timer, self._empty.device):
                got = ticket.wait()
            flats = [got[n] for n in names]
        else:
            flats = [self.store.get(n) for n in names]
        views = _views(flats[0], self.shapes[i])
        for p, v in zip(self.params[i], views, strict=True):
            p.data = v
        if len(flats) > 1:
            frozen = _views(flats[1], self.frozen_shapes[i])
            for p, v in zip(self.frozen[i], frozen, strict=True):
                p.data = v
        if self._observers is not None:
            for o in self._observers:
                o.block_acquired(i)
        return views

    def release(self, i: int) -> None:
        """Unbind block ``i`` and give its device slot back (resident blocks stay)."""
        if self._observers is not None:
            for o in self._observers:
                o.block_released(i)
        self._unbind(i)
        ticket = self._tickets.pop(i, None)
        if ticket is not None:
            ticket.wait()
        if self._paged(i) and self.store.state(self.names[i]) is Residency.RESIDENT:
            self.store.release(self.block_names(i))

    def add_observer(self, observer: BlockObserver) -> None:
        """Call ``observer`` at each acquire and release (:mod:`bb_lightning.engine.observers`);
        ``ValueError`` if it already is."""
        self._observers = added(self._observers, observer)

    def remove_observer(self, observer: BlockObserver) -> None:
        """Stop calling ``observer`` (no-op if absent)."""
        self._observers = removed(self._observers, observer)

    def release_all_except(self, keep: Sequence[int] = ()) -> None:
        """Release every paged-in or in-flight block not in ``keep``."""
        for i in range(self.num_blocks):
            if i not in keep and (i in self._tickets or self._paged(i)):
                self.release(i)

    def _unbind(self, i: int) -> None:
        if self.handed_back:
            return
        for p in (*self.params[i], *self.frozen[i]):
            set_data(p, self._empty)

    @contextlib.contextmanager
    def shaped(self) -> Iterator[None]:
        """Meanwhile every unbound parameter holds a meta tensor of its shape and dtype.

        Unbound, a parameter holds an empty tensor, so code reading it (a user's
        ``configure_optimizers`` that puts parameters with ``ndim >= 2`` in the decayed
        group, or counts ``numel()``) would see no shape. Each is swapped in place with a
        meta stand-in (the parameter object, its hooks and its ``requires_grad`` are
        those of before, put back at the end).
        """
        swapped: list[tuple[Tensor, Tensor]] = []
        try:
            for i in range(self.num_blocks):
                groups = ((self.params[i], self.shapes[i]), (self.frozen[i], self.frozen_shapes[i]))
                for params, shapes in groups:
                    for p, shape in zip(params, shapes, strict=True):
                        if p.is_meta or p.numel() != 0 or math.prod(shape) == 0:
                            continue  # bound, or nothing to show
                        meta = torch.empty(shape, dtype=p.dtype, device="meta")
                        stand_in: Tensor = nn.Parameter(meta, requires_grad=p.requires_grad)
                        torch.utils.swap_tensors(p, stand_in)
                        swapped.append((p, stand_in))
            yield
        finally:
            for param, held in reversed(swapped):
                torch.utils.swap_tensors(param, held)

    def read_frozen(self, i: int) -> list[Tensor]:
        """Block ``i``'s frozen parameters as fp32 CPU tensors (read from their home)."""
        name = self.frozen_names[i]
        if name is None:
            return []
        flat = self.store.read(name).to("cpu", torch.float32)
        return _views(flat, self.frozen_shapes[i])

    def write_weights(self, i: int, master: Tensor, scratch: Tensor) -> Ticket | None:
        """Store fp32 ``master`` as block ``i``'s weights in the compute dtype, asynchronously.

        HOST-home weights are cast in place into their home (None returned). Others are
        cast into ``scratch`` and written back on the store's copy threads: ``scratch``
        must stay unchanged until the returned ticket's :meth:`~storage.store.Ticket.wait_host`
        returned (on CUDA the copy reads it until it completes); the store orders the
        block's next page-in after the write.
        """
        assert not self._paged(i) or self.store.state(self.names[i]) is Residency.RELEASED, (
            f"block {i} must be released before its weights are rewritten"
        )
        if self.store.home(self.names[i]) is Tier.HOST:
            self.store.host_view(self.names[i]).copy_(master)
            return None
        out = scratch[: master.numel()]
        out.copy_(master)
        return self.store.write_back_async(self.names[i], out)

    def apply(self, placement: Placement) -> None:
        """Re-home every block's tensors as ``placement`` says (moves through the store).

        Every block is released first; the store checks each destination's budget
        and raises ``ValueError`` when one does not fit (blocks moved before stay moved).
        """
        if len(placement.weights) != self.num_blocks:
            raise ValueError(
                f"placement covers {len(placement.weights)} blocks but the pager holds "
                f"{self.num_blocks}: build the placement for this model"
            )
        if placement.compute_dtype != self.placement.compute_dtype:
            raise ValueError(
                f"placement computes in {placement.compute_dtype} but the pager holds "
                f"{self.placement.compute_dtype} weights: keep the compute dtype"
            )
        self.release_all_except(())
        for i in range(self.num_blocks):  # resident blocks may still be bound
            self._unbind(i)
        # Free a tier before filling it: moves off a tier go first.
        order = sorted(range(self.num_blocks), key=lambda i: placement.weights[i] is Tier.DEVICE)
        for i in order:
            for name in self.block_names(i):
                self.store.move(name, placement.weights[i])
        for i, state in enumerate(self.states):
            state.move(placement.master[i], placement.grad_tiers[i])
        self.placement = placement

    @property
    def frozen_numels(self) -> list[int]:
        """Elements of each block's frozen weights (0: none)."""
        return [sum(math.prod(s) for s in shapes) for shapes in self.frozen_shapes]

    def device_bytes(self) -> int:
        """Bytes of compute-dtype weights one block occupies (the largest block)."""
        elem = torch.empty(0, dtype=self.compute_dtype).element_size()
        sizes = [[*a, *b] for a, b in zip(self.shapes, self.frozen_shapes, strict=True)]
        return max(sum(math.prod(s) for s in shapes) for shapes in sizes) * elem
