"""The chosen generation candidate as a :class:`~bb_lightning.planner.plan.Plan`: its
placement, predicted times, roofline and the reasons for each decision (the candidates
and their prices are :mod:`~bb_lightning.planner.predict_search`'s)."""

from __future__ import annotations

from collections.abc import Mapping

from bb_lightning.placement import Placement
from bb_lightning.planner import cost, host_attention
from bb_lightning.planner.fit_plan import tier_memory
from bb_lightning.planner.job import PredictJob
from bb_lightning.planner.plan import (
    LINK_FIELDS,
    Plan,
    PlanOverrides,
    PredictedTime,
    Roofline,
    placement_tiers,
)
from bb_lightning.planner.predict_search import PricedPredictCandidate
from bb_lightning.planner.profile import HardwareProfile, ModelProfile
from storage.tiers import Link, Tier, format_bytes

__all__ = ["attention_reasons", "build_plan", "predict_reasons", "predict_roofline"]


def build_plan(
    model: ModelProfile,
    hw: HardwareProfile,
    job: PredictJob,
    overrides: PlanOverrides | None,
    best: PricedPredictCandidate,
    budgets: Mapping[Tier, int],
) -> Plan:
    """Turn the chosen candidate into a :class:`Plan` with reasons."""
    v, n, c = best.price, model.num_blocks, best.concurrent
    kw, w_h = int(v.resident_weight_blocks), int(v.host_weight_blocks)
    pred = PredictedTime(
        compute=v.compute_seconds,
        nvme_read=v.nvme_read_seconds,
        nvme_write=0.0,
        h2d=v.h2d_seconds,
        d2h=v.d2h_seconds,
        optimizer=0.0,
        exposed=max(0.0, v.batch_seconds - v.compute_seconds),
        total=v.batch_seconds,
    )
    limited = cost.limited_by(v.exposed_pass_seconds, v.compute_seconds, c >= job.num_prompts)
    processed = c * (job.prompt_len + job.new_tokens - 1) / v.batch_seconds
    flops = cost.model_flops_per_token(model, "predict", job.total_len) * processed
    micro_batch = int(v.prefill_micro_batch)
    return Plan(
        task="predict",
        job=job,
        model=model,
        hardware=hw,
        overrides=overrides,
        micro_batch=micro_batch,
        grad_accum=1,
        concurrent_seqs=c,
        tokens_per_pass=c,
        placement=Placement(
            weights=placement_tiers(n, kw, w_h),
            master=(),
            prefetch_depth=best.depth,
            compute_dtype=job.compute_dtype,
            kv_cache=best.kv,
            decode_attention=Tier.HOST
            if best.host_attention or (best.kv is Tier.HOST and ov_attention(overrides))
            else None,
            prefill_tokens=micro_batch * job.prompt_len,
            kv_cache_nvme_blocks=int(v.kv_nvme_blocks),
        ),
        memory=tier_memory(hw, budgets, v.device_bytes, v.host_bytes, v.nvme_bytes),
        predicted=pred,
        tokens_per_s=1.0 / v.seconds_per_token,
        mfu=cost.flops_utilisation(flops, hw)[0],
        model_flops=flops,
        limited_by=limited,
        roofline=predict_roofline(model, hw, job, best),
        reasons=predict_reasons(model, hw, job, best, budgets, limited)
        + attention_reasons(hw, best, overrides),
    )


def ov_attention(overrides: PlanOverrides | None) -> bool:
    """Whether ``overrides`` ask for decode attention on the host."""
    return overrides is not None and overrides.decode_attention is Tier.HOST


def attention_reasons(
    hw: HardwareProfile, best: PricedPredictCandidate, overrides: PlanOverrides | None
) -> tuple[str, ...]:
    """Where decode attention runs beside a device that is not the host, and why: the
    chosen side's generated tokens/s against the fastest candidate attending on the other
    side (``best.rival``), or what kept the search from trying it; none on a CPU device
    (its attention reads the cache where it lies)."""
    if hw.device_type == "cpu":
        return ()
    here, there = ("host", "device") if best.host_attention else ("device", "host")
    said = f"decode attention on the {here}"
    if best.rival is not None:
        c, spt = best.rival
        return (
            f"{said}: {_rate(1.0 / best.price.seconds_per_token)} generated tokens/s at "
            f"{best.concurrent} sequences vs {_rate(1.0 / spt)} with attention on the {there} "
            f"(its best: {c} sequences; --decode-attention {there} forces it)",
        )
    asked = overrides.decode_attention if overrides is not None else None
    if asked is not None:
        why = "" if asked is Tier.HOST else ", or for a model without 'sdpa' attention"
        return (f"{said}, as asked (--decode-attention {asked.value}{why})",)
    if not best.host_attention and hw.host_memory_bandwidth <= 0:
        return (
            f"{said}: {hw.name} has no host_memory_bandwidth to price the host's cores "
            "reading the cache (--hardware measure measures it)",
        )
    return (f"{said}: no candidate attending on the {there} fits the memory",)


