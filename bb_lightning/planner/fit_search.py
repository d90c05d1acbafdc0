"""Candidates of fine-tuning plans and the search among them (used by
:func:`search.make_plan`).

A candidate is (checkpointing, prefetch depth, micro-batch, kF, kW): ``kF`` blocks
fully on the device (bf16 weights, fp32 gradients, master and moments: the
optimizer runs there), ``kW`` blocks with resident weights whose gradients and
optimizer state live off the device, the rest paged. All (kF, kW) of three fill
orders are priced at once with numpy arrays (:func:`fit_price.price`); the plan of
the fastest is built by :func:`fit_plan.build_plan`.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from bb_lightning.planner import chunks, cost
from bb_lightning.planner.fit_price import Arr, FitPrice, price
from bb_lightning.planner.job import FitJob
from bb_lightning.planner.plan import PlanOverrides
from bb_lightning.planner.profile import HardwareProfile, ModelProfile
from storage.tiers import Tier, format_bytes


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


@dataclass(frozen=True, kw_only=True)
class PricedFitCandidate:
    """The fine-tuning candidate a search picked: its batch shape and its price."""

    checkpointing: bool
    """Per-block activation checkpointing."""
    depth: int
    """Prefetch depth (blocks paged in ahead)."""
    micro_batch: int
    """Sequences per forward/backward pass."""
    hold: bool
    """Whether the earlier micro-batches' gradients are held (``Placement.hold_grads``)."""
    price: FitPrice[float]
    """Its bytes per tier and seconds per step."""
    chunk_rows: int | None = None
    """Sequences per chunk of the recomputed blocks (None: the micro-batch in one piece)."""
    boundaries: Tier | None = None
    """Where the chunked blocks keep their boundary inputs (None: unchunked)."""

    @property
    def chunks(self) -> int:
        """Chunks a recomputed block runs per micro-batch."""
        return chunks.chunks_per_pass(self.micro_batch, self.chunk_rows)


TIE_TOLERANCE = 0.01
"""Relative step-time difference below which two candidates count as equally fast."""


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


def _chunkings(
    hw: HardwareProfile, ov: PlanOverrides, ckpt: bool, mb: int
) -> list[tuple[int | None, Tier | None]]:
    """(rows per chunk, boundary tier) pairs to price for micro-batch ``mb``: unchunked,
    then with checkpointing (chunks run recomputed blocks) every chunk of
    :func:`chunks.chunk_options` on each tier of :data:`chunks.BOUNDARY_TIERS` (one chunk
    of the whole micro-batch only off the device: on it, that is the unchunked pass), or
    what ``ov`` forces."""
    tiers = (ov.boundaries,) if ov.boundaries else chunks.BOUNDARY_TIERS[hw.device_type]
    if ov.chunk_rows is not None:
        return [(ov.chunk_rows, t) for t in tiers]
    if not (ov.chunked and ckpt):
        return [(None, None)]
    out: list[tuple[int | None, Tier | None]] = [(None, None)]
    for rows in chunks.chunk_options(mb):
        if rows is not None:
            out += [(rows, t) for t in tiers if rows < mb or t is not Tier.DEVICE]
    return out


def search(
    model: ModelProfile,
    hw: HardwareProfile,
    job: FitJob,
    ov: PlanOverrides,
    budgets: Mapping[Tier, int],
) -> PricedFitCandidate | None:
    """The fastest feasible candidate per token, or ``None`` when none fits."""
    kf, kw = states(model.num_blocks, ov)
    if kf.size == 0:
        return None
    found: list[tuple[float, float, float, float, float, PricedFitCandidate]] = []
    ckpts, depths, mbs = _options(job, ov)
    fills = (False, True) if hw.device_type == "cpu" else (False,)
    for ckpt, depth, (mb, hold), first in itertools.product(
        ckpts, depths, _shapes(hw, job, ov, mbs), fills
    ):
        for rows, tier in _chunkings(hw, ov, ckpt, mb):
            a = price(model, hw, job, ov, budgets, ckpt, depth, mb, kf, kw, hold, first, rows, tier)
            traffic = a.traffic_seconds
            for i in np.flatnonzero(a.feasible > 0):
                one = a.at(int(i))
                picked = PricedFitCandidate(
                    checkpointing=ckpt, depth=depth, micro_batch=mb, hold=hold, price=one,
                    chunk_rows=rows, boundaries=tier,
                )  # fmt: skip
                key = (float(traffic[i]), float(mb), float(picked.chunks), one.device_bytes)
                found.append((one.seconds_per_token, *key, picked))
    if not found:
        return None
    fastest = min(c[0] for c in found)
    # Candidates within TIE_TOLERANCE of the fastest are equally fast for this cost model:
    # take the one that moves the least (then the smaller micro-batch, fewer chunks, less
    # device memory).
    ties = [c for c in found if c[0] <= fastest * (1.0 + TIE_TOLERANCE)]
    return min(ties, key=lambda c: c[1:5])[5]


def _frugal(
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
) -> FitPrice[float]:
    """The price of the first (kF, kW) under the chunking of :func:`_chunkings` that needs
    the least device memory (then the least mandatory host memory)."""
    priced = [
        price(model, hw, job, ov, budgets, ckpt, depth, mb, kf, kw, False, False, r, t).at(0)
        for r, t in _chunkings(hw, ov, ckpt, mb)
    ]
    return min(priced, key=lambda v: (v.device_bytes, v.mandatory_host_bytes))


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
    a = _frugal(model, hw, job, ov, budgets, ckpt, depth, mb, kf[:1], kw[:1])
    relaxed = dataclasses.replace(ov, checkpointing=None)
    if ckpts == [False] and search(
        model, hw, dataclasses.replace(job, checkpointing=None), relaxed, budgets
    ):
        return (
            "checkpointing off needs every block used in place (resident on the device, or "
            "homed on the host of a CPU device), but the memory does not hold them: blocks "
            "paged in by copy are always recomputed; allow checkpointing (checkpointing=None)"
        )
    dev, mand, nvme = a.device_bytes, a.mandatory_host_bytes, a.nvme_bytes
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
            and _frugal(
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
            ).device_bytes
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
    need = a.host_bytes - 0.0 + nvme
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
        f"host {fmt(a.host_bytes)} of {fmt(host_b)}, NVMe {fmt(nvme)} of {fmt(nvme_b)}: "
        "relax the overrides"
    )
