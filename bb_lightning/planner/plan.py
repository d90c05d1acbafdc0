"""The Plan: frozen data the engine executes and a person reads (:meth:`Plan.explain`)."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from typing import Any

from bb_lightning.placement import Placement
from bb_lightning.planner.cost import flops_utilisation
from bb_lightning.planner.job import FitJob, PredictJob
from bb_lightning.planner.profile import HardwareProfile, ModelProfile
from storage.tiers import PRICED_LINKS, Link, Tier, format_bytes, format_count

__all__ = [
    "LINKS",
    "LINK_FIELDS",
    "Plan",
    "PlanOverrides",
    "PredictedTime",
    "Roofline",
    "TierMemory",
    "placement_tiers",
]

LINKS = PRICED_LINKS
"""Copy links the cost model prices: NVMe read, NVMe write, host to device, device to host."""

LINK_FIELDS: dict[Link, str] = {link: link.value for link in PRICED_LINKS}
"""The :class:`PredictedTime` field of each priced link's busy seconds: the link's own name
(its value), also its key in the plan's JSON (``roofline``) and the stem of the
``MeasuredTimes`` field."""


@dataclass(frozen=True, kw_only=True)
class PlanOverrides:
    """A partial :class:`~bb_lightning.placement.Placement` and batch shape forced on the
    search (``None`` = let the search choose): the tiers, resident blocks, prefetch depth
    and recompute policy of the placement the plan carries, and the batch around it."""

    micro_batch: int | None = None
    """Sequences per forward/backward pass (fit) or per prefill kernel (predict)."""
    grad_accum: int | None = None
    """Micro-batches per optimizer step (fit)."""
    concurrent_seqs: int | None = None
    """Sequences generated together, i.e. tokens per decode pass (predict)."""
    prefetch_depth: int | None = None
    """Blocks paged in ahead of the one computing (>= 1)."""
    checkpointing: bool | None = None
    """Per-block activation checkpointing (fit)."""
    resident_blocks: int | None = None
    """Blocks whose bf16 weights stay on the device."""
    weights_tier: Tier | None = None
    """Home tier of every block's bf16 weights."""
    master_tier: Tier | None = None
    """Tier of every block's fp32 master weights and AdamW moments (fit)."""
    hold_grads: bool = False
    """Let the search hold the earlier micro-batches' gradients and sum them once
    (``Placement.hold_grads``; a CPU device of one rank, several micro-batches per step)
    where memory allows and its price is lower (fit). Off unless asked: measured, a step
    took no less time than with the fp32 accumulator (``bench/grad_hold.py``)."""
    decode_attention: Tier | None = None
    """Where decode attention runs (predict): HOST prices the KV cache on the host with
    attention on the host's cores only (``Placement.decode_attention``; two groups of
    sequences in flight, priced and run), DEVICE the device's attention only; None: the
    faster of the two beside a GPU whose profile has ``host_memory_bandwidth``, else the
    device's."""
    chunked: bool = True
    """Let the search run the recomputed blocks' micro-batch in chunks of sequences, with
    their boundary inputs on the device, the host or NVMe (``Placement.chunk_rows``,
    ``Placement.boundaries``; fit); False: every micro-batch in one piece."""
    chunk_rows: int | None = None
    """Sequences per chunk of the recomputed blocks (fit; forces chunked execution)."""
    boundaries: Tier | None = None
    """Where chunked blocks keep their boundary inputs: DEVICE, HOST or NVME (fit)."""
    swap_activations: bool = True
    """Price keeping the saved activations of recomputed blocks on the host instead of
    recomputing them, per block where the links have headroom, against recomputing them
    all, and keep the cheaper (fit; the plan's ``Placement.swapped``); False: every
    paged block recomputes."""

    def __post_init__(self) -> None:
        """Refuse values out of range, one line naming the field, the value and the range."""
        for name, low, what in (
            ("micro_batch", 1, "sequences per pass"),
            ("grad_accum", 1, "micro-batches per optimizer step"),
            ("concurrent_seqs", 1, "sequences generated together"),
            ("prefetch_depth", 1, "blocks paged in ahead"),
            ("resident_blocks", 0, "blocks kept on the device"),
            ("chunk_rows", 1, "sequences per chunk"),
        ):
            value = getattr(self, name)
            ok = isinstance(value, int) and not isinstance(value, bool) and value >= low
            if value is not None and not ok:
                raise ValueError(
                    f"PlanOverrides.{name}={value!r}: must be an integer >= {low} ({what}), "
                    "or null to let the planner choose"
                )
        for name in ("weights_tier", "master_tier", "decode_attention", "boundaries"):
            object.__setattr__(self, name, _tier(name, getattr(self, name)))
        if self.decode_attention is Tier.NVME:
            raise ValueError(
                "PlanOverrides.decode_attention='nvme': attention "
                "runs on the device or the host: use 'device', 'host' or null"
            )

    def to_dict(self) -> dict[str, Any]:
        """JSON-friendly dict (tiers as their names)."""
        d = dataclasses.asdict(self)
        for key in ("weights_tier", "master_tier", "decode_attention", "boundaries"):
            if d[key] is not None:
                d[key] = Tier(d[key]).value
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> PlanOverrides:
        """Inverse of :meth:`to_dict`."""
        d = dict(d)
        for key in ("weights_tier", "master_tier", "decode_attention", "boundaries"):
            if d.get(key) is not None:
                d[key] = Tier(d[key])
        return cls(**d)


