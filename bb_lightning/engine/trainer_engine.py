"""Offloaded training of one model: paged blocks, host gradients, per-block host AdamW.

:class:`TrainingEngine` puts a model's repeated blocks in a
:class:`storage.store.TieredStore` (weights in the compute dtype, fp32 master
weights and AdamW moments, homes per :class:`~bb_lightning.placement.Placement`)
and keeps the other parameters (embedding, final norm, head) resident on the
device with ordinary autograd, their fp32 master state in the store's host
tier. Every gradient leaves the device into fp32 accumulators in the store, homed
per ``Placement.grads`` (see :meth:`~bb_lightning.engine.flat_state.FlatState.accumulate`).

Frozen parameters (``requires_grad=False``, as the base weights under LoRA adapters)
carry no optimizer state: in the blocks they are paged read-only from
``block.<i>.frozen`` (see :mod:`~bb_lightning.engine.pager`), outside the blocks they
stay on the device in the compute dtype; no master weights, moments, gradient
accumulator or write-back exist for them.

At the accumulation boundary :meth:`TrainingEngine.optimizer_step` computes the
clipping scale over all gradients, steps each block with
:class:`~bb_lightning.engine.optim.HostAdamW`, writes the block's weights back
to their home tier in the compute dtype and clears the accumulators.

Without clipping the step of a block needs only that block's gradient: after
:meth:`TrainingEngine.begin_overlapped_step`, the last backward of the window
sums each block's gradient and steps it on the gradient worker (with one
micro-batch per step, a non-HOST accumulator is never written: the gradient
goes from a scratch buffer straight into the step), so host updates run while
backward continues on earlier blocks; :meth:`TrainingEngine.optimizer_step`
then waits for them and steps only the parameters outside the blocks. On a CPU
device the cores are the compute's: there the training thread sums and steps each
block itself as its gradient comes (:meth:`TrainingEngine._inline_grads`), between two
blocks' backward, and only the optimizer state's reads and write-backs run beside it.

On a CPU device the engine, once its state is in the store, calls
:func:`~bb_lightning.engine.inference.keep_host_allocations` (process-wide), as the
inference engine does: each micro-batch's activations and gradients then reuse the heap
memory the previous one freed instead of faulting in fresh pages: the kernel's time a
step (zeroing fresh pages) falls, and the step's with it, less so where slow compute
dwarfs that time (``bench/train_offload.py``).

The engine's parts live in modules of their own: the blocks' paging
(:mod:`~bb_lightning.engine.pager`), their flat fp32 state
(:mod:`~bb_lightning.engine.flat_state`), the gradients' way off the device
(:mod:`~bb_lightning.engine.grad_sink`), the host buffers of the optimizer step
(:mod:`~bb_lightning.engine.scratch_pool`), the step itself
(:mod:`~bb_lightning.engine.optimizer_step`) and reading and writing the state
(:mod:`~bb_lightning.engine.state_io`). This module builds them and routes each
block's gradients. Written weights reach their home while the next forward starts (the
store orders each block's next page-in after its write); the reads of off-host state run
ahead when the strategy announces an overlapped step (:meth:`TrainingEngine.read_state_ahead`;
:mod:`bb_lightning.strategy.state_reads` says when), else from the start of the window's
last forward in an overlapped step, from the start of the step otherwise.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable, Iterator, Mapping, Sequence

import torch
from torch import Tensor, nn

from bb_lightning.engine import state_io
from bb_lightning.engine.blocks import PagedBlocks
from bb_lightning.engine.budgets import model_sizes
from bb_lightning.engine.chunked import Boundaries, chunking_for
from bb_lightning.engine.flat import (
    ParamLoader,
    block_params,
    buffers_to,
    flat_from,
    set_data,
    torch_dtype,
)
from bb_lightning.engine.flat_state import FlatState
from bb_lightning.engine.grad_sink import GradSink
from bb_lightning.engine.inference import keep_host_allocations
from bb_lightning.engine.optim import AdamWConfig, AdamWGroups, global_grad_norm
from bb_lightning.engine.optimizer_step import ClipConfig, OptimizerStep, Overlap
from bb_lightning.engine.pager import BlockPager
from bb_lightning.engine.recompute import planned_autograd_blocks
from bb_lightning.engine.scratch_pool import ScratchPool
from bb_lightning.engine.shard import Reduced, ShardComm, check_same_start
from bb_lightning.engine.state_io import EngineStateDict
from bb_lightning.engine.timing import PhaseTimer
from bb_lightning.placement import (
    RESIDENT_PREFIX,
    STATE_KINDS,
    SWAP_PREFIX,
    Placement,
    StateKind,
    StoredTensor,
    training_manifest,
)
from storage.store import TieredStore
from storage.threads import worker_threads
from storage.tiers import Tier

__all__ = ["TrainingEngine"]


class TrainingEngine:
    """Executes a placement on a model: paged blocks plus host-side optimizer state."""

    def __init__(
        self,
        model: nn.Module,
        blocks: Sequence[nn.Module],
        store: TieredStore,
        placement: Placement,
        *,
        device: torch.device,
        loader: ParamLoader | None = None,
        comm: ShardComm | None = None,
    ) -> None:
        """Put ``blocks`` in ``store`` and the other parameters on ``device``.

        ``loader`` gives parameter values when the model was built on the meta device
        (each block is read into the store one tensor at a time); None reads the
        parameters themselves. ``comm`` (data parallelism, :mod:`~bb_lightning.engine.
        shard`): this rank stores one shard of every fp32 state; the initial weights are
        checked equal on every rank (``ValueError`` naming the blocks that differ).
        """
        self.model = model
        self.store = store
        self.device = device
        self.comm = comm
        """The collectives of data parallelism (None: one process)."""
        self._held_reduced: list[tuple[Reduced, Callable[[Sequence[Tensor | None]], object]]] = []
        """Reduce-scatters whose results the CPU double copies at the end of backward."""
        self.compute_dtype = torch_dtype(placement)
        """The dtype the device computes in (``placement.compute_dtype``)."""
        sync = torch.cuda.synchronize if device.type == "cuda" else None
        self.timer = PhaseTimer(sync=sync)
        """Per-step phase times of the caller's thread."""
        self.backward_end = 0.0
        """``time.perf_counter()`` when the last backward pass returned."""
        self.gathered_states = 0
        """Flat states the last :meth:`iter_state` pass has read (and gathered)."""
        self.sizes = model_sizes(model, blocks, self.world_size)
        """Elements of the parameters whose tensors the store holds."""
        self.manifest: tuple[StoredTensor, ...] = ()
        """Every tensor the engine stores for the placement in force (registered from it)."""
        self._by_name: dict[str, StoredTensor] = {}
        self._set_manifest(placement)
        self._place_outside(blocks, loader)
        self._store_states(blocks, placement, loader)
        if comm is not None:
            digests = [st.digest for st in self.states]
            check_same_start(comm, self.model, blocks, digests, self.pager.frozen_digests,
                             self.frozen_params)  # fmt: skip
        buffers_to(model, device, self.compute_dtype)
        self._install(blocks, placement)
        self._reset_reduce_order()
        self.pool = ScratchPool(
            store,
            self.pager.states,
            self._by_name,
            compute_dtype=self.compute_dtype,
            cast_numel=max(self.sizes.shard_blocks or self.sizes.blocks),  # a rank's weights
            piece=placement.state_piece,
        )
        """The scratch and read-ahead sets of the optimizer step."""
        self.pool.ensure_ahead_sets(placement, self._by_name)
        self.steps = OptimizerStep(
            store,
            self.pager,
            self.resident,
            self.resident_params,
            self.pool,
            comm=comm,
            compute_dtype=self.compute_dtype,
        )
        """The host AdamW steps (step count, overlapped step in progress)."""
        self.pager.gate = self.steps.wait_block  # a page-in waits for its block's update
        if device.type == "cpu":  # activations and gradients reuse freed heap memory (set
            keep_host_allocations()  # after the state streamed in: its copies are not kept)

    def _place_outside(self, blocks: Sequence[nn.Module], loader: ParamLoader | None) -> None:
        """Split the parameters outside the blocks into trainable and frozen ones, the
        frozen ones put on the device in the compute dtype."""
        in_blocks = {id(p) for b in blocks for _, p in block_params(b)}
        outside = [p for _, p in self.model.named_parameters() if id(p) not in in_blocks]
        self.resident_params = [p for p in outside if p.requires_grad]
        """Trainable parameters outside the blocks (on the device, fp32 state on the host)."""
        self.frozen_params = [p for p in outside if not p.requires_grad]
        """Frozen parameters outside the blocks (on the device in the compute dtype only)."""
        for p in self.frozen_params:
            value = p if loader is None or not p.is_meta else loader(p)
            set_data(p, value.detach().to(self.device, self.compute_dtype))

    def _store_states(
        self, blocks: Sequence[nn.Module], placement: Placement, loader: ParamLoader | None
    ) -> None:
        """Register the resident parameters' flat state and bind them to the device (their
        initial values read by ``loader`` are dropped before the blocks' come), then the
        blocks' tensors (the :class:`~bb_lightning.engine.pager.BlockPager`) in the store."""
        initial = None if loader is None else flat_from(self.resident_params, loader)
        self.resident = FlatState(
            self.store,
            RESIDENT_PREFIX,
            self.resident_params,
            manifest=self._by_name,
            initial=initial,
            comm=self.comm,
        )
        """The flat fp32 state of the trainable parameters outside the blocks."""
        self._bind_resident(initial)
        del initial
        block_lists = [[p for _, p in block_params(b)] for b in blocks]
        self.pager = BlockPager(
            self.store,
            blocks,
            placement,
            manifest=self._by_name,
            device=self.device,
            loader=None if loader is None else (lambda i: flat_from(block_lists[i], loader)),
            timer=self.timer,
            comm=self.comm,
        )
        """The blocks' paged weights and flat states."""

    def _bind_resident(self, initial: Tensor | None) -> None:
        """Put the resident parameters on the device in the compute dtype (from
        ``initial``, their flat fp32 values, when they were loaded)."""
        device, dtype = self.device, self.compute_dtype
        if initial is not None:
            views = self.resident.master_views(initial)
            for p, v in zip(self.resident_params, views, strict=True):
                set_data(p, v.to(device, dtype))
        else:
            for p in self.resident_params:
                p.data = p.data.to(device, dtype)

    def _install(self, blocks: Sequence[nn.Module], placement: Placement) -> None:
        """Start the gradient sink and install the blocks' paged forwards."""
        # beside a CPU device's thread team: one thread; beside CUDA compute: this rank's
        # share of the cores less the kernel-launching thread's (storage/threads.py)
        self.grads = GradSink(
            self.timer,
            store=self.store,
            threads=worker_threads(self.store.device.type),
            inline=self._inline_grads(placement),
        )
        """Where the blocks' and resident parameters' gradients leave the device."""
        self.paged = PagedBlocks(blocks, self.pager, self.grads)
        self.paged.on_block_grads = self._block_grads
        self._set_autograd_blocks(placement)
        self._hold = self._holds(placement)
        self.paged.install()

    def _reset_reduce_order(self) -> None:
        """Data parallelism: forget the blocks handed on in a backward (none yet)."""
        self._arrived: dict[int, Sequence[Tensor | None]] = {}
        """Data parallelism: blocks handed on before a block that reduces first."""
        self._expected = self._reduce_order()
        """Data parallelism: blocks still to reduce in this backward, the next one last."""
        self._again: dict[int, list[Sequence[Tensor | None]]] = {}
        """Data parallelism: gradients of blocks the step ran more than once, after their
        first, reduced at the end of the backward in the fixed order."""

    @property
    def step_count(self) -> int:
        """Optimizer steps taken (the AdamW bias corrections use it)."""
        return self.steps.step_count

    @step_count.setter
    def step_count(self, value: int) -> None:
        self.steps.step_count = value

    @property
    def optimizer_busy_s(self) -> float:
        """Seconds of host AdamW work since the engine was built (overlapped work included)."""
        return self.steps.busy_s

    @property
    def overlap_starts(self) -> list[tuple[int, float]]:
        """(block, ``time.perf_counter()``) of each overlapped block step of the last step."""
        return self.steps.overlap_starts

    def _set_autograd_blocks(self, placement: Placement) -> None:
        """Blocks used in place run with ordinary autograd unless the placement recomputes
        them: resident (DEVICE-home) blocks, and on a CPU device HOST-home blocks too (the
        store pages those in as their host memory itself, so keeping them bound costs
        no copy and no device slot; not under the store's CPU double, which copies them as
        on CUDA: :attr:`storage.store.TieredStore.pages_host_in_place`)."""
        host = self.store.pages_host_in_place
        in_place = {Tier.DEVICE, Tier.HOST} if host else {Tier.DEVICE}
        blocks = (i for i, w in enumerate(placement.weights) if w in in_place)
        swapped = frozenset(placement.swapped or ())
        self.paged.autograd_blocks = frozenset(
            () if placement.recompute_resident else (i for i in blocks if i not in swapped)
        )
        if placement.recomputed is not None:  # the plan's decision
            if self.store.device.type == "cpu" and not host:
                # the CUDA double copies HOST blocks in as CUDA does; a plan for the CPU
                # kept them bound, so they are recomputed here, as on CUDA
                copied = {i for i, w in enumerate(placement.weights) if w not in in_place}
                recomputed = tuple(sorted((copied - swapped) | set(placement.recomputed)))
                placement = dataclasses.replace(placement, recomputed=recomputed)
            self.paged.autograd_blocks = planned_autograd_blocks(placement, in_place)
        self.paged.chunking = chunking_for(placement, self.store)
        self.paged.swapped_blocks = swapped
        to_host = swapped and not host  # a CPU device keeps them where the forward made them
        self.paged.swap = Boundaries(self.store, Tier.HOST, SWAP_PREFIX) if to_host else None

    def _reduce_order(self) -> list[int]:
        """Blocks whose gradients are reduced, in reverse (the first to reduce last)."""
        if self.comm is None:
            return []
        return [i for i, s in enumerate(self.pager.states) if s.numel > 0]

    @property
    def world_size(self) -> int:
        """Ranks sharing the optimizer state (1 without data parallelism)."""
        return 1 if self.comm is None else self.comm.world_size

    def _set_manifest(self, placement: Placement) -> None:
        self.manifest = training_manifest(self.sizes, placement, shards=self.world_size)
        self._by_name = {t.name: t for t in self.manifest}

    @property
    def states(self) -> list[FlatState]:
        """Optimizer state of every block, then of the resident parameters."""
        return [*self.pager.states, self.resident]

    def after_backward(self) -> None:
        """Move the resident parameters' gradients to the host and finish the block ones."""
        self.backward_end = time.perf_counter()
        for i, grads in sorted(self.paged.take_pending().items(), reverse=True):
            self.paged.hand_off(i, grads)
        for i in sorted(self._arrived, reverse=True):  # a block that got no gradient at all
            self._dispatch_grads(i, self._arrived.pop(i))
        for i in sorted(self._again, reverse=True):
            for more in self._again.pop(i):
                self._dispatch_grads(i, more)
        self._reset_reduce_order()
        resident = self.resident
        self._queue(
            resident,
            [p.grad for p in self.resident_params],
            resident.hold if self._hold else lambda g: resident.accumulate(g, None),
        )
        for p in self.resident_params:
            p.grad = None
        for reduced, work in self._held_reduced:  # the CPU double's, at last
            with reduced.ordered():
                self.grads.process_async([reduced.part], work)
        self._held_reduced.clear()
        self.grads.wait(phase="optimizer" if self.steps.overlap is not None else "wait_grads")
        self.pager.release_all_except(())

    def read_state_ahead(self) -> None:
        """Start reading off-host optimizer state for an overlapped step now.

        Call at the start of an accumulation window that will end in an overlapped
        step: the first read-ahead sets fill during the window's earlier micro-batches
        instead of only its last forward. Reads are issued in the order the overlapped
        step takes the blocks (last block first) and are ordered after any write of the
        same state still in flight; :meth:`begin_overlapped_step` keeps what was read."""
        self.pool.plan_reads(range(self.pager.num_blocks - 1, -1, -1))

    def begin_overlapped_step(
        self, adamw: AdamWConfig | AdamWGroups, clip: ClipConfig | None = None
    ) -> bool:
        """Step each block during the coming backward, as soon as its gradient is in; with
        global-norm clipping, right after it, overlapping the next forward. Whether the
        step overlaps (value clipping, and clipping under data parallelism, do not).

        Call before the last backward of an accumulation window, with the learning rate
        and clipping of this step; :meth:`optimizer_step` completes the step. Under
        ``clip`` each block's gradient norm is taken as its last gradient is summed, so
        the clip scale is known when backward ends; :meth:`optimizer_step` then steps
        the resident parameters and queues the blocks' updates on the gradient worker,
        block 0 first, and returns: the next forward's page-in of a block waits for that
        block's update only (the pager's ``gate``).
        """
        clip_norm = None if clip is None else clip.value
        if clip_norm is not None and (clip is None or clip.algorithm != "norm" or self.comm):
            return False
        self.steps.begin_overlapped(adamw, clip_norm)
        if clip_norm is None:
            self.read_state_ahead()
        return True

    def _block_grads(self, i: int, grads: Sequence[Tensor | None]) -> None:
        """Block ``i``'s gradients handed on by backward. Under data parallelism their
        reduce-scatters must run in the same order on every rank, and a block whose
        backward leaves a parameter without a gradient is handed on only at the end (which
        parameters may depend on the data: experts no token of this rank chose), so they
        are dispatched in a fixed order, last block first; a block that comes early
        waits for the ones before it."""
        self.pool.read_ahead()  # the next read-ahead set (ScratchPool.limit_reads)
        if self.comm is None or self.pager.states[i].numel == 0:
            self._dispatch_grads(i, grads)
            return
        if i in self._arrived or i not in self._expected:  # a block run twice this step
            self._again.setdefault(i, []).append(grads)  # reduced at the end, in order
            return
        self._arrived[i] = grads
        while self._expected and self._expected[-1] in self._arrived:
            j = self._expected.pop()
            self._dispatch_grads(j, self._arrived.pop(j))

    def _dispatch_grads(self, i: int, grads: Sequence[Tensor | None]) -> None:
        """Queue block ``i``'s gradients on the worker: summed, and stepped when overlapping."""
        overlap = self.steps.overlap
        state = self.pager.states[i]
        last = self.paged.runs_left(i) == 0  # else more of this micro-batch's gradient comes
        if overlap is not None and overlap.clip is not None and last and not self._hold:
            self._queue(state, grads, lambda g: self._accumulate(state, g, overlap.norms, i))
        elif overlap is not None and overlap.clip is None and i not in overlap.done and last:
            overlap.done.add(i)
            self._queue(state, grads, lambda g: self.steps.step_block(i, overlap, g))
        elif self._hold:
            self._queue(state, grads, state.hold)
        else:
            self._queue(state, grads, lambda g: self._accumulate(state, g))

    def _queue(
        self,
        state: FlatState,
        grads: Sequence[Tensor | None],
        work: Callable[[Sequence[Tensor | None]], object],
    ) -> None:
        """Hand ``state``'s gradients (device tensors) to the gradient sink, which runs
        ``work`` on them in host memory. Under data parallelism they are reduce-scattered
        on the device first, in the fixed order of :meth:`_block_grads`, and only this
        rank's shard of their mean (``work``'s one-tensor batch) leaves the device, copied
        after the collective on a stream of its own (CUDA) or taken by the sink's work."""
        comm = self.comm
        if comm is None or state.layout is None:
            self.grads.process_async(grads, work)
            return
        reduced = comm.reduce_scatter_async(grads, state.layout, self.device)
        if not self.store.copies_to_host:
            self.grads.process_async([reduced.part], reduced.then(work))
        elif self.device.type != "cuda":  # the CPU double, whose host would wait: at the end
            self._held_reduced.append((reduced, work))  # (another rank may first need ours)
        else:
            with reduced.ordered():  # the copy waits for the collective, the compute not
                self.grads.process_async([reduced.part], work)

    def _accumulate(
        self,
        state: FlatState,
        grads: Sequence[Tensor | None],
        norms: dict[int, Tensor] | None = None,
        i: int = -1,
    ) -> None:
        """Sum ``grads`` into ``state``'s accumulator (in place on the host, else piece by
        piece through a scratch buffer); with ``norms`` (a norm-clipped overlapped step's)
        the new sum's fp32 2-norm is recorded there as block ``i``'s."""
        host = self.store.home(state.grad_name) is Tier.HOST
        buf = None if host else self.pool.take().fp32["grad"]
        norm = state.accumulate_pieces(grads, buf, self.pool.piece, norm=norms is not None)
        if norms is not None and norm is not None:
            norms[i] = norm

    def apply_placement(self, placement: Placement) -> None:
        """Re-home the blocks' weights and optimizer state (between optimizer steps)."""
        self.grads.wait(phase=None)
        self.pool.settle()
        placement = dataclasses.replace(placement, state_piece=self.pool.piece)  # as sized
        self.pager.apply(placement)
        self._set_manifest(placement)
        self.pool.ensure_ahead_sets(placement, self._by_name)
        self._set_autograd_blocks(placement)
        self._hold = self._holds(placement)
        self.grads.inline = self._inline_grads(placement)

    def _inline_grads(self, placement: Placement) -> bool:
        """Whether the gradient work (sums, the overlapped step's block updates) runs on
        the training thread (:class:`~bb_lightning.engine.grad_sink.GradSink`, ``inline``): on
        a CPU device, whose cores the compute's team holds, unless a block's gradient sums
        are homed on NVMe (their reads and writes would then stall the compute instead of
        running beside it) or data parallelism reduces them (the worker waits for each
        reduce-scatter while backward goes on)."""
        return (
            self.store.device.type == "cpu"
            and self.comm is None
            and Tier.NVME not in placement.grad_tiers
        )

    def _holds(self, placement: Placement) -> bool:
        """Whether earlier micro-batches' gradients are held and summed once
        (``placement.hold_grads``): only where they arrive as host tensors of their own
        (a CPU device) and are not reduced across ranks as they come."""
        return placement.hold_grads and self.comm is None and not self.store.copies_to_host

    def grad_norm(self) -> float:
        """Global 2-norm of the accumulated gradients (fp32)."""
        self.grads.wait()
        scratch = self.pool.take().fp32["grad"]
        local = global_grad_norm(s.grad_norm(scratch, self.pool.piece) for s in self.states)
        if self.comm is None:
            return local
        return math.sqrt(self.comm.sum(local * local))  # the shards' squares summed

    def optimizer_step(
        self, adamw: AdamWConfig | AdamWGroups, clip: ClipConfig | None = None
    ) -> None:
        """One AdamW step of every parameter from the accumulated gradients; zeroes them.

        After :meth:`begin_overlapped_step` the blocks stepped during backward are only
        waited for, and ``adamw`` and ``clip`` are not read (the step's were fixed then).
        """
        with self.timer.phase("optimizer"):
            self.grads.wait(phase=None)
            self.pager.release_all_except(())
            overlap, self.steps.overlap = self.steps.overlap, None
            if overlap is not None and overlap.clip is not None:
                self._step_after_backward(overlap)
                return
            try:
                if overlap is not None:
                    self.steps.finish_overlapped(overlap)
                else:
                    self.steps.step_all(adamw, clip, self.grad_norm)
            finally:
                self.pool.end_reads()

    def _step_after_backward(self, overlap: Overlap) -> None:
        """A norm-clipped overlapped step: the norms of blocks whose last gradient was not
        summed in the last backward are taken now; the resident parameters step here and
        the blocks on the gradient worker (:meth:`OptimizerStep.step_deferred`)."""
        norms = []
        for i, state in enumerate(self.pager.states):
            norm = overlap.norms.get(i)
            if norm is None:
                norm = state.grad_norm(self.pool.take().fp32["grad"], self.pool.piece)
            norms.append(norm)
        self.steps.step_deferred(overlap, norms, self.grads.submit)

    def named_states(self) -> list[tuple[FlatState, list[str]]]:
        """Each flat state (blocks, then resident) with its parameters' names in the model.

        A parameter shared under several names (tied embeddings) carries the first
        name :meth:`torch.nn.Module.named_parameters` gives it.
        """
        first: dict[int, str] = {}
        for key, p in self.model.named_parameters():
            first.setdefault(id(p), key)
        groups = [*self.pager.params, self.resident_params]
        return [
            (state, [first[id(p)] for p in params])
            for state, params in zip(self.states, groups, strict=True)
        ]

    def close(self) -> None:
        """Restore the blocks' forwards and stop the gradient worker (the store stays open)."""
        self.paged.remove()
        self.grads.close()
        self.pool.settle()

    def iter_state(
        self, kinds: Sequence[StateKind] = STATE_KINDS, *, start: int = 0
    ) -> Iterator[tuple[str, dict[StateKind, Tensor]]]:
        """Each parameter's name and fp32 state, views valid until the next item
        (:func:`~bb_lightning.engine.state_io.iter_state`; under data parallelism a
        collective every rank runs to the end)."""
        return state_io.iter_state(self, kinds, start=start)

    def finish_gathers(self, kinds: Sequence[StateKind] = STATE_KINDS) -> None:
        """The gathers left of an :meth:`iter_state` pass this rank stopped early
        (:func:`~bb_lightning.engine.state_io.finish_gathers`)."""
        state_io.finish_gathers(self, kinds)

    def iter_shards(
        self, kinds: Sequence[StateKind] = STATE_KINDS
    ) -> Iterator[tuple[FlatState, list[str], dict[StateKind, Tensor]]]:
        """Each flat state, its parameters' names and this rank's stored state per kind
        (:func:`~bb_lightning.engine.state_io.iter_shards`; no collective)."""
        return state_io.iter_shards(self, kinds)

    def load_state(
        self, fill: Callable[[str, StateKind, Tensor], None], kinds: Sequence[StateKind]
    ) -> None:
        """Set the fp32 state of every parameter; ``fill(name, kind, out)`` writes into
        ``out`` (:func:`~bb_lightning.engine.state_io.load_state`)."""
        state_io.load_state(self, fill, kinds)

    def lazy_state_dict(self) -> EngineStateDict:
        """The model's state dict, each parameter's fp32 master read when asked for."""
        return EngineStateDict(self)

    def iter_frozen(self) -> Iterator[tuple[str, Tensor]]:
        """Each frozen parameter's name and value (fp32 host copies, read from the store)."""
        return state_io.iter_frozen(self)

    def state_dict(self) -> dict[str, Tensor]:
        """The model's state dict with every parameter as its fp32 master copy (host);
        frozen parameters as their stored values in fp32."""
        return state_io.state_dict(self)

    def load_state_dict(self, state_dict: Mapping[str, Tensor]) -> None:
        """Set master weights, paged weights and resident parameters from a full state
        dict; ``ValueError`` naming the first parameter missing or of another shape."""
        state_io.load_state_dict(self, state_dict)
