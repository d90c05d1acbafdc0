"""A dry run of a plan at full size: the engine's real schedule on ``meta`` tensors.

:func:`dry_fit` builds the plan's model on the ``meta`` device, builds its training
engine exactly as :func:`bb_lightning.strategy.assembly.build_engine` does for the plan, over a
:class:`storage.dry.DryStore` (every tier ``meta``, copies counted per link, nothing
moved), and runs one optimizer step as the strategy drives it: ``grad_accum``
micro-batches of ``micro_batch`` x ``seq_len`` tokens, then the optimizer step: each
block stepped as its gradient arrives (the optimizer state read ahead from the window's
start) or, when the job clips by norm, stepped on the gradient worker after the last
backward (``OptimizerStep.step_deferred``) as a run steps it. A
:class:`~bb_lightning.strategy.dryrun_memory.MemoryAccountant` counts the device and host bytes
live at each op (the arenas, the weights outside the blocks, activations, logits and
the loss's upcast, gradients, the optimizer's temporaries), with CUDA's caching
allocator's rounding. Attention runs as a fused (flash-style) kernel would: it keeps
the query, key, value, output and an fp32 log-sum-exp per head and token, never the
``T x T`` scores.

A window of more than three micro-batches runs its first, second and last: the second
stands for every middle one (their schedule is the same), and its link bytes count
``grad_accum - 2`` times. The :class:`DryReport` says, per tier, the peak against the
plan's budget and where it happened, and per link the bytes moved against the plan's
(its predicted busy seconds times the link's bandwidth).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from bb_lightning.causal_loss import causal_lm_loss
from bb_lightning.engine.generate import LayerMajorGenerator
from bb_lightning.engine.optim import AdamWConfig
from bb_lightning.engine.optimizer_step import ClipConfig
from bb_lightning.engine.trainer_engine import TrainingEngine
from bb_lightning.hf.structure import find_block_list, fused_attention, load_config
from bb_lightning.planner import Plan
from bb_lightning.planner.job import FitJob, PredictJob
from bb_lightning.strategy.assembly import build_engine
from bb_lightning.strategy.dryrun_memory import MemoryAccountant, Peak
from storage.dry import DryStore
from storage.host import mapped_bytes
from storage.store import StoreConfig, TieredStore
from storage.tiers import PRICED_LINKS, Link, Tier

if TYPE_CHECKING:
    from bb_lightning.hf.lora import LoraOptions

__all__ = [
    "DryReport",
    "dry_fit",
    "dry_predict",
    "meta_model",
    "planned_link_bytes",
    "priced_bytes",
    "run_fit_step",
]

META = torch.device("meta")
_ATTENTION = "bb_dry_fused"
_HOST_ATTENTION = "bb_dry_fused_host"


@dataclass(frozen=True)
class DryReport:
    """What a dry run found: peaks per tier, bytes per link, and the plan's figures."""

    task: str
    """``fit`` or ``predict``."""
    peaks: Mapping[Tier, Peak]
    """The most bytes each memory tier held, and where."""
    budgets: Mapping[Tier, int]
    """The plan's budget of each tier, bytes."""
    planned: Mapping[Tier, int]
    """The bytes the plan says it uses on each tier."""
    nvme_used: int
    """Bytes the NVMe tier holds (the store's catalogue)."""
    links: Mapping[Link, int]
    """Bytes moved per priced link in one step (file links counted as the disk's), through
    the store and outside it."""
    outside: Mapping[Link, int]
    """Of :attr:`links`, the bytes copied outside the store (the engine's own copies of
    the weights outside the blocks)."""
    planned_links: Mapping[Link, float]
    """The plan's bytes per priced link in one step."""
    micro_batches: int
    """Micro-batches of the step (those run, and those the middle one stands for); 1 for
    predict."""
    seconds: float
    """Wall-clock seconds the dry run took."""

    @property
    def over(self) -> list[Tier]:
        """Tiers whose peak exceeds the plan's budget."""
        out = [t for t, p in self.peaks.items() if p.bytes > self.budgets.get(t, 0)]
        if self.nvme_used > self.budgets.get(Tier.NVME, 0):
            out.append(Tier.NVME)
        return out

    def render(self) -> str:
        """The report as a person reads it."""
        gib = 2.0**30
        what = f"{self.micro_batches} micro-batches" if self.task == "fit" else "one batch"
        lines = [f"dry run ({self.task}, {what}): peak per tier"]
        lines.append("  tier        peak    planned     budget   where")
        for tier, peak in self.peaks.items():
            where = peak.phase + ("" if peak.block is None else f", block {peak.block}")
            flag = "  OVER BUDGET" if tier in self.over else ""
            lines.append(
                f"  {tier.value:<7} {peak.bytes / gib:7.2f} GiB {self.planned.get(tier, 0) / gib:7.2f}"
                f" GiB {self.budgets.get(tier, 0) / gib:7.2f} GiB   {where}{flag}"
            )
            held = ", ".join(f"{op} {n / gib:.2f}" for op, n in peak.top if n >= gib / 100)
            lines.append(f"          held (GiB): {held}")
        flag = "  OVER BUDGET" if Tier.NVME in self.over else ""
        lines.append(
            f"  nvme    {self.nvme_used / gib:7.2f} GiB {self.planned.get(Tier.NVME, 0) / gib:7.2f}"
            f" GiB {self.budgets.get(Tier.NVME, 0) / gib:7.2f} GiB   store{flag}"
        )
        step = "one step" if self.task == "fit" else "one batch"
        lines.append(f"bytes per link in {step} (dry run / plan)")
        for link in PRICED_LINKS:
            got, want = self.links.get(link, 0), self.planned_links.get(link, 0.0)
            ratio = f"{got / want:6.3f}" if want > 0 else "     -"
            more = self.outside.get(link, 0)
            note = f"  ({more / gib:.2f} GiB outside the store)" if more else ""
            lines.append(
                f"  {link.value:<14} {got / gib:9.2f} GiB {want / gib:9.2f} GiB  x{ratio}{note}"
            )
        lines.append(f"took {self.seconds:.1f} s")
        return "\n".join(lines)


