"""Bytes per tier of fine-tuning candidates (the memory step of
:func:`~bb_lightning.planner.fit_price.price`).

One batch shape's scalars (:class:`FitSizes`) and, for many (kF, kW) placements at
once, where their bytes live (:class:`FitMemory`): the device's fixed share, then the
host's free memory filled by benefit per byte of NVMe traffic saved per step (paged
weights ``4 GA + 2`` bytes per 2, gradient accumulators ``8 GA`` per 4, optimizer state
24 per 12), the rest on NVMe.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from bb_lightning.placement import READ_AHEAD
from bb_lightning.planner import chunks, cost
from bb_lightning.planner.cost import ADAM_STATE_BYTES, FP32_BYTES
from bb_lightning.planner.data_parallel import REDUCE_BYTES
from bb_lightning.planner.job import FitJob
from bb_lightning.planner.plan import PlanOverrides
from bb_lightning.planner.profile import HardwareProfile, ModelProfile
from storage.tiers import Tier

Arr = npt.NDArray[np.float64]
Mask = npt.NDArray[np.bool_]


@dataclass(frozen=True, kw_only=True)
class FitSizes:
    """The scalars of one batch shape that every (kF, kW) candidate shares."""

    blocks: int
    """Transformer blocks."""
    element_bytes: int
    """Bytes per element of the compute dtype (weights, their gradients)."""
    block_weight_bytes: float
    """Bytes of one block's weights (every parameter is paged)."""
    block_home_bytes: float
    """Bytes of one paged block's weights one rank homes on the host or NVMe and copies
    to its device at a page-in: all of them for one rank, its dim-0 shard of every
    parameter (``ceil(block_params / N)`` elements) with data parallelism."""
    block_train_params: float
    """Trained parameters of one block."""
    rest_train_params: float
    """Trained parameters outside the blocks."""
    rest_params: float
    """Parameters outside the blocks (their weights live on the device)."""
    block_shard_params: float
    """One rank's dim-0 shard of a block's trained parameters (all of them for one rank)."""
    rest_shard_params: float
    """One rank's shard of the trained parameters outside the blocks."""
    data_parallel: bool
    """Whether several ranks share the job."""
    world_size: int = 1
    """Ranks sharing the job (N)."""
    seqs_per_step: int
    """Sequences per optimizer step (one rank's share)."""
    seq_len: int
    """Tokens per sequence."""
    micro_batch: int
    """Sequences per forward/backward pass."""
    grad_accum: int
    """Micro-batches per optimizer step."""
    loss_chunk_tokens: int | None = None
    """Tokens whose logits the loss holds at once (None: the whole pass's)."""
    chunk_rows: int | None = None
    """Sequences of the micro-batch a recomputed block runs at once (``Placement.chunk_rows``;
    None: the micro-batch in one piece)."""
    boundaries: Tier | None = None
    """Where the recomputed blocks' boundary inputs live (``Placement.boundaries``; None:
    the device)."""

    @property
    def chunks(self) -> int:
        """Chunks a recomputed block runs per micro-batch."""
        return chunks.chunks_per_pass(self.micro_batch, self.chunk_rows)

    @property
    def chunk_tokens(self) -> int:
        """Tokens of a recomputed block's chunk (the micro-batch's unchunked)."""
        return min(self.chunk_rows or self.micro_batch, self.micro_batch) * self.seq_len


def fit_sizes(
    model: ModelProfile,
    hw: HardwareProfile,
    job: FitJob,
    mb: int,
    chunk_rows: int | None = None,
    boundaries: Tier | None = None,
) -> FitSizes:
    """The scalars of micro-batch ``mb`` of ``job`` (one rank's share) on ``hw``, its
    recomputed blocks run ``chunk_rows`` sequences at a time with their boundary inputs on
    ``boundaries``."""
    wb = job.compute_bytes
    return FitSizes(
        blocks=model.num_blocks,
        element_bytes=wb,
        block_weight_bytes=float(model.block_params) * wb,
        block_home_bytes=float(cost.shard_numel(model.block_params, hw.world_size)) * wb,
        block_train_params=float(model.block_train),
        rest_train_params=float(model.rest_train),
        rest_params=float(model.rest_params),
        block_shard_params=float(cost.shard_numel(model.block_train, hw.world_size)),
        rest_shard_params=float(cost.shard_numel(model.rest_train, hw.world_size)),
        data_parallel=hw.world_size > 1,
        world_size=hw.world_size,
        seqs_per_step=job.seqs_per_step,
        seq_len=job.seq_len,
        micro_batch=mb,
        grad_accum=math.ceil(job.seqs_per_step / mb),
        loss_chunk_tokens=job.loss_chunk_tokens,
        chunk_rows=chunk_rows,
        boundaries=boundaries if chunk_rows is not None else None,
    )


