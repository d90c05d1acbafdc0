"""The optimizer step on the host: AdamW over each flat state, weights written back.

:class:`OptimizerStep` steps each block's flat state with
:class:`~bb_lightning.engine.optim.HostAdamW` (HOST-home state in place, other state
through the :class:`~bb_lightning.engine.scratch_pool.ScratchPool`'s buffers), writes the
block's compute-dtype weights back to their home and the resident parameters' values to
the device. Without clipping a block's step needs only that block's gradient: an
overlapped step (:meth:`OptimizerStep.begin_overlapped`) steps each block on the gradient
worker during the window's last backward, as soon as its gradient is in. With global-norm
clipping each block's gradient norm is taken as its last gradient is summed during that
backward, so the clip scale is known when backward ends; the blocks then step on the
gradient worker in the order the next forward uses them (:meth:`OptimizerStep.
step_deferred`), and the forward's page-in of a block waits for that block's update only
(:meth:`OptimizerStep.wait_block`).

:class:`ClipConfig` and :func:`adamw_groups_from_optimizer` translate Lightning's clipping
arguments and a ``torch.optim.AdamW`` into what the step takes.
"""

from __future__ import annotations

import functools
import math
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

from bb_lightning.engine import host_norm
from bb_lightning.engine.flat_state import FlatState, read_piece_now, write_piece
from bb_lightning.engine.optim import (
    AdamWConfig,
    AdamWGroups,
    HostAdamW,
    adam_runs,
    clip_coefficient,
    host_step_serves,
)
from bb_lightning.engine.pager import BlockPager
from bb_lightning.engine.scratch_pool import Scratch, ScratchPool
from bb_lightning.engine.shard import ShardComm
from bb_lightning.placement import STATE_KINDS
from storage.store import TieredStore
from storage.tiers import Tier

__all__ = ["ClipConfig", "OptimizerStep", "Overlap", "Steppers", "adamw_groups_from_optimizer"]

Submit = Callable[[Callable[[], None]], None]
"""Queues a job on the gradient worker (:meth:`~bb_lightning.engine.grad_sink.GradSink.submit`)."""


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
class Overlap:
    """An optimizer step whose block updates run during the last backward of the window."""

    adam: Steppers
    step: int
    done: set[int] = field(default_factory=set)
    clip: float | None = None
    """Global-norm clipping's maximum norm: None steps each block during backward; set,
    each block's gradient norm is recorded during backward (:attr:`norms`) and the blocks
    step after it (:meth:`OptimizerStep.step_deferred`)."""
    norms: dict[int, Tensor] = field(default_factory=dict)
    """Each block's fp32 gradient 2-norm, taken as its last gradient of the window was summed."""


class Steppers:
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


