"""Pricing of fine-tuning candidates: bytes per tier and seconds per step (used by
:mod:`~bb_lightning.planner.fit_search`).

One batch shape (checkpointing, prefetch depth, micro-batch, held gradients) is priced
for many (kF, kW) placements at once with numpy arrays: ``kF`` blocks fully on the
device (weights, fp32 gradients, master and moments), ``kW`` with resident weights whose
gradients and optimizer state live off the device, the rest paged. Off-device state is
placed on the host by benefit per byte of NVMe traffic saved per step (paged weights
``4 GA + 2`` bytes per 2, gradient accumulators ``8 GA`` per 4, optimizer state 24 per
12), the rest on NVMe.

Weights are priced for every parameter (``block_params``: each pass pages them all,
frozen ones included); gradients, master weights, moments, the host AdamW and the weight
write-back only for the trained ones (``ModelProfile.block_train`` and ``rest_train``:
LoRA adapters over frozen base weights train a small share); frozen matrices skip their
weight gradients (:func:`cost.train_flops_per_token`).

The steps, each a pure function: :func:`~bb_lightning.planner.fit_memory.fit_sizes`
(the shape's scalars), :func:`~bb_lightning.planner.fit_memory.fit_memory` (bytes per
tier, the host's fill order), :func:`_recompute` (the blocks recomputed),
:func:`_pass_link_seconds`
and :func:`_optimizer_link_seconds` (busy seconds per link), :func:`_optimizer_times`
(the optimizer pipeline and what of it is exposed), :func:`_shared_core_seconds` (a CPU
device's host work) and :func:`price`, which adds them up into a :class:`FitPrice`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Generic, TypeVar

import numpy as np
import numpy.typing as npt

from bb_lightning.placement import READ_AHEAD
from bb_lightning.planner import chunks, cost
from bb_lightning.planner.cost import ADAM_STATE_BYTES, FP32_BYTES
from bb_lightning.planner.data_parallel import REDUCE_BYTES, collective_seconds
from bb_lightning.planner.fit_memory import FitMemory, FitSizes, fit_memory, fit_sizes
from bb_lightning.planner.fit_work import PassWork, pass_work
from bb_lightning.planner.job import FitJob
from bb_lightning.planner.plan import PlanOverrides
from bb_lightning.planner.profile import HardwareProfile, ModelProfile
from storage.tiers import Link, Tier

Arr = npt.NDArray[np.float64]
V = TypeVar("V", Arr, float)

MIN_READ_AHEAD = READ_AHEAD
"""Read-ahead sets every placement with optimizer state off the host has (counted in
the host budget by the manifest with the scratch sets); the planner adds more."""
MIXED_IO_EFFICIENCY = 0.7
"""Share of the serial read + write rate one disk keeps when optimizer-state reads and
write-backs interleave on it (both in flight at once, as in the overlapped step)."""


@dataclass(frozen=True, kw_only=True)
class FitPrice(Generic[V]):
    """Bytes and seconds of fine-tuning candidates: numpy arrays over the candidates of
    one batch shape (``FitPrice[Arr]``, from :func:`price`), or one candidate's scalars
    (``FitPrice[float]``, from :meth:`at`)."""

    feasible: V
    """1.0 where the candidate fits every tier's budget and the engine runs it, else 0.0."""
    step_seconds: V
    """Predicted seconds per optimizer step."""
    seconds_per_token: V
    """``step_seconds`` over the tokens of a step."""
    exposed_pass_seconds: V
    """Seconds of one micro-batch pass's transfers not hidden behind its compute."""
    compute_seconds: V
    """Device compute, seconds per step (forward, backward and recompute)."""
    optimizer_seconds: V
    """Host AdamW arithmetic, seconds per step."""
    optimizer_exposed_seconds: V
    """Seconds per step of the optimizer pipeline not hidden behind the last backward (or,
    norm-clipped on one rank, the next forward)."""
    shared_core_seconds: V
    """Seconds per step the host work adds to the compute on a CPU device (0 elsewhere)."""
    nvme_read_seconds: V
    """NVMe-to-host link busy seconds per step."""
    nvme_write_seconds: V
    """Host-to-NVMe link busy seconds per step."""
    h2d_seconds: V
    """Host-to-device link busy seconds per step."""
    d2h_seconds: V
    """Device-to-host link busy seconds per step."""
    network_seconds: V
    """One rank's network busy seconds per step (data parallel; 0 for one rank)."""
    device_bytes: V
    """Bytes the device tier holds."""
    host_bytes: V
    """Bytes the host tier holds (staging, host homes, read-ahead sets)."""
    nvme_bytes: V
    """Bytes the NVMe tier holds."""
    mandatory_host_bytes: V
    """Host bytes every placement of the shape needs (pinned staging, the state outside
    the blocks)."""
    full_blocks: V
    """Blocks fully on the device (``kF``): weights, gradients, master and moments."""
    resident_weight_blocks: V
    """Blocks with only their weights resident on the device (``kW``)."""
    host_weight_blocks: V
    """Paged blocks whose weights home on the host (the rest on NVMe)."""
    host_grad_blocks: V
    """Off-device blocks whose gradient accumulators are on the host (the rest on NVMe)."""
    host_state_blocks: V
    """Off-device blocks whose master weights and moments are on the host (the rest on
    NVMe)."""
    in_place_blocks: V
    """Host-home blocks a CPU device uses in place (keeping their activations)."""
    recomputed_blocks: V
    """Blocks recomputed in backward."""
    read_ahead_sets: V
    """Host buffer sets the optimizer state on NVMe is read ahead into."""
    swapped_blocks: V = 0.0  # type: ignore[assignment]
    """Of the blocks that would be recomputed, those whose saved activations are kept on
    the host instead (``PlanOverrides.swap_activations``; priced only)."""
    launch_seconds: V = 0.0  # type: ignore[assignment]
    """Seconds per step the chunks' extra kernel launches add to the compute."""

    def at(self: FitPrice[Arr], i: int) -> FitPrice[float]:
        """The scalars of candidate ``i``."""
        values = {f.name: float(getattr(self, f.name)[i]) for f in dataclasses.fields(self)}
        return FitPrice(**values)

    @property
    def traffic_seconds(self) -> V:
        """Busy seconds per step of the four copy links together."""
        return (
            self.h2d_seconds + self.nvme_read_seconds + self.nvme_write_seconds + self.d2h_seconds
        )


