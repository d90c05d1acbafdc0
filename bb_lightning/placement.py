"""The Placement: every choice the engine executes, produced by the planner (or given).

One frozen value object crosses from planning to execution: the planner builds it
(:class:`~bb_lightning.planner.plan.Plan` carries it beside its predictions), the
engine runs it as is. It holds what the engine can honour and nothing else: per-block
homes of the weights, optimizer state and gradient accumulators, whether the blocks
used in place are recomputed, the compute dtype, how far ahead page-ins and state
reads run, the KV-cache tier and the prefill chunk of generation. The parameters
outside the blocks (embedding, final norm, head) always live on the device: a fact
of the engine, not a choice.

The manifest (:func:`training_manifest`, :func:`weights_manifest`) is the other half of
the contract: a pure function from the model's sizes and a placement to the list of
tensors the engine registers in the store (name, elements, dtype, home). The engines
register from it, the store budgets sum it, and the planner's byte counts agree with it.

This module imports nothing of ours but :mod:`storage.tiers`, so that both the planner
and the engine may import it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from storage.tiers import Tier

__all__ = [
    "BOUNDARY_PREFIX",
    "DECODE_GROUPS",
    "DTYPE_BYTES",
    "READ_AHEAD",
    "STATE_PIECE",
    "SWAP_PREFIX",
    "ModelSizes",
    "Placement",
    "StoredTensor",
    "boundary_manifest",
    "manifest_bytes",
    "state_pieces",
    "training_manifest",
    "weights_manifest",
]

READ_AHEAD = 2
"""Read-ahead sets of a placement whose optimizer state is homed off the host, unless the
planner gives more (three fp32 host buffers of one state piece each)."""

STATE_PIECE = 64 << 20
"""Elements (256 MiB of fp32) of the pieces the host AdamW step works through a block's
flat state in, unless a placement gives another size: each scratch and read-ahead buffer
holds one piece, so the optimizer's host buffers are bounded by it, not by the block."""

PIECE_ALIGN = 2048
"""Elements a state piece is a multiple of: whole 4 KiB file blocks in fp32 and in a
2-byte compute dtype, so a piece of state or weights on NVMe is read and written alone."""

