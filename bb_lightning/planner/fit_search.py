"""Candidates and pricing of fine-tuning plans (used by :func:`search.make_plan`).

A candidate is (checkpointing, prefetch depth, micro-batch, kF, kW): ``kF`` blocks
fully on the device (bf16 weights, fp32 gradients, master and moments: the
optimizer runs there), ``kW`` blocks with resident weights whose gradients and
optimizer state live off the device, the rest paged. Off-device state is placed on
the host by benefit per byte of NVMe traffic saved per step (paged weights
``4 GA + 2`` bytes per 2, gradient accumulators ``8 GA`` per 4, optimizer state 24
per 12), the rest on NVMe. All (kF, kW) of three fill orders are priced at once
with numpy arrays.

Weights are priced for every parameter (``block_params``: each pass pages them all,
frozen ones included); gradients, master weights, moments, the host AdamW and the
weight write-back only for the trained ones (``ModelProfile.block_train`` and
``rest_train``: LoRA adapters over frozen base weights train a small share); frozen
matrices skip their weight gradients (:func:`cost.train_flops_per_token`).
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from bb_lightning.placement import READ_AHEAD, Placement
from bb_lightning.planner import cost
from bb_lightning.planner.cost import ADAM_STATE_BYTES, FP32_BYTES
from bb_lightning.planner.data_parallel import REDUCE_BYTES
from bb_lightning.planner.job import FitJob
from bb_lightning.planner.plan import (
    LINK_FIELDS,
    LINKS,
    Plan,
    PlanOverrides,
    PredictedTime,
    Roofline,
    TierMemory,
    placement_tiers,
)
from bb_lightning.planner.profile import HardwareProfile, ModelProfile
from storage.tiers import Link, Tier, format_bytes

Arr = npt.NDArray[np.float64]
MIN_READ_AHEAD = READ_AHEAD
"""Read-ahead sets every placement with optimizer state off the host has (counted in
the host budget by the manifest with the scratch sets); the planner adds more."""
MIXED_IO_EFFICIENCY = 0.7
"""Share of the serial read + write rate one disk keeps when optimizer-state reads and
write-backs interleave on it (both in flight at once, as in the overlapped step)."""


def ladder(cap: int) -> list[int]:
    """Powers of two below ``cap``, then ``cap``."""
    out, v = [], 1
    while v < cap:
        out.append(v)
        v *= 2
    return [*out, cap]


def states(n: int, ov: PlanOverrides) -> tuple[Arr, Arr]:
    """(kF, kW) pairs: weights-first, full-first and weights-then-full fill orders."""
    pairs = {(0, k) for k in range(n + 1)} | {(k, 0) for k in range(n + 1)}
    pairs |= {(j, n - j) for j in range(n + 1)}
    keep = []
    for kf, kw in sorted(pairs):
        if ov.resident_blocks is not None and kf + kw != ov.resident_blocks:
            continue
        if ov.weights_tier is Tier.DEVICE and kf + kw != n:
            continue
        # With resident_blocks, weights_tier homes the other (paged) blocks.
        if ov.weights_tier in (Tier.HOST, Tier.NVME) and ov.resident_blocks is None and kf + kw:
            continue
        if ov.master_tier is Tier.DEVICE and kf != n:
            continue
        if ov.master_tier in (Tier.HOST, Tier.NVME) and kf != 0:
            continue
        keep.append((kf, kw))
    arr = np.array(keep, dtype=np.float64).reshape(-1, 2)
    return arr[:, 0], arr[:, 1]


@dataclass
class Priced:
    """One priced candidate (scalars) picked from the arrays."""

    checkpointing: bool
    depth: int
    micro_batch: int
    values: dict[str, float]
    hold: bool = False
    """Whether the earlier micro-batches' gradients are held (``Placement.hold_grads``)."""


TIE_TOLERANCE = 0.01
"""Relative step-time difference below which two candidates count as equally fast."""


def _fill(
    free: Arr, count: Arr, each: float, forced: Tier | None
) -> tuple[Arr, npt.NDArray[np.bool_]]:
    """Blocks of ``each`` bytes placed on the host from ``free``; returns (placed, ok)."""
    if forced is Tier.NVME:
        return np.zeros_like(count), np.ones_like(count, dtype=bool)
    placed = np.minimum(count, np.floor(np.maximum(free, 0.0) / max(each, 1.0)))
    ok = placed >= count if forced is Tier.HOST else np.ones_like(count, dtype=bool)
    return placed, ok


