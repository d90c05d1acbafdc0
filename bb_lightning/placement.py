"""The Placement: every choice the engine executes, produced by the planner (or given).

One frozen value object crosses from planning to execution: the planner builds it
(:class:`~bb_lightning.planner.plan.Plan` carries it beside its predictions), the
engine runs it as is. It holds what the engine can honour and nothing else: per-block
homes of the weights, optimizer state and gradient accumulators, whether the blocks
used in place are recomputed, the compute dtype, how far ahead page-ins and state
reads run, the KV-cache tier and the prefill chunk of generation. The parameters
outside the blocks (embedding, final norm, head) always live on the device: a fact
of the engine, not a choice.

This module imports nothing of ours but :mod:`storage.tiers`, so that both the planner
and the engine may import it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from storage.tiers import Tier

__all__ = ["DTYPE_BYTES", "READ_AHEAD", "Placement"]

READ_AHEAD = 2
"""Read-ahead sets of a placement whose optimizer state is homed off the host, unless the
planner gives more (three fp32 host buffers of the largest block each)."""

DTYPE_BYTES: dict[str, int] = {"bfloat16": 2, "float16": 2, "float32": 4}
"""Bytes per element of each compute dtype the engine runs, by its torch name."""


@dataclass(frozen=True, kw_only=True)
class Placement:
    """Where each block's tensors live, the compute dtype, and how far ahead copies run."""

    weights: tuple[Tier, ...]
    """Home tier of each block's compute-dtype weights (DEVICE = resident)."""
    master: tuple[Tier, ...]
    """Home tier of each block's fp32 master weights and AdamW moments; empty for a
    weights-only (inference) placement."""
    prefetch_depth: int = 1
    """Blocks paged in ahead of the one computing (>= 1); the device holds depth + 1 blocks."""
    grads: tuple[Tier, ...] | None = None
    """Home tier of each block's fp32 gradient accumulator; None: as ``master``."""
    recompute_resident: bool = False
    """Checkpoint the blocks used in place too, recomputing them in backward: resident
    (DEVICE-home) blocks, and on a CPU device HOST-home blocks (paged in as their host
    memory itself). False keeps their activations (ordinary autograd: more activation
    memory, no recompute). Blocks copied in from another tier are always recomputed."""
    read_ahead: int = READ_AHEAD
    """Blocks whose optimizer state, where homed off the host, is read ahead of their
    optimizer step, each into its own host buffers (three fp32 tensors of the largest
    block); >= 1. More blocks give the reads more of the step to run in, at
    ``12 * largest block params`` host bytes each."""
    compute_dtype: str = "bfloat16"
    """Dtype of the weights the device computes with, a key of :data:`DTYPE_BYTES`."""
    kv_cache: Tier | None = None
    """Tier of the generator's KV cache (predict); None: the generator's default (device)."""
    prefill_tokens: int | None = None
    """Most tokens per prefill forward (a batch runs in chunks of whole rows); None: the
    whole batch at once."""

    def __post_init__(self) -> None:
        if self.master and len(self.weights) != len(self.master):
            raise ValueError(
                f"placement has {len(self.weights)} weight tiers but {len(self.master)} master "
                "tiers: give one of each per block (or no master tiers for inference)"
            )
        if self.grads is not None and len(self.grads) != len(self.master):
            raise ValueError(
                f"placement has {len(self.grads)} gradient tiers but {len(self.master)} master "
                "tiers: give one of each per block, or grads=None"
            )
        if self.prefetch_depth < 1:
            raise ValueError(f"prefetch_depth={self.prefetch_depth} must be >= 1: pass 1 or more")
        if self.read_ahead < 1:
            raise ValueError(f"read_ahead={self.read_ahead} must be >= 1: pass 1 or more")
        if self.compute_dtype not in DTYPE_BYTES:
            raise ValueError(
                f"compute_dtype={self.compute_dtype!r} is not supported: use one of "
                f"{sorted(DTYPE_BYTES)}"
            )
        if self.prefill_tokens is not None and self.prefill_tokens < 1:
            raise ValueError(
                f"prefill_tokens={self.prefill_tokens} must be >= 1 tokens, or None (whole batch)"
            )

    @property
    def num_blocks(self) -> int:
        """Blocks the placement covers."""
        return len(self.weights)

    @property
    def grad_tiers(self) -> tuple[Tier, ...]:
        """Home tier of each block's gradient accumulator (``grads``, else ``master``)."""
        return self.master if self.grads is None else self.grads

    @property
    def compute_bytes(self) -> int:
        """Bytes per element of the compute dtype."""
        return DTYPE_BYTES[self.compute_dtype]

    @property
    def resident_blocks(self) -> int:
        """Blocks whose weights are homed on the device."""
        return sum(w is Tier.DEVICE for w in self.weights)

    @property
    def reads_ahead(self) -> bool:
        """Whether the engine keeps read-ahead buffers: some optimizer state is off the host."""
        return any(t is not Tier.HOST for t in self.master)

    def copied_blocks(self, in_place: frozenset[Tier]) -> tuple[int, ...]:
        """Blocks paged in by copy: homed off ``in_place`` (the tiers used without a copy)."""
        return tuple(i for i, w in enumerate(self.weights) if w not in in_place)

    def recomputed_blocks(self, in_place: frozenset[Tier]) -> tuple[int, ...]:
        """Blocks whose forward runs again in backward (training), as the engine runs it:
        those paged in by copy, plus the ones used in place with ``recompute_resident``."""
        if self.recompute_resident:
            return tuple(range(self.num_blocks))
        return self.copied_blocks(in_place)

    @classmethod
    def uniform(
        cls,
        num_blocks: int,
        *,
        weights: Tier,
        master: Tier = Tier.HOST,
        prefetch_depth: int = 1,
        grads: Tier | None = None,
        compute_dtype: str = "bfloat16",
    ) -> Placement:
        """Every block's weights on ``weights``, optimizer state on ``master``, gradient
        accumulators on ``grads`` (None: ``master``)."""
        return cls(
            weights=(weights,) * num_blocks,
            master=(master,) * num_blocks,
            prefetch_depth=prefetch_depth,
            grads=None if grads is None else (grads,) * num_blocks,
            compute_dtype=compute_dtype,
        )

    # ------------------------------------------------------------ JSON
    def to_dict(self) -> dict[str, Any]:
        """JSON-friendly dict (tiers as their names); :meth:`from_dict` inverts it."""
        return {
            "weights": [t.value for t in self.weights],
            "master": [t.value for t in self.master],
            "grads": None if self.grads is None else [t.value for t in self.grads],
            "prefetch_depth": self.prefetch_depth,
            "recompute_resident": self.recompute_resident,
            "read_ahead": self.read_ahead,
            "compute_dtype": self.compute_dtype,
            "kv_cache": None if self.kv_cache is None else self.kv_cache.value,
            "prefill_tokens": self.prefill_tokens,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Placement:
        """Inverse of :meth:`to_dict`."""
        d = dict(d)
        grads, kv = d.pop("grads"), d.pop("kv_cache")
        return cls(
            weights=tuple(Tier(t) for t in d.pop("weights")),
            master=tuple(Tier(t) for t in d.pop("master")),
            grads=None if grads is None else tuple(Tier(t) for t in grads),
            kv_cache=None if kv is None else Tier(kv),
            **d,
        )