def _nvme_grad_bytes(sz: FitSizes, mem: FitMemory) -> Arr:
    """Bytes of the gradient sums on NVMe read, and as many written, per micro-batch on
    average: ``(GA - 1) / GA`` of the sums. The first micro-batch writes its sum without
    reading one, the last reads the sum and keeps the total in a scratch buffer the step
    takes it from (``FlatState.accumulate(persist=False)``): ``GA - 1`` reads and writes
    per step, none with one micro-batch."""
    share = (sz.grad_accum - 1) / max(sz.grad_accum, 1)
    return mem.nvme_grad_blocks * FP32_BYTES * sz.block_shard_params * share


def _device_grad_bytes(sz: FitSizes, mem: FitMemory) -> Arr:
    """Bytes of the kF blocks' gradient sums (homed on the device) read and written per
    micro-batch when several are summed."""
    kf = mem.full_blocks
    return kf * FP32_BYTES * sz.block_shard_params if sz.grad_accum > 1 else 0.0 * kf


def _pass_link_seconds(
    hw: HardwareProfile, sz: FitSizes, mem: FitMemory, boundaries: Mapping[Link, Arr]
) -> dict[Link, Arr]:
    """Busy seconds per link of one micro-batch pass (forward and backward); ``boundaries``:
    the bytes the boundary inputs move on each link (:func:`chunks.boundary_link_bytes`)."""
    n, p, wb, bb = sz.blocks, sz.block_train_params, sz.element_bytes, sz.block_home_bytes
    ps, nbs = sz.block_shard_params, sz.rest_shard_params
    grads_dev, grads_nvme = _device_grad_bytes(sz, mem), _nvme_grad_bytes(sz, mem)
    # what leaves the device per micro-batch: the gradients (one rank: all of them in the
    # compute dtype; data parallel: the rank's reduced fp32 shard)
    if sz.data_parallel:
        grads_d2h = (n * ps + nbs) * REDUCE_BYTES
    else:
        grads_d2h = (n * p + sz.rest_train_params) * wb
    nvme_r, paged = hw.nvme_read_bandwidth, mem.paged_blocks
    return {
        Link.HOST_TO_DEVICE: cost.link_seconds(
            2.0 * paged * bb + grads_dev + boundaries[Link.HOST_TO_DEVICE],
            hw.h2d_bandwidth,
            hw.h2d_efficiency,
        ),
        Link.NVME_TO_HOST: cost.link_seconds(
            2.0 * mem.nvme_weight_blocks * bb + grads_nvme + boundaries[Link.NVME_TO_HOST],
            nvme_r,
            hw.nvme_efficiency,
        ),
        Link.HOST_TO_NVME: cost.link_seconds(
            grads_nvme + boundaries[Link.HOST_TO_NVME], hw.nvme_write_bandwidth, hw.nvme_efficiency
        ),
        Link.DEVICE_TO_HOST: cost.link_seconds(
            grads_d2h + grads_dev + boundaries[Link.DEVICE_TO_HOST],
            hw.d2h_bandwidth,
            hw.d2h_efficiency,
        ),
    }