def price(
    model: ModelProfile,
    hw: HardwareProfile,
    job: FitJob,
    ov: PlanOverrides,
    budgets: Mapping[Tier, int],
    ckpt: bool,
    depth: int,
    mb: int,
    kf: Arr,
    kw: Arr,
    hold: bool = False,
    state_first: bool = False,
) -> dict[str, Arr]:
    """Bytes per tier and seconds per step of every (kF, kW) for one batch shape.

    ``hold`` prices ``Placement.hold_grads``: the earlier micro-batches' gradients take
    device memory (:func:`cost.held_grad_bytes`) and are summed once.

    The host's free memory goes to the paged blocks' weights first, then to gradient
    accumulators, then to optimizer state; ``state_first`` fills it the other way round
    (gradients, state, then weights). On a CPU device a host-home block also keeps its
    activations there, so one more such block may displace more state than it saves:
    :func:`search` prices both orders there, which keeps a bigger memory from ever
    predicting a slower step.

    With data parallelism (``hw.world_size`` N > 1) this prices one rank: ``hw`` is its
    :func:`~bb_lightning.planner.data_parallel.rank_share` and ``job`` its share of the
    batch. Master weights, moments, gradient accumulators and the host AdamW then count
    the rank's dim-0 shard (``ps = ceil(params / N)`` per block, ``nbs`` outside); the
    reduced fp32 gradient shard leaves the device, the updated weight shard goes up for
    the all-gather and the gathered paged weights go back home. The ``net`` column is
    the rank's network busy time per step (:func:`_net_seconds`): the per-micro-batch
    reduce-scatters run beside the pass's compute as one more link
    (:func:`cost.pass_exposed_seconds`), the all-gathers beside the host AdamW in the
    optimizer pipeline (:func:`cost.optimizer_exposed_seconds`), where they share the
    link with the last micro-batch's reduce-scatters.
    """
    n, p = model.num_blocks, float(model.block_train)  # trained params per block
    wb = job.compute_bytes  # bytes per compute-dtype element (weights, their gradients)
    bb = float(model.block_params) * wb  # every weight is paged
    nb = float(model.rest_train)  # trained params outside the blocks
    dp = hw.world_size > 1
    ps = float(cost.shard_numel(model.block_train, hw.world_size))  # the rank's shard
    nbs = float(cost.shard_numel(model.rest_train, hw.world_size))
    nw = float(model.rest_params)  # weights outside the blocks (on the device)
    g, s = job.seqs_per_step, job.seq_len
    ga = math.ceil(g / mb)
    np_ = n - kf - kw  # paged blocks
    off = n - kf  # blocks whose optimizer state and gradients are homed off the device
    # The engine steps every block with host AdamW, the kF blocks too: their fp32 state
    # comes off the device and goes back each step (12 + 12 bytes per parameter), their
    # weights go back in bf16, and their gradient sums (homed on the device) are read
    # and written per micro-batch when several are summed.
    grads_dev = kf * FP32_BYTES * ps if ga > 1 else 0.0 * kf
    paging = np.where(np_ > 0, (depth + 1) * bb, 0.0)
    # checkpointing forced on a placement that pages nothing: every block is recomputed
    act_kept = np.where(np_ > 0, kf + kw, 0.0) if ckpt else kf + kw
    # every block's gradients leave through the gradient sink (two batches in flight)
    in_flight = np.full_like(kf, float(cost.grad_bytes_in_flight(model, wb)))
    # the collectives' device buffers: a block's packed and reduced gradients, its gathered weights
    collective = (2 * REDUCE_BYTES + wb) * p if dp else 0.0
    held = cost.held_grad_bytes(ga, wb, n * p + nb) if hold else 0.0
    dev = (
        held
        + nw * wb
        + kw * bb
        + kf * (bb + ps * (FP32_BYTES + ADAM_STATE_BYTES))
        + paging
        + in_flight
        + collective
        + cost.activation_bytes(model, mb, s, ckpt, act_kept)
        + cost.logits_bytes(model, mb * s)
    )
    mandatory = paging + in_flight + nbs * (FP32_BYTES + ADAM_STATE_BYTES)
    # On a CPU device both tiers are the same RAM: one pool, whatever the device holds
    # is not there for the host (:func:`cost.pooled_budget`).
    pool = cost.pooled_budget(hw, budgets)
    host_base = budgets[Tier.HOST] if pool is None else pool - dev
    free = host_base - mandatory
    # On a CPU device a host-home block is used in place: it keeps its activations (in
    # the same RAM) instead of being recomputed, so it costs them on the host too.
    in_place_act = (
        float((model.act_bytes_per_token_full - model.act_bytes_per_token_checkpointed) * mb * s)
        if ckpt and hw.device_type == "cpu"
        else 0.0
    )
    w_forced, m_forced = ov.weights_tier, ov.master_tier
    if w_forced is Tier.HOST or not state_first:  # forced weights are reserved first
        w_h, ok_w = _fill(free, np_, bb + in_place_act, w_forced)
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
        w_h, ok_w = _fill(free, np_, bb + in_place_act, w_forced)
        free = free - w_h * (bb + in_place_act)
    in_place = w_h if in_place_act > 0 else 0.0 * w_h
    host = host_base - free
    nvme = (np_ - w_h) * bb + (off - g_h) * FP32_BYTES * ps + (off - m_h) * ADAM_STATE_BYTES * ps
    in_memory = (
        (dev <= budgets[Tier.DEVICE]) & (mandatory <= budgets[Tier.HOST])
        if pool is None
        else dev + mandatory <= pool
    )
    feasible = in_memory & (nvme <= budgets[Tier.NVME]) & ok_w & ok_m
    recomputed, runnable = _recompute(model, hw, job, ov, ckpt, np_, w_h)
    feasible &= runnable

    # resident blocks (and blocks used in place) keep their activations: never recomputed
    flops = float(g * s) * cost.train_flops_per_token(model, s, ckpt, n - recomputed)
    compute = cost.compute_seconds(flops, hw)
    c_pass = compute / ga
    nvme_r, nvme_w = hw.nvme_read_bandwidth, hw.nvme_write_bandwidth
    grads_nvme = (off - g_h) * FP32_BYTES * ps  # read-modify-write per micro-batch
    # what leaves the device per micro-batch: the gradients (one rank: all of them in the
    # compute dtype; data parallel: the rank's reduced fp32 shard)
    grads_d2h = (n * ps + nbs) * REDUCE_BYTES if dp else (n * p + nb) * wb
    links = {
        Link.HOST_TO_DEVICE: cost.link_seconds(
            2.0 * np_ * bb + grads_dev, hw.h2d_bandwidth, hw.h2d_efficiency
        ),
        Link.NVME_TO_HOST: cost.link_seconds(
            2.0 * (np_ - w_h) * bb + grads_nvme, nvme_r, hw.nvme_efficiency
        ),
        Link.HOST_TO_NVME: cost.link_seconds(grads_nvme, nvme_w, hw.nvme_efficiency),
        Link.DEVICE_TO_HOST: cost.link_seconds(
            grads_d2h + grads_dev, hw.d2h_bandwidth, hw.d2h_efficiency
        ),
    }
    net_pass, net_opt = _net_seconds(model, hw, wb)
    exposed_pass = cost.pass_exposed_seconds(
        np.full_like(kf, c_pass), links, net=net_pass if dp else None
    )
    adam = cost.host_adam_seconds(n * ps + nbs + 0.0 * kf, hw)
    # after the step, weights go up: one rank the resident ones; data parallel every
    # updated shard (for the all-gather), and the gathered paged weights come back home
    weights_up = (n * ps + nbs) * wb if dp else ((kw + kf) * p + nb) * wb
    weights_home = np_ * p * wb if dp else 0.0 * kf
    opt_links = {
        Link.NVME_TO_HOST: cost.link_seconds(
            (off - m_h) * ADAM_STATE_BYTES * ps + grads_nvme, nvme_r, hw.nvme_efficiency
        ),
        Link.HOST_TO_NVME: cost.link_seconds(
            (off - m_h) * ADAM_STATE_BYTES * ps + (np_ - w_h) * p * wb,
            nvme_w,
            hw.nvme_efficiency,
        ),
        Link.HOST_TO_DEVICE: cost.link_seconds(
            weights_up + kf * ADAM_STATE_BYTES * ps,
            hw.h2d_bandwidth,
            hw.h2d_efficiency,
        ),
        Link.DEVICE_TO_HOST: cost.link_seconds(
            kf * ADAM_STATE_BYTES * ps + weights_home, hw.d2h_bandwidth, hw.d2h_efficiency
        ),
    }
    bwd = c_pass * cost.backward_fraction(ckpt, recomputed / max(n, 1))
    k, disk = _state_reads(model, hw, job, off - m_h, free, compute - bwd, bwd, shard=ps)
    host = host + np.where(off - m_h > 0, (k - MIN_READ_AHEAD) * ADAM_STATE_BYTES * ps, 0.0)
    disk = disk + cost.link_seconds(grads_nvme, nvme_r, hw.nvme_efficiency)
    disk = disk + cost.link_seconds((np_ - w_h) * p * wb, nvme_w, hw.nvme_efficiency)
    opt_copies = np.maximum(opt_links[Link.HOST_TO_DEVICE], opt_links[Link.DEVICE_TO_HOST])
    pipeline = np.maximum(np.maximum(adam, disk), opt_copies)
    if dp:  # the all-gathers run beside the AdamW, block by block, on the link that
        # carries the last micro-batch's reduce-scatters in the same window
        pipeline = np.maximum(pipeline, net_pass + net_opt)
    opt_exposed = cost.optimizer_exposed_seconds(
        pipeline,
        np.full_like(kf, bwd),
        np.full_like(kf, n + (1.0 if nb > 0 else 0.0)),
        job.grad_clipping,
    )
    total = compute + ga * exposed_pass + opt_exposed
    shared = np.zeros_like(kf)
    if hw.device_type == "cpu":
        # The host work shares the compute's cores on a CPU device: the AdamW updates,
        # the fp32 gradient accumulation and the weights' cast after the step add to it
        # (the bytes of cost.host_grad_bytes_per_param, at memory-copy speed), and so
        # does the CPU time of every byte the step moves to and from NVMe.
        accumulate = cost.link_seconds(
            (n * ps + nbs) * cost.host_grad_bytes_per_param(ga, wb, hold),
            hw.h2d_bandwidth,
            hw.h2d_efficiency,
        )
        nvme_bytes = (
            ga * (2.0 * (np_ - w_h) * bb + 2.0 * grads_nvme)  # page-ins, gradient sums
            + 2.0 * (off - m_h) * ADAM_STATE_BYTES * ps  # optimizer state read and written
            + grads_nvme  # the last sum read for the step
            + (np_ - w_h) * p * wb  # updated weights written home
        )
        shared = adam + accumulate + nvme_bytes * hw.nvme_cpu_seconds_per_byte
        total = total + shared
    out = {
        "feasible": feasible.astype(np.float64),
        "total": total,
        "per_token": total / (g * s),
        "exposed_pass": exposed_pass,
        "optimizer": adam,
        "device": dev,
        "host": host,
        "nvme": nvme,
        "mandatory": mandatory,
        "w_h": w_h,
        "g_h": g_h,
        "m_h": m_h,
        "kf": kf,
        "kw": kw,
        "in_place": in_place,
        "recomputed": recomputed,
        "read_ahead": k,
        "shared": shared,
    }
    for link in LINKS:  # columns named as the PredictedTime fields
        out[LINK_FIELDS[link]] = ga * links[link] + opt_links.get(link, 0.0)
    out["compute"] = np.full_like(kf, compute)
    out["net"] = np.full_like(kf, ga * net_pass + net_opt)
    return out


