"""The chosen fine-tuning candidate as a :class:`Plan` (used by :func:`search.make_plan`):
its placement, predicted times, roofline, memory per tier and the reasons a person
reads. :func:`tier_memory` serves the generation plans too."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping

from bb_lightning.placement import Placement
from bb_lightning.planner import chunks, cost
from bb_lightning.planner.cost import ADAM_STATE_BYTES
from bb_lightning.planner.data_parallel import REDUCE_BYTES
from bb_lightning.planner.fit_price import FitPrice
from bb_lightning.planner.fit_search import PricedFitCandidate
from bb_lightning.planner.job import FitJob
from bb_lightning.planner.plan import (
    Plan,
    PlanOverrides,
    PredictedTime,
    Roofline,
    TierMemory,
    placement_tiers,
)
from bb_lightning.planner.profile import HardwareProfile, ModelProfile
from storage.tiers import Link, Tier, format_bytes


def build_plan(
    model: ModelProfile,
    hw: HardwareProfile,
    job: FitJob,
    overrides: PlanOverrides | None,
    best: PricedFitCandidate,
    budgets: Mapping[Tier, int],
) -> Plan:
    """Turn the chosen candidate into a :class:`Plan` with reasons."""
    v = best.price
    ga = math.ceil(job.seqs_per_step / best.micro_batch)
    limited = cost.limited_by(
        v.exposed_pass_seconds, v.compute_seconds, best.micro_batch >= job.seqs_per_step
    )
    tok_s = job.tokens_per_step / v.step_seconds
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
        tokens_per_pass=best.micro_batch * job.seq_len,
        placement=_with_swaps(
            _priced_recompute(hw, fit_placement(model, hw, job, best)),
            int(best.price.swapped_blocks),
        ),
        memory=tier_memory(hw, budgets, v.device_bytes, v.host_bytes, v.nvme_bytes),
        predicted=fit_predicted_time(v),
        tokens_per_s=tok_s,
        mfu=cost.flops_utilisation(flops, hw)[0],
        model_flops=flops,
        limited_by=limited,
        roofline=fit_roofline(model, hw, job, best),
        reasons=fit_reasons(model, hw, job, best, budgets, limited),
    )


def fit_predicted_time(v: FitPrice[float]) -> PredictedTime:
    """The predicted seconds per step of a priced candidate."""
    return PredictedTime(
        compute=v.compute_seconds,
        nvme_read=v.nvme_read_seconds,
        nvme_write=v.nvme_write_seconds,
        h2d=v.h2d_seconds,
        d2h=v.d2h_seconds,
        optimizer=v.optimizer_seconds,
        exposed=max(0.0, v.step_seconds - v.compute_seconds),
        total=v.step_seconds,
        net=v.network_seconds,
    )


def fit_placement(
    model: ModelProfile, hw: HardwareProfile, job: FitJob, best: PricedFitCandidate
) -> Placement:
    """The placement of the chosen candidate: tiers per block, prefetch, recompute policy."""
    v, n = best.price, model.num_blocks
    kf, kw = int(v.full_blocks), int(v.resident_weight_blocks)
    w_h = int(v.host_weight_blocks)
    in_place = hw.device_type == "cpu" and hw.world_size == 1  # a rank of several gathers
    copied = n - kf - kw - (w_h if in_place else 0)
    return Placement(
        weights=placement_tiers(n, kf + kw, w_h),
        master=placement_tiers(n, kf, int(v.host_state_blocks)),
        grads=placement_tiers(n, kf, int(v.host_grad_blocks)),
        prefetch_depth=best.depth,
        # checkpointing where no block is copied in: the in-place blocks are recomputed
        recompute_resident=best.checkpointing and copied == 0,
        read_ahead=int(v.read_ahead_sets),
        hold_grads=best.hold,
        compute_dtype=job.compute_dtype,
        chunk_rows=best.chunk_rows,
        boundaries=best.boundaries,
    )


def fit_roofline(
    model: ModelProfile, hw: HardwareProfile, job: FitJob, best: PricedFitCandidate
) -> Roofline:
    """The roofline of a training pass: FLOPs per token against the bytes each link moves."""
    v, n, ranks = best.price, model.num_blocks, hw.world_size
    # the weights a rank pages in of one block (its shard with data parallelism)
    block_bytes = cost.shard_numel(model.block_params, ranks) * job.compute_bytes
    paged = n - int(v.full_blocks) - int(v.resident_weight_blocks)
    recomputed = int(v.recomputed_blocks)
    bw = cost.effective_bandwidths(hw)
    return Roofline(
        flops_per_token=cost.train_flops_per_token(
            model, job.seq_len, best.checkpointing, float(n - recomputed)
        ),
        device_flops=hw.device_flops * hw.compute_efficiency,
        bytes_per_pass={
            Link.HOST_TO_DEVICE: 2.0 * paged * block_bytes,
            Link.NVME_TO_HOST: 2.0 * (paged - int(v.host_weight_blocks)) * block_bytes,
            Link.DEVICE_TO_HOST: float(n * model.block_train * job.compute_bytes)
            if ranks == 1
            else float(n * cost.shard_numel(model.block_train, ranks) * REDUCE_BYTES),
        },
        bandwidth={k: b for k, b in bw.items() if b > 0},
    )


def fit_reasons(
    model: ModelProfile,
    hw: HardwareProfile,
    job: FitJob,
    best: PricedFitCandidate,
    budgets: Mapping[Tier, int],
    limited: str,
) -> tuple[str, ...]:
    """Why the plan is what it is, one sentence per decision."""
    v, n = best.price, model.num_blocks
    placement = _with_swaps(
        _priced_recompute(hw, fit_placement(model, hw, job, best)), int(v.swapped_blocks)
    )
    block_bytes = model.block_params * job.compute_bytes  # one block's weights
    kf, kw = int(v.full_blocks), int(v.resident_weight_blocks)
    w_h, g_h, m_h = int(v.host_weight_blocks), int(v.host_grad_blocks), int(v.host_state_blocks)
    ga = math.ceil(job.seqs_per_step / best.micro_batch)
    recomputed = int(v.recomputed_blocks)
    acts = cost.activation_bytes(model, best.micro_batch, job.seq_len, best.checkpointing)
    reasons = [
        _batch_reason(model, hw, job, best, limited),
        *(
            _chunk_reasons(model, hw, job, best)
            if best.chunk_rows is not None
            else [
                f"checkpointing {'on' if best.checkpointing else 'off'}: activations take "
                f"{format_bytes(acts)} per micro-batch; "
                + (
                    f"{recomputed} of {n} blocks recomputed in backward (a quarter more FLOPs each)"
                    if best.checkpointing
                    else "no block is paged in by copy, none is recomputed"
                )
            ]
        ),
        *_block_work_reasons(model, job, best, placement, hw.device_type == "cpu"),
        f"{kf + kw} of {n} blocks resident with leftover device memory ({kf} with gradients and "
        f"optimizer on the device); each resident block saves "
        f"{format_bytes(2 * block_bytes * ga)} of H2D per step",
        f"host holds {w_h} paged blocks' weights, {g_h} gradient accumulators and {m_h} "
        f"optimizer states by benefit per byte; the rest goes to NVMe",
        _optimizer_reason(hw, job, v),
    ]
    if n - kf - m_h > 0:
        k = int(v.read_ahead_sets)
        piece = cost.state_piece_numel(cost.shard_numel(model.block_train, hw.world_size))
        reasons.append(
            f"optimizer state of {n - kf - m_h} blocks on NVMe is read ahead of each block's "
            f"step, {format_bytes(cost.FP32_BYTES * piece)} of each fp32 tensor at a time, "
            f"through {k} host buffer sets ({format_bytes(k * ADAM_STATE_BYTES * piece)}), "
            "sized so that its reads and write-backs fit the last backward where the host "
            "budget allows"
        )
    if job.loss_chunk_tokens is not None:
        tokens = best.micro_batch * job.seq_len
        chunk = min(job.loss_chunk_tokens, tokens)
        reasons.append(
            f"loss: head and cross-entropy over chunks of {chunk:,} tokens, each recomputed in "
            f"backward: {format_bytes(cost.logits_bytes(model, chunk))} of fp32 logits and "
            f"their gradients at once, not the pass's "
            f"{format_bytes(cost.logits_bytes(model, tokens))}"
        )
    if not model.full_fine_tune:
        reasons.append(
            f"{model.trainable_params:,} of {model.total_params:,} parameters train "
            f"({100.0 * model.trainable_params / max(model.total_params, 1):.2g}%): gradients, "
            "optimizer state and write-back only for them; the frozen weights are paged "
            "read-only in forward and backward"
        )
    if hw.device_type == "cpu":
        reasons.append(_cpu_reason(model, hw, job, best, budgets))
    return tuple(reasons)


def _chunk_reasons(
    model: ModelProfile, hw: HardwareProfile, job: FitJob, best: PricedFitCandidate
) -> list[str]:
    """A chunked pass: the tokens a weight pass carries, in how many chunks, where the
    boundary inputs live and what they cost."""
    v, mb, rows = best.price, best.micro_batch, best.chunk_rows or best.micro_batch
    tokens, ga = mb * job.seq_len, math.ceil(job.seqs_per_step / mb)
    recomputed = int(v.recomputed_blocks + v.swapped_blocks)
    tier = best.boundaries or Tier.DEVICE
    # a swapped block's inputs are among its saved activations: only recomputed ones keep
    held = chunks.boundary_bytes(model, tokens, int(v.recomputed_blocks), tier)
    moved = chunks.boundary_link_bytes(model, tokens, int(v.recomputed_blocks), tier)
    bw = {
        Link.HOST_TO_DEVICE: hw.h2d_bandwidth * hw.h2d_efficiency,
        Link.DEVICE_TO_HOST: hw.d2h_bandwidth * hw.d2h_efficiency,
        Link.NVME_TO_HOST: hw.nvme_read_bandwidth * hw.nvme_efficiency,
        Link.HOST_TO_NVME: hw.nvme_write_bandwidth * hw.nvme_efficiency,
    }
    links = [
        f"{link.value} {ga * float(b) / max(bw[link], 1.0):.3g} s"
        for link, b in moved.items()
        if float(b) > 0
    ]
    per_chunk = model.act_bytes_per_token_full + model.act_bytes_per_token_backward
    return [
        f"chunks: each of the {recomputed} checkpointed blocks carries the micro-batch's "
        f"{tokens:,} tokens per weight pass in {best.chunks} chunk(s) of {rows} sequence(s) "
        f"({rows * job.seq_len:,} tokens; {format_bytes(rows * job.seq_len * per_chunk)} of "
        f"activations at once), its weights paged in once per pass; the chunks' extra kernel "
        f"launches take {v.launch_seconds:.3g} s per step",
        f"boundary inputs ({format_bytes(tokens * model.act_bytes_per_token_checkpointed)} per "
        f"block, {format_bytes(float(held[tier]))} in all) live on the {tier.value}"
        + (
            f", {format_bytes(float(held[Tier.DEVICE]))} of them in flight on the device; "
            f"busy per step: {', '.join(links)} (overlapped with compute)"
            if tier is not Tier.DEVICE
            else ", nothing moved"
        ),
    ]


def _block_work_reasons(
    model: ModelProfile,
    job: FitJob,
    best: PricedFitCandidate,
    placement: Placement,
    cpu: bool = False,
) -> list[str]:
    """Per block, with checkpointing: whether its backward recomputes its forward, keeps its
    activations (autograd), or, where swapping was priced, fetches its saved activations
    back from the host (the last of the blocks that would recompute: backward needs them
    first; on a ``cpu`` device they stay where the forward made them)."""
    if not best.checkpointing:
        return []
    n = model.num_blocks
    recomputed = list(placement.recomputed or ())
    swaps = set(placement.swapped or ())
    work = ["swap" if i in swaps else "recompute" if i in recomputed else "keep" for i in range(n)]
    runs: list[str] = []
    start = 0
    for i in range(1, n + 1):
        if i == n or work[i] != work[start]:
            blocks = f"block {start}" if i - start == 1 else f"blocks {start}-{i - 1}"
            runs.append(f"{blocks} {work[start]}")
            start = i
    swap_bytes = best.micro_batch * job.seq_len * model.swap_bytes_per_token
    return [
        "per block (keep: activations kept by autograd; recompute: forward again in "
        "backward"
        + (
            (
                "; swap: weights paged out between forward and backward, saved activations "
                "kept in the CPU device's memory (its host) in place"
                if cpu
                else "; swap: saved activations to the host in forward and back in backward"
            )
            + f", {format_bytes(swap_bytes)} per block and micro-batch"
            if swaps
            else ""
        )
        + "): "
        + ", ".join(runs)
    ]


def _optimizer_reason(hw: HardwareProfile, job: FitJob, v: FitPrice[float]) -> str:
    """When the host AdamW steps the blocks, and the seconds of it not hidden."""
    head = f"host AdamW {v.optimizer_seconds:.3g} s per step runs block by block "
    exposed = f"{v.optimizer_exposed_seconds:.3g} s exposed"
    if not job.grad_clipping:
        return head + f"during backward, as each block's gradient is in ({exposed})"
    if job.grad_clip_algorithm == "value":
        return head + f"after backward ({exposed}: clipping by value waits for every gradient)"
    if hw.world_size > 1:
        return head + (
            f"after backward ({exposed}: global-norm clipping waits for every rank's "
            "gradient norms)"
        )
    return head + (
        "after backward beside the next forward, block 0 first (global-norm clipping: each "
        f"block's norm is taken as its gradient is summed); {exposed}: the parameters "
        "outside the blocks, block 0's update and what outlasts the forward"
    )


def _batch_reason(
    model: ModelProfile, hw: HardwareProfile, job: FitJob, best: PricedFitCandidate, limited: str
) -> str:
    """The tokens per pass a paged weight pass hides behind, and the ones chosen."""
    bw = cost.effective_bandwidths(hw)
    device_flops = hw.device_flops * hw.compute_efficiency
    hide = cost.hide_tokens_per_pass(  # FLOPs of the active weights against all bytes (MoE)
        (8.0 if best.checkpointing else 6.0) * model.active_fraction,
        4.0 / hw.world_size,  # each rank copies its 1/N shard of the weights
        device_flops,
        bw[Link.HOST_TO_DEVICE],
    )
    ga = math.ceil(job.seqs_per_step / best.micro_batch)
    return (
        f"a paged weight pass hides behind compute from about {hide:,.0f} tokens per pass "
        f"(device {device_flops / 1e12:.3g} TFLOP/s over H2D {bw[Link.HOST_TO_DEVICE] / 1e9:.3g} GB/s); "
        f"chosen {best.micro_batch} x {job.seq_len} = {best.micro_batch * job.seq_len:,} tokens, "
        f"{ga} accumulation step(s) make the "
        + ("global batch" if hw.world_size == 1 else "rank's share of the global batch")
        + f" (limited by {limited})"
    )


def _cpu_reason(
    model: ModelProfile,
    hw: HardwareProfile,
    job: FitJob,
    best: PricedFitCandidate,
    budgets: Mapping[Tier, int],
) -> str:
    """A CPU device: the shared RAM pool, blocks used in place, the host work on its cores."""
    v, n = best.price, model.num_blocks
    in_place = int(v.in_place_blocks)
    ga = math.ceil(job.seqs_per_step / best.micro_batch)
    held = cost.held_grad_bytes(ga, job.compute_bytes, n * model.block_train + model.rest_train)
    return (
        f"CPU device: device and host tiers share RAM, planned as one pool of "
        f"{format_bytes(cost.pooled_budget(hw, budgets) or 0)} "
        f"({format_bytes(v.device_bytes)} device + {format_bytes(v.host_bytes)} host used)"
        + (
            f"; the {in_place} host-home blocks run in place, keeping their activations "
            "on the host instead of recomputing them"
            if in_place
            else ""
        )
        + f"; host AdamW, gradient accumulation and NVMe transfers take the same cores: "
        f"+{v.shared_core_seconds:.3g} s per step"
        + (
            f"; the gradients of the first {ga - 1} micro-batches are held "
            f"({format_bytes(held)}) "
            "and summed once, in the last backward"
            if best.hold
            else ""
        )
    )


def tier_memory(
    hw: HardwareProfile,
    budgets: Mapping[Tier, int],
    device_bytes: float,
    host_bytes: float,
    nvme_bytes: float,
) -> tuple[TierMemory, ...]:
    """Use (bytes) and budget per tier; on a CPU device each memory tier's budget is what
    the shared pool leaves it beside the other's use (:func:`cost.pooled_budget`), and its
    capacity the RAM both share."""
    caps = (hw.device_memory, hw.host_memory, hw.nvme_capacity)
    used = (device_bytes, host_bytes, nvme_bytes)
    limits = dict(budgets)
    pool = cost.pooled_budget(hw, budgets)
    if pool is not None:  # either memory tier may grow to the whole RAM share
        limits[Tier.DEVICE] = max(0, int(pool - host_bytes))
        limits[Tier.HOST] = max(0, int(pool - device_bytes))
        ram = hw.device_memory + hw.host_memory
        caps = (ram, ram, hw.nvme_capacity)
    return tuple(
        TierMemory(tier=t, used=int(u), budget=limits[t], capacity=c)
        for t, u, c in zip((Tier.DEVICE, Tier.HOST, Tier.NVME), used, caps, strict=True)
    )


def _with_swaps(placement: Placement, swapped: int) -> Placement:
    """``placement`` with its last ``swapped`` recomputed paged blocks swapping their saved
    activations to the host instead (``Placement.swapped``): the last blocks' backward
    comes first, so their activations are fetched back while the earlier ones recompute."""
    recomputed = list(placement.recomputed or ())
    paged = [i for i in recomputed if placement.weights[i] is not Tier.DEVICE]
    swaps = paged[len(paged) - swapped :] if swapped > 0 else []
    if not swaps:
        return placement
    kept = tuple(i for i in recomputed if i not in swaps)
    return dataclasses.replace(placement, recomputed=kept, swapped=tuple(swaps))


def _priced_recompute(hw: HardwareProfile, placement: Placement) -> Placement:
    """``placement`` with the blocks it recomputes on ``hw``'s device written out
    (``Placement.recomputed``): the blocks paged in by copy there (HOST homes are used in
    place only on a CPU device), so that an engine on another device runs what was priced."""
    in_place = frozenset((Tier.DEVICE, Tier.HOST) if hw.device_type == "cpu" else (Tier.DEVICE,))
    return dataclasses.replace(placement, recomputed=placement.recomputed_blocks(in_place))
