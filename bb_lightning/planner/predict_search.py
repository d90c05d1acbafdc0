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
the host streams to a CUDA device layer by layer through the store
(:func:`~bb_lightning.planner.cost.offloaded_kv_bytes`: the whole cache each way per pass;
the compute waits for each layer's copy to the host before its device lane is reused,
priced exposed); a CPU device reads it in place. A KV cache on the host with decode
attention on the host's cores
(:mod:`~bb_lightning.planner.host_attention`; a candidate beside a CUDA device whose
profile has ``host_memory_bandwidth``, unless ``PlanOverrides.decode_attention`` is DEVICE)
sends each block's q/k/v rows to the host and the attention output back, and prices the
host's read of the cache at its memory bandwidth beside the device's matrix products.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Generic, TypeVar

import numpy as np
import numpy.typing as npt

from bb_lightning.planner import cost, host_attention
from bb_lightning.planner.cost import FP32_BYTES
from bb_lightning.planner.fit_search import ladder
from bb_lightning.planner.job import PredictJob
from bb_lightning.planner.plan import (
    PlanOverrides,
)
from bb_lightning.planner.profile import HardwareProfile, ModelProfile
from storage.tiers import Link, Tier, format_bytes

Arr = npt.NDArray[np.float64]
Mask = npt.NDArray[np.bool_]
V = TypeVar("V", Arr, float)
PREFILL_TOKENS = 8192
"""Tokens per prefill micro-batch (enough rows for efficient matrix products)."""
CPU_PREFILL_TOKENS = 2048
"""Tokens per prefill micro-batch on a CPU device. The micro-batches of one block run
while its weights stay paged in, so their size moves no bytes; on a CPU a smaller one
keeps a block's activations in cache (a block's prefill took less time per prompt at 16
prompts of 128 tokens than at 64, and the whole model's prefill from NVMe was shorter
than with :data:`PREFILL_TOKENS`). The predict probe times a prefill of
the same size (``probe.calibrate.PREFILL_PROBE_TOKENS``)."""

PREFETCH_DEPTHS = (1, 2, 4)
"""Prefetch depths (blocks paged in ahead) the search tries. The cost model prices a pass
at its mean rates, where every depth ties; the deepest one that fits wins the tie, as more
reads in flight ride out a slow one: with weights read from NVMe as fast as the decode
passes compute, the passes waited for page-ins at depth 1 and 2 and not at 4."""