def _net_seconds(model: ModelProfile, hw: HardwareProfile, wb: int) -> tuple[float, float]:
    """(seconds per micro-batch, seconds per step) of one rank's ring collectives.

    Per micro-batch each block's trained gradients, packed into one padded buffer of
    ``N * ceil(block_train / N)`` elements of :data:`REDUCE_BYTES`, are reduce-scattered,
    and so are the trained parameters outside the blocks (one more buffer); per step the
    updated shards in the compute dtype (``wb`` bytes) are all-gathered, one buffer each.
    Each collective is :func:`cost.ring_seconds` over ``hw.network_bandwidth`` and
    ``hw.collective_latency``; (0, 0) for one rank.
    """
    n_ranks = hw.world_size
    if n_ranks == 1:
        return 0.0, 0.0
    bw, lat = hw.network_bandwidth, hw.collective_latency
    units = [(model.num_blocks, model.block_train), (1, model.rest_train)]
    reduce = gather = 0.0
    for count, numel in units:
        if numel == 0:
            continue
        padded = float(n_ranks * cost.shard_numel(numel, n_ranks))
        reduce += count * cost.ring_seconds(padded * REDUCE_BYTES, n_ranks, bw, lat)
        gather += count * cost.ring_seconds(padded * wb, n_ranks, bw, lat)
    return reduce, gather