def _tier(name: str, value: object) -> Tier | None:
    """``value`` as a :class:`Tier` (its value or name in any case), or None."""
    if value is None or isinstance(value, Tier):
        return value
    for tier in Tier:
        if isinstance(value, str) and value.strip().lower() == tier.value:
            return tier
    names = ", ".join(t.name for t in Tier)
    raise ValueError(
        f"PlanOverrides.{name}={value!r}: must be a tier, one of {names}, or null to let "
        "the planner choose"
    )


@dataclass(frozen=True, kw_only=True)
class PredictedTime:
    """Predicted seconds per step (fit: one optimizer step; predict: one batch of prompts)."""

    compute: float
    """Device compute, seconds."""
    nvme_read: float
    """Busy time of the NVMe read link, seconds."""
    nvme_write: float
    """Busy time of the NVMe write link, seconds."""
    h2d: float
    """Busy time of the host-to-device link, seconds."""
    d2h: float
    """Busy time of the device-to-host link, seconds."""
    optimizer: float
    """Host AdamW arithmetic, seconds (0 for predict)."""
    exposed: float
    """Seconds of transfers and optimizer not hidden behind compute."""
    total: float
    """Step time, seconds: ``compute + exposed``."""
    net: float = 0.0
    """Busy time of one rank's network link (its ring collectives with the other
    data-parallel ranks), seconds (0 for one rank)."""

    @property
    def transfer(self) -> dict[Link, float]:
        """Busy seconds per priced link."""
        return {link: self.on(link) for link in LINKS}

    def on(self, link: Link) -> float:
        """Busy seconds of ``link``, priced as its :attr:`~storage.tiers.Link.priced_as`."""
        return float(getattr(self, LINK_FIELDS[Link(link).priced_as]))

    @property
    def bottleneck(self) -> str:
        """``compute`` when under 1% of the step is exposed, else the busiest link (its
        :data:`LINK_FIELDS` name) or ``optimizer``."""
        if self.exposed <= 0.01 * self.total:
            return "compute"
        phases = {LINK_FIELDS[k]: v for k, v in self.transfer.items()}
        phases["optimizer"] = self.optimizer
        if self.net > 0:
            phases["net"] = self.net
        return max(phases, key=lambda k: phases[k])


@dataclass(frozen=True, kw_only=True)
class TierMemory:
    """Bytes planned on one tier."""

    tier: Tier
    """The tier."""
    used: int
    """Bytes the plan places there."""
    budget: int
    """Bytes the plan may use there (capacity less the safety margin)."""
    capacity: int
    """Bytes the hardware profile offers."""

    @property
    def headroom(self) -> int:
        """``budget - used``, bytes."""
        return self.budget - self.used