def _optimizer_link_seconds(hw: HardwareProfile, sz: FitSizes, mem: FitMemory) -> dict[Link, Arr]:
    """Busy seconds per link of the optimizer step.

    The engine steps every block with host AdamW, the kF blocks too: their fp32 state
    comes off the device and goes back each step (12 + 12 bytes per parameter). After
    the step the resident weights go up (data parallel: the rank's updated shards, gathered
    at their next use; a paged block's shard stays home until its next page-in) and the
    paged blocks' updated weights homed on NVMe go there.
    """
    wb = sz.element_bytes
    ps, nbs, kf = sz.block_shard_params, sz.rest_shard_params, mem.full_blocks
    nvme_r, nvme_w = hw.nvme_read_bandwidth, hw.nvme_write_bandwidth
    state_nvme = mem.nvme_state_blocks * ADAM_STATE_BYTES * ps
    weights_up = ((mem.resident_weight_blocks + kf) * ps + nbs) * wb
    return {
        Link.NVME_TO_HOST: cost.link_seconds(state_nvme, nvme_r, hw.nvme_efficiency),
        Link.HOST_TO_NVME: cost.link_seconds(
            state_nvme + mem.nvme_weight_blocks * ps * wb, nvme_w, hw.nvme_efficiency
        ),
        Link.HOST_TO_DEVICE: cost.link_seconds(
            weights_up + kf * ADAM_STATE_BYTES * ps, hw.h2d_bandwidth, hw.h2d_efficiency
        ),
        Link.DEVICE_TO_HOST: cost.link_seconds(
            kf * ADAM_STATE_BYTES * ps, hw.d2h_bandwidth, hw.d2h_efficiency
        ),
    }


@dataclass(frozen=True, kw_only=True)
class FitOptimizerTimes:
    """The optimizer step of every candidate: arrays over the candidates."""

    adam_seconds: Arr
    """Host AdamW arithmetic, seconds per step."""
    exposed_seconds: Arr
    """Seconds of the optimizer pipeline not hidden behind the last backward (or, norm-
    clipped on one rank, the next forward: :func:`cost.deferred_optimizer_exposed_seconds`)."""
    read_ahead_sets: Arr
    """Host buffer sets the optimizer state on NVMe is read ahead into."""
    read_ahead_bytes: Arr
    """Host bytes of the read-ahead sets beyond :data:`MIN_READ_AHEAD`."""


