"""Candidates and pricing of bulk-generation plans (used by :func:`search.make_plan`).

Generation is layer-major: each block's weights are paged in once per pass and
serve every concurrent sequence, so the tokens of a decode pass are the
concurrent sequences. A candidate is (prefetch depth, concurrent sequences, KV
cache tier, resident blocks); paged weights home on the host when it holds them,
else NVMe. Prefill runs in micro-batches of about :data:`PREFILL_TOKENS` tokens
(:data:`CPU_PREFILL_TOKENS` on a CPU device)
(the whole batch when the KV cache streams from the host: its rows cannot be
shared between micro-batches).
Decode passes compute at ``decode_efficiency`` times the rate of prefill (thin
matrix products, attention over the cache), and no faster than the device streams
every block's weights, the head and the KV cache from its memory
(``device_memory_bandwidth``, where the profile has it): the whole static cache on an
accelerator, the positions cached so far on a CPU device (whose decode step cuts the
cache after the last attended position), ``mean_context`` on average. A KV cache on
the host streams to a CUDA device block by block as transformers' offloading cache
moves it (:func:`~bb_lightning.planner.cost.offloaded_kv_bytes`: the whole cache each way per
decode pass, the copies to the host on the compute stream, so exposed); a CPU device
reads it in place.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from bb_lightning.placement import Placement
from bb_lightning.planner import cost
from bb_lightning.planner.cost import FP32_BYTES
from bb_lightning.planner.fit_search import ladder, tier_memory
from bb_lightning.planner.job import PredictJob
from bb_lightning.planner.plan import (
    LINK_FIELDS,
    Plan,
    PlanOverrides,
    PredictedTime,
    Roofline,
    placement_tiers,
)
from bb_lightning.planner.profile import HardwareProfile, ModelProfile
from storage.tiers import Link, Tier, format_bytes

Arr = npt.NDArray[np.float64]
PREFILL_TOKENS = 8192
"""Tokens per prefill micro-batch (enough rows for efficient matrix products)."""
CPU_PREFILL_TOKENS = 2048
"""Tokens per prefill micro-batch on a CPU device. The micro-batches of one block run
while its weights stay paged in, so their size moves no bytes; on a CPU a smaller one
keeps a block's activations in cache (a 374M Llama's block, 2 cores with AMX: 2.7-3.0 ms
per 128-token prompt at 16 prompts, 5.0-5.1 ms at 64; the whole model's prefill of 128
prompts from NVMe 8.3-8.4 s against 9.3-9.4 s). The predict probe times a prefill of
the same size (``probe.calibrate.PREFILL_PROBE_TOKENS``)."""

PREFETCH_DEPTHS = (1, 2, 4)
"""Prefetch depths (blocks paged in ahead) the search tries. The cost model prices a pass
at its mean rates, where every depth ties; the deepest one that fits wins the tie, as more
reads in flight ride out a slow one: a 374M Llama's 31 decode passes, weights read from
NVMe as fast as the passes compute (2 cores with AMX, 128 sequences), waited 3.8-4.6 s
for page-ins at depth 1 and 2 and 0.0 s at 4 (decode 16.2-16.9 s against 10.5 s)."""


@dataclass
class Priced:
    """One priced candidate (scalars)."""

    depth: int
    concurrent: int
    kv: Tier
    values: dict[str, float]


def price(
    model: ModelProfile,
    hw: HardwareProfile,
    job: PredictJob,
    ov: PlanOverrides,
    budgets: Mapping[Tier, int],
    depth: int,
    c: int,
    kv: Tier,
    kw: Arr,
) -> dict[str, Arr]:
    """Bytes per tier and seconds per batch of ``c`` prompts for every resident count."""
    wb = job.compute_bytes  # bytes per compute-dtype element
    n, bb = model.num_blocks, float(model.block_params * wb)
    nb = float(model.embed_params + model.head_params + model.final_params)
    plen, new = job.prompt_len, job.new_tokens
    ctx = job.mean_context
    # a host cache streams to the device one block at a time (double-buffered); a CPU
    # device reads it where it lies
    streamed = kv is Tier.HOST and hw.device_type != "cpu"
    # prefill runs in micro-batches of rows sharing the cache; a streamed (offloading)
    # cache cannot be shared by rows, so its prefill runs the whole batch at once
    chunk = CPU_PREFILL_TOKENS if hw.device_type == "cpu" else PREFILL_TOKENS
    mb = c if streamed else ov.micro_batch or min(c, max(1, math.ceil(chunk / plen)))
    np_ = n - kw
    paging = np.where(np_ > 0, (depth + 1) * bb, 0.0)
    kv_all = float(cost.kv_cache_bytes(model, c, job.total_len))
    kv_dev = 2.0 * kv_all / n if streamed else kv_all if kv is Tier.DEVICE else 0.0
    dev = (
        nb * wb
        + kw * bb
        + paging
        + c * plen * model.hidden_size * wb  # hidden states of all sequences
        + mb * plen * model.act_bytes_per_token_full
        + c * model.vocab_size * FP32_BYTES
        + kv_dev
    )
    mandatory = paging + (kv_all if kv is Tier.HOST else 0.0)
    pool = cost.pooled_budget(hw, budgets)  # a CPU device: one RAM pool
    free = (budgets[Tier.HOST] if pool is None else pool - dev) - mandatory
    if ov.weights_tier is Tier.NVME:
        w_h = np.zeros_like(kw)
    else:
        w_h = np.minimum(np_, np.floor(np.maximum(free, 0.0) / bb))
    host = mandatory + w_h * bb
    nvme = (np_ - w_h) * bb
    in_memory = (
        (dev <= budgets[Tier.DEVICE]) & (mandatory <= budgets[Tier.HOST])
        if pool is None
        else dev + mandatory <= pool
    )
    feasible = in_memory & (nvme <= budgets[Tier.NVME])
    if ov.weights_tier is Tier.HOST:
        feasible &= w_h >= np_

    head = model.head_flops_per_token()
    blocks_prefill = cost.forward_flops_per_token(model, plen) - head
    c_pre = cost.compute_seconds(c * plen * blocks_prefill + c * head, hw)
    c_dec = cost.compute_seconds(c * cost.forward_flops_per_token(model, ctx), hw)
    c_dec /= hw.decode_efficiency
    steps = new - 1
    kv_tok = float(model.kv_bytes_per_token * n)
    if hw.device_memory_bandwidth > 0:  # a decode pass streams the weights and the cache
        head_bytes = (model.head_params or model.embed_params) * wb
        read = ctx if hw.device_type == "cpu" else float(job.cache_len)
        dec_bytes = n * bb + head_bytes + c * (read + 1.0) * kv_tok
        c_dec = max(c_dec, dec_bytes / hw.device_memory_bandwidth)
    w_h2d = np_ * bb
    nvme_s = cost.link_seconds((np_ - w_h) * bb, hw.nvme_read_bandwidth, hw.nvme_efficiency)
    h2d = hw.h2d_bandwidth, hw.h2d_efficiency
    d2h = hw.d2h_bandwidth, hw.d2h_efficiency
    kv_pre = cost.offloaded_kv_bytes(model, c, job.cache_len, prefill=True) if streamed else (0, 0)
    kv_dec = cost.offloaded_kv_bytes(model, c, job.cache_len, prefill=False) if streamed else (0, 0)
    pre_links = {
        Link.HOST_TO_DEVICE: cost.link_seconds(w_h2d + kv_pre[0], *h2d),
        Link.NVME_TO_HOST: nvme_s,
        Link.DEVICE_TO_HOST: cost.link_seconds(np.full_like(kw, kv_pre[1]), *d2h),
    }
    dec_links = {
        Link.HOST_TO_DEVICE: cost.link_seconds(w_h2d + kv_dec[0], *h2d),
        Link.NVME_TO_HOST: nvme_s,
        Link.DEVICE_TO_HOST: cost.link_seconds(np.full_like(kw, kv_dec[1]), *d2h),
    }
    # on a CPU device the CPU time of a pass's reads from NVMe comes out of its cores
    per_byte = hw.nvme_cpu_seconds_per_byte if hw.device_type == "cpu" else 0.0
    io_cpu = (np_ - w_h) * bb * per_byte
    c_pre_a, c_dec_a = c_pre + io_cpu, c_dec + io_cpu
    # the cache's copies to the host run on the compute stream: exposed, not overlapped
    exp_pre = cost.pass_exposed_seconds(c_pre_a, _overlapped(pre_links))
    exp_pre = exp_pre + pre_links[Link.DEVICE_TO_HOST]
    exp_dec = cost.pass_exposed_seconds(c_dec_a, _overlapped(dec_links))
    exp_dec = exp_dec + dec_links[Link.DEVICE_TO_HOST]
    compute = c_pre_a + steps * c_dec_a
    total = compute + exp_pre + steps * exp_dec
    out = {
        "feasible": feasible.astype(np.float64),
        "total": total,
        "per_token": total / (c * new),
        "compute": compute,
        "exposed_pass": exp_dec if steps > 0 else exp_pre,
        "device": dev,
        "host": host,
        "nvme": nvme,
        "mandatory": mandatory,
        "w_h": w_h,
        "kw": kw,
        "micro_batch": np.full_like(kw, mb),
        "nvme_write": np.zeros_like(kw),
    }
    for link in pre_links:  # columns named as the PredictedTime fields
        out[LINK_FIELDS[link]] = pre_links[link] + steps * dec_links[link]
    return out


def _overlapped(links: dict[Link, Arr]) -> dict[Link, Arr]:
    """The links that run beside compute (the KV cache's device-to-host copies do not)."""
    return {k: v for k, v in links.items() if k is not Link.DEVICE_TO_HOST}


def _options(n: int, job: PredictJob, ov: PlanOverrides) -> tuple[list[int], list[int], Arr]:
    depths = [ov.prefetch_depth] if ov.prefetch_depth else list(PREFETCH_DEPTHS)
    cs = [ov.concurrent_seqs] if ov.concurrent_seqs else ladder(job.num_prompts)
    if ov.resident_blocks is not None:
        ks = [ov.resident_blocks]
    elif ov.weights_tier is Tier.DEVICE:
        ks = [n]
    elif ov.weights_tier is not None:
        ks = [0]
    else:
        ks = list(range(n + 1))
    return depths, cs, np.array(ks, dtype=np.float64)


def search(
    model: ModelProfile,
    hw: HardwareProfile,
    job: PredictJob,
    ov: PlanOverrides,
    budgets: Mapping[Tier, int],
) -> Priced | None:
    """The fastest feasible candidate per generated token, or ``None``."""
    depths, cs, kw = _options(model.num_blocks, job, ov)
    best: tuple[tuple[float, ...], Priced] | None = None
    for depth in depths:
        for c in cs:
            for kv in (Tier.DEVICE, Tier.HOST):
                a = price(model, hw, job, ov, budgets, depth, c, kv, kw)
                ok = np.flatnonzero(a["feasible"] > 0)
                if ok.size == 0:
                    continue
                i = int(ok[np.lexsort((a["device"][ok], a["per_token"][ok]))[0]])
                # Ties go to more concurrency (a profile without device memory bandwidth
                # does not see that decoding few sequences is bound by it), then to a KV
                # cache on the device (no transfers to overlap), then to a deeper prefetch
                # (see PREFETCH_DEPTHS), then to less device memory.
                tie = (-float(c), float(kv is Tier.HOST), -float(depth), float(a["device"][i]))
                key = (float(a["per_token"][i]), *tie)
                if best is None or key < best[0]:
                    vals = {k: float(v[i]) for k, v in a.items()}
                    best = (key, Priced(depth=depth, concurrent=c, kv=kv, values=vals))
    return None if best is None else best[1]


def diagnose(
    model: ModelProfile,
    hw: HardwareProfile,
    job: PredictJob,
    ov: PlanOverrides,
    budgets: Mapping[Tier, int],
) -> str:
    """Why nothing fits: the shortfall per tier and the smallest change that fits."""
    depths, cs, kw = _options(model.num_blocks, job, ov)
    a = price(model, hw, job, ov, budgets, depths[0], cs[0], Tier.HOST, kw[:1])
    dev, host, nvme = (float(a[k][0]) for k in ("device", "host", "nvme"))
    fmt = format_bytes
    dev_b, host_b, nvme_b = budgets[Tier.DEVICE], budgets[Tier.HOST], budgets[Tier.NVME]
    pool = cost.pooled_budget(hw, budgets)
    if pool is not None and dev + host > pool:  # a CPU device: one RAM pool
        return (
            f"even {cs[0]} sequence(s) with a {job.prompt_len}-token prompt need {fmt(dev + host)} "
            f"of RAM ({fmt(dev)} for the embedding, head, paging slots and activations, "
            f"{fmt(host)} for the KV cache and staging) but the RAM pool of the CPU device "
            f"and host is {fmt(pool)}: use shorter prompts or fewer concurrent sequences"
        )
    if pool is None and dev > dev_b:
        return (
            f"even {cs[0]} sequence(s) with a {job.prompt_len}-token prompt need {fmt(dev)} on "
            f"the device (embedding, head, paging slots, activations) but the device budget is "
            f"{fmt(dev_b)}: use shorter prompts or a device with >= {fmt((dev + cost.GIB) / 0.9)}"
        )
    need = host + nvme
    nvme_desc = f"{fmt(nvme_b)} NVMe" if nvme_b else "no NVMe path"
    return (
        f"needs {fmt(need)} of host+NVMe for the weights and KV cache, have {fmt(host_b)} host "
        f"and {nvme_desc}: add an NVMe path with >= {fmt(nvme / 0.95)} (--nvme-capacity) or "
        "more host memory"
    )


def build_plan(
    model: ModelProfile,
    hw: HardwareProfile,
    job: PredictJob,
    overrides: PlanOverrides | None,
    best: Priced,
    budgets: Mapping[Tier, int],
) -> Plan:
    """Turn the chosen candidate into a :class:`Plan` with reasons."""
    v, n, c = best.values, model.num_blocks, best.concurrent
    kw, w_h = int(v["kw"]), int(v["w_h"])
    pred = PredictedTime(
        compute=v["compute"],
        nvme_read=v["nvme_read"],
        nvme_write=0.0,
        h2d=v["h2d"],
        d2h=v["d2h"],
        optimizer=0.0,
        exposed=max(0.0, v["total"] - v["compute"]),
        total=v["total"],
    )
    limited = cost.limited_by(v["exposed_pass"], v["compute"], c >= job.num_prompts)
    tok_s = c * job.new_tokens / v["total"]
    processed = c * (job.prompt_len + job.new_tokens - 1) / v["total"]
    ctx = job.mean_context
    eff_flops = hw.device_flops * hw.compute_efficiency
    bw = cost.effective_bandwidths(hw)
    streamed = best.kv is Tier.HOST and hw.device_type != "cpu"
    kv_tok = float(model.kv_bytes_per_token * n) if streamed else 0.0
    roof = Roofline(  # of a decode pass: its tokens are the concurrent sequences
        flops_per_token=cost.forward_flops_per_token(model, ctx),
        device_flops=eff_flops * hw.decode_efficiency,
        bytes_per_pass={
            Link.HOST_TO_DEVICE: float((n - kw) * model.block_params * job.compute_bytes),
            Link.NVME_TO_HOST: float((n - kw - w_h) * model.block_params * job.compute_bytes),
        },
        # transformers' offloading cache moves the whole cache each way per decode pass
        bytes_per_token={
            Link.HOST_TO_DEVICE: job.cache_len * kv_tok,
            Link.DEVICE_TO_HOST: job.cache_len * kv_tok,
        },
        bandwidth={k: b for k, b in bw.items() if b > 0},
    )
    # the paged weights come over the slowest link they cross: NVMe when some home there
    link = Link.NVME_TO_HOST if n - kw - w_h > 0 else Link.HOST_TO_DEVICE
    hide = cost.hide_tokens_per_pass(  # FLOPs of the active weights against all bytes (MoE)
        2.0 * model.active_fraction, 2.0, eff_flops * hw.decode_efficiency, bw[link]
    )
    kv_bytes = cost.kv_cache_bytes(model, c, job.total_len)
    where = ""
    if streamed:
        where = " (offloaded: the whole cache to the device and back each decode pass)"
    elif best.kv is Tier.HOST:
        where = " (RAM: the CPU reads it in place)"
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
            f"({format_bytes(v['device'])} device + {format_bytes(v['host'])} host used)"
        )
    memory = tier_memory(hw, budgets, v)
    flops = cost.model_flops_per_token(model, "predict", job.total_len) * processed
    return Plan(
        task="predict",
        job=job,
        model=model,
        hardware=hw,
        overrides=overrides,
        micro_batch=int(v["micro_batch"]),
        grad_accum=1,
        concurrent_seqs=c,
        tokens_per_pass=c,
        placement=Placement(
            weights=placement_tiers(n, kw, w_h),
            master=(),
            prefetch_depth=best.depth,
            compute_dtype=job.compute_dtype,
            kv_cache=best.kv,
            prefill_tokens=int(v["micro_batch"]) * job.prompt_len,
        ),
        memory=memory,
        predicted=pred,
        tokens_per_s=tok_s,
        mfu=cost.flops_utilisation(flops, hw)[0],
        model_flops=flops,
        limited_by=limited,
        roofline=roof,
        reasons=tuple(reasons),
    )