def batches_of(job: PredictJob, c: int) -> int:
    """Batches of ``c`` concurrent sequences the job's ``num_prompts`` prompts take."""
    return -(-job.num_prompts // max(c, 1))


@dataclass(frozen=True, kw_only=True)
class PredictPrice(Generic[V]):
    """Bytes and seconds of generation candidates: numpy arrays over the resident-block
    counts of one (depth, concurrency, KV tier) (``PredictPrice[Arr]``, from
    :func:`price`), or one candidate's scalars (``PredictPrice[float]``, from :meth:`at`)."""

    feasible: V
    """1.0 where the candidate fits every tier's budget and the forced homes, else 0.0."""
    batch_seconds: V
    """Predicted seconds to generate for one batch of concurrent sequences (prefill and
    every decode pass)."""
    seconds_per_token: V
    """Seconds per generated token over all the job's prompts: ``batch_seconds`` for each
    of its :func:`batches_of` batches but a last, partial one, priced for its own prompts
    (its passes stream every block's weights as a whole one's do and compute for fewer
    rows)."""
    compute_seconds: V
    """Device compute of the batch, seconds (with a CPU device's NVMe CPU time)."""
    exposed_pass_seconds: V
    """Seconds of one decode pass (the prefill when one token is generated) not hidden
    behind its compute."""
    nvme_read_seconds: V
    """NVMe-to-host link busy seconds per batch."""
    nvme_write_seconds: V
    """Host-to-NVMe link busy seconds per batch: the prompts' cache of the blocks whose
    cache homes on NVMe (the decode steps' rows are a few KiB per sequence; busy seconds
    only, not in ``batch_seconds``)."""
    h2d_seconds: V
    """Host-to-device link busy seconds per batch."""
    d2h_seconds: V
    """Device-to-host link busy seconds per batch."""
    device_bytes: V
    """Bytes the device tier holds."""
    host_bytes: V
    """Bytes the host tier holds."""
    nvme_bytes: V
    """Bytes the NVMe tier holds."""
    mandatory_host_bytes: V
    """Host bytes every placement needs (paging slots, a host KV cache)."""
    resident_weight_blocks: V
    """Blocks whose weights stay on the device."""
    host_weight_blocks: V
    """Paged blocks whose weights home on the host (the rest on NVMe)."""
    prefill_micro_batch: V
    """Sequences per prefill micro-batch."""
    host_attention_seconds: V
    """Seconds the host's cores spend on decode attention per batch (0 where the device
    attends)."""
    kv_nvme_blocks: V
    """Last blocks whose KV cache homes on NVMe where host memory ends (attention on the
    host; ``Placement.kv_cache_nvme_blocks``)."""

    def at(self: PredictPrice[Arr], i: int) -> PredictPrice[float]:
        """The scalars of candidate ``i``."""
        values = {f.name: float(getattr(self, f.name)[i]) for f in dataclasses.fields(self)}
        return PredictPrice(**values)


@dataclass(frozen=True, kw_only=True)
class PredictMemory:
    """Where the bytes of every resident-block count live: arrays over the counts."""

    resident_weight_blocks: Arr
    """Blocks whose weights stay on the device."""
    paged_blocks: Arr
    """Blocks whose weights are paged in."""
    host_weight_blocks: Arr
    """Paged blocks whose weights home on the host."""
    device_bytes: Arr
    """Bytes on the device."""
    mandatory_host_bytes: Arr
    """Host bytes every placement needs (paging slots, a host KV cache)."""
    host_bytes: Arr
    """Bytes on the host."""
    nvme_bytes: Arr
    """Bytes on NVMe."""
    fits: Mask
    """Whether the bytes fit every tier's budget and the forced homes are honoured."""
    prefill_micro_batch: int
    """Sequences per prefill micro-batch."""
    kv_streamed: bool
    """Whether the KV cache streams from the host to the device block by block."""
    host_attention: bool = False
    """Whether decode attention runs on the host's cores over a KV cache homed there."""
    kv_nvme_blocks: Arr | None = None
    """Last blocks whose KV cache homes on NVMe (None: none)."""

    @property
    def nvme_weight_blocks(self) -> Arr:
        """Paged blocks whose weights home on NVMe."""
        return self.paged_blocks - self.host_weight_blocks


def load_staging_bytes(model: ModelProfile, compute_bytes: int) -> float:
    """Host bytes the engine's setup holds beside the host arena while it fills the store,
    bytes: each block's values laid end to end in fp32 (``flat_from``, read one tensor at
    a time from the checkpoint) and their cast to the compute dtype (``compute_bytes`` per
    element), one block at a time."""
    return float(model.block_params * (FP32_BYTES + compute_bytes))


def prefill_hidden_copies(model: ModelProfile) -> int:
    """How many ``[sequences, prompt_len, hidden]`` tensors of hidden states (all the
    batch's prompt tokens, compute dtype) the device holds at once in a prefill: the
    embedding's output (the model's forward keeps it to its end), a block's input and its
    output (the row chunks' outputs are written into one output of all rows:
    :func:`~bb_lightning.engine.rows.call_in_row_chunks`); with a learned table of
    positions (embedding parameters beyond ``vocab x hidden``: OPT, GPT-2) the positions'
    embedding too, beside the tokens' (their sum is the first block's input). The full-size
    dry run shows them at the prefill's peak (``bb-lightning plan --task predict --dry-run``)."""
    learned_positions = model.embed_params > model.vocab_size * model.hidden_size
    return 4 if learned_positions else 3


def predict_memory(
    model: ModelProfile,
    hw: HardwareProfile,
    job: PredictJob,
    ov: PlanOverrides,
    budgets: Mapping[Tier, int],
    depth: int,
    c: int,
    kv: Tier,
    kw: Arr,
    *,
    host_attn: bool = False,
) -> PredictMemory:
    """Bytes per tier of ``c`` concurrent sequences for every resident count ``kw``;
    ``host_attn``: decode attention on the host over a host cache (no cache on the device,
    staging buffers for the q/k/v rows and outputs on both sides)."""
    wb = job.compute_bytes  # bytes per compute-dtype element
    n, bb = model.num_blocks, float(model.block_params * wb)
    nb = float(model.embed_params + model.head_params + model.final_params)
    plen = job.prompt_len
    # a host cache streams to the device one block at a time (double-buffered); a CPU
    # device reads it where it lies
    streamed = kv is Tier.HOST and hw.device_type != "cpu" and not host_attn
    # prefill runs in micro-batches of rows sharing the cache; a streamed (offloading)
    # cache cannot be shared by rows, so its prefill runs the whole batch at once
    chunk = CPU_PREFILL_TOKENS if hw.device_type == "cpu" else PREFILL_TOKENS
    mb = c if streamed else ov.micro_batch or min(c, max(1, math.ceil(chunk / plen)))
    paged = n - kw
    paging = np.where(paged > 0, (depth + 1) * bb, 0.0)
    # the store's device arena holds depth + 1 paging slots of the largest block whether
    # or not a block is paged (``store_budgets`` of the weights manifest)
    slots = np.full_like(kw, (depth + 1) * bb)
    kv_all = float(cost.kv_cache_bytes(model, c, job.total_len))
    kv_dev = 2.0 * kv_all / n if streamed else kv_all if kv is Tier.DEVICE else 0.0
    dev = (
        nb * wb
        + kw * bb
        + slots
        + prefill_hidden_copies(model) * c * plen * model.hidden_size * wb
        + mb * plen * model.act_bytes_per_token_full
        + c * model.vocab_size * FP32_BYTES
        + kv_dev
    )
    stage = host_attention.staging_bytes(model, c, wb) if host_attn else 0.0
    dev = dev + stage
    base = paging + stage + load_staging_bytes(model, wb)
    pool = cost.pooled_budget(hw, budgets)  # a CPU device: one RAM pool
    room = budgets[Tier.HOST] if pool is None else pool - dev
    spilled = np.zeros_like(kw)
    if kv is Tier.HOST and (host_attn or ov.decode_attention is Tier.HOST):
        per_block = kv_all / n  # the host attends: caches past host memory home on NVMe
        over = np.ceil(np.maximum(kv_all - np.maximum(room - base, 0.0), 0.0) / per_block)
        spilled = np.minimum(over, float(n))
    mandatory = base + (kv_all * (1.0 - spilled / n) if kv is Tier.HOST else 0.0)
    free = room - mandatory
    if ov.weights_tier is Tier.NVME:
        w_h = np.zeros_like(kw)
    else:
        w_h = np.minimum(paged, np.floor(np.maximum(free, 0.0) / bb))
    nvme = (paged - w_h) * bb + spilled * kv_all / n
    in_memory = (
        (dev <= budgets[Tier.DEVICE]) & (mandatory <= budgets[Tier.HOST])
        if pool is None
        else dev + mandatory <= pool
    )
    fits = in_memory & (nvme <= budgets[Tier.NVME])
    if ov.weights_tier is Tier.HOST:
        fits &= w_h >= paged
    return PredictMemory(
        resident_weight_blocks=kw,
        paged_blocks=paged,
        host_weight_blocks=w_h,
        device_bytes=dev,
        mandatory_host_bytes=mandatory,
        host_bytes=mandatory + w_h * bb,
        nvme_bytes=nvme,
        fits=fits,
        prefill_micro_batch=mb,
        kv_streamed=streamed,
        host_attention=host_attn,
        kv_nvme_blocks=spilled,
    )


def _pass_compute_seconds(
    model: ModelProfile, hw: HardwareProfile, job: PredictJob, c: int, host_attn: bool = False
) -> tuple[float, float]:
    """(prefill, one decode pass) compute seconds of ``c`` concurrent sequences: a decode
    pass at ``decode_efficiency`` of the rate, and no faster than the device streams the
    blocks' weights, the head and the KV cache from its memory (``host_attn``: the device
    neither attends over the cache nor reads it, and its groups' launches and copies add
    :func:`~bb_lightning.planner.host_attention.launch_seconds`)."""
    wb, n = job.compute_bytes, model.num_blocks
    bb = float(model.block_params * wb)
    plen, ctx = job.prompt_len, job.mean_context
    head = model.head_flops_per_token()
    blocks_prefill = cost.forward_flops_per_token(model, plen) - head
    c_pre = cost.compute_seconds(c * plen * blocks_prefill + c * head, hw)
    attended = 0.0 if host_attn else ctx
    c_dec = cost.compute_seconds(c * cost.forward_flops_per_token(model, attended), hw)
    c_dec /= hw.decode_efficiency
    kv_tok = 0.0 if host_attn else float(model.kv_bytes_per_token * n)
    if hw.device_memory_bandwidth > 0:  # a decode pass streams the weights and the cache
        head_bytes = (model.head_params or model.embed_params) * wb
        read = ctx if hw.device_type == "cpu" else float(job.cache_len)
        dec_bytes = n * bb + head_bytes + c * (read + 1.0) * kv_tok
        c_dec = max(c_dec, dec_bytes / hw.device_memory_bandwidth)
    if host_attn:  # the copies to the host and back sync the device's stream: not hidden
        c_dec += host_attention.launch_seconds(hw, n)
    return c_pre, c_dec


def _pass_link_seconds(
    model: ModelProfile,
    hw: HardwareProfile,
    job: PredictJob,
    c: int,
    mem: PredictMemory,
    prefill: bool,
) -> dict[Link, Arr]:
    """Busy seconds per link of the prefill pass or of one decode pass: every paged
    block's weights (from NVMe where they home there) and a streamed KV cache's copies
    (:func:`cost.offloaded_kv_bytes`); with attention on the host, the prompts' cache to
    the host in the prefill and back to the device, where each block's prefill attends over
    it (:func:`~bb_lightning.engine.attention.host_attention` copies the attended prefix),
    each block's q/k/v rows there and outputs back per decode."""
    bb = float(model.block_params * job.compute_bytes)
    kv_up, kv_down = (
        cost.offloaded_kv_bytes(model, c, job.cache_len) if mem.kv_streamed else (0.0, 0.0)
    )
    if mem.host_attention:
        to_host, to_dev = host_attention.qkv_row_bytes(model, job.compute_bytes)
        n = model.num_blocks
        prompts = float(cost.kv_cache_bytes(model, c, job.prompt_len))
        kv_up, kv_down = (prompts, prompts) if prefill else (c * n * to_dev, c * n * to_host)
    nvme_bytes = mem.nvme_weight_blocks * bb + _kv_nvme_read_bytes(model, job, c, mem, prefill)
    return {
        Link.HOST_TO_DEVICE: cost.link_seconds(
            mem.paged_blocks * bb + kv_up, hw.h2d_bandwidth, hw.h2d_efficiency
        ),
        Link.NVME_TO_HOST: cost.link_seconds(
            nvme_bytes, hw.nvme_read_bandwidth, hw.nvme_efficiency
        ),
        Link.DEVICE_TO_HOST: cost.link_seconds(
            np.full_like(mem.resident_weight_blocks, kv_down), hw.d2h_bandwidth, hw.d2h_efficiency
        ),
    }


def _kv_nvme_read_bytes(
    model: ModelProfile, job: PredictJob, c: int, mem: PredictMemory, prefill: bool
) -> Arr:
    """Bytes a decode pass reads of the blocks' caches homed on NVMe (the positions attended
    so far, on average: the memory map's pages come from the disk where host memory ends);
    none in the prefill, which writes them."""
    if mem.kv_nvme_blocks is None or prefill:
        return np.zeros_like(mem.resident_weight_blocks)
    per_block = c * job.mean_context * model.kv_bytes_per_token
    return mem.kv_nvme_blocks * per_block


def _exposed_seconds(compute: Arr, links: dict[Link, Arr], mem: PredictMemory) -> Arr:
    """Seconds of a pass not hidden behind its compute: the links beside it, then a
    streamed KV cache's copies to the host, which run on the compute stream (the q/k/v
    rows of host attention and the prompt's cache go on a side stream)."""
    if mem.host_attention:
        return cost.pass_exposed_seconds(compute, links)
    overlapped: dict[Link, Arr] = {k: v for k, v in links.items() if k is not Link.DEVICE_TO_HOST}
    return cost.pass_exposed_seconds(compute, overlapped) + links[Link.DEVICE_TO_HOST]


def _host_attention_exposed(
    model: ModelProfile,
    hw: HardwareProfile,
    job: PredictJob,
    c: int,
    compute: Arr,
    links: dict[Link, Arr],
) -> tuple[Arr, float]:
    """(exposed seconds of one decode pass, the host's attention seconds of it) with
    attention on the host: :func:`host_attention.pipelined_pass_seconds` per candidate."""
    host_s = host_attention.host_attention_seconds(
        model, hw, c, job.mean_context, job.compute_bytes
    )
    n = model.num_blocks
    exposed = np.array(
        [
            host_attention.pipelined_pass_seconds(
                float(dev), host_s, tuple(float(v[i]) for v in links.values()), n
            )
            - float(dev)
            for i, dev in enumerate(compute)
        ]
    )
    return exposed, host_s


def _batch_seconds(
    model: ModelProfile,
    hw: HardwareProfile,
    job: PredictJob,
    c: int,
    mem: PredictMemory,
    host_attn: bool,
) -> tuple[Arr, Arr, Arr, float, dict[Link, Arr], dict[Link, Arr]]:
    """(compute, prefill exposed, exposed per decode pass, host attention per pass, prefill
    link seconds, decode link seconds) of a batch of ``c`` prompts in memory ``mem``."""
    c_pre, c_dec = _pass_compute_seconds(model, hw, job, c, host_attn)
    steps = job.new_tokens - 1
    pre_links = _pass_link_seconds(model, hw, job, c, mem, prefill=True)
    dec_links = _pass_link_seconds(model, hw, job, c, mem, prefill=False)
    # on a CPU device the CPU time of a pass's reads from NVMe comes out of its cores
    per_byte = hw.nvme_cpu_seconds_per_byte if hw.device_type == "cpu" else 0.0
    io_cpu = mem.nvme_weight_blocks * float(model.block_params * job.compute_bytes) * per_byte
    c_dec_io = _kv_nvme_read_bytes(model, job, c, mem, False) * per_byte
    c_pre_a, c_dec_a = c_pre + io_cpu, c_dec + io_cpu + c_dec_io
    exp_pre = _exposed_seconds(c_pre_a, pre_links, mem)
    exp_dec = _exposed_seconds(c_dec_a, dec_links, mem)
    host_s = 0.0
    if host_attn:
        exp_dec, host_s = _host_attention_exposed(model, hw, job, c, c_dec_a, dec_links)
    return c_pre_a + steps * c_dec_a, exp_pre, exp_dec, host_s, pre_links, dec_links


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
    *,
    host_attn: bool = False,
) -> PredictPrice[Arr]:
    """Bytes per tier and seconds per batch of ``c`` prompts for every resident count
    (``host_attn``: decode attention on the host over a cache homed there)."""
    mem = predict_memory(model, hw, job, ov, budgets, depth, c, kv, kw, host_attn=host_attn)
    steps = job.new_tokens - 1
    t = _batch_seconds(model, hw, job, c, mem, host_attn)
    compute, exp_pre, exp_dec, host_s, pre_links, dec_links = t
    rest = job.num_prompts - (batches_of(job, c) - 1) * c  # the last batch's prompts
    r = _batch_seconds(model, hw, job, rest, mem, host_attn) if 0 < rest < c else t
    spilled = mem.kv_nvme_blocks if mem.kv_nvme_blocks is not None else np.zeros_like(kw)
    prompt_cache = float(cost.kv_cache_bytes(model, c, job.prompt_len)) / model.num_blocks
    kv_write = cost.link_seconds(  # the prefill writes the spilled blocks' prompt cache
        spilled * prompt_cache, hw.nvme_write_bandwidth, hw.nvme_efficiency
    )
    total = compute + exp_pre + steps * exp_dec
    job_seconds = total * (batches_of(job, c) - 1) + r[0] + r[1] + steps * r[2]
    busy = {link: pre_links[link] + steps * dec_links[link] for link in pre_links}
    return PredictPrice(
        feasible=mem.fits.astype(np.float64),
        batch_seconds=total,
        seconds_per_token=job_seconds / (job.num_prompts * job.new_tokens),
        compute_seconds=compute,
        exposed_pass_seconds=exp_dec if steps > 0 else exp_pre,
        nvme_read_seconds=busy[Link.NVME_TO_HOST],
        nvme_write_seconds=kv_write,
        h2d_seconds=busy[Link.HOST_TO_DEVICE],
        d2h_seconds=busy[Link.DEVICE_TO_HOST],
        device_bytes=mem.device_bytes,
        host_bytes=mem.host_bytes,
        nvme_bytes=mem.nvme_bytes,
        mandatory_host_bytes=mem.mandatory_host_bytes,
        resident_weight_blocks=kw,
        host_weight_blocks=mem.host_weight_blocks,
        prefill_micro_batch=np.full_like(kw, mem.prefill_micro_batch),
        host_attention_seconds=np.full_like(kw, steps * host_s),
        kv_nvme_blocks=spilled,
    )