def _recompute(
    model: ModelProfile,
    hw: HardwareProfile,
    job: FitJob,
    ov: PlanOverrides,
    ckpt: bool,
    paged: Arr,
    paged_host: Arr,
) -> tuple[Arr, npt.NDArray[np.bool_]]:
    """(blocks recomputed in backward, whether the engine runs the candidate).

    The engine recomputes every block whose weights it pages in by copy (all paged
    blocks; on a CPU device not the HOST-home ones, used in place), and no other unless
    every block is used in place and checkpointing is forced on
    (``Placement.recompute_resident``: then all are). So checkpointing off runs only
    where nothing is copied, and on (unless forced) only where something is.
    """
    copied = paged - (paged_host if hw.device_type == "cpu" else 0.0)
    if not ckpt:
        return np.zeros_like(paged), copied == 0
    forced = (ov.checkpointing if ov.checkpointing is not None else job.checkpointing) is True
    recomputed = np.where(copied > 0, copied, float(model.num_blocks))
    return recomputed, (copied > 0) | forced


def _state_reads(
    model: ModelProfile,
    hw: HardwareProfile,
    job: FitJob,
    blocks: Arr,
    free: Arr,
    ahead_s: Arr,
    backward_s: Arr,
    shard: float | None = None,
) -> tuple[Arr, Arr]:
    """Read-ahead sets for ``blocks`` blocks whose optimizer state is on NVMe, and the
    seconds from the start of the last backward until the disk has served the state
    traffic the optimizer step waits for.

    One disk serves the state's reads and write-backs (interleaved, at
    :data:`MIXED_IO_EFFICIENCY` of their serial rate). A block's state
    (:data:`ADAM_STATE_BYTES` per parameter) is read into a free read-ahead set before
    its step and written back from it after, freeing the set. In an overlapped step the
    reads start with the accumulation window: ``k`` sets are read in the ``ahead_s``
    seconds before its last backward (what does not fit spills over). The last backward
    (``backward_s``) hands the blocks' gradients over one by one; from the first, each
    other block needs one set's write plus its own read. ``k`` is the fewest sets for
    which all that fits the backward (more sets never cost time, only host memory), at
    least :data:`MIN_READ_AHEAD`, at most ``blocks`` or what the host memory ``free``
    has left. With clipping the step starts after backward: every read and the writes
    that free sets are waited on. ``shard``: the block's parameters whose state one rank
    holds (data parallel; None: all of them).
    """
    state = ADAM_STATE_BYTES * float(model.block_train if shard is None else shard)
    eff = hw.nvme_efficiency * MIXED_IO_EFFICIENCY
    read = cost.link_seconds(state, hw.nvme_read_bandwidth, eff)
    write = cost.link_seconds(state, hw.nvme_write_bandwidth, eff)
    room = np.floor(np.maximum(free, 0.0) / max(state, 1.0))
    cap = np.maximum(MIN_READ_AHEAD, np.minimum(room, blocks))
    lead = backward_s / np.maximum(blocks, 1.0)  # until the first gradient is in

    def seconds(k: Arr) -> Arr:
        rest = np.maximum(blocks - k, 0.0)
        if job.grad_clipping:
            return blocks * read + rest * write
        spill = np.maximum(np.minimum(k, blocks) * read - ahead_s, 0.0)
        return spill + np.where(rest > 0, lead, 0.0) + rest * (read + write)

    k = cap.copy()
    chosen = np.zeros_like(k, dtype=bool)
    for sets in range(MIN_READ_AHEAD, int(np.max(cap, initial=0.0)) + 1):
        trial = np.full_like(k, float(sets))
        fits = ~chosen & (trial <= cap) & (seconds(trial) <= backward_s)
        k = np.where(fits, trial, k)
        chosen |= fits
    return k, np.where(blocks > 0, seconds(k), 0.0)


