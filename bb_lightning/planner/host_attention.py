"""Pricing of decode attention on the host, where a KV cache homed there lies.

A decode pass carries one token per concurrent sequence, so its tokens are the
sequences the KV cache holds. With the cache in host memory and attention computed
there (FlexGen, Sheng et al. 2023, Sec. 4.2 "CPU delegation"; ZeRO-Inference 2023's KV
cache offload), the device runs every block's projections and MLP for all sequences,
and for each block sends the new token's q/k/v rows to the host and gets the attention
output back: a few KiB per sequence and block on each link, instead of the whole cache.
The host's cores read the cache once per pass: a decode step's attention is two FLOPs
per cached element and query head for ``q·Kᵀ`` and two for ``p·V`` against two bytes
per element (one FLOP per byte and query head in 16 bits), so on a host of many cores it
is bound by the rate the host reads memory at. The skinny products (one column per query
head of a group) run far below the cores' peak, so on a host of few cores the arithmetic
is the bound: ``HardwareProfile.host_memory_bandwidth`` is, as the hardware probe measures
it, the lesser of a plain read of host memory and the engine's decode attention over a
cache of the same bytes (a preset states its memory's read bandwidth).

The sequences run in :data:`GROUPS_IN_FLIGHT` groups: while the host attends for one
group, the device runs the next group's matrix products (FlexGen's zig-zag block
schedule in spirit), and the copies run on side streams, so a pass takes the longest of
the device's compute, the host's attention and each link's copies, plus the pipeline's
fill: one group's device and host work of one block.

Pure functions of the profiles; sizes in bytes, times in seconds.
"""

from __future__ import annotations

from bb_lightning.placement import DECODE_GROUPS
from bb_lightning.planner.profile import BF16_BYTES, HardwareProfile, ModelProfile

__all__ = [
    "FORWARD_LAUNCHES_PER_BLOCK",
    "GROUPS_IN_FLIGHT",
    "HOST_COPIES_PER_BLOCK",
    "host_attention_seconds",
    "host_cache_read_bytes",
    "launch_seconds",
    "pipelined_pass_seconds",
    "qkv_row_bytes",
    "staging_bytes",
]

GROUPS_IN_FLIGHT = DECODE_GROUPS
"""Groups of sequences a decode pass keeps in flight, as the engine runs them: one attended
on the host while the device computes another (two suffice to overlap the two; more only
shorten the fill)."""
FORWARD_LAUNCHES_PER_BLOCK = 20
"""Kernels a decoder layer's forward launches: two norms, four attention projections, the
rotary embedding, attention, three MLP projections, the activation, products and residual
additions (the count :data:`~bb_lightning.planner.chunks.LAUNCHES_PER_BLOCK_CHUNK` takes
four times over a training step)."""
HOST_COPIES_PER_BLOCK = 5
"""Copies a group's decode step makes in each block with attention on the host, as
:func:`~bb_lightning.engine.attention.host_attention` and the KV cache's update make them:
the new key rows, value rows, query rows and the mask to the host, the output back."""


def qkv_row_bytes(model: ModelProfile, compute_bytes: int) -> tuple[float, float]:
    """(to the host, to the device) bytes per sequence and block of one decode step: the
    new token's query, key and value rows, ``(heads + 2 kv_heads) * head_dim`` elements,
    and the attention output, ``heads * head_dim``, each ``compute_bytes`` per element."""
    q = model.num_heads * model.head_dim
    kv = 2 * model.num_kv_heads * model.head_dim
    return float((q + kv) * compute_bytes), float(q * compute_bytes)


def staging_bytes(model: ModelProfile, seqs: int, compute_bytes: int) -> float:
    """Bytes of the buffers that carry one block's q/k/v rows and outputs for ``seqs``
    sequences, double-buffered (one block's in flight while the next fills), on each of
    the device and the host."""
    up, down = qkv_row_bytes(model, compute_bytes)
    return 2.0 * seqs * (up + down)


def host_cache_read_bytes(
    model: ModelProfile, seqs: int, context: float, compute_bytes: int
) -> float:
    """Bytes of KV cache the host reads in one decode pass: every block's keys and values
    of the ``context`` cached positions and the new one, ``seqs * (context + 1) *
    kv_bytes_per_token * num_blocks`` in the compute dtype (``kv_bytes_per_token`` counts
    bf16)."""
    per_token = model.kv_bytes_per_token * compute_bytes / BF16_BYTES
    return seqs * (context + 1.0) * per_token * model.num_blocks


def host_attention_seconds(
    model: ModelProfile, hw: HardwareProfile, seqs: int, context: float, compute_bytes: int
) -> float:
    """Seconds the host's cores take for one decode pass's attention: the cache's bytes
    (:func:`host_cache_read_bytes`) over ``hw.host_memory_bandwidth``; infinite where the
    profile has no host memory bandwidth (not priceable, so never chosen)."""
    if hw.host_memory_bandwidth <= 0:
        return float("inf")
    return host_cache_read_bytes(model, seqs, context, compute_bytes) / hw.host_memory_bandwidth


def launch_seconds(hw: HardwareProfile, num_blocks: int) -> float:
    """Device seconds a decode pass with the host attending costs beyond its arithmetic:
    each group beyond the first launches every block's kernels again, and each group's
    block makes :data:`HOST_COPIES_PER_BLOCK` copies, each a launch the device's stream
    waits on: ``num_blocks * ((GROUPS_IN_FLIGHT - 1) * FORWARD_LAUNCHES_PER_BLOCK +
    GROUPS_IN_FLIGHT * HOST_COPIES_PER_BLOCK) * hw.kernel_launch_seconds``. Nothing beside
    passes of seconds; it decides against the host's attention where the cache is small and
    every block resident (a pass of a few milliseconds)."""
    per_block = (GROUPS_IN_FLIGHT - 1) * FORWARD_LAUNCHES_PER_BLOCK
    per_block += GROUPS_IN_FLIGHT * HOST_COPIES_PER_BLOCK
    return num_blocks * per_block * hw.kernel_launch_seconds


def pipelined_pass_seconds(
    device_s: float, host_s: float, link_s: tuple[float, ...], num_blocks: int
) -> float:
    """Seconds of one decode pass with the host attending beside the device: the longest
    of the device's compute ``device_s``, the host's attention ``host_s`` and each link's
    busy seconds ``link_s``, plus the fill of the pipeline, one group's device and host
    work of one block: ``(device_s + host_s) / (GROUPS_IN_FLIGHT * num_blocks)``."""
    longest = max(device_s, host_s, *link_s)
    return longest + (device_s + host_s) / (GROUPS_IN_FLIGHT * max(num_blocks, 1))
