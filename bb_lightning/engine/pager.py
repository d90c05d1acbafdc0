"""Page blocks' weights in and out of the device through a :class:`storage.store.TieredStore`.

The pager owns the mapping from a block to the names of its tensors in the
store. The store owns residency (RESIDENT / IN_FLIGHT / RELEASED); the pager
only keeps the tickets of page-ins it has issued and asks the store for state.

Per block ``i`` the store holds, each as one flat 1-D tensor:

- ``<prefix>.<i>.weight``: the block's parameters in the compute dtype, laid end
  to end (home: ``Placement.weights[i]``; DEVICE means resident);
- ``<prefix>.<i>.master``, ``.exp_avg``, ``.exp_avg_sq``: fp32 master weights and
  AdamW moments (home: ``Placement.master[i]``), and ``<prefix>.<i>.grad``, the fp32
  gradient accumulator (home: ``Placement.grads[i]``): a
  :class:`~bb_lightning.engine.flat_state.FlatState` each (training only).

Frozen parameters (``requires_grad=False``, say the base weights under LoRA adapters)
are kept apart in training: ``<prefix>.<i>.weight`` and the :class:`FlatState` hold only
the block's trainable parameters, and ``<prefix>.<i>.frozen`` (registered only when the
block has frozen parameters) holds the others in the compute dtype, homed with the
block's weights and paged in with them, but never written back: no master weights,
moments or gradient accumulator exist for them.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator, Mapping, Sequence

import torch
from torch import Tensor, nn

from bb_lightning.engine.flat import (
    BlockLoader,
    block_params,
    flat_views,
    flatten_fp32,
    register_stored,
    set_data,
    split_frozen,
    torch_dtype,
)
from bb_lightning.engine.flat_state import FlatState, write_piece
from bb_lightning.engine.observers import BlockObserver
from bb_lightning.engine.shard import ShardComm, ShardLayout, digest
from bb_lightning.engine.timing import PhaseTimer
from bb_lightning.placement import Placement, StoredTensor, state_pieces
from storage.external import FilePiece
from storage.observers import added, removed
from storage.store import Ticket, TieredStore
from storage.tiers import Residency, Tier

__all__ = ["BlockPager"]


class BlockPager:
    """Binds each block's parameters to paged device views of its flat weights.

    Released parameters point at one shared empty tensor, so a block costs no
    device memory until it is paged in.
    """

    gate: Callable[[int], None] | None = None
    """Called with a block's index before its page-in is issued or it is bound; the
    training engine waits there for that block's pending optimizer update."""

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
            comm: data parallelism: the store holds this rank's shard of each block's
                weights and each :class:`FlatState` this rank's shard of its state.
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
        self.comm = comm
        """Data parallelism: the store holds this rank's shard of each block's weights,
        assembled on the device at each page-in (:mod:`bb_lightning.engine.shard`)."""
        self.layouts = [self._layout(shapes) for shapes in self.shapes]
        """Under ``comm``: each block's (trainable) weights' shard layout; else None each."""
        self.frozen_layouts = [self._layout(shapes) for shapes in self.frozen_shapes]
        """Under ``comm``: each block's frozen weights' shard layout; else None each."""
        self._tickets: dict[int, Ticket] = {}
        self._observers: tuple[BlockObserver, ...] | None = None
        self.handed_back = False
        """Whether the parameters hold their own values (the module was given its weights
        back, :mod:`bb_lightning.strategy.handback`): releases then leave them bound to those."""
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
            master = self._register_weights(i, master, every[i], manifest)
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

    def _register_weights(
        self, i: int, master: Tensor, every: Sequence[Tensor], manifest: Mapping[str, StoredTensor]
    ) -> Tensor:
        """Register block ``i``'s compute-dtype weights (this rank's shard under ``comm``)
        from ``master``, all of its parameters ``every`` laid end to end in fp32; the
        trainable ones' part of ``master``."""
        frozen_name = self.frozen_names[i]
        if frozen_name is not None:
            master, frozen = split_frozen(master, every)
            if self.comm is not None:
                self.frozen_digests[i] = digest(frozen)
            register_stored(self.store, manifest[frozen_name], self._mine(frozen, i, frozen=True))
            del frozen
        register_stored(self.store, manifest[self.names[i]], self._mine(master, i))
        return master

    def _layout(self, shapes: Sequence[tuple[int, ...]]) -> ShardLayout | None:
        return None if self.comm is None else ShardLayout(shapes, self.comm.world_size)

    def _mine(self, full: Tensor, i: int, *, frozen: bool = False) -> Tensor:
        """What this rank stores of block ``i``'s whole flat (frozen) weights ``full``:
        all of them, or under ``comm`` its shard."""
        layout = (self.frozen_layouts if frozen else self.layouts)[i]
        if self.comm is None or layout is None:
            return full
        return layout.take(full, self.comm.rank, torch.empty(layout.shard_numel))

    def _whole(self, flat: Tensor, layout: ShardLayout | None) -> Tensor:
        """Block weights as the parameters view them: ``flat`` itself, or under ``comm``
        the block assembled on ``flat``'s device from every rank's shard (a collective)."""
        if self.comm is None or layout is None:
            return flat
        return self.comm.assemble(flat, layout)

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
        """Start page-ins of the given blocks that are neither resident nor in flight
        (each after :attr:`gate` returned for it)."""
        for i in indices:
            if i in self._tickets or not self._paged(i):
                continue
            if self.gate is not None:
                self.gate(i)
            if self.store.state(self.names[i]) is Residency.RELEASED:
                self._tickets[i] = self.store.prefetch_async(self.block_names(i))

    def acquire(self, i: int) -> list[Tensor]:
        """Page block ``i`` in (waiting for its prefetch) and bind its parameters; the views
        of its (trainable) parameters."""
        if self._observers is not None:
            for o in self._observers:
                o.block_acquiring(i)
        if self.gate is not None:
            self.gate(i)
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
        views = flat_views(self._whole(flats[0], self.layouts[i]), self.shapes[i])
        for p, v in zip(self.params[i], views, strict=True):
            p.data = v
        if len(flats) > 1:
            whole = self._whole(flats[1], self.frozen_layouts[i])
            frozen = flat_views(whole, self.frozen_shapes[i])
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
        """Block ``i``'s frozen parameters as fp32 CPU tensors (read from their home;
        under ``comm`` assembled from every rank's shard: a collective)."""
        name = self.frozen_names[i]
        if name is None:
            return []
        flat = self._whole(self.store.read(name), self.frozen_layouts[i])
        return flat_views(flat.to("cpu", torch.float32), self.frozen_shapes[i])

    def write_weights(
        self, i: int, master: Tensor, scratch: Tensor, start: int = 0
    ) -> Ticket | None:
        """Store fp32 ``master`` as elements ``[start, start + master.numel())`` of block
        ``i``'s weights in the compute dtype, asynchronously.

        HOST-home weights are cast in place into their home (None returned). Others are
        cast into ``scratch`` and written back on the store's copy threads: ``scratch``
        must stay unchanged until the returned ticket's :meth:`~storage.store.Ticket.wait_host`
        returned (on CUDA the copy reads it until it completes); the store orders the
        block's next page-in after the write. A ``master`` larger than ``scratch`` is
        written one ``scratch`` at a time, each waited for (None returned).
        """
        n = master.numel()
        if self.store.home(self.names[i]) is not Tier.HOST and n > scratch.numel():
            # a whole state through a piece buffer (loading state)
            for a, b in state_pieces(n, scratch.numel()):
                ticket = self.write_weights(i, master[a:b], scratch, start + a)
                if ticket is not None:
                    ticket.wait_host()  # scratch takes the next piece
            return None
        self.cast_target(i, n, scratch, start).copy_(master)
        return self.write_cast(i, n, scratch, start)

    def cast_target(self, i: int, n: int, scratch: Tensor, start: int = 0) -> Tensor:
        """Where elements ``[start, start + n)`` of block ``i``'s compute-dtype weights are
        cast to (:meth:`write_weights` in two halves, for a caller that casts them itself):
        their HOST home's view, else ``scratch[:n]`` (then :meth:`write_cast`)."""
        name = self.names[i]
        assert not self._paged(i) or self.store.state(name) is Residency.RELEASED, (
            f"block {i} must be released before its weights are rewritten"
        )
        if self.store.home(name) is Tier.HOST:
            return self.store.host_view(name)[start : start + n]
        return scratch[:n]

    def write_cast(self, i: int, n: int, scratch: Tensor, start: int = 0) -> Ticket | None:
        """Write home what :meth:`cast_target` gave (None for a HOST home, cast in place),
        as :meth:`write_weights` does."""
        if self.store.home(self.names[i]) is Tier.HOST:
            return None
        return write_piece(self.store, self.names[i], scratch, start, start + n)

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


def _timed_wait(
    timer: PhaseTimer | None, device: torch.device
) -> contextlib.AbstractContextManager[None]:
    """Times a page-in wait: by events on ``device``'s stream on CUDA, else by the clock."""
    return contextlib.nullcontext() if timer is None else timer.stream_wait("wait_page_in", device)
