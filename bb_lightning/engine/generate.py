"""Layer-major bulk generation: every block once per step for the whole generation batch.

:class:`LayerMajorGenerator` runs a prefill over the whole (left-padded)
batch of prompts, then one decode step per new token. Each phase is one
forward of the Hugging Face model over *all* running sequences, so when the
model's blocks are paged (:class:`~bb_lightning.engine.blocks.PagedBlocks`,
installed by the ``balance_beam`` strategy) each block's weights are paged in
once per step, applied to every sequence (a prefill in the plan's micro-batches
of prompts: :attr:`~bb_lightning.engine.blocks.PagedBlocks.max_tokens`), released,
and the next blocks are prefetched while it computes: the weight traffic of a step is amortised over
the batch, which is what the planner's ``concurrent_seqs`` sizes.

The decode loop is ours, not ``generate``'s: a preallocated static KV cache
(:class:`~bb_lightning.engine.kv.KVCache`), an attention-mask buffer as long as the
cache (what transformers pads a mask to; a model that builds positions from the mask,
such as ALiBi, needs it), written in place, position ids advanced in place, and one
host read of the chosen tokens per step (the step's one sync point). Positions
follow ``generate``'s rule for left padding (``cumsum(mask) - 1``), so greedy
tokens equal ``generate``'s. Sequences that finish (eos, a stop string, or the
model's context) leave the batch: once at most half the rows are still running,
the cache and the buffers are compacted to those rows.

Sampling draws one uniform number per sequence and step from a generator
seeded per sequence, and picks the token by inverse CDF over the filtered
distribution (temperature, top-k, top-p): a sequence's tokens depend on its
seed and its logits, not on the other sequences in the batch.

Decode steps use :func:`~bb_lightning.engine.attention.decode_attention` (one
query token over the cache as two batched products) on models that run
transformers' ``sdpa`` attention on the CPU; prefill, and every step on CUDA, keep ``sdpa``.
With ``attention_tier`` :attr:`Tier.HOST` (the plan's ``decode_attention``) the KV cache
lives on the host whatever the model's device, and each decode step's attention runs there
(:func:`~bb_lightning.engine.attention.host_attention`: the layer's new query, key and
value rows go to the host, its output comes back). The batch then runs as
:attr:`LayerMajorGenerator.attention_groups` groups of sequences in flight, one thread and
one KV cache each (:mod:`~bb_lightning.engine.groups`): while the host attends for one
group, the device computes for another, and each paged block is paged in once per step for
every group. Each group finishes and compacts its own rows.
"""

from __future__ import annotations

import os
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial
from typing import Any, Literal

import torch
from torch import Tensor, nn
from transformers import PretrainedConfig

from bb_lightning.engine.attention import decode_attention_for, one_forward, uses_sdpa
from bb_lightning.engine.groups import group_spans, run_groups
from bb_lightning.engine.hf_quirks import (
    forward_options,
    model_context,
    static_cache_limit,
    unread_outputs_off,
)
from bb_lightning.engine.kv import KVCache
from bb_lightning.placement import DECODE_GROUPS
from bb_lightning.shapes import cache_length
from storage.store import TieredStore
from storage.tiers import Tier

__all__ = [
    "Generated",
    "GenerationConfig",
    "LayerMajorGenerator",
    "forward_options",
    "model_context",
]

FinishReason = Literal["eos", "stop", "length", "context"]
_Call = tuple[Tensor, Tensor | None, Tensor, Tensor, KVCache]
"""One group's forward: token ids, attention mask, position ids, cache positions, cache."""


@dataclass(frozen=True, kw_only=True)
class GenerationConfig:
    """How to extend each prompt."""

    max_new_tokens: int = 32
    """Tokens generated per prompt at most."""
    temperature: float = 0.0
    """Sampling temperature; 0 is greedy decoding (argmax)."""
    top_k: int = 0
    """Sample among the ``top_k`` most likely tokens (0: no limit)."""
    top_p: float = 1.0
    """Nucleus sampling: the smallest set of tokens whose probability reaches ``top_p``."""
    eos_token_ids: tuple[int, ...] = ()
    """Tokens that end a sequence (not included in the result)."""
    pad_token_id: int = 0
    """Token fed for finished sequences still in the batch and under left padding."""
    stop_strings: tuple[str, ...] = ()
    """Texts that end a sequence; the result is cut before the first one (needs a decoder)."""

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens={self.max_new_tokens} must be >= 1 (tokens)")
        if self.temperature < 0.0:
            raise ValueError(f"temperature={self.temperature} must be >= 0 (0: greedy)")
        if self.top_k < 0:
            raise ValueError(f"top_k={self.top_k} must be >= 0 (0: no limit)")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p={self.top_p} must be in (0, 1]: use 1.0 to disable it")
        if any(not s for s in self.stop_strings):
            raise ValueError(f"stop_strings={self.stop_strings!r} holds an empty string: drop it")

    @property
    def greedy(self) -> bool:
        """Whether decoding takes the argmax."""
        return self.temperature == 0.0