def planned_link_bytes(plan: Plan) -> dict[Link, float]:
    """The plan's bytes per priced link in one step: its predicted busy seconds on the
    link times the link's bandwidth (with the profile's efficiency factors), bytes."""
    hw = plan.hardware
    rate = {
        Link.HOST_TO_DEVICE: hw.h2d_bandwidth * hw.h2d_efficiency,
        Link.DEVICE_TO_HOST: hw.d2h_bandwidth * hw.d2h_efficiency,
        Link.NVME_TO_HOST: hw.nvme_read_bandwidth * hw.nvme_efficiency,
        Link.HOST_TO_NVME: hw.nvme_write_bandwidth * hw.nvme_efficiency,
    }
    return {link: plan.predicted.on(link) * rate[link] for link in PRICED_LINKS}


def meta_model(
    config: Any, dtype: torch.dtype, *, training: bool = True, lora: LoraOptions | None = None
) -> nn.Module:
    """The causal LM of ``config`` on the ``meta`` device, attention as a fused kernel;
    with ``lora``, wrapped in its adapters as :func:`~bb_lightning.hf.lora.wrap_lora` wraps a
    run's model (base weights frozen, the adapters in fp32 and trained), all on ``meta``."""
    from transformers import AttentionInterface, AutoModelForCausalLM

    AttentionInterface.register(_ATTENTION, fused_attention)
    cfg = load_config(config)
    with torch.device(META):
        model = AutoModelForCausalLM.from_config(cfg, dtype=dtype)
        if lora is not None:
            peft_config = lora.peft_config()  # ImportError naming the extra without peft
            from peft import get_peft_model

            model = get_peft_model(model, peft_config)
    model.config._attn_implementation = _ATTENTION
    model.train(training)
    return model


def host_fused_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """:func:`~bb_lightning.hf.structure.fused_attention` with the copies the engine's
    :func:`~bb_lightning.engine.attention.host_attention` makes over a KV cache on the
    host: a decode step's query rows and mask to the host, its output back to the device;
    a prefill's attended prefix of the keys and values (the positions its queries reach
    from the cache's start) to the device."""
    if query.shape[2] == 1:
        mask = None if attention_mask is None else attention_mask.to("cpu")
        out, _ = fused_attention(module, query.to("cpu"), key, value, mask, **kwargs)
        return out.to(META, copy=True), None  # meta stands for the device: a copy
    used = query.shape[2]
    key, value = (t[:, :, :used].to(META, copy=True) for t in (key, value))
    return fused_attention(module, query, key, value, attention_mask, **kwargs)


def dry_fit(
    plan: Plan, config: Any, *, direct_device: bool = False, lora: LoraOptions | None = None
) -> DryReport:
    """Run one optimizer step of ``plan`` (a fit plan) on the model of ``config`` (a
    config dict, ``PretrainedConfig``, config.json or model directory) on ``meta``
    tensors; ``direct_device``: NVMe reads land in device memory (kvikio); ``lora``: the
    model trains these adapters over its frozen weights (plan it on
    ``model_profile_from_module(meta_model(..., lora=lora))``, as a run does)."""
    if not isinstance(plan.job, FitJob):
        raise ValueError(f"dry_fit needs a fit plan, got a {plan.task} plan: use dry_predict")
    return _dry(plan, config, direct_device, training=True, lora=lora)