def _options(job: FitJob, ov: PlanOverrides) -> tuple[list[bool], list[int], list[int]]:
    ckpt = ov.checkpointing if ov.checkpointing is not None else job.checkpointing
    ckpts = [True, False] if ckpt is None else [ckpt]
    depths = [ov.prefetch_depth] if ov.prefetch_depth else [1, 2]
    g = job.seqs_per_step
    if ov.micro_batch:
        mbs = [ov.micro_batch]
    elif ov.grad_accum:
        mbs = [math.ceil(g / ov.grad_accum)]
    else:
        mbs = ladder(g)
    return ckpts, depths, mbs


def _shapes(
    hw: HardwareProfile, job: FitJob, ov: PlanOverrides, mbs: list[int]
) -> list[tuple[int, bool]]:
    """(micro-batch, hold) pairs to price: gradients are held (``Placement.hold_grads``)
    only when ``ov.hold_grads`` asks and where the engine honours it, a CPU device of one
    rank, with several micro-batches per step; either way there, as memory decides."""
    holds = ov.hold_grads and hw.device_type == "cpu" and hw.world_size == 1
    return [
        (mb, hold)
        for mb in mbs
        for hold in ((True, False) if holds and math.ceil(job.seqs_per_step / mb) > 1 else (False,))
    ]