@dataclass
class Generated:
    """One sequence's result."""

    token_ids: list[int]
    """New tokens, cut before the eos token or the stop string."""
    finish_reason: FinishReason
    """Why it stopped: ``eos``, ``stop`` (string), ``length`` (max_new_tokens) or ``context``."""
    text: str | None = None
    """Decoded new tokens (cut before the stop string), when a decoder was given."""


class LayerMajorGenerator:
    """Generates for whole batches of prompts with one model forward per step."""

    def __init__(
        self,
        model: nn.Module,
        *,
        kv_tier: Tier | None = None,
        attention_tier: Tier | None = None,
        kv_nvme_layers: int = 0,
        kv_nvme_dir: str | None = None,
        attention_groups: int | None = None,
        kv_store: TieredStore | None = None,
    ) -> None:
        """Wrap a Hugging Face causal LM (its blocks paged or not).

        Args:
            model: the ``PreTrainedModel``; its ``config`` gives the context length.
            kv_tier: where the KV cache lives (the plan's ``kv_cache``); None: the device.
            attention_tier: where decode attention runs (the plan's ``decode_attention``);
                :attr:`Tier.HOST` needs ``kv_tier`` HOST, and :meth:`generate` a model
                running ``sdpa``.
            kv_nvme_layers: with host attention, the last layers of keys and values homed on
                NVMe (memory-mapped files under ``kv_nvme_dir``; see
                :class:`~bb_lightning.engine.kv.KVCache`).
            kv_nvme_dir: where those files go (None: the system's temporary directory).
            attention_groups: with host attention, groups of sequences in flight in each
                step (>= 1; a batch of fewer rows runs one group per row); None:
                :data:`~bb_lightning.placement.DECODE_GROUPS` beside a device other than
                the CPU, 1 on the CPU (the host is the device: nothing to overlap).
            kv_store: the engine's store: a ``kv_tier`` HOST cache beside attention on a
                device that is not the host keeps its layers in the store's host tier
                (:class:`~bb_lightning.engine.kv.KVCache`); :meth:`close` gives them back.
        """
        if attention_tier not in (None, Tier.DEVICE, Tier.HOST):
            raise ValueError(
                f"attention_tier={attention_tier!r}: use Tier.DEVICE, Tier.HOST or None"
            )
        if attention_tier is Tier.HOST and kv_tier is not Tier.HOST:
            raise ValueError(
                f"attention_tier=host with kv_tier={kv_tier!r}: attention runs where the cache "
                "lives; set kv_tier=Tier.HOST or attention_tier=None"
            )
        if kv_nvme_layers and attention_tier is not Tier.HOST:
            raise ValueError(
                f"kv_nvme_layers={kv_nvme_layers} with attention_tier={attention_tier!r}: a KV "
                "cache spills to NVMe only beside host attention; pass attention_tier=Tier.HOST"
            )
        if attention_groups is not None and (
            attention_groups < 1 or (attention_groups > 1 and attention_tier is not Tier.HOST)
        ):
            raise ValueError(
                f"attention_groups={attention_groups} with attention_tier={attention_tier!r}: "
                "groups of sequences in flight (>= 1) serve host attention; pass "
                "attention_tier=Tier.HOST, or attention_groups=1 or None"
            )
        self.attention_groups = attention_groups
        """Groups of sequences in flight per step with host attention (None: by device)."""
        self.model = model
        self.kv_tier = kv_tier
        self.attention_tier = attention_tier
        self.kv_nvme = (kv_nvme_layers, kv_nvme_dir)
        """(layers of keys and values homed on NVMe, their directory)."""
        self.kv_store = kv_store
        """The store whose host tier homes a ``kv_tier`` HOST cache paged to the device
        (:mod:`~bb_lightning.engine.kv_paged`); None: the cache holds its own buffers."""
        self.context = model_context(getattr(model, "config", None))
        """Longest sequence the model takes (tokens), or None when the config has no limit."""
        config = getattr(model, "config", None)
        self.cache_limit = None if config is None else static_cache_limit(config)
        """Most positions of a static KV cache the model generates right with, and why
        (:func:`~bb_lightning.engine.hf_quirks.static_cache_limit`), or None."""
        self._kvs: list[KVCache] = []
        """Each group's KV cache (one group: one cache)."""
        self._pool: tuple[int, ThreadPoolExecutor] | None = None
        """(workers, pool): threads of the groups beside the caller's (made at the first
        grouped batch)."""
        self._cache_kw, self._logits_kw = forward_options(model)
        self._quiet = unread_outputs_off(model)
        self.steps = 0
        """Forward passes (prefill and decode steps) run so far."""
        self.seconds = {"prefill": 0.0, "decode": 0.0}
        """Wall seconds spent so far in prefill and in decode steps (host read of the tokens
        included: the step's sync point)."""

    @property
    def _kv(self) -> KVCache | None:
        """The first group's KV cache (the whole batch's with one group), or None."""
        return self._kvs[0] if self._kvs else None

    def _cache(self, rows: int, max_len: int) -> KVCache:
        """The KV cache of a batch of ``rows`` sequences run as one group (:meth:`_caches`)."""
        return self._caches([rows], max_len)[0]

    def _caches(self, rows: Sequence[int], max_len: int) -> list[KVCache]:
        """One KV cache per group of ``rows[g]`` sequences, reused while batches have groups
        of as many rows and fit their length.

        Lengths are rounded up to a multiple of ``CACHE_ROUND`` (32) tokens so that batches
        of ragged prompts share one cache.
        """
        if len(self._kvs) != len(rows) or not all(
            kv.fits(n, max_len) for kv, n in zip(self._kvs, rows, strict=True)
        ):
            max_len = cache_length(max_len)
            if self.cache_limit is not None:  # no rounding past it (the rows fit it)
                max_len = min(max_len, max(self.cache_limit[0], 1))
            self.close()  # free the old buffers before allocating new ones
            self._kvs = [self._new_cache(n, max_len) for n in rows]
        for kv in self._kvs:
            kv.reset()
        return self._kvs

    def _new_cache(self, rows: int, max_len: int) -> KVCache:
        config = self.model.config
        assert isinstance(config, PretrainedConfig), "a Hugging Face model has a config"
        return KVCache(
            config, rows=rows, max_len=max_len, tier=self.kv_tier,
            device=_device_of(self.model), host_attention=self.attention_tier is Tier.HOST,
            nvme_layers=self.kv_nvme[0], nvme_dir=self.kv_nvme[1], store=self.kv_store,
        )  # fmt: skip

    def close(self) -> None:
        """Drop the KV caches, giving back what they hold in the store; the next batch
        builds new ones."""
        for kv in self._kvs:
            kv.close()
        self._kvs = []

    def _groups(self, device: torch.device) -> int:
        """Groups of sequences in flight per step on ``device`` (see ``attention_groups``)."""
        if self.attention_tier is not Tier.HOST:
            return 1
        if self.attention_groups is not None:
            return self.attention_groups
        return DECODE_GROUPS if device.type != "cpu" else 1

    def _forward_groups(self, calls: Sequence[_Call]) -> list[Tensor]:
        """:meth:`_forward` of each group's ``(ids, mask, pos, cache_pos, kv)``, the groups
        side by side (one step: :attr:`steps` counts one)."""
        workers = len(calls) - 1
        if workers and (self._pool is None or self._pool[0] < workers):
            if self._pool is not None:
                self._pool[1].shutdown(wait=False)
            made = ThreadPoolExecutor(workers, "bb-generate-group")
            weakref.finalize(self, made.shutdown, wait=False)
            self._pool = (workers, made)
        pool = None if self._pool is None else self._pool[1]
        out = run_groups([partial(self._forward, *c, count=False) for c in calls], pool)
        self.steps += 1
        return out

    def _forward(
        self, ids: Tensor, mask: Tensor | None, pos: Tensor, cache_pos: Tensor, kv: KVCache,
        *, count: bool = True,
    ) -> Tensor:  # fmt: skip
        kwargs: dict[str, Any] = {
            "input_ids": ids,
            "attention_mask": mask,
            "position_ids": pos,
            "cache_position": cache_pos,
            "use_cache": True,
            self._cache_kw: kv.cache,
            **self._quiet,
        }
        if self._logits_kw:
            kwargs["logits_to_keep"] = 1
        self.steps += count
        try:
            with one_forward():  # the layers share what their attention derives from a mask
                logits: Tensor = self.model(**kwargs).logits
        except (RuntimeError, AssertionError, IndexError) as err:
            broken = isinstance(err, threading.BrokenBarrierError)  # another group failed
            if broken or isinstance(err, torch.OutOfMemoryError) or not _from_model_code(err):
                raise
            config = getattr(self.model, "config", None)
            raise ValueError(
                f"model_type={getattr(config, 'model_type', '?')!r} "
                f"({type(self.model).__name__}) failed inside its own forward on a static KV "
                f"cache with a cache-long attention mask ({type(err).__name__}: "
                f"{str(err).splitlines()[0] if str(err) else 'no message'}): generate with "
                "transformers (model.generate) under plain Lightning"
            ) from err
        return logits[:, -1, :]

    def check_prompt(self, length: int, new_tokens: int = 0) -> str | None:
        """Why a prompt of ``length`` tokens followed by up to ``new_tokens`` new ones cannot
        run (None: it can)."""
        if length < 1:
            return "prompt has 0 tokens"
        if self.context is not None and length >= self.context:
            return (
                f"prompt has {length} tokens >= the model's context of {self.context}: "
                f"shorten it below {self.context} tokens"
            )
        if self.cache_limit is not None and length + new_tokens > self.cache_limit[0]:
            limit, why = self.cache_limit
            config = getattr(self.model, "config", None)
            return (
                f"prompt has {length} tokens + {new_tokens} new > {limit}: "
                f"model_type={getattr(config, 'model_type', '?')!r} generates on balance_beam's "
                f"static KV cache only up to {limit} positions ({why}); shorten the prompt to "
                f"{max(limit - new_tokens, 0)} tokens or lower max_new_tokens, or generate with "
                "transformers (model.generate) under plain Lightning"
            )
        return None

    @torch.inference_mode()
    def generate(
        self,
        input_ids: Tensor,
        attention_mask: Tensor,
        config: GenerationConfig,
        *,
        seeds: Sequence[int] | None = None,
        decode: Callable[[list[int]], str] | None = None,
    ) -> list[Generated]:
        """Extend every row of a left-padded batch; one :class:`Generated` per row.

        Args:
            input_ids: ``[batch, prompt_len]`` token ids, left-padded.
            attention_mask: ``[batch, prompt_len]``, 1 on prompt tokens, 0 on padding.
            config: decoding settings.
            seeds: one sampling seed per row (needed when ``config`` samples).
            decode: token ids -> text, for ``text`` and stop strings.

        Raises ``ValueError`` when a row has no token or is too long for the model's
        context (check rows with :meth:`check_prompt` first to report them per prompt).
        """
        if input_ids.ndim != 2 or input_ids.shape != attention_mask.shape:
            raise ValueError(
                f"input_ids {tuple(input_ids.shape)} and attention_mask "
                f"{tuple(attention_mask.shape)} must be the same [batch, prompt_len] shape"
            )
        if config.stop_strings and decode is None:
            raise ValueError(f"stop_strings={config.stop_strings!r} need a decode function")
        rows, plen = input_ids.shape
        if not config.greedy and (seeds is None or len(seeds) != rows):
            raise ValueError(
                f"sampling needs one seed per row: got {None if seeds is None else len(seeds)} "
                f"seeds for {rows} rows"
            )
        lengths = attention_mask.sum(-1).tolist()
        for n in lengths:
            if (why := self.check_prompt(int(n), config.max_new_tokens)) is not None:
                raise ValueError(why)
        device = _device_of(self.model)
        total = plen + config.max_new_tokens
        if self.context is not None:
            total = min(total, self.context + plen - int(max(lengths)))
        if self.cache_limit is not None and total > self.cache_limit[0]:
            raise ValueError(
                f"a batch {plen} tokens wide + {config.max_new_tokens} new > "
                f"{self.cache_limit[0]} positions ({self.cache_limit[1]}): drop the padding "
                "columns no prompt uses, or lower max_new_tokens"
            )
        if self.attention_tier is Tier.HOST and not uses_sdpa(self.model):
            impl = getattr(getattr(self.model, "config", None), "_attn_implementation", None)
            raise ValueError(
                f"attention_tier=host with attn_implementation={impl!r}: host attention serves "
                "models running 'sdpa'; load the model with attn_implementation='sdpa' or run "
                "attention on the device (attention_tier=None; --decode-attention device)"
            )
        run = _Run(self, config, rows, plen, total, device, seeds, decode)
        with decode_attention_for(self.model, host=self.attention_tier is Tier.HOST):
            return run.run(input_ids.to(device), attention_mask.to(device))