def _optimizer_times(
    model: ModelProfile,
    hw: HardwareProfile,
    job: FitJob,
    sz: FitSizes,
    mem: FitMemory,
    opt_links: Mapping[Link, Arr],
    compute: Arr,
    passes: tuple[Arr, Arr],
    network: Arr,
) -> FitOptimizerTimes:
    """The optimizer pipeline (host AdamW, the state's disk traffic, the copies and, data
    parallel, the all-gather of the parameters outside the blocks: each block's step runs
    beside the others') against the last backward, or, norm-clipped on one rank, the next forward
    (``passes``: the (forward, backward) seconds of one micro-batch of the ``compute``
    seconds per step).

    ``network``: the seconds of the step's all-gather on the devices.
    """
    n, ps, kf = sz.blocks, sz.block_shard_params, mem.full_blocks
    forward, backward = passes
    nvme_state = mem.nvme_state_blocks
    adam = cost.host_adam_seconds(n * ps + sz.rest_shard_params + 0.0 * kf, hw)
    deferred = _deferred_step(job, sz)
    # the free host bytes beside the read-ahead sets (of one state piece each) the memory
    # step reserved
    piece = cost.state_piece_numel(ps)
    least = MIN_READ_AHEAD * ADAM_STATE_BYTES * piece
    free = mem.free_host_bytes + np.maximum(mem.read_ahead_bytes, least)
    # a deferred step reads the state after backward, in the next forward's window
    window = forward if deferred else backward
    reserved = np.floor(mem.read_ahead_bytes / (ADAM_STATE_BYTES * piece))  # sets registered
    k, disk = _state_reads(
        model, hw, job, nvme_state, free, compute - backward, window, shard=ps, least=reserved
    )
    beyond = np.maximum(k * ADAM_STATE_BYTES * piece - mem.read_ahead_bytes, 0.0)
    extra = np.where(nvme_state > 0, beyond, 0.0)
    eff = hw.nvme_efficiency
    written = mem.nvme_weight_blocks * ps * sz.element_bytes
    disk = disk + cost.link_seconds(written, hw.nvme_write_bandwidth, eff)
    opt_copies = np.maximum(opt_links[Link.HOST_TO_DEVICE], opt_links[Link.DEVICE_TO_HOST])
    pipeline = np.maximum(np.maximum(adam, disk), opt_copies)
    if sz.data_parallel:  # the outside parameters' all-gather runs beside the AdamW
        pipeline = np.maximum(pipeline, network)
    if deferred:  # the outside parameters step and go up first, then the blocks
        adam_rest = cost.host_adam_seconds(sz.rest_shard_params + 0.0 * kf, hw)
        rest_up = cost.link_seconds(
            sz.rest_train_params * sz.element_bytes, hw.h2d_bandwidth, hw.h2d_efficiency
        )
        blocks_copies = np.maximum(
            opt_links[Link.HOST_TO_DEVICE] - rest_up, opt_links[Link.DEVICE_TO_HOST]
        )
        exposed = cost.deferred_optimizer_exposed_seconds(
            adam_rest + rest_up,
            np.maximum(np.maximum(adam - adam_rest, disk), blocks_copies),
            np.full_like(kf, forward),
            np.full_like(kf, float(n)),
        )
    else:
        exposed = cost.optimizer_exposed_seconds(
            pipeline,
            np.full_like(kf, backward),
            np.full_like(kf, n + (1.0 if sz.rest_train_params > 0 else 0.0)),
            job.grad_clipping,
        )
    return FitOptimizerTimes(
        adam_seconds=adam, exposed_seconds=exposed, read_ahead_sets=k, read_ahead_bytes=extra
    )


def _deferred_step(job: FitJob, sz: FitSizes) -> bool:
    """Whether the engine steps the blocks after backward beside the next forward: global-
    norm clipping on one rank (value clipping, and clipping under data parallelism, step
    after backward, exposed; no clipping steps each block during backward)."""
    return job.grad_clipping and job.grad_clip_algorithm == "norm" and not sz.data_parallel