def search(
    model: ModelProfile,
    hw: HardwareProfile,
    job: FitJob,
    ov: PlanOverrides,
    budgets: Mapping[Tier, int],
) -> Priced | None:
    """The fastest feasible candidate per token, or ``None`` when none fits."""
    kf, kw = states(model.num_blocks, ov)
    if kf.size == 0:
        return None
    found: list[tuple[float, float, float, float, Priced]] = []
    ckpts, depths, mbs = _options(job, ov)
    fills = (False, True) if hw.device_type == "cpu" else (False,)
    for ckpt, depth, (mb, hold), first in itertools.product(
        ckpts, depths, _shapes(hw, job, ov, mbs), fills
    ):
        a = price(model, hw, job, ov, budgets, ckpt, depth, mb, kf, kw, hold, first)
        traffic = a["h2d"] + a["nvme_read"] + a["nvme_write"] + a["d2h"]
        for i in np.flatnonzero(a["feasible"] > 0):
            vals = {k: float(v[i]) for k, v in a.items()}
            found.append(
                (
                    vals["per_token"],
                    float(traffic[i]),
                    float(mb),
                    vals["device"],
                    Priced(checkpointing=ckpt, depth=depth, micro_batch=mb, values=vals, hold=hold),
                )
            )
    if not found:
        return None
    fastest = min(c[0] for c in found)
    # Candidates within TIE_TOLERANCE of the fastest are equally fast for this cost model:
    # take the one that moves the least (then the smaller micro-batch, less device memory).
    ties = [c for c in found if c[0] <= fastest * (1.0 + TIE_TOLERANCE)]
    return min(ties, key=lambda c: c[1:4])[4]


def diagnose(
    model: ModelProfile,
    hw: HardwareProfile,
    job: FitJob,
    ov: PlanOverrides,
    budgets: Mapping[Tier, int],
) -> str:
    """Why nothing fits: the shortfall per tier and the smallest change that fits."""
    ckpts, depths, mbs = _options(job, ov)
    ckpt, depth, mb = ckpts[0], depths[0], mbs[0]
    kf, kw = states(model.num_blocks, ov)
    if kf.size == 0:
        return f"no block placement satisfies the overrides {ov}: relax them"
    a = price(model, hw, job, ov, budgets, ckpt, depth, mb, kf[:1], kw[:1])
    relaxed = dataclasses.replace(ov, checkpointing=None)
    if ckpts == [False] and search(
        model, hw, dataclasses.replace(job, checkpointing=None), relaxed, budgets
    ):
        return (
            "checkpointing off needs every block used in place (resident on the device, or "
            "homed on the host of a CPU device), but the memory does not hold them: blocks "
            "paged in by copy are always recomputed; allow checkpointing (checkpointing=None)"
        )
    dev, mand, nvme = float(a["device"][0]), float(a["mandatory"][0]), float(a["nvme"][0])
    dev_b, host_b, nvme_b = budgets[Tier.DEVICE], budgets[Tier.HOST], budgets[Tier.NVME]
    pool = cost.pooled_budget(hw, budgets)
    if pool is not None:  # a CPU device: what the pool leaves beside the host's staging
        dev_b, host_b = max(0, int(pool - mand)), max(0, int(pool - dev))
    fmt = format_bytes
    if dev > dev_b:
        fits = [
            s
            for s in (2**k for k in range(4, 20))
            if s < job.seq_len
            and float(
                price(
                    model,
                    hw,
                    FitJob(seq_len=s, global_batch_seqs=1),
                    ov,
                    budgets,
                    ckpt,
                    depth,
                    1,
                    kf[:1],
                    kw[:1],
                )["device"][0]
            )
            <= dev_b
        ]
        fix = (
            f"use a shorter sequence (<= {fits[-1]} fits)"
            if fits
            else f"use a device with >= {fmt((dev + cost.GIB) / 0.9)} of memory"
        )
        return (
            f"even micro-batch {mb} at seq {job.seq_len} needs {fmt(dev)} on the device "
            f"(activations {fmt(cost.activation_bytes(model, mb, job.seq_len, ckpt))}, logits, "
            f"paging slots, embedding and head) but the device budget is {fmt(dev_b)} "
            + (
                f"({fmt(hw.device_memory)} less a 10% + 1 GiB margin): {fix}"
                if pool is None
                else f"(the RAM pool of the CPU device and host, {fmt(pool)}, less "
                f"{fmt(mand)} of host staging): {fix}"
            )
        )
    if mand > host_b:
        return (
            f"needs {fmt(mand)} of host memory for pinned staging and the embedding/head "
            f"optimizer state, have {fmt(host_b)} ({fmt(hw.host_memory)} less 5%): raise host "
            f"memory to >= {fmt(mand / 0.95)}"
        )
    need = float(a["host"][0]) - 0.0 + nvme
    off_dev = need if nvme > nvme_b else 0.0
    nvme_desc = f"{fmt(nvme_b)} NVMe" if nvme_b else "no NVMe path"
    if off_dev:
        return (
            f"needs {fmt(need)} of host+NVMe for weights, gradients and optimizer state "
            f"({model.total_params / 1e9:.2f} B params), have {fmt(host_b)} host and {nvme_desc}: "
            f"add an NVMe path with >= {fmt(nvme / 0.95)} (--nvme-capacity) or more host memory "
            f"(>= {fmt(need / 0.95)})"
        )
    return (
        f"no placement satisfies the overrides {ov}: device needs {fmt(dev)} of {fmt(dev_b)}, "
        f"host {fmt(float(a['host'][0]))} of {fmt(host_b)}, NVMe {fmt(nvme)} of {fmt(nvme_b)}: "
        "relax the overrides"
    )