class _Group:
    """One group's rows of a generation batch: its KV cache, mask buffer and live rows."""

    def __init__(self, kv: KVCache, rows: range, device: torch.device) -> None:
        self.kv = kv
        # as long as the static cache (zeros past the tokens so far), as a model that builds
        # positions from the mask's width (alibi) needs it, and as transformers pads it
        self.mask = torch.zeros(len(rows), kv.max_len, dtype=torch.long, device=device)
        self.live = list(rows)
        """Original row index of each row still in the group."""
        self.logits: Tensor | None = None
        """Last-position logits of the group's rows from its last forward."""
        self.pos = torch.zeros(len(rows), 1, dtype=torch.long, device=device)
        """Position id of each row's next token."""

    def compact(self, done: list[int], tokens: Tensor) -> Tensor:
        """Drop the rows ``done`` (positions in the group) from the cache and the buffers;
        the tokens of the rows kept."""
        gone = set(done)
        keep_b = [b for b in range(len(self.live)) if b not in gone]
        keep = torch.tensor(keep_b, device=tokens.device)
        self.kv.compact(keep)
        n = len(keep_b)
        self.mask[:n] = self.mask.index_select(0, keep)
        self.mask = self.mask[:n]
        self.live = [self.live[b] for b in keep_b]
        self.pos = self.pos.index_select(0, keep)
        return tokens.index_select(0, keep)