@dataclass(frozen=True, kw_only=True)
class Roofline:
    """Per-pass quantities for a roofline plot (tokens per pass vs tokens/s)."""

    flops_per_token: float
    """Device FLOPs per token of a pass."""
    device_flops: float
    """Effective device FLOP/s."""
    bytes_per_pass: dict[Link, float] = field(default_factory=dict)
    """Bytes each link carries per pass regardless of its tokens (weights)."""
    bytes_per_token: dict[Link, float] = field(default_factory=dict)
    """Bytes each link carries per token of a pass (gradients excluded; KV cache)."""
    bandwidth: dict[Link, float] = field(default_factory=dict)
    """Effective bytes/s of each link."""

    _MAPS = ("bytes_per_pass", "bytes_per_token", "bandwidth")

    def to_dict(self) -> dict[str, Any]:
        """JSON-friendly dict, links keyed by their :data:`LINK_FIELDS` names."""
        d: dict[str, Any] = {"flops_per_token": self.flops_per_token}
        d["device_flops"] = self.device_flops
        for key in self._MAPS:
            d[key] = {LINK_FIELDS[link]: v for link, v in getattr(self, key).items()}
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Roofline:
        """Inverse of :meth:`to_dict`."""
        by_field = {name: link for link, name in LINK_FIELDS.items()}
        maps = {key: {by_field[k]: v for k, v in d.get(key, {}).items()} for key in cls._MAPS}
        return cls(flops_per_token=d["flops_per_token"], device_flops=d["device_flops"], **maps)

    def tokens_per_s(self, tokens_per_pass: float) -> float:
        """Predicted tokens/s of one pass of ``tokens_per_pass`` tokens (optimizer aside)."""
        seconds = tokens_per_pass * self.flops_per_token / self.device_flops
        for link, bw in self.bandwidth.items():
            nbytes = self.bytes_per_pass.get(link, 0.0)
            nbytes += self.bytes_per_token.get(link, 0.0) * tokens_per_pass
            seconds = max(seconds, nbytes / bw)
        return tokens_per_pass / seconds


def _tier_runs(placement: list[tuple[str, ...]]) -> list[tuple[int, int, tuple[str, ...]]]:
    runs: list[tuple[int, int, tuple[str, ...]]] = []
    for i, key in enumerate(placement):
        if runs and runs[-1][2] == key:
            runs[-1] = (runs[-1][0], i, key)
        else:
            runs.append((i, i, key))
    return runs