DECODE_GROUPS = 2
"""Groups of sequences a decode step keeps in flight with ``decode_attention`` HOST beside
a device other than the CPU: the host attends for one group while the device computes for
another (two suffice to overlap the two)."""

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
    recomputed: tuple[int, ...] | None = None
    """The blocks whose forward runs again in backward, as a plan decided them for the
    device it priced (:meth:`recomputed_blocks`); the engine runs every other block but the
    ``swapped`` ones with ordinary autograd, and refuses a block it must copy in but the
    plan keeps bound.
    None: decided by the device the engine runs on (``recompute_resident`` above)."""
    read_ahead: int = READ_AHEAD
    """Pieces of blocks' optimizer state (:attr:`state_piece`), where homed off the host,
    read ahead of their optimizer step, each into its own host buffers (three fp32 tensors
    of one piece, or of the largest block where that is smaller); >= 1. More give the
    reads more of the step to run in, at 12 bytes per element each."""
    state_piece: int = STATE_PIECE
    """Elements of the pieces the host AdamW step reads, steps and writes a block's flat
    state in (a multiple of :data:`PIECE_ALIGN`): the optimizer's scratch and read-ahead
    buffers hold one piece each (the whole block where it is smaller), and the state and
    weights of a larger block are read and written piece by piece (each piece one
    sequential request per tensor)."""
    hold_grads: bool = False
    """Training with several micro-batches per step: keep each earlier micro-batch's
    gradients as the backward made them, in the compute dtype, and sum them into the
    fp32 accumulators once, in the window's last backward (``compute bytes * micro-batches
    + 4`` bytes of memory traffic per trained parameter instead of ``(compute bytes + 8)``
    per micro-batch), at ``compute bytes`` of memory per trained parameter and held
    micro-batch. Honoured where gradients arrive as host tensors of their own (a CPU
    device) and are not reduced across ranks as they come; ignored elsewhere."""
    compute_dtype: str = "bfloat16"
    """Dtype of the weights the device computes with, a key of :data:`DTYPE_BYTES`."""
    kv_cache: Tier | None = None
    """Tier of the generator's KV cache (predict); None: the generator's default (device)."""
    prefill_tokens: int | None = None
    """Most tokens per prefill forward (a batch runs in chunks of whole rows); None: the
    whole batch at once."""
    decode_attention: Tier | None = None
    """Where a decode step's attention over the KV cache runs (predict): HOST computes it
    with the host's cores over a cache homed on the host, the q/k/v rows of the new token
    sent there and the output sent back; None: on the device the model runs on (on a CPU
    device that is the host itself). The engine runs HOST beside any device, with
    :data:`DECODE_GROUPS` groups of sequences in flight beside a device other than the CPU."""
    kv_cache_nvme_blocks: int = 0
    """With ``decode_attention`` HOST, the last blocks whose KV cache is homed on NVMe where
    host memory ends (memory-mapped files under the store's NVMe path that the host's
    attention reads); 0: the whole cache in host memory."""
    chunk_rows: int | None = None
    """Training: rows (sequences) of the micro-batch each recomputed block runs at once
    while its weights are paged in once (forward chunk by chunk without grad, backward
    recomputing chunk by chunk and summing the block's weight gradients on the device
    before one hand-off); the last chunk may be shorter. None: the micro-batch in one
    piece. Blocks run with ordinary autograd (not recomputed) run whole."""
    boundaries: Tier | None = None
    """Training: where the recomputed blocks' boundary inputs (the hidden states and any
    other tensor argument needing gradient, kept from forward to backward) live: None or
    DEVICE on the device, HOST in host memory (pinned beside a GPU), NVME on the NVMe
    tier; stored, fetched back ahead of their block in backward, and freed after."""
    swapped: tuple[int, ...] | None = None
    """Training: paged blocks whose forward runs with autograd while their weights are
    paged in and whose saved activations go to the store's host tier (pinned beside a GPU)
    instead of being recomputed in backward: fetched back ahead of the block's backward,
    the saved weights re-bound to the block paged in again, and freed after. Disjoint from
    ``recomputed``; None or empty: no block swaps."""

    def __post_init__(self) -> None:
        for name in ("weights", "master", "grads"):
            value = getattr(self, name)
            if isinstance(value, str):  # a Tier is a str: its letters would pass for tiers
                raise ValueError(
                    f"{name}={value!r} is one tier, not one per block: give a tuple, e.g. "
                    f"{name}=({value!r},) * num_blocks, or Placement.uniform(num_blocks, ...)"
                )
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
        if (
            isinstance(self.state_piece, bool)
            or not isinstance(self.state_piece, int)
            or self.state_piece < PIECE_ALIGN
            or self.state_piece % PIECE_ALIGN
        ):
            raise ValueError(
                f"state_piece={self.state_piece!r} elements must be a multiple of "
                f"{PIECE_ALIGN} (4 KiB file blocks): pass one, e.g. {STATE_PIECE}"
            )
        if self.compute_dtype not in DTYPE_BYTES:
            raise ValueError(
                f"compute_dtype={self.compute_dtype!r} is not supported: use one of "
                f"{sorted(DTYPE_BYTES)}"
            )
        if self.decode_attention not in (None, Tier.DEVICE, Tier.HOST):
            raise ValueError(
                f"decode_attention={self.decode_attention!r}: use Tier.DEVICE, Tier.HOST or None"
            )
        if self.decode_attention is Tier.HOST and self.kv_cache is not Tier.HOST:
            raise ValueError(
                f"decode_attention=host with kv_cache={self.kv_cache!r}: attention runs on the "
                "host where the cache lives there; set kv_cache=Tier.HOST or decode_attention=None"
            )
        if self.kv_cache_nvme_blocks < 0 or (
            self.kv_cache_nvme_blocks and self.decode_attention is not Tier.HOST
        ):
            raise ValueError(
                f"kv_cache_nvme_blocks={self.kv_cache_nvme_blocks}: the KV cache spills to NVMe "
                "(>= 0 blocks) only with decode_attention=Tier.HOST; set it or pass 0"
            )
        if self.prefill_tokens is not None and self.prefill_tokens < 1:
            raise ValueError(
                f"prefill_tokens={self.prefill_tokens} must be >= 1 tokens, or None (whole batch)"
            )
        if self.chunk_rows is not None and (
            isinstance(self.chunk_rows, bool)
            or not isinstance(self.chunk_rows, int)
            or self.chunk_rows < 1
        ):
            raise ValueError(
                f"chunk_rows={self.chunk_rows!r} must be an int >= 1 rows per chunk, or None "
                "(the micro-batch in one piece)"
            )
        if self.boundaries is not None and not isinstance(self.boundaries, Tier):
            raise ValueError(
                f"boundaries={self.boundaries!r}: use Tier.DEVICE, Tier.HOST, Tier.NVME or None"
            )
        if self.swapped:
            self._check_swapped(self.swapped)

    def _check_swapped(self, swapped: tuple[int, ...]) -> None:
        """One line per bad ``swapped``: out of range, recomputed too, or resident."""
        bad = sorted(i for i in swapped if not 0 <= i < len(self.weights))
        both = sorted(set(swapped) & set(self.recomputed or ()))
        resident = sorted(i for i in swapped if i not in bad and self.weights[i] is Tier.DEVICE)
        if bad:
            raise ValueError(
                f"swapped blocks {bad} are out of range for {len(self.weights)} blocks: give "
                f"indices 0 to {len(self.weights) - 1}"
            )
        if both:
            raise ValueError(
                f"blocks {both} are both recomputed and swapped: list each block in at most "
                "one of recomputed and swapped"
            )
        if resident:
            raise ValueError(
                f"swapped blocks {resident} are resident (weights on the device) and keep "
                "their activations: swap only paged blocks (weights on host or NVMe)"
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
        those paged in by copy, plus the ones used in place with ``recompute_resident``, less
        the ``swapped`` ones; or ``recomputed`` where a plan decided them."""
        if self.recomputed is not None:
            return self.recomputed
        swapped = set(self.swapped or ())
        if self.recompute_resident:
            return tuple(i for i in range(self.num_blocks) if i not in swapped)
        return tuple(i for i in self.copied_blocks(in_place) if i not in swapped)

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
            "recomputed": None if self.recomputed is None else list(self.recomputed),
            "read_ahead": self.read_ahead,
            "hold_grads": self.hold_grads,
            "compute_dtype": self.compute_dtype,
            "kv_cache": None if self.kv_cache is None else self.kv_cache.value,
            "prefill_tokens": self.prefill_tokens,
            "decode_attention": None
            if self.decode_attention is None
            else self.decode_attention.value,
            "kv_cache_nvme_blocks": self.kv_cache_nvme_blocks,
            "chunk_rows": self.chunk_rows,
            "boundaries": None if self.boundaries is None else self.boundaries.value,
            "swapped": None if self.swapped is None else list(self.swapped),
            # the planner's pieces are the default: written only when another was given
            **({} if self.state_piece == STATE_PIECE else {"state_piece": self.state_piece}),
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Placement:
        """Inverse of :meth:`to_dict`."""
        d = dict(d)
        grads, kv = d.pop("grads"), d.pop("kv_cache")
        recomputed = d.pop("recomputed", None)
        attention = d.pop("decode_attention", None)
        boundaries = d.pop("boundaries", None)
        swapped = d.pop("swapped", None)
        return cls(
            swapped=None if swapped is None else tuple(swapped),
            boundaries=None if boundaries is None else Tier(boundaries),
            decode_attention=None if attention is None else Tier(attention),
            recomputed=None if recomputed is None else tuple(recomputed),
            weights=tuple(Tier(t) for t in d.pop("weights")),
            master=tuple(Tier(t) for t in d.pop("master")),
            grads=None if grads is None else tuple(Tier(t) for t in grads),
            kv_cache=None if kv is None else Tier(kv),
            **d,
        )


# ---------------------------------------------------------------- the manifest
RESIDENT_PREFIX = "resident"
"""Store name prefix of the fp32 state of the trained parameters outside the blocks."""

SCRATCH_PREFIX = "engine.scratch"
"""Store name prefix of the optimizer's host scratch buffers."""

SCRATCH_SETS = 2
"""Sets of host scratch buffers (one in use, one whose writes may still be in flight)."""

SCRATCH_FP32 = ("master", "exp_avg", "exp_avg_sq", "grad")
"""fp32 buffers of a scratch set (each of one state piece, :attr:`Placement.state_piece`,
or of the largest block where that is smaller); plus one ``cast``."""

StateKind = Literal["master", "exp_avg", "exp_avg_sq"]
STATE_KINDS: tuple[StateKind, StateKind, StateKind] = ("master", "exp_avg", "exp_avg_sq")
"""The fp32 tensors kept per trained parameter: master weights, first and second AdamW
moment (a :class:`FlatState`'s, with its ``grad`` accumulator)."""


@dataclass(frozen=True, kw_only=True)
class StoredTensor:
    """One flat tensor the engine registers in the store."""

    name: str
    """Store name."""
    numel: int
    """Elements."""
    dtype: str
    """Dtype, a key of :data:`DTYPE_BYTES`."""
    home: Tier
    """Tier it is registered on."""
    block: int | None = None
    """Index of the block whose compute-dtype weights it is (paged in with the block into
    a device slot); None for every other tensor."""

    @property
    def nbytes(self) -> int:
        """Bytes of its elements."""
        return self.numel * DTYPE_BYTES[self.dtype]


@dataclass(frozen=True, kw_only=True)
class ModelSizes:
    """Elements of a model's parameters, as the engine stores them. The parameters
    outside the blocks (embedding, final norm, head) are ordinary device tensors; only
    the fp32 state of their trained ones (``rest``) is in the store."""

    blocks: tuple[int, ...]
    """Elements of each block's trained parameters (training), or of all its parameters
    (weights only)."""
    frozen: tuple[int, ...] = ()
    """Elements of each block's frozen parameters (training; empty: none)."""
    rest: int = 0
    """Elements of the trained parameters outside the blocks (training)."""
    shard_blocks: tuple[int, ...] = ()
    """Data parallelism: elements of one rank's shard of each block's fp32 state, padding
    included (:class:`~bb_lightning.engine.shard.ShardLayout`); empty: no sharding."""
    shard_rest: int = 0
    """Data parallelism: elements of one rank's shard of the state outside the blocks."""
    shard_frozen: tuple[int, ...] = ()
    """Data parallelism: elements of one rank's shard of each block's frozen weights,
    padding included; empty: the frozen weights' own count divided up (``ceil(f / N)``,
    which the padding may exceed by a few rows: give it for the engine's own store)."""

    def __post_init__(self) -> None:
        if self.frozen and len(self.frozen) != len(self.blocks):
            raise ValueError(
                f"{len(self.frozen)} frozen sizes for {len(self.blocks)} blocks: give one per "
                "block, or none"
            )
        if (
            not self.blocks
            or min(self.blocks) < 0
            or min(self.frozen, default=0) < 0
            or self.rest < 0
        ):
            raise ValueError(
                f"model sizes {self}: give one size >= 0 per block (at least one block), "
                "frozen sizes and rest >= 0"
            )


def weights_manifest(
    sizes: ModelSizes, placement: Placement, prefix: str = "block"
) -> tuple[StoredTensor, ...]:
    """What a weights-only (inference) engine stores: each block's weights in the compute
    dtype (``<prefix>.<i>.weight``, every parameter of the block) on its home."""
    _check_blocks(sizes, placement)
    dtype = placement.compute_dtype
    return tuple(
        StoredTensor(name=f"{prefix}.{i}.weight", numel=n, dtype=dtype, home=w, block=i)
        for i, (n, w) in enumerate(zip(sizes.blocks, placement.weights, strict=True))
    )


def training_manifest(
    sizes: ModelSizes, placement: Placement, prefix: str = "block", *, shards: int = 1
) -> tuple[StoredTensor, ...]:
    """What the training engine stores, in registration order.

    First the fp32 state of the parameters outside the blocks (``resident.*``, host).
    Per block ``i``: ``<prefix>.<i>.weight`` (trained parameters, compute dtype) and, when
    it has frozen ones, ``<prefix>.<i>.frozen`` (compute dtype), both on
    ``placement.weights[i]``; the fp32 master weights and moments on ``placement.master[i]``
    and the fp32 gradient accumulator on ``placement.grad_tiers[i]``. Then the optimizer's
    :data:`SCRATCH_SETS` host scratch sets (four fp32 buffers and one compute-dtype
    ``cast``, each of one ``placement.state_piece`` or of the largest block where that is
    smaller), and, with optimizer state off the host, ``placement.read_ahead`` read-ahead
    sets (three fp32 buffers of that size each).

    With ``shards`` N > 1 (data parallelism, :mod:`bb_lightning.engine.shard`) every fp32
    state holds one rank's shard (``sizes.shard_blocks``, ``sizes.shard_rest``), and so do
    the compute-dtype weights (the trainable ones laid out as the state,
    ``sizes.shard_blocks``; the frozen ones ``sizes.shard_frozen``), the fp32 scratch and
    read-ahead buffers and each ``cast`` buffer: the ranks of a node hold one copy of the
    weights between them, each block assembled on the device at its page-in.
    """
    if shards < 1:
        raise ValueError(f"shards={shards} must be >= 1 (the data-parallel world size)")
    if shards > 1 and len(sizes.shard_blocks) != len(sizes.blocks):
        raise ValueError(
            f"shards={shards} but sizes give {len(sizes.shard_blocks)} shard sizes for "
            f"{len(sizes.blocks)} blocks: give one rank's shard elements per block"
        )
    _check_blocks(sizes, placement)
    if not placement.master:
        raise ValueError(
            "placement has no master tiers (a weights-only placement): give one master tier "
            "per block to train"
        )
    dtype, fp32, host = placement.compute_dtype, "float32", Tier.HOST
    frozen = sizes.frozen or (0,) * len(sizes.blocks)

    state = sizes.shard_blocks if shards > 1 else sizes.blocks
    if shards > 1:
        frozen = sizes.shard_frozen or tuple(-(-f // shards) for f in frozen)
    out = _flat_state(RESIDENT_PREFIX, sizes.shard_rest if shards > 1 else sizes.rest, host, host)
    tiers = zip(placement.weights, placement.master, placement.grad_tiers, strict=True)
    blocks = zip(state, frozen, tiers, strict=True)  # the weights laid out as the state
    for i, (s, f, (w, m, g)) in enumerate(blocks):
        name = f"{prefix}.{i}"
        if f:
            out.append(StoredTensor(name=f"{name}.frozen", numel=f, dtype=dtype, home=w, block=i))
        out.append(StoredTensor(name=f"{name}.weight", numel=s, dtype=dtype, home=w, block=i))
        out += _flat_state(name, s, m, g)
    largest = cast = min(max(state), placement.state_piece)  # one piece of the largest
    for k in range(SCRATCH_SETS):
        name = f"{SCRATCH_PREFIX}.{k}"
        out += [StoredTensor(name=f"{name}.{b}", numel=largest, dtype=fp32, home=host)
                for b in SCRATCH_FP32]  # fmt: skip
        out.append(StoredTensor(name=f"{name}.cast", numel=cast, dtype=dtype, home=host))
    if placement.reads_ahead:
        for k in range(placement.read_ahead):
            out += [StoredTensor(name=read_ahead_name(k, s), numel=largest, dtype=fp32, home=host)
                    for s in STATE_KINDS]  # fmt: skip
    return tuple(out)


BOUNDARY_PREFIX = "boundary"
"""Store name prefix of the recomputed blocks' boundary inputs kept off the device."""

SWAP_PREFIX = "swap"
"""Store name prefix of the swapped blocks' saved activations (``Placement.swapped``)."""


def boundary_manifest(placement: Placement, numel: int) -> tuple[StoredTensor, ...]:
    """The boundary inputs of one micro-batch that the training engine keeps in the store
    (``placement.boundaries`` HOST or NVME): each block's hidden states, ``numel``
    elements (rows x tokens x width) in the compute dtype, as ``boundary.<i>.0.0``. The
    engine registers them at their first use with the micro-batch's shape (another
    tensor argument needing gradient, a second forward in one micro-batch, adds its own);
    none for boundaries on the device, or ``numel`` 0."""
    home = placement.boundaries
    if home in (None, Tier.DEVICE) or numel <= 0:
        return ()
    return tuple(
        StoredTensor(name=f"{BOUNDARY_PREFIX}.{i}.0.0", numel=numel,
                     dtype=placement.compute_dtype, home=home)
        for i in range(placement.num_blocks)
    )  # fmt: skip


def state_pieces(numel: int, piece: int) -> list[tuple[int, int]]:
    """``(start, end)`` element ranges of a flat state of ``numel`` elements cut into pieces
    of ``piece`` (:attr:`Placement.state_piece`); the last may be shorter, one when the
    state is no larger than a piece (none for an empty state)."""
    return [(a, min(a + piece, numel)) for a in range(0, numel, piece)]


def read_ahead_name(k: int, kind: str) -> str:
    """Store name of buffer ``kind`` (one of :data:`STATE_KINDS`) of read-ahead set ``k``."""
    return f"{SCRATCH_PREFIX}.ahead.{k}.{kind}"


def manifest_bytes(manifest: tuple[StoredTensor, ...]) -> dict[Tier, int]:
    """Exact bytes of the manifest's tensors on each tier (no allocator padding)."""
    out = dict.fromkeys(Tier, 0)
    for t in manifest:
        out[t.home] += t.nbytes
    return out


def _flat_state(name: str, numel: int, home: Tier, grad_home: Tier) -> list[StoredTensor]:
    kinds = [(k, home) for k in STATE_KINDS] + [("grad", grad_home)]
    return [StoredTensor(name=f"{name}.{k}", numel=numel, dtype="float32", home=t)
            for k, t in kinds]  # fmt: skip


def _check_blocks(sizes: ModelSizes, placement: Placement) -> None:
    if len(sizes.blocks) != placement.num_blocks:
        raise ValueError(
            f"placement covers {placement.num_blocks} blocks but the model has "
            f"{len(sizes.blocks)}: build the placement for this model"
        )