def _shared_core_seconds(
    hw: HardwareProfile, sz: FitSizes, mem: FitMemory, adam: Arr, hold: bool
) -> Arr:
    """Seconds per step a CPU device's compute loses to host work on its cores.

    The AdamW updates, the fp32 gradient accumulation and the weights' cast after the
    step (the bytes of :func:`cost.host_grad_bytes_per_param`, at memory-copy speed), and
    the CPU time of every byte the step moves to and from NVMe
    (``hw.nvme_cpu_seconds_per_byte``).
    """
    n, ga, wb = sz.blocks, sz.grad_accum, sz.element_bytes
    ps, nbs = sz.block_shard_params, sz.rest_shard_params
    accumulate = cost.link_seconds(
        (n * ps + nbs) * cost.host_grad_bytes_per_param(ga, wb, hold),
        hw.h2d_bandwidth,
        hw.h2d_efficiency,
    )
    grads_nvme = _nvme_grad_bytes(sz, mem)
    nvme_weights = mem.nvme_weight_blocks
    nvme_bytes = (
        ga * (2.0 * nvme_weights * sz.block_home_bytes + 2.0 * grads_nvme)  # page-ins, sums
        + 2.0 * mem.nvme_state_blocks * ADAM_STATE_BYTES * ps  # state read and written
        + nvme_weights * ps * wb  # updated weights written home
    )
    return adam + accumulate + nvme_bytes * hw.nvme_cpu_seconds_per_byte


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
    chunk_rows: int | None = None,
    boundaries: Tier | None = None,
) -> FitPrice[Arr]:
    """Bytes per tier and seconds per step of every (kF, kW) for one batch shape.

    ``chunk_rows`` and ``boundaries`` price ``Placement.chunk_rows`` and ``boundaries``
    (:mod:`~bb_lightning.planner.chunks`; a candidate with nothing recomputed runs none).
    With ``ov.swap_activations`` each candidate is priced with its blocks recomputing and
    with some swapping (:func:`~bb_lightning.planner.fit_work.pass_work`): the faster kept.

    ``hold`` prices ``Placement.hold_grads``: the earlier micro-batches' gradients take
    device memory (:func:`cost.held_grad_bytes`) and are summed once.

    The host's free memory goes to the paged blocks' weights first, then to gradient
    accumulators, then to optimizer state; ``state_first`` fills it the other way round
    (gradients, state, then weights). On a CPU device a host-home block also keeps its
    activations there, so one more such block may displace more state than it saves:
    the search prices both orders there, which keeps a bigger memory from ever
    predicting a slower step.

    With data parallelism (``hw.world_size`` N > 1) this prices one rank: ``hw`` is its
    :func:`~bb_lightning.planner.data_parallel.rank_share` and ``job`` its share of the
    batch. Paged weights, master weights, moments, gradient accumulators and the host
    AdamW then count the rank's dim-0 shard (``ceil(params / N)`` per block and outside):
    a page-in copies the weight shard and all-gathers the block on the device, the
    gradients are reduce-scattered there and only the reduced fp32 shard leaves it
    (:mod:`~bb_lightning.planner.data_parallel`). ``network_seconds`` is the rank's
    collective busy time per step (:func:`_net_seconds`): each pass's reduce-scatters run
    on their own stream beside its compute, one more link (:func:`cost.pass_exposed_seconds`:
    exposed only where they outlast it); its all-gathers are issued as each block is paged
    in, before its compute, and so are exposed whole; the outside
    parameters' all-gather after the step beside the host AdamW in the optimizer pipeline
    (:func:`cost.optimizer_exposed_seconds`).
    """
    sz = fit_sizes(model, hw, job, mb, chunk_rows, boundaries)
    mem = fit_memory(model, hw, ov, budgets, sz, ckpt, depth, kf, kw, hold, state_first)
    recomputed, runnable = _recompute(
        model, hw, job, ov, ckpt, mem.paged_blocks, mem.host_weight_blocks
    )
    if sz.chunk_rows is not None:  # only recomputed blocks run in chunks
        runnable = runnable & (recomputed > 0)
    bounds = chunks.boundary_link_bytes(model, mb * sz.seq_len, recomputed, sz.boundaries)
    links = _pass_link_seconds(hw, sz, mem, bounds)
    best: FitPrice[Arr] | None = None
    for swap in (False, True) if ov.swap_activations else (False,):
        work = pass_work(model, hw, sz, mem, ckpt, recomputed, links, budgets[Tier.DEVICE], swap)
        priced = _priced_work(model, hw, job, sz, mem, ckpt, hold, work)
        best = priced if best is None else _cheaper(best, priced)
    assert best is not None
    return dataclasses.replace(
        best,
        feasible=(mem.fits & runnable).astype(np.float64),
        full_blocks=kf,
        resident_weight_blocks=kw,
    )


def _cheaper(a: FitPrice[Arr], b: FitPrice[Arr]) -> FitPrice[Arr]:
    """Per candidate, whichever of ``a`` and ``b`` takes fewer seconds per step (``a`` on a tie)."""
    take = b.step_seconds < a.step_seconds
    values = {
        f.name: np.where(take, getattr(b, f.name), getattr(a, f.name))
        for f in dataclasses.fields(a)
    }
    return FitPrice(**values)