class _Run:
    """The state of one generation batch: its groups, results."""

    def __init__(
        self,
        gen: LayerMajorGenerator,
        config: GenerationConfig,
        rows: int,
        plen: int,
        total: int,
        device: torch.device,
        seeds: Sequence[int] | None,
        decode: Callable[[list[int]], str] | None,
    ) -> None:
        self.gen, self.config, self.plen, self.total = gen, config, plen, total
        self.decode = decode
        spans = group_spans(rows, gen._groups(device))
        kvs = gen._caches([b - a for a, b in spans], total)
        self.groups = [
            _Group(kv, range(a, b), device) for kv, (a, b) in zip(kvs, spans, strict=True)
        ]
        self.spans = spans
        self.cache_pos = torch.arange(total, device=device)
        self.results: list[Generated | None] = [None] * rows
        self.raw: list[list[int]] = [[] for _ in range(rows)]
        self.longest_stop = max((len(x) for x in config.stop_strings), default=0)
        self.gens = (
            None
            if config.greedy or seeds is None
            else [torch.Generator().manual_seed(int(s)) for s in seeds]
        )

    def run(self, input_ids: Tensor, attention_mask: Tensor) -> list[Generated]:
        plen, total, seconds = self.plen, self.total, self.gen.seconds
        start = time.perf_counter()
        calls: list[_Call] = []
        for g, (a, b) in zip(self.groups, self.spans, strict=True):
            g.mask[:, :plen] = attention_mask[a:b]
            pos = attention_mask[a:b].long().cumsum(-1) - 1
            pos.masked_fill_(attention_mask[a:b] == 0, 1)
            mask = g.mask[:, :plen] if g.kv.has_states else g.mask
            calls.append((input_ids[a:b], mask, pos, self.cache_pos[:plen], g.kv))
            g.pos = pos[:, -1:] + 1
        self._forward(self.groups, calls)
        running: list[_Group] = list(self.groups)
        for cur in range(plen, total + 1):
            chosen = [(g, self._choose(g)) for g in running]
            hosts = [tokens.tolist() for _, tokens in chosen]  # the step's one sync point
            now = time.perf_counter()
            seconds["prefill" if cur == plen else "decode"] += now - start
            start = now
            running, calls = [], []
            for (g, tokens), host in zip(chosen, hosts, strict=True):
                done = self._record(g, host, at_limit=cur == total)
                if len(done) == len(g.live):
                    continue  # the group is done
                if done and 2 * (len(g.live) - len(done)) <= g.mask.shape[0]:
                    tokens = g.compact(done, tokens)
                g.mask[:, cur] = 1
                calls.append((
                    tokens[:, None], g.mask if g.kv.attends else None, g.pos,
                    self.cache_pos[cur : cur + 1], g.kv,
                ))  # fmt: skip
                running.append(g)
            if not running:
                break
            self._forward(running, calls)
            for g in running:
                g.pos = g.pos + 1
        out = [r for r in self.results if r is not None]
        assert len(out) == len(self.results), "every row finishes"
        return out

    def _forward(self, groups: list[_Group], calls: list[_Call]) -> None:
        for g, logits in zip(groups, self.gen._forward_groups(calls), strict=True):
            g.logits = logits

    def _choose(self, g: _Group) -> Tensor:
        assert g.logits is not None, "a group's forward ran before its tokens are chosen"
        if self.gens is None:
            return g.logits.max(-1).indices  # the first largest, as argmax (and faster)
        return _sample(g.logits.float(), self.config, [self.gens[i] for i in g.live])

    def _record(self, g: _Group, tokens: list[int], *, at_limit: bool) -> list[int]:
        """Append each of the group's live rows' token; finish rows; return the positions in
        the group that finished."""
        cfg = self.config
        done: list[int] = []
        for b, (row, t) in enumerate(zip(g.live, tokens, strict=True)):
            if self.results[row] is not None:
                continue  # finished but not compacted away yet
            raw = self.raw[row]
            reason: FinishReason | None = None
            if t in cfg.eos_token_ids:
                reason = "eos"
            else:
                raw.append(t)
                if cfg.stop_strings and self._stopped(raw):
                    reason = "stop"
                elif len(raw) >= cfg.max_new_tokens:
                    reason = "length"
                elif at_limit:
                    reason = "context"
            if reason is not None:
                self.results[row] = self._finish(raw, reason)
                done.append(b)
        done += [b for b, row in enumerate(g.live) if self.results[row] is not None]
        return sorted(set(done))

    def _stopped(self, raw: list[int]) -> bool:
        """Whether the text of the last tokens holds a stop string (a token is >= 1 char)."""
        assert self.decode is not None
        tail = self.decode(raw[-(4 * self.longest_stop + 4) :])
        return any(s in tail for s in self.config.stop_strings)

    def _finish(self, raw: list[int], reason: FinishReason) -> Generated:
        if self.decode is None:
            return Generated(token_ids=list(raw), finish_reason=reason)
        text = self.decode(raw)
        ids = list(raw)
        if reason == "stop":
            text = text[: min(text.find(s) for s in self.config.stop_strings if s in text)]
            while ids and len(self.decode(ids)) > len(text):
                ids.pop()
        return Generated(token_ids=ids, finish_reason=reason, text=text)


