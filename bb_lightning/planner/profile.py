"""Profiles the planner reasons on: what the machine can do, what the model needs.

:class:`HardwareProfile` holds capacities (bytes), bandwidths (bytes/s) and
throughputs (FLOP/s, parameter updates/s) of one machine, from a preset
(:func:`preset`) or a short measurement (:func:`bb_lightning.probe.measure`).
:class:`ModelProfile` holds the per-block parameter counts, FLOPs and activation bytes
of a causal LM, found by introspection of the model's structure
(:func:`bb_lightning.probe.model_profile_from_config` and
:func:`~bb_lightning.probe.model_profile_from_module`; no per-architecture tables).
Both are frozen data with a JSON-friendly ``to_dict``/``from_dict``; the planner
imports no probe (see ``docs/architecture.md``, "Layers").
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, TypeVar

from bb_lightning.planner.presets import PRESETS, preset_fields

__all__ = ["HardwareProfile", "ModelProfile", "preset", "preset_names"]

BF16_BYTES = 2
"""Bytes per bf16 element."""
LAYOUT_FIELDS = (
    "world_size",
    "ranks_per_node",
    "intra_node_bandwidth",
    "inter_node_bandwidth",
    "collective_latency",
)
"""The :class:`HardwareProfile` fields of the data-parallel layout (defaults: one rank)."""

_T = TypeVar("_T")


def _from_dict(cls: type[_T], d: dict[str, Any]) -> _T:
    names = {f.name for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    unknown = sorted(set(d) - names)
    if unknown:
        raise ValueError(
            f"unknown {cls.__name__} field(s) {unknown}: known fields are {sorted(names)}; "
            "remove the unknown keys"
        )
    return cls(**d)


def _millions(count: float) -> str:
    """A parameter count for a person, in millions (``"12.3 M"``)."""
    return f"{count / 1e6:,.4g} M"


def _check_non_negative(obj: object, names: tuple[str, ...]) -> None:
    for name in names:
        value = getattr(obj, name)
        if value < 0:
            raise ValueError(f"{type(obj).__name__}.{name} = {value} is negative: it must be >= 0")


@dataclass(frozen=True, kw_only=True)
class HardwareProfile:
    """What one machine can do, in bytes, bytes/s and FLOP/s."""

    name: str
    """Human-readable origin, e.g. ``"A100-80GB SXM (preset)"`` or ``"measured: <cpu model>"``."""
    device_type: str
    """``"cuda"`` or ``"cpu"`` (on ``"cpu"`` the CPU computes; device and host tiers share RAM)."""
    device_memory: int
    """Bytes usable for the device tier."""
    device_flops: float
    """Realistic dense bf16 matrix-product throughput, FLOP/s: the rate plans are priced at
    (measured, or a preset's datasheet figure times its efficiency)."""
    h2d_bandwidth: float
    """Pinned host -> device copy bandwidth, bytes/s."""
    d2h_bandwidth: float
    """Device -> pinned host copy bandwidth, bytes/s."""
    host_memory: int
    """Bytes usable for the host tier."""
    nvme_read_bandwidth: float
    """Sequential read bandwidth of the NVMe tier, bytes/s (0.0 when there is no NVMe path)."""
    nvme_write_bandwidth: float
    """Sequential write bandwidth of the NVMe tier, bytes/s (0.0 when there is no NVMe path)."""
    nvme_capacity: int
    """Free bytes for the NVMe tier (0 = no NVMe path)."""
    host_adam_params_per_s: float
    """Fused AdamW parameter updates per second on the host (fp32 master + 2 moments)."""
    cores: int
    """CPU cores available to the process."""
    device_memory_bandwidth: float = 0.0
    """Bytes/s the device streams its own memory at, reads and writes together (0.0: not
    modelled). A decode pass reads every block's weights and the KV cache once for a few
    tokens per sequence; it takes at least those bytes over this bandwidth."""
    host_memory_bandwidth: float = 0.0
    """Bytes/s decode attention on the host's cores, all of them, reads a KV cache homed
    there at (0.0: not modelled): a preset's stated memory read bandwidth; measured by
    :func:`bb_lightning.probe.measure` as the lesser of a plain read of host memory and the
    engine's CPU decode attention over a cache of the same bytes (on a host of few cores its
    skinny matrix products, not the memory, bound it)."""
    nvme_cpu_seconds_per_byte: float = 0.0
    """Seconds of the compute's time each byte written to or read from the NVMe tier costs
    (0.0: not modelled): the process's CPU time for it (the kernel's share of ``O_DIRECT``
    transfers and the I/O threads'), and where the probe measured more, what compute on
    every core loses beside the transfers (on a virtual machine, also the cores' time the
    hypervisor takes to emulate the disk). On a CPU device it comes out of the compute."""
    compute_efficiency: float = 1.0
    """Multiplier on ``device_flops`` learnt from measured steps (1.0 = as profiled)."""
    h2d_efficiency: float = 1.0
    """Multiplier on ``h2d_bandwidth`` learnt from measured steps (1.0 = as profiled)."""
    d2h_efficiency: float = 1.0
    """Multiplier on ``d2h_bandwidth`` learnt from measured steps (1.0 = as profiled)."""
    nvme_efficiency: float = 1.0
    """Multiplier on both NVMe bandwidths learnt from measured steps (1.0 = as profiled)."""
    optimizer_efficiency: float = 1.0
    """Multiplier on ``host_adam_params_per_s`` learnt from measured steps (1.0 = as profiled)."""
    decode_efficiency: float = 1.0
    """Rate of a decode pass (one new token per sequence: thin matrix products, attention
    over the whole KV cache) relative to a prefill or training pass, as a multiplier on
    ``device_flops * compute_efficiency`` (1.0 = the same rate; see
    :func:`bb_lightning.probe.calibrate.probe_predict_compute`)."""
    world_size: int = 1
    """Data-parallel ranks of the job, over all nodes (1: one process, no network)."""
    ranks_per_node: int = 1
    """Ranks (one device each) on one node; they share the node's host memory, NVMe
    capacity and bandwidth and host AdamW cores. ``world_size`` is a multiple of it."""
    intra_node_bandwidth: float = 0.0
    """Bytes/s per direction one rank's device sends another device of its node in a ring
    collective on the devices (NVLink, PCIe peer-to-peer or staged through host memory; a
    preset's datasheet figure, or measured at start-up on the ranks' group; 0.0: not given,
    needed when a node holds several ranks)."""
    inter_node_bandwidth: float = 0.0
    """Bytes/s per direction one rank sends to ranks of other nodes: its share of the
    node's network adapters (a preset's datasheet figure, or measured at start-up; 0.0:
    not given, needed when the ranks span several nodes)."""
    collective_latency: float = 0.0
    """Seconds each step of a ring collective waits besides its bytes."""
    peak_flops: float = 0.0
    """The device's datasheet dense bf16 matrix-product FLOP/s, the denominator of model
    FLOPs utilisation (0.0: no datasheet figure is known, e.g. a CPU)."""
    kernel_launch_seconds: float = 5e-6
    """Seconds each kernel launch costs the device beyond its arithmetic (about 5 us, the
    launch latency of a CUDA kernel and of an eager CPU operator alike): priced for the
    extra launches of a block whose micro-batch runs in chunks."""

    def __post_init__(self) -> None:
        if self.device_type not in ("cuda", "cpu"):
            raise ValueError(
                f"HardwareProfile.device_type = {self.device_type!r}: use 'cuda' or 'cpu'"
            )
        _check_non_negative(
            self,
            (
                "device_memory",
                "device_flops",
                "h2d_bandwidth",
                "d2h_bandwidth",
                "host_memory",
                "nvme_read_bandwidth",
                "nvme_write_bandwidth",
                "nvme_capacity",
                "host_adam_params_per_s",
                "cores",
                "device_memory_bandwidth",
                "host_memory_bandwidth",
                "nvme_cpu_seconds_per_byte",
                "intra_node_bandwidth",
                "inter_node_bandwidth",
                "collective_latency",
                "peak_flops",
                "kernel_launch_seconds",
            ),
        )
        self._check_layout()
        for name in (
            "compute_efficiency",
            "h2d_efficiency",
            "d2h_efficiency",
            "nvme_efficiency",
            "optimizer_efficiency",
            "decode_efficiency",
        ):
            value = getattr(self, name)
            if not value > 0:
                raise ValueError(
                    f"HardwareProfile.{name} = {value} must be > 0 (1.0 = as profiled)"
                )

    def _check_layout(self) -> None:
        for name in ("world_size", "ranks_per_node"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(
                    f"HardwareProfile.{name} = {value!r} must be a positive integer (1 = one rank)"
                )
        n, g = self.world_size, self.ranks_per_node
        if n % g:
            raise ValueError(
                f"HardwareProfile.world_size = {n} is not a multiple of ranks_per_node = {g}: "
                f"give world_size = ranks_per_node x the number of nodes"
            )
        if n > 1 and g > 1 and self.intra_node_bandwidth <= 0:
            raise ValueError(
                f"HardwareProfile.intra_node_bandwidth = {self.intra_node_bandwidth} with "
                f"{g} ranks per node: give the bytes/s between two devices of a node (> 0)"
            )
        if self.num_nodes > 1 and self.inter_node_bandwidth <= 0:
            raise ValueError(
                f"HardwareProfile.inter_node_bandwidth = {self.inter_node_bandwidth} with the "
                f"ranks on {self.num_nodes} nodes: give the bytes/s between two nodes (> 0)"
            )

    @property
    def num_nodes(self) -> int:
        """Nodes the ranks span: ``world_size / ranks_per_node``."""
        return self.world_size // self.ranks_per_node

    @property
    def network_bandwidth(self) -> float:
        """Bytes/s of the slowest hop of the ranks' ring: ``inter_node_bandwidth`` when
        the ranks span several nodes, else ``intra_node_bandwidth`` (0.0 for one rank)."""
        if self.num_nodes > 1:
            return self.inter_node_bandwidth
        return self.intra_node_bandwidth if self.world_size > 1 else 0.0

    def replace(self, **changes: Any) -> HardwareProfile:
        """Return a copy with ``changes`` applied (``dataclasses.replace``)."""
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        """Plain dict of the fields (JSON-serialisable); the data-parallel layout's fields
        (:data:`LAYOUT_FIELDS`) only where they differ from one rank's defaults, so that a
        one-rank profile's dict is what it was before the layout existed."""
        d = dataclasses.asdict(self)
        defaults = {f.name: f.default for f in dataclasses.fields(self)}
        for name in LAYOUT_FIELDS:
            if d[name] == defaults[name]:
                del d[name]
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> HardwareProfile:
        """Inverse of :meth:`to_dict`; unknown keys raise ``ValueError``."""
        return _from_dict(cls, d)


def preset_names() -> list[str]:
    """Names accepted by :func:`preset`, e.g. ``"a100-80gb"``, ``"h100"``, ``"t4"``."""
    return sorted(PRESETS)


def preset(name: str, gpus: int = 1) -> HardwareProfile:
    """The preset profile called ``name`` (case-insensitive): one GPU's machine, or with
    ``gpus`` > 1 the node of that many (``gpus`` times the host memory and NVMe a row
    gives one GPU); see ``presets.py`` for sources."""
    key = name.strip().lower()
    if key not in PRESETS:
        raise ValueError(
            f"unknown hardware preset {name!r}: known presets are {preset_names()}; "
            "pick one of them or measure this machine with measure()"
        )
    return HardwareProfile(**preset_fields(key, gpus))


@dataclass(frozen=True, kw_only=True)
class ModelProfile:
    """Sizes and costs of a decoder-only causal LM, per repeated block and for the rest."""

    name: str
    """Model name (config ``_name_or_path`` or ``model_type``)."""
    num_blocks: int
    """Number of repeated blocks (decoder layers)."""
    hidden_size: int
    """Width of the residual stream, elements."""
    num_heads: int
    """Attention query heads."""
    num_kv_heads: int
    """Attention key/value heads (== ``num_heads`` without grouped-query attention)."""
    head_dim: int
    """Elements per attention head."""
    vocab_size: int
    """Vocabulary size, tokens."""
    max_positions: int
    """Context length in tokens (``max_position_embeddings`` or ``n_positions``; 0 if unknown)."""
    block_params: int
    """Parameters of ONE repeated block; where blocks differ (the dense first layers of an
    MoE model), of the largest, which then stands for every block."""
    block_matmul_params: int
    """Of ``block_params``, those in matrix-product weights (Linear / Conv1D)."""
    embed_params: int
    """Input embedding and everything that runs before the first block, parameters."""
    head_params: int
    """Output head parameters not shared with the embedding (0 when tied)."""
    final_params: int
    """Parameters after the last block other than the head (final norm, projections)."""
    tied_embeddings: bool
    """Whether the output head reuses the input embedding weight."""
    act_bytes_per_token_checkpointed: int
    """Bytes per token per block kept across forward with per-block checkpointing (bf16 input)."""
    act_bytes_per_token_full: int
    """Bytes per token per block saved for backward without checkpointing (bf16, introspected)."""
    act_bytes_per_token_backward: int = 0
    """Bytes per token per block a block's backward holds at its peak beyond what its
    forward saved: the gradient flowing in and the gradients of its intermediate
    activations (bf16, introspected by :mod:`bb_lightning.hf.backward_trace`)."""
    act_bytes_per_token_swapped: int = 0
    """Bytes per token per block a swapped block stores of its saved activations (bf16,
    introspected): each view autograd saves at its own bytes, where the storages of
    ``act_bytes_per_token_full`` count once (the attention's output is saved as it is and
    as the output projection's input); 0: not introspected, taken as
    ``act_bytes_per_token_full``."""
    kv_bytes_per_token: int
    """Bytes per token per block of the bf16 K and V cache: ``2 * num_kv_heads * head_dim * 2``."""
    num_experts: int = 0
    """Routed experts per block of a mixture-of-experts model (0: dense blocks)."""
    experts_per_token: int = 0
    """Routed experts each token uses per block (the router's top-k; 0: dense)."""
    block_expert_params: int = 0
    """Of ``block_matmul_params``, those of the routed experts, all ``num_experts`` of them."""
    block_trainable_params: int | None = None
    """Of ``block_params``, those trained (with gradients and optimizer state), e.g. LoRA
    adapters over frozen base weights; None: all of them (full fine-tuning)."""
    rest_trainable_params: int | None = None
    """Of the parameters outside the blocks (embedding, head, final), those trained;
    None: all of them."""

    def __post_init__(self) -> None:
        _check_non_negative(
            self,
            tuple(
                f.name
                for f in dataclasses.fields(self)
                if f.name not in ("name", "tied_embeddings") and getattr(self, f.name) is not None
            ),
        )
        if self.experts_per_token > self.num_experts or (
            self.num_experts > 0 and self.experts_per_token == 0
        ):
            raise ValueError(
                f"experts_per_token={self.experts_per_token} must be in [1, num_experts="
                f"{self.num_experts}] for an MoE model (both 0 for a dense one)"
            )
        if self.block_expert_params > self.block_matmul_params:
            raise ValueError(
                f"block_expert_params={self.block_expert_params} > block_matmul_params="
                f"{self.block_matmul_params}: expert weights are matrix-product weights"
            )

        limits = (
            ("block_trainable_params", self.block_trainable_params, self.block_params),
            ("rest_trainable_params", self.rest_trainable_params, self.rest_params),
        )
        for field_name, value, total in limits:
            if value is not None and value > total:
                raise ValueError(
                    f"ModelProfile.{field_name} = {value} exceeds the {total} parameters it "
                    "counts from: give at most that many trainable parameters"
                )

    @property
    def swap_bytes_per_token(self) -> int:
        """Bytes per token per block a swapped block stores (bf16):
        ``act_bytes_per_token_swapped``, or ``act_bytes_per_token_full`` where not
        introspected."""
        return self.act_bytes_per_token_swapped or self.act_bytes_per_token_full

    @property
    def block_active_matmul_params(self) -> float:
        """Matrix-product parameters of one block that each token uses.

        Dense: ``block_matmul_params``. MoE: the router, attention and shared parts,
        plus ``experts_per_token / num_experts`` of the routed experts' weights
        (each token runs its top-k experts only; Fedus et al. 2022, Switch
        Transformers, Sec. 2). Bytes still count every expert (``block_params``).
        """
        if self.num_experts == 0:
            return float(self.block_matmul_params)
        routed = self.block_expert_params * self.experts_per_token / self.num_experts
        return float(self.block_matmul_params - self.block_expert_params) + routed

    @property
    def active_fraction(self) -> float:
        """``block_active_matmul_params / block_matmul_params``: 1 for dense blocks."""
        return self.block_active_matmul_params / max(self.block_matmul_params, 1)

    def moe_summary(self) -> str | None:
        """One line on how an MoE model is priced (None for a dense model)."""
        if self.num_experts == 0:
            return None
        n = self.num_blocks
        return (
            f"MoE: top-{self.experts_per_token} of {self.num_experts} experts per block: "
            f"compute counts the {_millions(n * self.block_active_matmul_params)} block "
            f"parameters a token uses, transfers all {_millions(n * self.block_params)} "
            f"(every expert moves with its block)"
        )

    @property
    def rest_params(self) -> int:
        """Parameters outside the blocks: embedding side, untied head, final side."""
        return self.embed_params + self.head_params + self.final_params

    @property
    def block_train(self) -> int:
        """Trained parameters of one block (``block_trainable_params``, else all)."""
        t = self.block_trainable_params
        return self.block_params if t is None else t

    @property
    def rest_train(self) -> int:
        """Trained parameters outside the blocks (``rest_trainable_params``, else all)."""
        t = self.rest_trainable_params
        return self.rest_params if t is None else t

    @property
    def trainable_params(self) -> int:
        """All trained parameters: what carries gradients, master weights and moments."""
        return self.num_blocks * self.block_train + self.rest_train

    @property
    def full_fine_tune(self) -> bool:
        """Whether every parameter trains."""
        return self.trainable_params == self.total_params

    def with_trainable(self, block: int, rest: int) -> ModelProfile:
        """This profile with ``block`` trained parameters per block and ``rest`` outside."""
        return dataclasses.replace(self, block_trainable_params=block, rest_trainable_params=rest)

    def block_flops_per_token(self, context: int) -> float:
        """Forward FLOPs per token of one block attending over ``context`` tokens.

        ``2 * block_active_matmul_params + 4 * num_heads * head_dim * context``: two
        FLOPs (multiply, add) per matmul weight a token uses (all of them in a dense
        block, the top-k experts in an MoE one), plus ``Q K^T`` and ``A V`` against the
        context, each ``2 * num_heads * head_dim`` FLOPs per attended token
        (Kaplan et al. 2020, "Scaling Laws for Neural Language Models", Table 1;
        Hoffmann et al. 2022, Chinchilla, Appendix F). Backward costs about twice
        the forward.
        """
        if context < 0:
            raise ValueError(f"context = {context} tokens is negative: pass >= 0")
        return (
            2.0 * self.block_active_matmul_params + 4.0 * self.num_heads * self.head_dim * context
        )

    def head_flops_per_token(self) -> float:
        """Forward FLOPs per token of the output head: ``2 * hidden_size * vocab_size``."""
        return 2.0 * self.hidden_size * self.vocab_size

    @property
    def total_params(self) -> int:
        """All parameters: blocks, embedding side, final side and an untied head."""
        return (
            self.num_blocks * self.block_params
            + self.embed_params
            + self.head_params
            + self.final_params
        )

    @property
    def block_bytes(self) -> int:
        """Bytes of one block's parameters in bf16 (2 bytes/param)."""
        return self.block_params * BF16_BYTES

    def to_dict(self) -> dict[str, Any]:
        """Plain dict of all fields (JSON-serialisable)."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ModelProfile:
        """Inverse of :meth:`to_dict`; unknown keys raise ``ValueError``."""
        return _from_dict(cls, d)