@dataclass(frozen=True, kw_only=True)
class FitMemory:
    """Where every candidate's bytes live: arrays over the candidates."""

    full_blocks: Arr
    """Blocks fully on the device (``kF``)."""
    resident_weight_blocks: Arr
    """Blocks with only their weights resident on the device (``kW``)."""
    paged_blocks: Arr
    """Blocks whose weights are paged in (``n - kF - kW``)."""
    off_device_blocks: Arr
    """Blocks whose gradients and optimizer state home off the device (``n - kF``)."""
    host_weight_blocks: Arr
    """Paged blocks whose weights home on the host."""
    host_grad_blocks: Arr
    """Off-device blocks whose gradient accumulators are on the host."""
    host_state_blocks: Arr
    """Off-device blocks whose master weights and moments are on the host."""
    in_place_blocks: Arr
    """Host-home blocks a CPU device uses in place."""
    device_bytes: Arr
    """Bytes on the device."""
    mandatory_host_bytes: Arr
    """Host bytes every placement needs: outside the store the larger of the engine's
    setup and the pinned staging; in it the state outside the blocks, the optimizer's
    scratch sets, the read-ahead sets when state is off the host, the arena's padding."""
    host_bytes: Arr
    """Bytes on the host before the read-ahead sets beyond :attr:`read_ahead_bytes`."""
    free_host_bytes: Arr
    """Host bytes left after the homes (room for read-ahead sets)."""
    read_ahead_bytes: Arr
    """Host bytes reserved among the mandatory ones for read-ahead sets (0: state on the
    host)."""
    nvme_bytes: Arr
    """Bytes on NVMe."""
    fits: Mask
    """Whether the bytes fit every tier's budget and the forced homes are honoured."""

    @property
    def nvme_weight_blocks(self) -> Arr:
        """Paged blocks whose weights home on NVMe."""
        return self.paged_blocks - self.host_weight_blocks

    @property
    def nvme_grad_blocks(self) -> Arr:
        """Off-device blocks whose gradient accumulators are on NVMe."""
        return self.off_device_blocks - self.host_grad_blocks

    @property
    def nvme_state_blocks(self) -> Arr:
        """Off-device blocks whose optimizer state is on NVMe."""
        return self.off_device_blocks - self.host_state_blocks