def dry_predict(plan: Plan, config: Any, *, direct_device: bool = False) -> DryReport:
    """Run one batch of ``plan`` (a predict plan) on ``meta`` tensors: the prefill of
    ``concurrent_seqs`` prompts of ``prompt_len`` tokens, then ``new_tokens - 1`` decode
    steps, every row to the end (no token is read, so none stops early)."""
    if not isinstance(plan.job, PredictJob):
        raise ValueError(f"dry_predict needs a predict plan, got a {plan.task} plan: use dry_fit")
    return _dry(plan, config, direct_device, training=False)


def _dry(
    plan: Plan,
    config: Any,
    direct_device: bool,
    *,
    training: bool,
    lora: LoraOptions | None = None,
) -> DryReport:
    started = time.perf_counter()
    dtype = getattr(torch, plan.placement.compute_dtype)
    model = meta_model(config, dtype, training=training, lora=lora)
    _, blocks = find_block_list(model)
    acct = MemoryAccountant()
    acct.ignore([*model.parameters(), *model.buffers()], Tier.HOST)  # a checkpoint read
    stores: list[DryStore] = []

    def open_store(cfg: StoreConfig) -> DryStore:
        store = DryStore(cfg, direct_device=direct_device)
        stores.append(store)
        acct.is_host = store.is_host_memory
        acct.ignore([store._device_arena.buffer, store._host_arena.buffer])
        acct.base[Tier.DEVICE] = store._device_arena.capacity
        acct.base[Tier.HOST] = store._host_arena.capacity
        acct.restart_peaks()  # the arenas were counted as made, then as the base
        return store

    mapped = mapped_bytes()
    acct.extra[Tier.HOST] = lambda: mapped_bytes() - mapped  # the gradient sink's buffers
    with acct:
        built = build_engine(model, list(blocks), plan.placement, training=training,
                             device=META, loader=lambda p: p.detach(), nvme_path="dry-run",
                             plan=plan, open_store=open_store)  # fmt: skip
        engine = built.engine
        store = stores[0]
        engine.pager.add_observer(acct)
        if isinstance(engine, TrainingEngine):
            # the gradient work on this thread, in the order it is queued: the accountant
            # sees the host optimizer's temporaries and the run does not depend on timing
            engine.grads.inline = True
            links, beside = run_fit_step(
                engine, plan, device=META, where=acct.where, outside=lambda: acct.moved
            )
        else:
            links, beside = _run_batch(model, plan, store, acct)
    nvme_used = store.usage()[Tier.NVME][0]
    engine.close()
    store.close()
    return DryReport(
        task=plan.task,
        peaks=dict(acct.peaks),
        budgets={m.tier: m.budget for m in plan.memory},
        planned={m.tier: m.used for m in plan.memory},
        nvme_used=nvme_used,
        links={link: links[link] + beside[link] for link in PRICED_LINKS},
        outside=beside,
        planned_links=planned_link_bytes(plan),
        micro_batches=plan.grad_accum,
        seconds=time.perf_counter() - started,
    )


def _run_batch(
    model: nn.Module, plan: Plan, store: DryStore, acct: MemoryAccountant
) -> tuple[dict[Link, int], dict[Link, int]]:
    """One batch of generation as :class:`~bb_lightning.engine.generate.LayerMajorGenerator`
    runs it (its KV cache in the plan's tier), every row to ``new_tokens``.

    Of more than three decode steps only the first, the second and the last run: the
    static cache holds the same memory at every step, and the second step's bytes count
    for every middle one."""
    assert isinstance(plan.job, PredictJob)
    job = plan.job
    if plan.placement.decode_attention is Tier.HOST and plan.hardware.device_type != "cpu":
        from transformers import AttentionInterface

        AttentionInterface.register(_HOST_ATTENTION, host_fused_attention)
        config: Any = model.config
        config._attn_implementation = _HOST_ATTENTION
    rows, plen, total = plan.concurrent_seqs, job.prompt_len, job.prompt_len + job.new_tokens
    steps = list(range(plen, total - 1))  # decode steps: the prefill gave the first token
    runs = steps if len(steps) <= 3 else [steps[0], steps[1], steps[-1]]
    links, beside = dict.fromkeys(PRICED_LINKS, 0), dict.fromkeys(PRICED_LINKS, 0)

    def count(times: int, since: tuple[dict[Link, int], dict[Link, int]]) -> None:
        now, moved = priced_bytes(store), acct.moved
        for link in PRICED_LINKS:
            links[link] += (now[link] - since[0][link]) * times
            beside[link] += (moved.get(link, 0) - since[1].get(link, 0)) * times

    with torch.no_grad():
        gen = LayerMajorGenerator(
            model, kv_tier=plan.placement.kv_cache, attention_tier=plan.placement.decode_attention,
            kv_store=store,  # a cache on the host beside the device's attention pages through it
        )  # fmt: skip
        kv = gen._cache(rows, total)
        mask = torch.ones(rows, kv.max_len, dtype=torch.long, device=META)
        cache_pos = torch.arange(total, device=META)
        pos = torch.arange(plen, device=META).expand(rows, plen)
        acct.where("prefill", None)
        since = priced_bytes(store), dict(acct.moved)
        ids = torch.zeros(rows, plen, dtype=torch.long, device=META)
        logits = gen._forward(ids, mask[:, :plen] if kv.has_states else mask, pos,
                              cache_pos[:plen], kv)  # fmt: skip
        count(1, since)
        for k, cur in enumerate(runs):
            acct.where(f"decode (token {cur - plen + 2})", None)
            since = priced_bytes(store), dict(acct.moved)
            tokens = logits.argmax(-1)
            logits = gen._forward(tokens[:, None], mask if kv.attends else None,
                                  pos[:, -1:] + 1 + (cur - plen), cache_pos[cur : cur + 1],
                                  kv)  # fmt: skip
            count(len(steps) - 2 if len(runs) < len(steps) and k == 1 else 1, since)
    return links, beside