@dataclass(frozen=True, kw_only=True)
class Plan:
    """Where every tensor lives, the batch shape, and the predicted step time."""

    task: str
    """``"fit"`` or ``"predict"``."""
    job: FitJob | PredictJob
    """The job planned for."""
    model: ModelProfile
    """The model profile planned on."""
    hardware: HardwareProfile
    """The hardware profile planned on (efficiency factors included)."""
    overrides: PlanOverrides | None
    """Choices forced on the search, kept so that re-planning keeps them."""
    micro_batch: int
    """Sequences per forward/backward pass (fit) or per prefill kernel (predict)."""
    grad_accum: int
    """Micro-batches per optimizer step (fit; 1 for predict)."""
    concurrent_seqs: int
    """Sequences generated together (predict; 0 for fit)."""
    tokens_per_pass: int
    """Tokens each streamed weight pass serves (fit: micro_batch x seq_len; predict: decode)."""
    placement: Placement
    """What the engine executes: the blocks' homes, recompute policy, compute dtype,
    prefetch depth and read-ahead, KV-cache tier and prefill chunk."""
    memory: tuple[TierMemory, ...]
    """Bytes used and budgeted per tier (device, host, NVMe), of one rank (its share of
    what the node's ranks share, with data parallelism)."""
    predicted: PredictedTime
    """Predicted seconds per step."""
    tokens_per_s: float
    """Predicted throughput of the job: trained tokens/s (fit) or generated tokens/s
    (predict); with data parallelism ``world_size`` times one rank's."""
    mfu: float
    """Model FLOPs utilisation of one device: its model FLOP/s
    (:func:`~bb_lightning.planner.cost.model_flops_per_token` per processed token) over the
    datasheet peak, ``hardware.peak_flops`` (0.0 where no datasheet figure is known)."""
    limited_by: str
    """Why tokens per pass stopped rising: ``hidden``, ``memory`` or ``batch``."""
    roofline: Roofline
    """Per-pass data for the roofline plot."""
    reasons: tuple[str, ...] = ()
    """Why each choice was made, for people."""
    model_flops: float = 0.0
    """Model FLOP/s of one device (the numerator of :attr:`mfu`)."""

    # ------------------------------------------------------------ the placement's choices
    @property
    def weights(self) -> tuple[Tier, ...]:
        """Home tier of each block's compute-dtype weights (DEVICE = resident)."""
        return self.placement.weights

    @property
    def master(self) -> tuple[Tier, ...]:
        """Tier of each block's fp32 master weights and AdamW moments (empty for predict)."""
        return self.placement.master

    @property
    def grads(self) -> tuple[Tier, ...]:
        """Tier of each block's fp32 gradient accumulators (empty for predict)."""
        return self.placement.grad_tiers

    @property
    def prefetch_depth(self) -> int:
        """Blocks paged in ahead of the computing one."""
        return self.placement.prefetch_depth

    @property
    def read_ahead(self) -> int:
        """Blocks whose off-host optimizer state is read ahead of their step (fit)."""
        return self.placement.read_ahead

    @property
    def kv_cache(self) -> Tier | None:
        """Tier of the KV cache (predict; None for fit)."""
        return self.placement.kv_cache

    def _attention_where(self) -> str:
        """Where decode attention runs, for the batch line: ``""`` on the device."""
        if self.placement.decode_attention is not Tier.HOST:
            return ""
        return ", attention on host"

    @property
    def checkpointing(self) -> bool:
        """Whether some block is recomputed in backward or swaps its saved activations to
        the host instead (the search's checkpointing candidates; fit; False for predict)."""
        return bool(self.recomputed_blocks() or self.placement.swapped)

    def in_place_tiers(self) -> frozenset[Tier]:
        """Weight homes the engine uses in place, without a copy: DEVICE, and HOST when
        the device is the CPU (the two tiers share its memory)."""
        if self.hardware.device_type == "cpu":
            return frozenset((Tier.DEVICE, Tier.HOST))
        return frozenset((Tier.DEVICE,))

    def recomputed_blocks(self) -> tuple[int, ...]:
        """Blocks whose forward runs again in backward (fit), as the engine executes it:
        the blocks paged in by copy (homed off :meth:`in_place_tiers`), or every block
        with ``placement.recompute_resident`` (checkpointing forced where none is copied)."""
        if self.task != "fit":
            return ()
        return self.placement.recomputed_blocks(self.in_place_tiers())

    # ------------------------------------------------------------ JSON
    def to_dict(self) -> dict[str, Any]:
        """JSON-friendly dict; :meth:`from_dict` inverts it."""
        return {
            "task": self.task,
            "job": dataclasses.asdict(self.job),
            "model": self.model.to_dict(),
            "hardware": self.hardware.to_dict(),
            "overrides": None if self.overrides is None else self.overrides.to_dict(),
            **{
                k: getattr(self, k)
                for k in (
                    "micro_batch",
                    "grad_accum",
                    "concurrent_seqs",
                    "tokens_per_pass",
                    "tokens_per_s",
                    "mfu",
                    "model_flops",
                    "limited_by",
                )
            },
            "placement": self.placement.to_dict(),
            "memory": [
                {"tier": m.tier.value, "used": m.used, "budget": m.budget, "capacity": m.capacity}
                for m in self.memory
            ],
            "predicted": _predicted_dict(self.predicted),
            "roofline": self.roofline.to_dict(),
            "reasons": list(self.reasons),
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Plan:
        """Rebuild a Plan from :meth:`to_dict` output."""
        d = dict(d)
        job_cls = FitJob if d["task"] == "fit" else PredictJob
        return cls(
            job=job_cls(**d.pop("job")),
            model=ModelProfile.from_dict(d.pop("model")),
            hardware=HardwareProfile.from_dict(d.pop("hardware")),
            overrides=None if d["overrides"] is None else PlanOverrides.from_dict(d["overrides"]),
            placement=Placement.from_dict(d.pop("placement")),
            memory=tuple(
                TierMemory(
                    tier=Tier(m["tier"]), used=m["used"], budget=m["budget"], capacity=m["capacity"]
                )
                for m in d.pop("memory")
            ),
            predicted=PredictedTime(**d.pop("predicted")),
            roofline=Roofline.from_dict(d.pop("roofline")),
            reasons=tuple(d.pop("reasons")),
            **{k: v for k, v in d.items() if k != "overrides"},
        )

    def to_json(self, indent: int | None = 2) -> str:
        """The plan as JSON text."""
        return json.dumps(self.to_dict(), indent=indent)

    @classmethod
    def from_json(cls, text: str) -> Plan:
        """Inverse of :meth:`to_json`."""
        return cls.from_dict(json.loads(text))

    # ------------------------------------------------------------ explain
    def explain(self) -> str:
        """A compact table: job, batch shape, placement, memory, predicted time."""
        m, hw, p = self.model, self.hardware, self.predicted
        lines = [
            f"plan: {self.task} {m.name} ({format_count(m.total_params)} params, "
            f"{m.num_blocks} blocks of {format_bytes(m.block_bytes)}) on {hw.name}"
        ]
        if m.moe_summary() is not None:
            lines.append(str(m.moe_summary()))
        if self.task == "fit":
            lines.append(
                f"trains: {m.trainable_params:,} of {m.total_params:,} parameters"
                + ("" if m.full_fine_tune else " (the others frozen: no optimizer state)")
            )
        if isinstance(self.job, FitJob):
            lines.append(
                f"job: seq {self.job.seq_len} tokens, global batch {self.job.seqs_per_step} seqs "
                f"({self.job.tokens_per_step} tokens) per optimizer step"
            )
            lines.append(
                f"batch{' per rank' if hw.world_size > 1 else ''}: "
                f"micro-batch {self.micro_batch} x grad-accum {self.grad_accum}, "
                f"{self.tokens_per_pass} tokens per pass, prefetch depth {self.prefetch_depth}, "
                f"checkpointing {'on' if self.checkpointing else 'off'} "
                f"({len(self.recomputed_blocks())} of {len(self.weights)} blocks recomputed"
                + (f", {len(self.placement.swapped)} swapped" if self.placement.swapped else "")
                + f"; limited by {self.limited_by})"
            )
        else:
            lines.append(
                f"job: {self.job.num_prompts} prompts of {self.job.prompt_len} tokens, "
                f"{self.job.new_tokens} new tokens each"
            )
            lines.append(
                f"batch{' per rank' if hw.world_size > 1 else ''}: "
                f"{self.concurrent_seqs} concurrent sequences ({self.tokens_per_pass} "
                f"tokens per decode pass), prefill micro-batch {self.micro_batch}, prefetch depth "
                f"{self.prefetch_depth}, KV cache on {self.kv_cache.value if self.kv_cache else '-'}"
                f"{self._attention_where()} (limited by {self.limited_by})"
            )
        lines.append("placement:")
        per_block: list[tuple[str, ...]] = []
        for i, w in enumerate(self.weights):
            key = [f"weights {w.value}" + (" (resident)" if w is Tier.DEVICE else " (paged)")]
            if self.master:
                key.append(f"master {self.master[i].value}")
                key.append(f"grads {self.grads[i].value}")
            per_block.append(tuple(key))
        for first, last, run in _tier_runs(per_block):
            span = f"block {first}" if first == last else f"blocks {first}-{last}"
            lines.append(f"  {span}: " + " · ".join(run))
        lines.append(
            f"  embedding · head · final norm on the device · compute in "
            f"{self.placement.compute_dtype}"
        )
        ranks = hw.world_size
        lines.append(
            "memory:          used      budget    headroom" + (" (per rank)" if ranks > 1 else "")
        )
        for mem in self.memory:
            lines.append(
                f"  {mem.tier.value:<7} {format_bytes(mem.used):>11} {format_bytes(mem.budget):>11}"
                f" {format_bytes(mem.headroom):>11}"
            )
        if ranks > 1:
            lines.extend(self._data_parallel_lines())
        lines.append(
            f"step: {p.total:.3g} s = compute {p.compute:.3g} s + exposed {p.exposed:.3g} s "
            f"(bottleneck: {p.bottleneck})"
        )
        lines.append(
            "  busy: "
            + " · ".join(f"{LINK_FIELDS[k]} {v:.3g} s" for k, v in p.transfer.items())
            + f" · optimizer {p.optimizer:.3g} s"
        )
        unit = "trained" if self.task == "fit" else "generated"
        per_rank = (
            f" ({ranks} ranks x {self.tokens_per_s / ranks:.4g} per rank)" if ranks > 1 else ""
        )
        lines.append(
            f"throughput: {self.tokens_per_s:.4g} {unit} tokens/s{per_rank}, {self._rate()}"
        )
        if self.reasons:
            lines.append("why:")
            lines.extend(f"  - {r}" for r in self.reasons)
        return "\n".join(lines)

    def _rate(self) -> str:
        """The model FLOP/s in words: MFU against the datasheet peak where one is known,
        and the share of the matrix-product rate the plan is priced at beside it."""
        hw = self.hardware
        mfu, share = flops_utilisation(self.model_flops, hw)
        priced = f"{share:.1%} of the {_flops(hw.device_flops)} priced matrix-product rate"
        if hw.peak_flops > 0:
            return f"MFU {mfu:.1%} of the {_flops(hw.peak_flops)} datasheet peak ({priced})"
        return f"{_flops(self.model_flops)} model FLOP/s ({priced})"

    def _data_parallel_lines(self) -> list[str]:
        """explain()'s lines on the ranks: the layout, memory per node, the collectives."""
        hw, p = self.hardware, self.predicted
        g, n = hw.ranks_per_node, hw.world_size
        work = (
            f"trains its share of the global batch on its 1/{n} shard of every block "
            "(weights homed and paged in as shards, all-gathered on the device; gradients "
            "reduce-scattered there; master weights and moments), so a node's host and NVMe "
            f"hold {g}/{n} of one copy of the weights"
            if self.task == "fit"
            else "its own share of the prompts"
        )
        lines = [
            f"data parallel: {n} ranks, {g} per node on {hw.num_nodes} node(s); each rank {work}",
            f"  per node ({g} rank(s)): "
            + " · ".join(
                f"{mem.tier.value} {format_bytes(g * mem.used)} of {format_bytes(g * mem.capacity)}"
                for mem in self.memory
            ),
        ]
        if self.task == "fit":
            levels = f"within a node at {hw.intra_node_bandwidth / 1e9:.3g} GB/s" if g > 1 else ""
            if hw.num_nodes > 1:
                between = f"between nodes at {hw.inter_node_bandwidth / 1e9:.3g} GB/s per rank"
                levels = f"{levels}, then {between}" if levels else between
            lines.append(
                f"  collectives on the devices: {p.net:.3g} s busy per step (each page-in's "
                "all-gather before its block's compute, exposed; each block's reduce-scatter "
                f"beside the next block's backward), rings {levels}"
            )
        return lines


def _predicted_dict(predicted: PredictedTime) -> dict[str, Any]:
    """``predicted`` as a dict; ``net`` left out at 0 (one rank), as before ranks existed."""
    d = dataclasses.asdict(predicted)
    if not d["net"]:
        del d["net"]
    return d


def placement_tiers(count: int, device: int, host: int) -> tuple[Tier, ...]:
    """``device`` blocks on DEVICE, then ``host`` on HOST, the rest of ``count`` on NVME."""
    return (Tier.DEVICE,) * device + (Tier.HOST,) * host + (Tier.NVME,) * (count - device - host)


def _flops(rate: float) -> str:
    """FLOP/s in words: ``312 TFLOP/s``, ``27.5 GFLOP/s``."""
    for scale, unit in ((1e15, "PFLOP/s"), (1e12, "TFLOP/s"), (1e9, "GFLOP/s")):
        if rate >= scale:
            return f"{rate / scale:.3g} {unit}"
    return f"{rate / 1e6:.3g} MFLOP/s"