@dataclass(frozen=True, kw_only=True)
class PricedPredictCandidate:
    """The generation candidate a search picked: its shape and its price."""

    depth: int
    """Prefetch depth (blocks paged in ahead)."""
    concurrent: int
    """Sequences generated together (tokens per decode pass)."""
    kv: Tier
    """Tier of the KV cache."""
    price: PredictPrice[float]
    """Its bytes per tier and seconds per batch."""
    host_attention: bool = False
    """Whether decode attention runs on the host's cores (the cache on the host)."""
    rival: tuple[int, float] | None = None
    """(concurrent sequences, seconds per generated token) of the fastest feasible
    candidate with decode attention on the other side (the host's cores against the
    device's), or None where the search tried no such candidate or none fit."""


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


def kv_options(hw: HardwareProfile, ov: PlanOverrides) -> list[tuple[Tier, bool]]:
    """The (KV cache tier, attention on the host) pairs the search tries: the cache on the
    device or the host, attended where the device is; beside a CUDA device also the cache
    on the host attended by the host's cores, where the profile prices the host's memory
    reads (``host_memory_bandwidth`` > 0; a profile without it plans the device's attention,
    unless ``ov.decode_attention`` asks for the host's, which it refuses). On a CPU device
    the host's attention is the cache read in place (the device is the host): asked for, it
    is the only pair. ``ov.decode_attention`` DEVICE keeps attention on the device, HOST
    forces it on the host."""
    device_attends = [(Tier.DEVICE, False), (Tier.HOST, False)]
    if ov.decode_attention is Tier.DEVICE:
        return device_attends
    if hw.device_type == "cpu":  # the device is the host: it reads the cache in place
        return [(Tier.HOST, False)] if ov.decode_attention is Tier.HOST else device_attends
    if ov.decode_attention is not Tier.HOST:
        return device_attends + ([(Tier.HOST, True)] if hw.host_memory_bandwidth > 0 else [])
    if hw.host_memory_bandwidth <= 0:
        raise ValueError(
            f"decode attention on the host asked for, but {hw.name} has host_memory_bandwidth "
            "= 0 (not measured): measure the machine or give the profile the bytes/s its "
            "cores read host memory at"
        )
    return [(Tier.HOST, True)]