def _loss(model: nn.Module, ids: torch.Tensor, chunk: int | None) -> torch.Tensor:
    """The training loss of ``ids`` as the job's module computes it: the head and the
    cross-entropy in chunks of ``chunk`` tokens (``CausalLMModule``), or whole through the
    model's ``labels`` (None: a module of the user's own)."""
    if chunk is None:
        return model(input_ids=ids, labels=ids).loss
    return causal_lm_loss(model, ids, None, ids, chunk)


def priced_bytes(store: TieredStore) -> dict[Link, int]:
    """Bytes per priced link ``store`` has moved so far (a file link counted as the disk's)."""
    out = dict.fromkeys(PRICED_LINKS, 0)
    for link, stats in store.stats().items():
        out[link.priced_as] += stats.bytes
    return out


def run_fit_step(
    engine: TrainingEngine,
    plan: Plan,
    *,
    device: torch.device,
    where: Callable[[str, int | None], None] = lambda phase, block: None,
    every: bool = False,
    outside: Callable[[], Mapping[Link, int]] = dict,
) -> tuple[dict[Link, int], dict[Link, int]]:
    """One optimizer step of ``plan`` as the strategy drives the engine: the last backward
    steps each block as its gradient arrives, the state read ahead from the window's start;
    when the job clips (by norm), the blocks step after it on the gradient worker, their
    state read as each steps (``OptimizerStep.step_deferred``), which this waits for. The
    step's bytes per priced link through the store, and those ``outside`` it (a running
    count per link). ``where`` hears each phase's name.

    Over three micro-batches, only the first, the second and the last run (all with
    ``every``); the second's bytes count for every middle one (``grad_accum - 2`` times).
    The bytes are read as the step returns: a real store's write-backs may still run.
    """
    assert isinstance(plan.job, FitJob)
    job, store, accum = plan.job, engine.store, plan.grad_accum
    runs = list(range(accum)) if accum <= 3 or every else [0, 1, accum - 1]
    adamw = AdamWConfig(lr=1e-4)
    clip = ClipConfig(value=1.0 if job.grad_clipping else None)
    ahead = clip.value is None  # a clipped step reads its state as its blocks step
    total = dict.fromkeys(PRICED_LINKS, 0)
    beside = dict.fromkeys(PRICED_LINKS, 0)
    gen = torch.Generator().manual_seed(0)
    for k in runs:
        before, out_before = priced_bytes(store), dict(outside())
        last = k == accum - 1
        if k == 0 and ahead:
            engine.read_state_ahead()
        if last:  # the engine says whether the step overlaps (it does under norm clipping)
            engine.begin_overlapped_step(adamw, clip)
        where(f"forward (micro-batch {k + 1})", None)
        shape = (plan.micro_batch, job.seq_len)
        if device.type == "meta":
            ids = torch.zeros(shape, dtype=torch.long, device=device)
        else:
            ids = torch.randint(0, plan.model.vocab_size, shape, generator=gen).to(device)
        loss = _loss(engine.model, ids, job.loss_chunk_tokens) / accum
        del ids
        where(f"backward (micro-batch {k + 1})", None)
        loss.backward()
        del loss
        where(f"gradients off the device (micro-batch {k + 1})", None)
        engine.after_backward()
        if last:
            where("optimizer step", None)
            engine.optimizer_step(adamw, clip)
            engine.grads.wait(phase=None)  # a clipped step's deferred block updates
        after, out_after = priced_bytes(store), outside()
        times = accum - 2 if len(runs) < accum and k == 1 else 1
        for link in PRICED_LINKS:
            total[link] += (after[link] - before[link]) * times
            beside[link] += (out_after.get(link, 0) - out_before.get(link, 0)) * times
    return total, beside