def _priced_work(
    model: ModelProfile,
    hw: HardwareProfile,
    job: FitJob,
    sz: FitSizes,
    mem: FitMemory,
    ckpt: bool,
    hold: bool,
    work: PassWork,
) -> FitPrice[Arr]:
    """Seconds per step and bytes per tier of every candidate doing ``work`` per pass (its
    blocks recomputed or swapped; the read-ahead sets in the host memory the swapped
    activations leave; feasibility left to :func:`price`)."""
    n, ga, tokens, kf = sz.blocks, sz.grad_accum, sz.seqs_per_step * sz.seq_len, mem.full_blocks
    recomputed, compute, links = work.recomputed, work.compute, work.links
    c_pass = compute / ga
    gather, reduce, net_opt = _net_seconds(model, hw, sz, mem, recomputed)
    net = reduce if sz.data_parallel else None
    exposed_pass = gather + cost.pass_exposed_seconds(c_pass + 0.0 * kf, links, net=net)
    opt_links = _optimizer_link_seconds(hw, sz, mem)
    bwd = c_pass * cost.backward_fraction(ckpt, recomputed / max(n, 1))
    passes = (c_pass - bwd, bwd)
    left = dataclasses.replace(mem, free_host_bytes=mem.free_host_bytes - work.swap_host_bytes)
    opt = _optimizer_times(model, hw, job, sz, left, opt_links, compute, passes, net_opt)
    total = compute + ga * exposed_pass + opt.exposed_seconds
    shared = np.zeros_like(kf)
    if hw.device_type == "cpu":  # the host work shares the compute's cores
        shared = _shared_core_seconds(hw, sz, mem, opt.adam_seconds, hold)
        total = total + shared
    busy = {link: ga * links[link] + opt_links.get(link, 0.0) for link in links}
    swapped_bounds = {t: work.boundary_bytes if sz.boundaries is t else 0.0 for t in Tier}
    return FitPrice(
        feasible=np.ones_like(kf),
        step_seconds=total,
        seconds_per_token=total / tokens,
        exposed_pass_seconds=exposed_pass,
        compute_seconds=compute + 0.0 * kf,
        optimizer_seconds=opt.adam_seconds,
        optimizer_exposed_seconds=opt.exposed_seconds,
        shared_core_seconds=shared,
        nvme_read_seconds=busy[Link.NVME_TO_HOST],
        nvme_write_seconds=busy[Link.HOST_TO_NVME],
        h2d_seconds=busy[Link.HOST_TO_DEVICE],
        d2h_seconds=busy[Link.DEVICE_TO_HOST],
        network_seconds=ga * (gather + reduce) + net_opt,
        device_bytes=mem.device_bytes + work.swap_device_bytes,
        host_bytes=mem.host_bytes
        + opt.read_ahead_bytes
        + work.swap_host_bytes
        - swapped_bounds[Tier.HOST],
        nvme_bytes=mem.nvme_bytes - swapped_bounds[Tier.NVME],
        mandatory_host_bytes=mem.mandatory_host_bytes,
        full_blocks=kf,
        resident_weight_blocks=mem.resident_weight_blocks,
        host_weight_blocks=mem.host_weight_blocks,
        host_grad_blocks=mem.host_grad_blocks,
        host_state_blocks=mem.host_state_blocks,
        in_place_blocks=mem.in_place_blocks,
        recomputed_blocks=recomputed,
        read_ahead_sets=opt.read_ahead_sets,
        swapped_blocks=work.swapped,
        launch_seconds=work.launch,
    )