class OptimizerStep:
    """One training engine's host AdamW steps: its step count and the overlapped step in
    progress.

    ``pager`` holds the blocks' flat states, ``resident`` the state of the trainable
    parameters outside the blocks (``resident_params``, on the device); ``pool`` lends the
    scratch and read-ahead sets; ``comm`` (data parallelism) assembles the resident
    parameters from every rank's stepped shard (a block's weights are assembled at its
    next page-in).
    """

    def __init__(
        self,
        store: TieredStore,
        pager: BlockPager,
        resident: FlatState,
        resident_params: Sequence[Tensor],
        pool: ScratchPool,
        *,
        comm: ShardComm | None,
        compute_dtype: torch.dtype,
    ) -> None:
        self.store = store
        self.pager = pager
        self.resident = resident
        self.resident_params = resident_params
        self.pool = pool
        self.comm = comm
        self.step_count = 0
        """Optimizer steps taken (the AdamW bias corrections use it)."""
        self.busy_s = 0.0
        """Seconds of host AdamW work since the engine was built (overlapped work included)."""
        self.overlap_starts: list[tuple[int, float]] = []
        """(block, ``time.perf_counter()``) of each overlapped block step of the last step."""
        self.overlap: Overlap | None = None
        """The overlapped step in progress (:meth:`begin_overlapped`), if any."""
        self.updated: list[threading.Event] | None = None
        """Per block, set once its deferred update is done (:meth:`step_deferred`)."""
        self._failed = False
        self._cast_part = torch.empty(0 if comm is None else resident.numel, dtype=compute_dtype)
        """The resident parameters' stepped shard cast to the compute dtype (data
        parallelism), assembled on the device from every rank's."""

    def begin_overlapped(
        self, adamw: AdamWConfig | AdamWGroups, clip_norm: float | None = None
    ) -> None:
        """Count a step whose blocks are stepped during the coming backward
        (:meth:`step_block` as each gradient comes, :meth:`finish_overlapped` after); with
        ``clip_norm`` (global-norm clipping), stepped after it (:meth:`step_deferred`)."""
        self.step_count += 1
        self.overlap_starts = []
        self.overlap = Overlap(adam=Steppers(adamw), step=self.step_count, clip=clip_norm)

    def step_deferred(self, overlap: Overlap, norms: Sequence[Tensor], submit: Submit) -> None:
        """Clip and step a norm-clipped overlapped step: the resident parameters now, each
        block by a job ``submit`` queues on the gradient worker, block 0 first.

        ``norms`` are the blocks' fp32 gradient norms; the resident parameters' is added
        here. Until block ``i``'s job is done, :meth:`wait_block` ``(i)`` waits for it.
        """
        assert overlap.clip is not None
        grad = self.resident.gradient()
        local = [*norms, torch.linalg.vector_norm(grad, 2.0, dtype=torch.float32)]
        total = float(torch.linalg.vector_norm(torch.stack(local), 2.0))
        scale = clip_coefficient(total, overlap.clip)
        master = self.step_state(self.resident, overlap.adam, scale, overlap.step, grad)
        self.set_resident(master)
        self._failed = False
        self.overlap_starts = []
        self.updated = [threading.Event() for _ in range(self.pager.num_blocks)]
        self.pool.plan_reads(range(self.pager.num_blocks))
        for i in range(self.pager.num_blocks):
            submit(functools.partial(self._deferred_block, i, overlap, scale))
        submit(self.pool.end_reads)

    def _deferred_block(self, i: int, overlap: Overlap, scale: float) -> None:
        updated = self.updated
        assert updated is not None
        try:
            self.overlap_starts.append((i, time.perf_counter()))
            self.step_block_state(i, overlap.adam, scale, overlap.step)
        except BaseException:
            self._failed = True
            raise
        finally:
            updated[i].set()

    def wait_block(self, i: int) -> None:
        """Return once block ``i``'s deferred update is done (at once when none is pending);
        ``RuntimeError`` when an update failed (the worker's error is raised at the next
        wait for the gradient worker)."""
        updated = self.updated
        if updated is None or updated[i].is_set():
            return
        updated[i].wait()
        if self._failed:
            raise RuntimeError(
                f"the optimizer update of block {i} or of one before it failed: its error "
                "is raised by the next wait for the gradient worker"
            )

    def step_block(
        self, i: int, overlap: Overlap, grads: Sequence[Tensor | None] | None = None
    ) -> None:
        """Block ``i``'s AdamW step (its last ``grads`` summed in) and weight write-back."""
        self.overlap_starts.append((i, time.perf_counter()))
        self.step_block_state(i, overlap.adam, 1.0, overlap.step, grads)

    def finish_overlapped(self, overlap: Overlap) -> None:
        """Step the blocks the backward did not (no gradient came), then the resident
        parameters, in the overlapped step ``overlap``."""
        for i in range(self.pager.num_blocks):
            if i not in overlap.done:
                self.step_block(i, overlap)
        resident = self.resident
        master = self.step_state(resident, overlap.adam, 1.0, overlap.step, resident.gradient())
        self.set_resident(master)

    def step_all(
        self,
        adamw: AdamWConfig | AdamWGroups,
        clip: ClipConfig | None,
        grad_norm: Callable[[], float],
    ) -> None:
        """Step every block, then the resident parameters, from the accumulated gradients
        (clipped by ``clip``, the norm from ``grad_norm``)."""
        scale, clamp = 1.0, None
        if clip is not None and clip.value is not None:
            if clip.algorithm == "norm":
                scale = clip_coefficient(grad_norm(), clip.value)
            else:
                clamp = clip.value
        self.step_count += 1
        adam = Steppers(adamw)
        self.pool.plan_reads(range(self.pager.num_blocks))
        for i in range(self.pager.num_blocks):
            self.step_block_state(i, adam, scale, self.step_count, clamp=clamp)
        grad = self.resident.gradient()
        if clamp is not None:
            grad.clamp_(-clamp, clamp)
        master = self.step_state(self.resident, adam, scale, self.step_count, grad)
        self.set_resident(master)

    def set_resident(self, master: Tensor) -> None:
        """The resident parameters' device values from their stepped fp32 ``master``
        (this rank's shard under data parallelism: cast, then assembled on the device)."""
        resident = self.resident
        if self.comm is not None and resident.layout is not None:  # assembled on the device
            part = self._cast_part[: resident.numel]
            part.copy_(master[: resident.numel])
            device = next((p.device for p in self.resident_params), part.device)
            master = self.comm.assemble(part.to(device), resident.layout)
        for p, v in zip(self.resident_params, resident.master_views(master), strict=True):
            p.data.copy_(v)

    def step_state(
        self, state: FlatState, adam: Steppers, scale: float, step: int, grad: Tensor
    ) -> Tensor:
        """AdamW on the resident parameters' flat state (homed on the host: stepped in
        place); the stepped fp32 master weights."""
        start = time.perf_counter()
        master, exp_avg, exp_avg_sq = (self.store.host_view(n) for n in state.state_names)
        for a, b, stepper in adam.runs(state, self.resident_params):
            stepper.step_block(
                master[a:b], grad[a:b], exp_avg[a:b], exp_avg_sq[a:b], step=step, grad_scale=scale
            )
        state.clear_grad()
        self.busy_s += time.perf_counter() - start
        return master

    def step_block_state(
        self,
        i: int,
        adam: Steppers,
        scale: float,
        step: int,
        fresh: Sequence[Tensor | None] | None = None,
        *,
        clamp: float | None = None,
    ) -> None:
        """AdamW on block ``i``'s flat state, one piece (``pool.piece`` elements) at a time:
        its gradient (the accumulated one plus ``fresh``, clamped to ``clamp``), its
        HOST-home tensors in place, the others from the piece's read-ahead set or read into
        a scratch set, stepped and written back asynchronously, then the piece's
        compute-dtype weights written from its stepped master.

        A HOST-home gradient accumulator is summed whole in place first (no buffer). A
        read-ahead set goes back to the free list once its piece's weights are cast (from
        then on a read of another piece may refill it).
        """
        start = time.perf_counter()
        state = self.pager.states[i]
        runs = adam.runs(state, self.pager.params[i])
        one_pass = clamp is None and self._one_pass(runs)
        host_grad = None
        if not one_pass and self.store.home(state.grad_name) is Tier.HOST:
            host_grad = state.gradient() if fresh is None else state.accumulate(fresh, None)
        for k, (a, b) in enumerate(state.pieces(self.pool.piece)):
            scratch = self.pool.take()
            ahead = self.pool.take_ahead((i, k))  # the next pieces' reads run meanwhile
            if ahead is not None:
                ahead.wait_reads()
            bufs = self._piece_bufs(state, a, b, scratch, ahead)
            master = bufs[0]
            cast = self.pager.cast_target(i, b - a, scratch.cast, a)
            if one_pass:
                one_pass = self._step_one_pass(state, a, b, scratch, bufs, runs, cast, fresh,
                                               scale, step)  # fmt: skip
            if not one_pass:  # summed, stepped and cast in turn
                if host_grad is None and self.store.home(state.grad_name) is Tier.HOST:
                    host_grad = state.gradient() if fresh is None else state.accumulate(fresh, None)
                if host_grad is not None:
                    grad = host_grad[a:b]
                else:
                    grad = state.gradient_piece(a, b, scratch.fp32["grad"], fresh)
                if clamp is not None:
                    grad.clamp_(-clamp, clamp)
                for lo, hi, stepper in runs:
                    lo, hi = max(lo, a) - a, min(hi, b) - a
                    if lo < hi:
                        stepper.step_block(
                            master[lo:hi], grad[lo:hi], bufs[1][lo:hi], bufs[2][lo:hi],
                            step=step, grad_scale=scale,
                        )  # fmt: skip
                cast.copy_(master[: b - a])
            held = ahead if ahead is not None else scratch
            for name, buf in zip(state.state_names, bufs, strict=True):
                if self.store.home(name) is not Tier.HOST:
                    held.tickets.append(write_piece(self.store, name, buf, a, b))
            # the weights written home (under data parallelism this rank's shard: each rank
            # writes its own, the next page-in assembles the block on the device)
            ticket = self.pager.write_cast(i, b - a, scratch.cast, a)
            if ticket is not None:
                scratch.tickets.append(ticket)
            if ahead is not None:  # the weights are cast from its master: reused once written
                self.pool.give_back(ahead)
        state.clear_grad()
        self.busy_s += time.perf_counter() - start

    def _one_pass(self, runs: Sequence[tuple[int, int, HostAdamW]]) -> bool:
        """Whether a block's pieces may be stepped by :meth:`_step_one_pass` (each piece
        still falls back where the kernel declines it before changing anything)."""
        return all(stepper.kernel == "fused" for _, _, stepper in runs) and host_norm.eager()

    def _step_one_pass(
        self,
        state: FlatState,
        a: int,
        b: int,
        scratch: Scratch,
        bufs: Sequence[Tensor],
        runs: Sequence[tuple[int, int, HostAdamW]],
        cast: Tensor,
        fresh: Sequence[Tensor | None] | None,
        scale: float,
        step: int,
    ) -> bool:
        """Step elements ``[a, b)`` of ``state`` (``bufs``: their master weights and moments)
        with the gradient summed in and the weights cast into ``cast``, one pass per tensor
        and group (:meth:`HostAdamW.step_host`); False, having changed nothing, where the
        kernel does not serve the piece's tensors."""
        n = b - a
        acc, tiles = state.gradient_parts(a, b, scratch.fp32["grad"], fresh)
        bufs = [t[:n] for t in bufs]
        if not host_step_serves(bufs, acc, [g for _, _, srcs in tiles for g in srcs], cast):
            return False
        done = 0  # elements before it are stepped or cast
        for lo_r, hi_r, stepper in runs:
            lo_r, hi_r = max(lo_r, a) - a, min(hi_r, b) - a
            if lo_r >= hi_r:
                continue
            cast[done:lo_r].copy_(bufs[0][done:lo_r])  # in no group: cast as they are
            for lo_t, hi_t, srcs in tiles:
                lo, hi = max(lo_r, lo_t), min(hi_r, hi_t)
                if lo < hi and not stepper.step_host(
                    [t[lo:hi] for t in bufs], None if acc is None else acc[lo:hi],
                    [g[lo - lo_t : hi - lo_t] for g in srcs], cast[lo:hi],
                    step=step, grad_scale=scale,
                ):  # fmt: skip
                    raise RuntimeError(f"the host AdamW declined {state.name!r}'s piece")
            done = hi_r
        cast[done:n].copy_(bufs[0][done:n])
        return True

    def _piece_bufs(
        self, state: FlatState, a: int, b: int, scratch: Scratch, ahead: Scratch | None
    ) -> list[Tensor]:
        """Elements ``[a, b)`` of ``state``'s master weights and moments to step: views of
        HOST homes, else the read-ahead set's buffers (read), else read into ``scratch``.
        Off-host buffers are whole piece buffers (a range write needs their padding); the
        caller steps their first ``b - a`` elements."""
        bufs: list[Tensor] = []
        for kind, name in zip(STATE_KINDS, state.state_names, strict=True):
            if self.store.home(name) is Tier.HOST:
                bufs.append(self.store.host_view(name)[a:b])
            elif ahead is not None:
                bufs.append(ahead.fp32[kind])
            else:
                read_piece_now(self.store, name, scratch.fp32[kind], a, b)
                bufs.append(scratch.fp32[kind])
        return bufs