def _rate(tokens_per_s: float) -> str:
    """Tokens/s to four figures; from 10,000 up whole, thousands grouped."""
    return f"{tokens_per_s:,.0f}" if tokens_per_s >= 1e4 else f"{tokens_per_s:.4g}"


def predict_roofline(
    model: ModelProfile, hw: HardwareProfile, job: PredictJob, best: PricedPredictCandidate
) -> Roofline:
    """The roofline of a decode pass: its tokens are the concurrent sequences."""
    v, n = best.price, model.num_blocks
    kw, w_h = int(v.resident_weight_blocks), int(v.host_weight_blocks)
    bw = cost.effective_bandwidths(hw)
    streamed = best.kv is Tier.HOST and hw.device_type != "cpu" and not best.host_attention
    kv_tok = float(model.kv_bytes_per_token * n) if streamed else 0.0
    up, down = job.cache_len * kv_tok, job.cache_len * kv_tok
    if best.host_attention:  # a token's q/k/v rows to the host, its output back, per block
        to_host, to_dev = host_attention.qkv_row_bytes(model, job.compute_bytes)
        up, down = n * to_dev, n * to_host
    return Roofline(
        flops_per_token=cost.forward_flops_per_token(model, job.mean_context),
        device_flops=hw.device_flops * hw.compute_efficiency * hw.decode_efficiency,
        bytes_per_pass={
            Link.HOST_TO_DEVICE: float((n - kw) * model.block_params * job.compute_bytes),
            Link.NVME_TO_HOST: float((n - kw - w_h) * model.block_params * job.compute_bytes),
        },
        # the cache paged through the store moves the whole cache each way per pass
        bytes_per_token={Link.HOST_TO_DEVICE: up, Link.DEVICE_TO_HOST: down},
        bandwidth={k: b for k, b in bw.items() if b > 0},
    )


def predict_reasons(
    model: ModelProfile,
    hw: HardwareProfile,
    job: PredictJob,
    best: PricedPredictCandidate,
    budgets: Mapping[Tier, int],
    limited: str,
) -> tuple[str, ...]:
    """Why the plan is what it is, one sentence per decision."""
    v, n, c = best.price, model.num_blocks, best.concurrent
    kw, w_h = int(v.resident_weight_blocks), int(v.host_weight_blocks)
    eff_flops = hw.device_flops * hw.compute_efficiency
    # the paged weights come over the slowest link they cross: NVMe when some home there
    link = Link.NVME_TO_HOST if n - kw - w_h > 0 else Link.HOST_TO_DEVICE
    hide = cost.hide_tokens_per_pass(  # FLOPs of the active weights against all bytes (MoE)
        2.0 * model.active_fraction,
        2.0,
        eff_flops * hw.decode_efficiency,
        cost.effective_bandwidths(hw)[link],
    )
    kv_bytes = cost.kv_cache_bytes(model, c, job.total_len)
    where = ""
    if best.host_attention:
        per_pass = v.host_attention_seconds / max(job.new_tokens - 1, 1)
        where = (
            f" (decode attention on the host's {hw.cores} cores, reading the cache at "
            f"{hw.host_memory_bandwidth / 1e9:.3g} GB/s: {per_pass:.3g} s per pass beside the "
            f"device's, {host_attention.GROUPS_IN_FLIGHT} groups of sequences in flight; "
            "each block's q/k/v rows to the host and outputs back)"
        )
    elif best.kv is Tier.HOST and hw.device_type != "cpu":
        where = " (offloaded: the whole cache to the device and back each decode pass)"
    elif best.kv is Tier.HOST:
        where = " (RAM: the CPU reads it in place)"
    if spilled := int(v.kv_nvme_blocks):
        where += (
            f"; the last {spilled} of {n} blocks' caches home on NVMe where host memory ends "
            f"({format_bytes(kv_bytes * spilled / n)}, the attended part read back each pass)"
        )
    reasons = [
        f"a paged weight pass ({LINK_FIELDS[link].replace('_', ' ')}) hides behind compute from about "
        f"{hide:,.0f} tokens per decode pass; chosen {c} concurrent sequences (limited by "
        f"{limited})",
        f"KV cache of {c} sequences x {job.total_len} tokens = {format_bytes(kv_bytes)} on "
        f"{best.kv.value}{where}",
        f"{kw} of {n} blocks resident with the device memory left; {w_h} paged blocks home on "
        "host, the rest on NVMe",
    ]
    if hw.device_type == "cpu":
        reasons.append(
            f"CPU device: device and host tiers share RAM, planned as one pool of "
            f"{format_bytes(cost.pooled_budget(hw, budgets) or 0)} "
            f"({format_bytes(v.device_bytes)} device + {format_bytes(v.host_bytes)} host used)"
        )
    return tuple(reasons)
