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

On a CPU device the engine calls
:func:`~bb_lightning.engine.inference.keep_host_allocations` (process-wide), as the
inference engine does: each micro-batch's activations and gradients then reuse the heap
memory the previous one freed instead of faulting in fresh pages: the kernel's time a
step (zeroing fresh pages) falls, and the step's with it, less so where slow compute
dwarfs that time (``bench/train_offload.py``).

Host memory: state homed on HOST is stepped in place in the host arena. State
homed elsewhere passes through :data:`SCRATCH_SETS` sets of scratch buffers sized
for the largest block, registered in the store's host arena (so the host budget
covers them); writes from the optimizer go back asynchronously on the store's
copy threads, a set waiting for its previous writes only when it is used again,
so the written weights reach their home while the next forward starts (the store
orders each block's next page-in after its write). When some optimizer state is
homed off the host, ``Placement.read_ahead`` more sets of three fp32 buffers let
the reads of the next blocks' state run on the store's threads while a block steps:
from the start of the accumulation window when the strategy announces an
overlapped step (:meth:`TrainingEngine.read_state_ahead`), else from the start of the
window's last forward in an overlapped step, from the start of the step otherwise.
"""

from __future__ import annotations

import dataclasses
import math
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from bb_lightning.engine.blocks import PagedBlocks
from bb_lightning.engine.budgets import model_sizes
from bb_lightning.engine.flat import (
    ParamLoader,
    block_params,
    buffers_to,
    flat_from,
    register_stored,
    set_data,
    torch_dtype,
)
from bb_lightning.engine.flat_state import FlatState
from bb_lightning.engine.grad_sink import GradSink
from bb_lightning.engine.inference import keep_host_allocations
from bb_lightning.engine.optim import (
    AdamWConfig,
    AdamWGroups,
    HostAdamW,
    adam_runs,
    clip_coefficient,
    global_grad_norm,
)
from bb_lightning.engine.pager import BlockPager
from bb_lightning.engine.recompute import planned_autograd_blocks
from bb_lightning.engine.shard import ShardComm, digest
from bb_lightning.engine.timing import PhaseTimer
from bb_lightning.placement import (
    RESIDENT_PREFIX,
    SCRATCH_FP32,
    SCRATCH_PREFIX,
    SCRATCH_SETS,
    STATE_KINDS,
    Placement,
    StateKind,
    StoredTensor,
    read_ahead_name,
    training_manifest,
)
from storage.store import Ticket, TieredStore
from storage.threads import worker_threads
from storage.tiers import Tier

__all__ = [
    "ClipConfig",
    "EngineStateDict",
    "TrainingEngine",
    "adamw_groups_from_optimizer",
]


@dataclass(frozen=True, kw_only=True)
class ClipConfig:
    """Gradient clipping applied at the optimizer step (Lightning's ``gradient_clip_*``)."""

    value: float | None = None
    """Maximum gradient norm (``"norm"``) or magnitude (``"value"``); None disables clipping."""
    algorithm: str = "norm"
    """``"norm"`` (global 2-norm over all gradients) or ``"value"`` (element-wise clamp)."""

    def __post_init__(self) -> None:
        if self.algorithm not in ("norm", "value"):
            raise ValueError(
                f"gradient clip algorithm {self.algorithm!r} is not supported: use 'norm' or 'value'"
            )
        if self.value is not None and not (math.isfinite(self.value) and self.value > 0):
            raise ValueError(f"gradient clip value {self.value!r} must be finite and > 0")


def adamw_groups_from_optimizer(optimizer: torch.optim.Optimizer) -> AdamWGroups:
    """Each param group's AdamW hyperparameters (the learning rate of now) and parameters.

    ``torch.optim.AdamW``, or ``torch.optim.Adam`` where no group decays weights (the same
    update); anything else, AMSGrad or ``maximize`` raises ``ValueError`` saying so.
    """
    kind = type(optimizer).__name__
    plain_adam = type(optimizer) is torch.optim.Adam
    if not isinstance(optimizer, torch.optim.AdamW) and not plain_adam:
        raise ValueError(
            f"the balance_beam strategy steps AdamW on the host, but configure_optimizers "
            f"returned {kind}: return torch.optim.AdamW"
        )
    configs = []
    for k, g in enumerate(optimizer.param_groups):
        for flag in ("amsgrad", "maximize"):
            if g.get(flag):
                raise ValueError(
                    f"{kind} param group {k} sets {flag}=True, which the balance_beam "
                    f"strategy's host AdamW does not do: drop {flag}"
                )
        if plain_adam and float(g["weight_decay"]) != 0.0:
            raise ValueError(
                f"Adam param group {k} has weight_decay={g['weight_decay']} (L2 added to the "
                "gradient), but the balance_beam strategy steps AdamW (decoupled decay): "
                "return torch.optim.AdamW, or Adam with weight_decay=0"
            )
        lr = g["lr"].item() if isinstance(g["lr"], Tensor) else float(g["lr"])
        b1, b2 = g["betas"]
        configs.append(
            AdamWConfig(
                lr=lr,
                betas=(float(b1), float(b2)),
                eps=float(g["eps"]),
                weight_decay=float(g["weight_decay"]),
            )
        )
    params = tuple(tuple(g["params"]) for g in optimizer.param_groups)
    return AdamWGroups(configs=tuple(configs), params=params)


@dataclass
class _Scratch:
    """One set of host scratch buffers and the writes still reading them."""

    fp32: dict[str, Tensor]
    """fp32 buffers by :data:`SCRATCH_FP32` name, each of the largest block's numel."""
    cast: Tensor
    """A compute-dtype buffer of the largest block's numel (weights being written)."""
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


@dataclass
class _Overlap:
    """An optimizer step whose block updates run during the last backward of the window."""

    adam: _Steppers
    step: int
    done: set[int] = field(default_factory=set)


class _Steppers:
    """One optimizer step's AdamW: a stepper per parameter group, and which elements of a
    flat state each steps."""

    def __init__(self, adamw: AdamWConfig | AdamWGroups) -> None:
        groups = adamw if isinstance(adamw, AdamWGroups) else AdamWGroups(configs=(adamw,))
        self.steppers = [HostAdamW(config) for config in groups.configs]
        self._group_of = groups.group_of()

    def runs(self, state: FlatState, params: Sequence[Tensor]) -> list[tuple[int, int, HostAdamW]]:
        """``(start, end, stepper)`` of the element ranges of ``state`` (laid out from
        ``params``) to step; a parameter in no group is left as it is."""
        runs = adam_runs(params, state.ranges(), self._group_of)
        return [(a, b, self.steppers[g]) for a, b, g in runs]


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
        self.compute_dtype = compute_dtype = torch_dtype(placement)
        """The dtype the device computes in (``placement.compute_dtype``)."""
        if device.type == "cpu":  # activations and gradients reuse freed heap memory
            keep_host_allocations()
        sync = torch.cuda.synchronize if device.type == "cuda" else None
        self.timer = PhaseTimer(sync=sync)
        """Per-step phase times of the caller's thread."""
        self.optimizer_busy_s = 0.0
        """Seconds of host AdamW work since the engine was built (overlapped work included)."""
        self.overlap_starts: list[tuple[int, float]] = []
        """(block, ``time.perf_counter()``) of each overlapped block step of the last step."""
        self.backward_end = 0.0
        """``time.perf_counter()`` when the last backward pass returned."""
        self._overlap: _Overlap | None = None
        in_blocks = {id(p) for b in blocks for _, p in block_params(b)}
        outside = [p for _, p in model.named_parameters() if id(p) not in in_blocks]
        self.resident_params = [p for p in outside if p.requires_grad]
        """Trainable parameters outside the blocks (on the device, fp32 state on the host)."""
        self.frozen_params = [p for p in outside if not p.requires_grad]
        """Frozen parameters outside the blocks (on the device in the compute dtype only)."""
        for p in self.frozen_params:
            value = p if loader is None or not p.is_meta else loader(p)
            set_data(p, value.detach().to(device, compute_dtype))
        self.sizes = model_sizes(model, blocks, 1 if comm is None else comm.world_size)
        """Elements of the parameters whose tensors the store holds."""
        self.manifest: tuple[StoredTensor, ...] = ()
        """Every tensor the engine stores for the placement in force (registered from it)."""
        self._by_name: dict[str, StoredTensor] = {}
        self._set_manifest(placement)
        initial = None if loader is None else flat_from(self.resident_params, loader)
        self.resident = FlatState(
            store,
            RESIDENT_PREFIX,
            self.resident_params,
            manifest=self._by_name,
            initial=initial,
            comm=comm,
        )
        block_lists = [[p for _, p in block_params(b)] for b in blocks]
        self.pager = BlockPager(
            store,
            blocks,
            placement,
            manifest=self._by_name,
            device=device,
            loader=None if loader is None else (lambda i: flat_from(block_lists[i], loader)),
            timer=self.timer,
            comm=comm,
        )
        if comm is not None:
            self._check_same_start(comm, blocks)
        if initial is not None:
            views = self.resident.master_views(initial)
            for p, v in zip(self.resident_params, views, strict=True):
                set_data(p, v.to(device, compute_dtype))
        else:
            for p in self.resident_params:
                p.data = p.data.to(device, compute_dtype)
        buffers_to(model, device, compute_dtype)
        # beside a CPU device's thread team: one thread; beside CUDA compute: this rank's
        # share of the cores less the kernel-launching thread's (storage/threads.py)
        self.grads = GradSink(
            self.timer,
            store=store,
            threads=worker_threads(store.device.type),
            inline=self._inline_grads(placement),
        )
        self.paged = PagedBlocks(blocks, self.pager, self.grads)
        self.paged.on_block_grads = self._block_grads
        self._set_autograd_blocks(placement)
        self._hold = self._holds(placement)
        self.paged.install()
        self.step_count = 0
        """Optimizer steps taken (the AdamW bias corrections use it)."""
        self.gathered_states = 0
        """Flat states the last :meth:`iter_state` pass has read (and gathered)."""
        self._arrived: dict[int, Sequence[Tensor | None]] = {}
        """Data parallelism: blocks handed on before a block that reduces first."""
        self._expected = self._reduce_order()
        """Data parallelism: blocks still to reduce in this backward, the next one last."""
        self._again: dict[int, list[Sequence[Tensor | None]]] = {}
        """Data parallelism: gradients of blocks the step ran more than once, after their
        first, reduced at the end of the backward in the fixed order."""
        self._largest = max(s.numel for s in self.pager.states)
        width = 1 if comm is None else comm.world_size
        self._cast_part = torch.empty(
            0 if comm is None else max(self._largest, self.resident.numel), dtype=compute_dtype
        )
        """A shard cast to the compute dtype before its all-gather (data parallelism)."""
        self._resident_gathered = torch.empty(
            0 if comm is None else self.resident.numel * width, dtype=compute_dtype
        )
        """Every rank's compute-dtype shard of the resident parameters (all-gathered)."""
        self._resident_full = torch.empty(
            0 if comm is None else self.resident.full_numel, dtype=compute_dtype
        )
        """The resident parameters' compute-dtype values, unpacked from the shards."""
        self._gathered = torch.empty(self._largest * width if comm else 0, dtype=compute_dtype)
        """Every rank's compute-dtype shard of a block (all-gathered), unpacked into the
        block's scratch ``cast`` buffer, from which its weights are written home."""
        self._sets = [self._scratch_set(k, self._largest) for k in range(SCRATCH_SETS)]
        self._next_set = 0
        self._free_ahead: list[_Scratch] = []
        """Read-ahead sets not holding a block's state (a set may still be writing)."""
        self._ahead_sets = 0
        """Read-ahead sets registered in the store (only grows)."""
        self._ensure_ahead_sets(placement)
        self._ahead: dict[int, _Scratch] = {}
        """Blocks whose state is being (or has been) read ahead, and the set it is read into."""
        self._queue: list[int] = []
        """Blocks still to step in this optimizer step, in step order, not yet read ahead."""
        self._ahead_lock = threading.Lock()

    def _set_autograd_blocks(self, placement: Placement) -> None:
        """Blocks used in place run with ordinary autograd unless the placement recomputes
        them: resident (DEVICE-home) blocks, and on a CPU device HOST-home blocks too (the
        store pages those in as their host memory itself, so keeping them bound costs
        no copy and no device slot; not under the store's CPU double, which copies them as
        on CUDA: :attr:`storage.store.TieredStore.pages_host_in_place`)."""
        host = self.store.pages_host_in_place
        in_place = {Tier.DEVICE, Tier.HOST} if host else {Tier.DEVICE}
        blocks = (i for i, w in enumerate(placement.weights) if w in in_place)
        self.paged.autograd_blocks = frozenset(() if placement.recompute_resident else blocks)
        if placement.recomputed is not None:  # the plan's decision
            if self.store.device.type == "cpu" and not host:
                # the CUDA double copies HOST blocks in as CUDA does; a plan for the CPU
                # kept them bound, so they are recomputed here, as on CUDA
                copied = {i for i, w in enumerate(placement.weights) if w not in in_place}
                recomputed = tuple(sorted(copied | set(placement.recomputed)))
                placement = dataclasses.replace(placement, recomputed=recomputed)
            self.paged.autograd_blocks = planned_autograd_blocks(placement, in_place)

    def _reduce_order(self) -> list[int]:
        """Blocks whose gradients are reduced, in reverse (the first to reduce last)."""
        if self.comm is None:
            return []
        return [i for i, s in enumerate(self.pager.states) if s.numel > 0]

    def _check_same_start(self, comm: ShardComm, blocks: Sequence[nn.Module]) -> None:
        """Raise ``ValueError`` unless every rank starts from the same weights."""
        where = {id(m): name for name, m in self.model.named_modules()}
        labels = [f"block {i} ({where.get(id(b), '?')})" for i, b in enumerate(blocks)]
        labels.append("the parameters outside the blocks (embedding, final norm, head)")
        digests = [s.digest for s in self.states]
        for i, frozen in enumerate(self.pager.frozen_digests):  # a LoRA base, say
            if frozen is not None:
                labels.append(f"the frozen weights of block {i} ({where.get(id(blocks[i]), '?')})")
                digests.append(frozen)
        if self.frozen_params:
            values = [p.detach().reshape(-1).to("cpu", torch.float32) for p in self.frozen_params]
            labels.append("the frozen parameters outside the blocks")
            digests.append(digest(torch.cat(values)))
        assert all(d is not None for d in digests)
        comm.check_equal(labels, [int(d) for d in digests if d is not None])

    @property
    def world_size(self) -> int:
        """Ranks sharing the optimizer state (1 without data parallelism)."""
        return 1 if self.comm is None else self.comm.world_size

    def _set_manifest(self, placement: Placement) -> None:
        self.manifest = training_manifest(self.sizes, placement, shards=self.world_size)
        self._by_name = {t.name: t for t in self.manifest}

    def _ensure_ahead_sets(self, placement: Placement) -> None:
        """Register read-ahead sets up to ``placement.read_ahead`` when state is off the host."""
        if not placement.reads_ahead:
            return
        while self._ahead_sets < placement.read_ahead:
            self._free_ahead.append(self._ahead_set(self._ahead_sets, self._largest))
            self._ahead_sets += 1

    def _scratch_set(self, k: int, numel: int) -> _Scratch:
        store, prefix = self.store, f"{SCRATCH_PREFIX}.{k}"
        for name in (*SCRATCH_FP32, "cast"):
            entry = self._by_name[f"{prefix}.{name}"]
            want = max(self.sizes.blocks) if name == "cast" else numel  # cast: whole weights
            assert entry.numel == want, (entry, want)
            register_stored(store, entry)
        return _Scratch(
            fp32={name: store.host_view(f"{prefix}.{name}") for name in SCRATCH_FP32},
            cast=store.host_view(f"{prefix}.cast"),
        )

    def _ahead_set(self, k: int, numel: int) -> _Scratch:
        store = self.store
        for name in STATE_KINDS:
            entry = self._by_name[read_ahead_name(k, name)]
            assert entry.numel == numel, (entry, numel)
            register_stored(store, entry)
        views: dict[str, Tensor] = {n: store.host_view(read_ahead_name(k, n)) for n in STATE_KINDS}
        return _Scratch(fp32=views, cast=torch.empty(0, dtype=self.compute_dtype))

    def _plan_reads(self, order: Sequence[int]) -> None:
        """Blocks ``order`` will step in this order: start reading their off-host state
        (blocks already read ahead are kept)."""
        with self._ahead_lock:
            self._queue = [
                i
                for i in order
                if i not in self._ahead
                and any(
                    self.store.home(n) is not Tier.HOST for n in self.pager.states[i].state_names
                )
            ]
        self._read_ahead()

    def _read_ahead(self) -> None:
        """Issue state reads of the next queued blocks into free read-ahead sets whose
        earlier writes are done (never waits: a set still writing is taken later)."""
        with self._ahead_lock:
            while self._queue and self._free_ahead and self._free_ahead[0].idle():
                i = self._queue.pop(0)
                if i in self._ahead:
                    continue
                buf = self._free_ahead.pop(0)
                buf.settle()  # collects the finished writes
                state = self.pager.states[i]
                for kind, name in zip(STATE_KINDS, state.state_names, strict=True):
                    if self.store.home(name) is not Tier.HOST:
                        out = buf.fp32[kind][: state.numel]
                        buf.reads.append(self.store.read_async(name, out))
                self._ahead[i] = buf

    def _end_reads(self) -> None:
        """Drop what is left of this step's read-ahead (sets back to the free list)."""
        with self._ahead_lock:
            self._queue = []
            for buf in self._ahead.values():
                buf.wait_reads()
                self._free_ahead.append(buf)
            self._ahead = {}

    def _take_set(self) -> _Scratch:
        """The next scratch set, its earlier writes done (one thread at a time uses sets)."""
        scratch = self._sets[self._next_set]
        self._next_set = (self._next_set + 1) % len(self._sets)
        scratch.settle()
        return scratch

    def _settle_sets(self) -> None:
        self._end_reads()
        for scratch in [*self._sets, *self._free_ahead]:
            scratch.settle()

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
        self._expected = self._reduce_order()
        resident = self.resident
        self.grads.process_async(
            [p.grad for p in self.resident_params],
            resident.hold if self._hold else lambda g: resident.accumulate(g, None),
        )
        for p in self.resident_params:
            p.grad = None
        self.grads.wait(phase="optimizer" if self._overlap is not None else "wait_grads")
        self.pager.release_all_except(())

    def read_state_ahead(self) -> None:
        """Start reading off-host optimizer state for an overlapped step now.

        Call at the start of an accumulation window that will end in an overlapped
        step: the first read-ahead sets fill during the window's earlier micro-batches
        instead of only its last forward. Reads are issued in the order the overlapped
        step takes the blocks (last block first) and are ordered after any write of the
        same state still in flight; :meth:`begin_overlapped_step` keeps what was read.
        """
        self._plan_reads(range(self.pager.num_blocks - 1, -1, -1))

    def begin_overlapped_step(self, adamw: AdamWConfig | AdamWGroups) -> None:
        """Step each block during the coming backward, as soon as its gradient is in.

        Call before the last backward of an accumulation window, only when no
        clipping is configured (the clip scale needs every gradient first), with
        the learning rate of this step; :meth:`optimizer_step` completes the step.
        """
        self.step_count += 1
        self.overlap_starts = []
        self._overlap = _Overlap(adam=_Steppers(adamw), step=self.step_count)
        self.read_state_ahead()

    def _block_grads(self, i: int, grads: Sequence[Tensor | None]) -> None:
        """Block ``i``'s gradients handed on by backward. Under data parallelism their
        reduce-scatters must run in the same order on every rank, and a block whose
        backward leaves a parameter without a gradient is handed on only at the end (which
        parameters may depend on the data: experts no token of this rank chose), so they
        are dispatched in a fixed order, last block first; a block that comes early
        waits for the ones before it."""
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
        overlap = self._overlap
        state = self.pager.states[i]
        last = self.paged.runs_left(i) == 0  # else more of this micro-batch's gradient comes
        if overlap is not None and i not in overlap.done and last:
            overlap.done.add(i)
            self.grads.process_async(grads, lambda g: self._step_block(i, overlap, g))
        elif self._hold:
            self.grads.process_async(grads, state.hold)
        else:
            self.grads.process_async(
                grads, lambda g: state.accumulate(g, self._grad_scratch(state))
            )

    def _grad_scratch(self, state: FlatState) -> Tensor | None:
        """A scratch buffer to sum ``state``'s gradient in, None when it sums in place."""
        if self.store.home(state.grad_name) is Tier.HOST:
            return None
        return self._take_set().fp32["grad"]

    def _step_block(
        self, i: int, overlap: _Overlap, grads: Sequence[Tensor | None] | None = None
    ) -> None:
        """Block ``i``'s AdamW step (its last ``grads`` summed in) and weight write-back."""
        self.overlap_starts.append((i, time.perf_counter()))
        scratch = self._take_set()
        state = self.pager.states[i]
        if grads is None:
            grad = state.gradient(scratch.fp32["grad"])
        else:
            grad = state.accumulate(grads, scratch.fp32["grad"], persist=False)
        self._step_state(state, overlap.adam, 1.0, overlap.step, scratch, grad, block=i)

    def _write_weights(self, i: int, master: Tensor, scratch: _Scratch) -> None:
        if self.comm is not None:  # every rank's stepped shard, cast, unpacked in scratch.cast
            state = self.pager.states[i]
            part = self._cast_part[: state.numel]
            part.copy_(master[: state.numel])
            master = state.gather(part, self._gathered, scratch.cast)  # written from there
        ticket = self.pager.write_weights(i, master, scratch.cast)
        if ticket is not None:
            scratch.tickets.append(ticket)

    def apply_placement(self, placement: Placement) -> None:
        """Re-home the blocks' weights and optimizer state (between optimizer steps)."""
        self.grads.wait(phase=None)
        self._settle_sets()
        self.pager.apply(placement)
        self._set_manifest(placement)
        self._ensure_ahead_sets(placement)
        self._set_autograd_blocks(placement)
        self._hold = self._holds(placement)
        self.grads.inline = self._inline_grads(placement)

    def _inline_grads(self, placement: Placement) -> bool:
        """Whether the gradient work (sums, the overlapped step's block updates) runs on
        the training thread (:class:`~bb_lightning.engine.grad_sink.GradSink`, ``inline``): on
        a CPU device, whose cores the compute's team holds, unless a block's gradient sums
        are homed on NVMe (their reads and writes would then stall the compute instead of
        running beside it) or data parallelism reduces them (its collectives run on the
        worker, in their fixed order, while backward goes on)."""
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
        scratch = self._take_set().fp32["grad"]
        local = global_grad_norm(s.gradient(scratch) for s in self.states)
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
            overlap, self._overlap = self._overlap, None
            try:
                if overlap is not None:
                    self._finish_overlapped(overlap)
                else:
                    self._step_all(adamw, clip)
            finally:
                self._end_reads()

    def _finish_overlapped(self, overlap: _Overlap) -> None:
        for i in range(self.pager.num_blocks):
            if i not in overlap.done:
                self._step_block(i, overlap)
        resident = self.resident
        master = self._step_state(
            resident, overlap.adam, 1.0, overlap.step, None, resident.gradient()
        )
        self._set_resident(master)

    def _step_all(self, adamw: AdamWConfig | AdamWGroups, clip: ClipConfig | None) -> None:
        scale, clamp = 1.0, None
        if clip is not None and clip.value is not None:
            if clip.algorithm == "norm":
                scale = clip_coefficient(self.grad_norm(), clip.value)
            else:
                clamp = clip.value
        self.step_count += 1
        adam = _Steppers(adamw)
        self._plan_reads(range(self.pager.num_blocks))
        for i, state in enumerate(self.pager.states):
            scratch = self._take_set()
            grad = state.gradient(scratch.fp32["grad"])
            if clamp is not None:
                grad.clamp_(-clamp, clamp)
            self._step_state(state, adam, scale, self.step_count, scratch, grad, block=i)
        grad = self.resident.gradient()
        if clamp is not None:
            grad.clamp_(-clamp, clamp)
        master = self._step_state(self.resident, adam, scale, self.step_count, None, grad)
        self._set_resident(master)

    def _set_resident(self, master: Tensor) -> None:
        """The resident parameters' device values from their stepped fp32 ``master``
        (this rank's shard under data parallelism: cast, then all-gathered)."""
        resident = self.resident
        if self.comm is not None:
            part = self._cast_part[: resident.numel]
            part.copy_(master[: resident.numel])
            master = resident.gather(part, self._resident_gathered, self._resident_full)
        for p, v in zip(self.resident_params, resident.master_views(master), strict=True):
            p.data.copy_(v)

    def _step_state(
        self,
        state: FlatState,
        adam: _Steppers,
        scale: float,
        step: int,
        scratch: _Scratch | None,
        grad: Tensor,
        *,
        block: int | None = None,
    ) -> Tensor:
        """AdamW on one flat state: HOST-home tensors in place, others through ``scratch``
        or block ``block``'s read-ahead set (read, stepped, written back asynchronously);
        the stepped fp32 master weights.

        For a block, its compute-dtype weights are written from the stepped master here,
        before its read-ahead set goes back to the free list: from then on a read-ahead of
        another block may refill that set (the returned master is then no longer its own).
        """
        start = time.perf_counter()
        with self._ahead_lock:
            ahead = self._ahead.pop(block, None) if block is not None else None
            if block in self._queue:
                self._queue.remove(block)
        self._read_ahead()  # the next blocks' reads run while this one steps
        held = ahead if ahead is not None else scratch
        if ahead is not None:
            ahead.wait_reads()
        bufs: list[Tensor] = []
        for kind, name in zip(STATE_KINDS, state.state_names, strict=True):
            if self.store.home(name) is Tier.HOST:
                bufs.append(self.store.host_view(name))
            elif ahead is not None:
                bufs.append(ahead.fp32[kind][: state.numel])
            else:
                assert scratch is not None, f"{name} is not on host and no scratch was given"
                bufs.append(self.store.read(name, out=scratch.fp32[kind][: state.numel]))
        master, exp_avg, exp_avg_sq = bufs
        params = self.resident_params if block is None else self.pager.params[block]
        for a, b, stepper in adam.runs(state, params):
            stepper.step_block(
                master[a:b], grad[a:b], exp_avg[a:b], exp_avg_sq[a:b], step=step, grad_scale=scale
            )
        for name, buf in zip(state.state_names, bufs, strict=True):
            if self.store.home(name) is not Tier.HOST:
                assert held is not None
                held.tickets.append(self.store.write_back_async(name, buf))
        if block is not None:
            assert scratch is not None, f"block {block} is stepped without a scratch set"
            self._write_weights(block, master, scratch)
        if ahead is not None:  # the weights are cast from its master: reused once written
            with self._ahead_lock:
                self._free_ahead.append(ahead)
            self._read_ahead()
        state.clear_grad()
        self.optimizer_busy_s += time.perf_counter() - start
        return master

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

    def iter_state(
        self, kinds: Sequence[StateKind] = STATE_KINDS, *, start: int = 0
    ) -> Iterator[tuple[str, dict[StateKind, Tensor]]]:
        """Each parameter's name and fp32 state (``master``, ``exp_avg``, ``exp_avg_sq``).

        Reads one flat state at a time into the engine's scratch buffers (HOST-home
        state is seen in place): the tensors yielded are views, valid until the next
        item (copy to keep them). Under data parallelism each flat state is gathered
        from every rank's shard: a collective, so every rank iterates it to the end with
        the same ``kinds``; a rank that stops early ends its part with
        :meth:`finish_gathers`. ``start`` skips the first flat states.
        """
        self.grads.wait()
        self.pager.release_all_except(())
        self._settle_sets()
        scratch = self._sets[0].fp32
        wide, whole = self._whole_buffers(kinds), self._whole_buffers(kinds)
        self.gathered_states = start
        for state, names in self.named_states()[start:]:
            views: dict[StateKind, list[Tensor]] = {}
            for kind, name in zip(STATE_KINDS, state.state_names, strict=True):
                if kind in kinds:
                    flat = self._read(name, self._flat(name, scratch[kind], state.numel))
                    if self.comm is not None:
                        flat = state.gather(flat, wide[kind], whole[kind])
                    views[kind] = state.master_views(flat)
            self.gathered_states += 1
            for j, key in enumerate(names):
                yield key, {kind: v[j] for kind, v in views.items()}

    def finish_gathers(self, kinds: Sequence[StateKind] = STATE_KINDS) -> None:
        """The gathers left of an :meth:`iter_state` pass this rank stopped early (an
        error while writing what it read), so that the other ranks' passes end too."""
        for _ in self.iter_state(kinds, start=self.gathered_states):
            pass

    def iter_shards(
        self, kinds: Sequence[StateKind] = STATE_KINDS
    ) -> Iterator[tuple[FlatState, list[str], dict[StateKind, Tensor]]]:
        """Each flat state, its parameters' names, and the flat state as this rank stores
        it per kind (its shard under data parallelism; no collective).

        Reads one flat state at a time into the engine's scratch buffers (HOST-home state
        is seen in place): the tensors yielded are valid until the next item.
        """
        self.grads.wait()
        self.pager.release_all_except(())
        self._settle_sets()
        scratch = self._sets[0].fp32
        for state, names in self.named_states():
            flats = {
                kind: self._read(name, self._flat(name, scratch[kind], state.numel))
                for kind, name in zip(STATE_KINDS, state.state_names, strict=True)
                if kind in kinds
            }
            yield state, names, flats

    def load_state(
        self, fill: Callable[[str, StateKind, Tensor], None], kinds: Sequence[StateKind]
    ) -> None:
        """Set the fp32 state of every parameter; ``fill(name, kind, out)`` writes into ``out``.

        ``out`` is an fp32 host view of the parameter's shape. When ``master`` is among
        ``kinds``, the compute-dtype weights (paged and resident) are re-derived from it.
        Under data parallelism every rank fills whole parameters and keeps its shard (no
        collective: each rank reads the values itself).
        """
        self.grads.wait()
        self.pager.release_all_except(())
        self._settle_sets()
        scratch = self._sets[0]
        wide = self._whole_buffers(kinds)
        for i, (state, names) in enumerate(self.named_states()):
            flats: dict[StateKind, Tensor] = {}
            for kind, name in zip(STATE_KINDS, state.state_names, strict=True):
                if kind not in kinds:
                    continue
                flat = self._flat(name, scratch.fp32[kind], state.numel)
                whole = flat if self.comm is None else wide[kind][: state.full_numel]
                flats[kind] = whole
                for key, view in zip(names, state.master_views(whole), strict=True):
                    fill(key, kind, view)
                if self.comm is not None:
                    state.local(whole, flat)
                if self.store.home(name) is not Tier.HOST:
                    self.store.write(name, flat)
            if "master" not in kinds:
                continue
            master = flats["master"]
            if i < self.pager.num_blocks:
                ticket = self.pager.write_weights(i, master, scratch.cast)
                if ticket is not None:
                    ticket.wait_host()  # scratch.cast is refilled for the next block
            else:
                for p, v in zip(self.resident_params, state.master_views(master), strict=True):
                    p.data.copy_(v)

    def _whole_buffers(self, kinds: Sequence[StateKind]) -> dict[StateKind, Tensor]:
        """fp32 host buffers of every rank's shards of the largest flat state, per kind
        (data parallelism; none otherwise)."""
        if self.comm is None:
            return {}
        n = max(s.numel for s in self.states) * self.comm.world_size
        return {kind: torch.empty(n, dtype=torch.float32) for kind in kinds}

    def _flat(self, name: str, scratch: Tensor, numel: int) -> Tensor:
        """Where the state ``name`` is worked on: its host view (HOST home) or ``scratch``."""
        if self.store.home(name) is Tier.HOST:
            return self.store.host_view(name)
        return scratch[:numel]

    def _read(self, name: str, flat: Tensor) -> Tensor:
        """``flat`` holding the contents of ``name`` (read unless it is the host view)."""
        if self.store.home(name) is Tier.HOST:
            return flat
        return self.store.read(name, out=flat)

    def lazy_state_dict(self) -> EngineStateDict:
        """The model's state dict, each parameter's fp32 master read when asked for."""
        return EngineStateDict(self)

    def iter_frozen(self) -> Iterator[tuple[str, Tensor]]:
        """Each frozen parameter's name and value (fp32 host copies, read from the store)."""
        first: dict[int, str] = {}
        for key, p in self.model.named_parameters():
            first.setdefault(id(p), key)
        for i in range(self.pager.num_blocks):
            for p, value in zip(self.pager.frozen[i], self.pager.read_frozen(i), strict=True):
                yield first[id(p)], value
        for p in self.frozen_params:
            yield first[id(p)], p.detach().to("cpu", torch.float32)

    def state_dict(self) -> dict[str, Tensor]:
        """The model's state dict with every parameter as its fp32 master copy (host);
        frozen parameters as their stored values in fp32."""
        values = {key: s["master"].clone() for key, s in self.iter_state(("master",))}
        values.update(self.iter_frozen())
        first = {id(p): key for key, p in reversed(list(self.model.named_parameters()))}
        out: dict[str, Tensor] = {}
        for key, t in self.model.state_dict(keep_vars=True).items():
            out[key] = values[first[id(t)]] if id(t) in first else t.detach().to("cpu")
        return out

    def load_state_dict(self, state_dict: Mapping[str, Tensor]) -> None:
        """Set master weights, paged weights and resident parameters from a full state dict.

        Raises ``ValueError`` naming the first parameter missing or of another shape.
        """
        names = [key for _, keys in self.named_states() for key in keys]
        missing = [k for k in names if k not in state_dict]
        if missing:
            raise ValueError(f"state dict lacks {len(missing)} parameters, e.g. {missing[:3]}")

        def fill(key: str, kind: StateKind, out: Tensor) -> None:
            value = state_dict[key]
            if tuple(value.shape) != tuple(out.shape):
                raise ValueError(
                    f"parameter {key!r} has shape {tuple(value.shape)} in the state dict but "
                    f"{tuple(out.shape)} in the model: load a state dict of this model"
                )
            out.copy_(value)

        self.load_state(fill, ("master",))

    def close(self) -> None:
        """Restore the blocks' forwards and stop the gradient worker (the store stays open)."""
        self.paged.remove()
        self.grads.close()
        self._settle_sets()


class EngineStateDict(Mapping[str, Tensor]):
    """The model's state dict with parameters as fp32 masters, read from the store on demand.

    Nothing is read until a key is asked for; then the flat state holding that
    parameter is read (one block's masters, kept until a key of another flat state
    is asked for), and the parameter returned as a copy (host, fp32). Iterating it
    therefore holds at most one block's masters besides the tensors the caller keeps,
    where :meth:`TrainingEngine.state_dict` holds the whole model. Buffers and other
    non-parameter entries are the module's own tensors (moved to the host).
    """

    def __init__(self, engine: TrainingEngine) -> None:
        self.engine = engine
        self._entries: dict[str, Tensor] = engine.model.state_dict(keep_vars=True)
        first = {id(p): key for key, p in reversed(list(engine.model.named_parameters()))}
        self._where: dict[str, tuple[int, int]] = {}
        names_at = {key: (i, j) for i, (_, keys) in enumerate(engine.named_states())
                    for j, key in enumerate(keys)}  # fmt: skip
        frozen_at = {id(p): (i, j) for i, ps in enumerate(engine.pager.frozen)
                     for j, p in enumerate(ps)}  # fmt: skip
        self._frozen: dict[str, tuple[int, int]] = {}
        """Keys of frozen block parameters: (block, index in its frozen weights)."""
        for key, t in self._entries.items():
            if id(t) in frozen_at:
                self._frozen[key] = frozen_at[id(t)]
            elif id(t) in first and first[id(t)] in names_at:
                self._where[key] = names_at[first[id(t)]]
        self._cached: tuple[int, list[Tensor]] | None = None
        self._frozen_cached: tuple[int, list[Tensor]] | None = None

    @property
    def parameter_keys(self) -> frozenset[str]:
        """Keys whose values are parameters (fp32 masters in the store)."""
        return frozenset(self._where)

    def __getitem__(self, key: str) -> Tensor:
        where = self._where.get(key)
        if key in self._frozen:
            i, j = self._frozen[key]
            if self._frozen_cached is None or self._frozen_cached[0] != i:
                self._frozen_cached = (i, self.engine.pager.read_frozen(i))
            return self._frozen_cached[1][j].clone()
        if where is None:
            return self._entries[key].detach().to("cpu")
        i, j = where
        if self._cached is None or self._cached[0] != i:
            engine = self.engine
            engine.grads.wait()
            state = engine.states[i]  # under data parallelism a collective: every rank asks
            self._cached = (i, state.master_views(state.gather(state.read_master())))
        return self._cached[1][j].clone()

    def __contains__(self, key: object) -> bool:
        return key in self._entries

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)