def _device_and_staging_bytes(
    model: ModelProfile,
    sz: FitSizes,
    ckpt: bool,
    depth: int,
    kf: Arr,
    kw: Arr,
    hold: bool,
) -> tuple[Arr, Arr, Arr]:
    """(bytes on the device, host bytes every placement needs, NVMe bytes of the boundary
    inputs) of each candidate."""
    n, p, wb, bb = sz.blocks, sz.block_train_params, sz.element_bytes, sz.block_weight_bytes
    ps, mb, ga = sz.block_shard_params, sz.micro_batch, sz.grad_accum
    paged = n - kf - kw
    # the pages in flight: the blocks' homed bytes on the host (a rank's shards with data
    # parallelism), and on the device besides them the blocks assembled from the shards
    # (a resident block too is assembled at its use: one at a time where nothing is paged)
    paging = np.where(paged > 0, (depth + 1) * sz.block_home_bytes, 0.0)
    gathered = np.where(paged > 0, (depth + 1) * bb, bb) if sz.data_parallel else 0.0 * kf
    # data parallel: a resident block's device home is the rank's shard, and the block
    # assembled from it is held from its forward to its backward
    shard_home = sz.block_home_bytes if sz.data_parallel else 0.0
    # checkpointing forced on a placement that pages nothing: every block is recomputed
    act_kept = np.where(paged > 0, kf + kw, 0.0) if ckpt else kf + kw
    # every block's gradients leave through the gradient sink (two batches in flight)
    in_flight = np.full_like(kf, float(cost.grad_bytes_in_flight(model, wb)))
    # the reduce-scatter's device buffers: a block's fp32 gradients packed into N padded
    # shards, and the rank's reduced shard
    collective = REDUCE_BYTES * (sz.world_size + 1) * ps if sz.data_parallel else 0.0
    # the activations kept across the pass, less the recomputed block's (priced with the
    # backward's peak)
    tokens = mb * sz.seq_len
    bounds = chunks.boundary_bytes(model, tokens, n - act_kept, sz.boundaries)
    if sz.chunk_rows is None:
        recomputed = tokens * model.act_bytes_per_token_full if ckpt else 0
        kept_acts = cost.activation_bytes(model, mb, sz.seq_len, ckpt, act_kept) - recomputed
        peak = cost.backward_peak_bytes(model, tokens, ckpt, sz.loss_chunk_tokens, wb)
    else:  # the recomputed blocks run in chunks: their boundaries, one chunk's activations
        kept_acts = tokens * model.act_bytes_per_token_full * act_kept + bounds[Tier.DEVICE]
        loss = cost.backward_peak_bytes(model, tokens, False, sz.loss_chunk_tokens, wb)
        head = cost.head_grad_bytes(model, wb)
        peak = np.maximum(loss, chunks.chunk_peak_bytes(model, tokens, sz.chunk_tokens) + head)
    held = (
        cost.held_grad_bytes(ga, wb, n * p + sz.rest_train_params) if hold else 0.0
    )  # the earlier micro-batches' gradients (Placement.hold_grads)
    device = (
        held
        + sz.rest_params * wb
        + kw * (bb + shard_home)
        + kf * (bb + shard_home + ps * (FP32_BYTES + ADAM_STATE_BYTES))
        + paging
        + gathered
        + in_flight
        + collective
        + kept_acts
        + peak
    )
    # host bytes outside the store: the engine's setup, then the pages and gradients in flight
    shard = sz.block_home_bytes / wb if sz.data_parallel else None
    setup = cost.setup_host_bytes(sz.rest_train_params, bb / wb, sz.block_train_params, wb, shard)
    outside = np.maximum(paging + in_flight, setup)
    mandatory = (
        outside
        + bounds[Tier.HOST]  # boundary inputs kept in (or staged through) pinned host memory
        + sz.rest_shard_params * (FP32_BYTES + ADAM_STATE_BYTES)
        + cost.scratch_set_bytes(ps, ps, wb)  # each ``cast`` the rank's updated shard
        + cost.store_overhead_bytes(n)
    )
    return device, mandatory, bounds[Tier.NVME] + 0.0 * kf


def _fill(free: Arr, count: Arr, each: float, forced: Tier | None) -> tuple[Arr, Mask]:
    """Blocks of ``each`` bytes placed on the host from ``free``; returns (placed, ok)."""
    if forced is Tier.NVME:
        return np.zeros_like(count), np.ones_like(count, dtype=bool)
    placed = np.minimum(count, np.floor(np.maximum(free, 0.0) / max(each, 1.0)))
    ok = placed >= count if forced is Tier.HOST else np.ones_like(count, dtype=bool)
    return placed, ok


def _fill_host(
    sz: FitSizes,
    ov: PlanOverrides,
    free: Arr,
    paged: Arr,
    off: Arr,
    in_place_act: float,
    state_first: bool,
) -> tuple[Arr, Arr, Arr, Mask, Arr]:
    """(host weight blocks, host gradient blocks, host state blocks, forced homes kept,
    host bytes left) from ``free`` host bytes, in :func:`price`'s fill order."""
    bb, ps = sz.block_home_bytes, sz.block_shard_params
    w_forced, m_forced = ov.weights_tier, ov.master_tier
    if w_forced is Tier.HOST or not state_first:  # forced weights are reserved first
        w_h, ok_w = _fill(free, paged, bb + in_place_act, w_forced)
        free = free - w_h * (bb + in_place_act)
    if m_forced is Tier.HOST:  # forced state is reserved before the gradients
        m_h, ok_m = _fill(free, off, ADAM_STATE_BYTES * ps, m_forced)
        free = free - m_h * ADAM_STATE_BYTES * ps
        g_h, _ = _fill(free, off, FP32_BYTES * ps, None)
        free = free - g_h * FP32_BYTES * ps
    else:
        g_h, _ = _fill(free, off, FP32_BYTES * ps, None)
        free = free - g_h * FP32_BYTES * ps
        m_h, ok_m = _fill(free, off, ADAM_STATE_BYTES * ps, m_forced)
        free = free - m_h * ADAM_STATE_BYTES * ps
    if state_first and w_forced is not Tier.HOST:
        w_h, ok_w = _fill(free, paged, bb + in_place_act, w_forced)
        free = free - w_h * (bb + in_place_act)
    return w_h, g_h, m_h, ok_w & ok_m, free