def _sample(logits: Tensor, cfg: GenerationConfig, gens: Sequence[torch.Generator]) -> Tensor:
    """One token per row: temperature, top-k, top-p, then inverse CDF of a seeded uniform."""
    logits = logits / cfg.temperature
    if cfg.top_k > 0 and cfg.top_k < logits.shape[-1]:
        kth = logits.topk(cfg.top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = logits.softmax(-1)
    sorted_p, order = probs.sort(dim=-1, descending=True)
    cdf = sorted_p.cumsum(-1)
    if cfg.top_p < 1.0:
        # keep the smallest prefix reaching top_p: drop a token when the mass before it does
        sorted_p = sorted_p.masked_fill(cdf - sorted_p >= cfg.top_p, 0.0)
        cdf = sorted_p.cumsum(-1)
    u = torch.cat([torch.rand(1, generator=g) for g in gens]).to(logits.device)
    u = u * cdf[:, -1]
    idx = torch.searchsorted(cdf, u[:, None]).clamp_(max=cdf.shape[-1] - 1)
    return order.gather(-1, idx).squeeze(-1)


def _device_of(model: nn.Module) -> torch.device:
    for p in model.parameters():
        if p.numel() > 0:
            return p.device
    return torch.device("cpu")


def _from_model_code(err: BaseException) -> bool:
    """Whether ``err`` passed through a transformers model file (a family's forward that
    assumes another cache layout), not only through our code or torch's."""
    tb = err.__traceback__
    while tb is not None:
        if f"{os.sep}transformers{os.sep}models{os.sep}" in tb.tb_frame.f_code.co_filename:
            return True
        tb = tb.tb_next
    return False