def search(
    model: ModelProfile,
    hw: HardwareProfile,
    job: PredictJob,
    ov: PlanOverrides,
    budgets: Mapping[Tier, int],
) -> PricedPredictCandidate | None:
    """The fastest feasible candidate per generated token, or ``None``."""
    depths, cs, kw = _options(model.num_blocks, job, ov)
    best: dict[bool, tuple[tuple[float, ...], PricedPredictCandidate]] = {}
    for depth in depths:
        for c in cs:
            for kv, on_host in kv_options(hw, ov):
                a = price(model, hw, job, ov, budgets, depth, c, kv, kw, host_attn=on_host)
                ok = np.flatnonzero(a.feasible > 0)
                if ok.size == 0:
                    continue
                i = int(ok[np.lexsort((a.device_bytes[ok], a.seconds_per_token[ok]))[0]])
                # Ties go to more concurrency (a profile without device memory bandwidth
                # does not see that decoding few sequences is bound by it), then to a KV
                # cache on the device (no transfers to overlap), then to the device's
                # attention, then to a deeper prefetch (see PREFETCH_DEPTHS), then to less
                # device memory.
                tie = (-float(c), float(kv is Tier.HOST), float(on_host), -float(depth),
                       float(a.device_bytes[i]))  # fmt: skip
                key = (float(a.seconds_per_token[i]), *tie)
                if on_host not in best or key < best[on_host][0]:
                    picked = PricedPredictCandidate(
                        depth=depth, concurrent=c, kv=kv, price=a.at(i), host_attention=on_host
                    )
                    best[on_host] = (key, picked)
    if not best:
        return None
    winner = min(best.values(), key=lambda kc: kc[0])[1]
    other = best.get(not winner.host_attention)
    if other is None:
        return winner
    rival = (other[1].concurrent, other[1].price.seconds_per_token)
    return dataclasses.replace(winner, rival=rival)


def diagnose(
    model: ModelProfile,
    hw: HardwareProfile,
    job: PredictJob,
    ov: PlanOverrides,
    budgets: Mapping[Tier, int],
) -> str:
    """Why nothing fits: the shortfall per tier and the smallest change that fits."""
    depths, cs, kw = _options(model.num_blocks, job, ov)
    on_host = kv_options(hw, ov)[-1][1]
    a = price(
        model, hw, job, ov, budgets, depths[0], cs[0], Tier.HOST, kw[:1], host_attn=on_host
    ).at(0)
    dev, host, nvme = a.device_bytes, a.host_bytes, a.nvme_bytes
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