def fit_memory(
    model: ModelProfile,
    hw: HardwareProfile,
    ov: PlanOverrides,
    budgets: Mapping[Tier, int],
    sz: FitSizes,
    ckpt: bool,
    depth: int,
    kf: Arr,
    kw: Arr,
    hold: bool,
    state_first: bool,
) -> FitMemory:
    """Bytes per tier of every (kF, kW) and the host's homes (see :func:`price`)."""
    n, bb, ps = sz.blocks, sz.block_home_bytes, sz.block_shard_params
    paged, off = n - kf - kw, n - kf
    device, mandatory, boundaries = _device_and_staging_bytes(model, sz, ckpt, depth, kf, kw, hold)
    # On a CPU device both tiers are the same RAM: one pool, whatever the device holds
    # is not there for the host (:func:`cost.pooled_budget`).
    pool = cost.pooled_budget(hw, budgets)
    host_base = budgets[Tier.HOST] if pool is None else pool - device
    # On a CPU device a host-home block is used in place (one rank: with data parallelism
    # the rank homes a shard, gathered into a page): it keeps its activations (in the same
    # RAM) instead of being recomputed, so it costs them on the host too.
    in_place_act = (
        float(
            (model.act_bytes_per_token_full - model.act_bytes_per_token_checkpointed)
            * sz.micro_batch
            * sz.seq_len
        )
        if ckpt and hw.device_type == "cpu" and not sz.data_parallel
        else 0.0
    )
    # with optimizer state off the host (on NVMe, or a full block's on the device) the
    # engine registers read-ahead sets of one state piece each: READ_AHEAD whole blocks'
    # worth reserved where the host holds them beside what it must, else READ_AHEAD pieces;
    # filled once with and once without them
    piece = cost.state_piece_numel(ps)
    sets = max(READ_AHEAD, math.ceil(READ_AHEAD * ps / max(piece, 1.0)))  # whole sets
    blocks_ahead = float(sets * ADAM_STATE_BYTES * piece)
    pieces_ahead = float(READ_AHEAD * ADAM_STATE_BYTES * piece)
    ahead = np.where(mandatory + blocks_ahead <= host_base, blocks_ahead, pieces_ahead)
    with_sets = _fill_host(
        sz, ov, host_base - mandatory - ahead, paged, off, in_place_act, state_first
    )
    without = _fill_host(sz, ov, host_base - mandatory, paged, off, in_place_act, state_first)
    no_sets = (without[2] >= off) & (kf <= 0)
    w_h, g_h, m_h, forced_ok, free = (
        np.where(no_sets, b, a) for a, b in zip(with_sets, without, strict=True)
    )
    reserved = np.where(no_sets, 0.0, ahead)
    mandatory = mandatory + reserved
    nvme = (
        boundaries
        + (paged - w_h) * bb
        + (off - g_h) * FP32_BYTES * ps
        + (off - m_h) * ADAM_STATE_BYTES * ps
    )
    in_memory = (
        (device <= budgets[Tier.DEVICE]) & (mandatory <= budgets[Tier.HOST])
        if pool is None
        else device + mandatory <= pool
    )
    return FitMemory(
        full_blocks=kf,
        resident_weight_blocks=kw,
        paged_blocks=paged,
        off_device_blocks=off,
        host_weight_blocks=w_h,
        host_grad_blocks=g_h,
        host_state_blocks=m_h,
        in_place_blocks=w_h if in_place_act > 0 else 0.0 * w_h,
        device_bytes=device,
        mandatory_host_bytes=mandatory,
        host_bytes=host_base - free,
        free_host_bytes=free,
        read_ahead_bytes=reserved,
        nvme_bytes=nvme,
        fits=in_memory & (nvme <= budgets[Tier.NVME]) & forced_ok,
    )