def build_plan(
    model: ModelProfile,
    hw: HardwareProfile,
    job: FitJob,
    overrides: PlanOverrides | None,
    best: Priced,
    budgets: Mapping[Tier, int],
) -> Plan:
    """Turn the chosen candidate into a :class:`Plan` with reasons."""
    v, n = best.values, model.num_blocks
    wb = model.block_params * job.compute_bytes  # bytes of one block's weights
    kf, kw = int(v["kf"]), int(v["kw"])
    w_h, g_h, m_h = int(v["w_h"]), int(v["g_h"]), int(v["m_h"])
    ga = math.ceil(job.seqs_per_step / best.micro_batch)
    tokens_pass = best.micro_batch * job.seq_len
    exposed = v["total"] - v["compute"]
    pred = PredictedTime(
        compute=v["compute"],
        nvme_read=v["nvme_read"],
        nvme_write=v["nvme_write"],
        h2d=v["h2d"],
        d2h=v["d2h"],
        optimizer=v["optimizer"],
        exposed=max(0.0, exposed),
        total=v["total"],
        net=v["net"],
    )
    limited = cost.limited_by(
        v["exposed_pass"], v["compute"], best.micro_batch >= job.seqs_per_step
    )
    tok_s = job.tokens_per_step / v["total"]
    paged = n - kf - kw
    in_place = int(v.get("in_place", 0.0))
    recomputed = int(v["recomputed"])
    fpt = cost.train_flops_per_token(model, job.seq_len, best.checkpointing, float(n - recomputed))
    bw = cost.effective_bandwidths(hw)
    roof = Roofline(
        flops_per_token=fpt,
        device_flops=hw.device_flops * hw.compute_efficiency,
        bytes_per_pass={
            Link.HOST_TO_DEVICE: 2.0 * paged * wb,
            Link.NVME_TO_HOST: 2.0 * (paged - w_h) * wb,
            Link.DEVICE_TO_HOST: float(n * model.block_train * job.compute_bytes),
        },
        bandwidth={k: b for k, b in bw.items() if b > 0},
    )
    hide = cost.hide_tokens_per_pass(  # FLOPs of the active weights against all bytes (MoE)
        (8.0 if best.checkpointing else 6.0) * model.active_fraction,
        4.0,
        roof.device_flops,
        bw[Link.HOST_TO_DEVICE],
    )
    reasons = [
        f"a paged weight pass hides behind compute from about {hide:,.0f} tokens per pass "
        f"(device {roof.device_flops / 1e12:.3g} TFLOP/s over H2D {bw[Link.HOST_TO_DEVICE] / 1e9:.3g} GB/s); "
        f"chosen {best.micro_batch} x {job.seq_len} = {tokens_pass:,} tokens, "
        f"{ga} accumulation step(s) make the "
        + ("global batch" if hw.world_size == 1 else "rank's share of the global batch")
        + f" (limited by {limited})",
        f"checkpointing {'on' if best.checkpointing else 'off'}: activations take "
        f"{format_bytes(cost.activation_bytes(model, best.micro_batch, job.seq_len, best.checkpointing))}"
        f" per micro-batch; "
        + (
            f"{recomputed} of {n} blocks recomputed in backward (a quarter more FLOPs each)"
            if best.checkpointing
            else "no block is paged in by copy, none is recomputed"
        ),
        f"{kf + kw} of {n} blocks resident with leftover device memory ({kf} with gradients and "
        f"optimizer on the device); each resident block saves "
        f"{format_bytes(2 * wb * ga)} of H2D per step",
        f"host holds {w_h} paged blocks' weights, {g_h} gradient accumulators and {m_h} "
        f"optimizer states by benefit per byte; the rest goes to NVMe",
        f"host AdamW {v['optimizer']:.3g} s per step runs block by block during backward"
        + (" (exposed: gradient clipping waits for every gradient)" if job.grad_clipping else ""),
    ]
    if n - kf - m_h > 0:
        k = int(v["read_ahead"])
        reasons.append(
            f"optimizer state of {n - kf - m_h} blocks on NVMe is read ahead of each block's "
            f"step through {k} host buffer sets "
            f"({format_bytes(k * ADAM_STATE_BYTES * cost.shard_numel(model.block_train, hw.world_size))}), sized so that its "
            "reads and write-backs fit the last backward where the host budget allows"
        )
    if not model.full_fine_tune:
        reasons.append(
            f"{model.trainable_params:,} of {model.total_params:,} parameters train "
            f"({100.0 * model.trainable_params / max(model.total_params, 1):.2g}%): gradients, "
            "optimizer state and write-back only for them; the frozen weights are paged "
            "read-only in forward and backward"
        )
    if hw.device_type == "cpu":
        reasons.append(
            f"CPU device: device and host tiers share RAM, planned as one pool of "
            f"{format_bytes(cost.pooled_budget(hw, budgets) or 0)} "
            f"({format_bytes(v['device'])} device + {format_bytes(v['host'])} host used)"
            + (
                f"; the {in_place} host-home blocks run in place, keeping their activations "
                "on the host instead of recomputing them"
                if in_place
                else ""
            )
            + f"; host AdamW, gradient accumulation and NVMe transfers take the same cores: "
            f"+{v.get('shared', 0.0):.3g} s per step"
            + (
                f"; the gradients of the first {ga - 1} micro-batches are held "
                f"({format_bytes(cost.held_grad_bytes(ga, wb, n * model.block_train + model.rest_train))}) "
                "and summed once, in the last backward"
                if best.hold
                else ""
            )
        )
    copied = paged - (w_h if hw.device_type == "cpu" else 0)
    flops = cost.model_flops_per_token(model, "fit", job.seq_len) * tok_s
    return Plan(
        task="fit",
        job=job,
        model=model,
        hardware=hw,
        overrides=overrides,
        micro_batch=best.micro_batch,
        grad_accum=ga,
        concurrent_seqs=0,
        tokens_per_pass=tokens_pass,
        placement=_priced_recompute(
            hw,
            Placement(
                weights=placement_tiers(n, kf + kw, w_h),
                master=placement_tiers(n, kf, m_h),
                grads=placement_tiers(n, kf, g_h),
                prefetch_depth=best.depth,
                # checkpointing where no block is copied in: the in-place blocks are recomputed
                recompute_resident=best.checkpointing and copied == 0,
                read_ahead=int(v["read_ahead"]),
                hold_grads=best.hold,
                compute_dtype=job.compute_dtype,
            ),
        ),
        memory=tier_memory(hw, budgets, v),
        predicted=pred,
        tokens_per_s=tok_s,
        mfu=cost.flops_utilisation(flops, hw)[0],
        model_flops=flops,
        limited_by=limited,
        roofline=roof,
        reasons=tuple(reasons),
    )