def _net_seconds(
    model: ModelProfile, hw: HardwareProfile, sz: FitSizes, mem: FitMemory, recomputed: Arr
) -> tuple[Arr, Arr, Arr]:
    """(all-gather seconds per micro-batch, reduce-scatter seconds per micro-batch,
    seconds per step) of one rank's collectives on the devices, each :func:`~bb_lightning.planner.data_parallel.collective_seconds` of its
    buffer of N padded shards.

    Per micro-batch: every use of a block all-gathers its weights from the ranks' shards
    (``N * ceil(block_params / N)`` elements of the compute dtype): once in forward, and
    again in backward where the block is ``recomputed`` (every paged block; a resident
    block keeps its assembled weights for its backward); every block's trained gradients
    are reduce-scattered in :data:`REDUCE_BYTES` (``N * ceil(block_train / N)`` elements),
    and so are the trained parameters outside the blocks (one more buffer). Per step: the
    updated shards of the parameters outside the blocks are all-gathered into the
    device's copy, in the compute dtype. (0, 0, 0) for one rank.
    """
    zero = 0.0 * mem.full_blocks
    if not sz.data_parallel:
        return zero, zero, zero
    n_ranks, wb = sz.world_size, sz.element_bytes

    def coll(numel: int, elem: int) -> float:
        padded = n_ranks * cost.shard_numel(numel, n_ranks)
        return collective_seconds(float(padded * elem), hw) if numel else 0.0

    reduce = sz.blocks * coll(model.block_train, REDUCE_BYTES)
    reduce += coll(model.rest_train, REDUCE_BYTES)
    gathers = (sz.blocks + recomputed) * coll(model.block_params, wb) + zero
    return gathers, reduce + zero, coll(model.rest_train, wb) + zero


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
    in_place = hw.device_type == "cpu" and hw.world_size == 1  # a rank of several gathers
    copied = paged - (paged_host if in_place else 0.0)
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
    least: Arr | None = None,
) -> tuple[Arr, Arr]:
    """Read-ahead sets for ``blocks`` blocks whose optimizer state is on NVMe, and the
    seconds from the start of the last backward until the disk has served the state
    traffic the optimizer step waits for.

    One disk serves the state's reads and write-backs (interleaved, at
    :data:`MIXED_IO_EFFICIENCY` of their serial rate). The step works through a block's
    state in pieces (:func:`cost.state_piece_numel`, :func:`cost.state_pieces_per_block`):
    each piece's state (:data:`ADAM_STATE_BYTES` per parameter) is read into a free
    read-ahead set before its step and written back from it after, freeing the set; below,
    "a block" is one piece. In an overlapped step the
    reads start with the accumulation window: ``k`` sets are read in the ``ahead_s``
    seconds before its last backward (what does not fit spills over). The last backward
    (``backward_s``) hands the blocks' gradients over one by one; from the first, each
    other block needs one set's write plus its own read. ``k`` is the fewest sets for
    which all that fits the backward (more sets never cost time, only host memory), at
    least :data:`MIN_READ_AHEAD`, at most ``blocks`` or what the host memory ``free``
    has left. With clipping the step starts after backward: every read and the writes
    that free sets are waited on (norm-clipped on one rank the step runs beside the next
    forward, whose seconds are then passed as ``backward_s``). ``shard``: the block's parameters whose state one rank
    holds (data parallel; None: all of them). ``least``: sets the host memory already
    reserves for each candidate (``k`` is at least that many).
    """
    numel = float(model.block_train if shard is None else shard)
    pieces = cost.state_pieces_per_block(numel)
    state = ADAM_STATE_BYTES * numel / pieces  # a piece's state on disk, on average
    eff = hw.nvme_efficiency * MIXED_IO_EFFICIENCY
    read = cost.link_seconds(state, hw.nvme_read_bandwidth, eff)
    write = cost.link_seconds(state, hw.nvme_write_bandwidth, eff)
    per_set = ADAM_STATE_BYTES * cost.state_piece_numel(numel)  # a set's host buffers
    room = np.floor(np.maximum(free, 0.0) / max(per_set, 1.0))
    lead = backward_s / np.maximum(blocks, 1.0)  # until the first block's gradient is in
    blocks = blocks * pieces  # the pieces, read one by one
    lowest = np.maximum(MIN_READ_AHEAD, 0.0 if least is None else least)
    cap = np.maximum(lowest, np.minimum(room, blocks))

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
        fits = ~chosen & (trial >= lowest) & (trial <= cap) & (seconds(trial) <= backward_s)
        k = np.where(fits, trial, k)
        chosen |= fits
    return k, np.where(blocks > 0, seconds(k), 0.0)