def tier_memory(
    hw: HardwareProfile, budgets: Mapping[Tier, int], v: dict[str, Any]
) -> tuple[TierMemory, ...]:
    """Use (bytes) and budget per tier; on a CPU device each memory tier's budget is what
    the shared pool leaves it beside the other's use (:func:`cost.pooled_budget`), and its
    capacity the RAM both share."""
    caps = (hw.device_memory, hw.host_memory, hw.nvme_capacity)
    used = (v["device"], v["host"], v["nvme"])
    limits = dict(budgets)
    pool = cost.pooled_budget(hw, budgets)
    if pool is not None:  # either memory tier may grow to the whole RAM share
        limits[Tier.DEVICE] = max(0, int(pool - v["host"]))
        limits[Tier.HOST] = max(0, int(pool - v["device"]))
        ram = hw.device_memory + hw.host_memory
        caps = (ram, ram, hw.nvme_capacity)
    return tuple(
        TierMemory(tier=t, used=int(u), budget=limits[t], capacity=c)
        for t, u, c in zip((Tier.DEVICE, Tier.HOST, Tier.NVME), used, caps, strict=True)
    )


def _priced_recompute(hw: HardwareProfile, placement: Placement) -> Placement:
    """``placement`` with the blocks it recomputes on ``hw``'s device written out
    (``Placement.recomputed``): the blocks paged in by copy there (HOST homes are used in
    place only on a CPU device), so that an engine on another device runs what was priced."""
    in_place = frozenset((Tier.DEVICE, Tier.HOST) if hw.device_type == "cpu" else (Tier.DEVICE,))
    return dataclasses.replace(placement, recomputed=placement.recomputed_blocks(in_place))
