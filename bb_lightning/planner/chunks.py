"""Pricing of chunked block execution in training, and of swapping saved activations.

A recomputed block may run its micro-batch ``chunk_rows`` sequences at a time while its
weights are paged in once (``Placement.chunk_rows``): forward chunk by chunk without
autograd, keeping only the block's boundary input (its hidden states), then backward
recomputing chunk by chunk and summing its weight gradients on the device before one
hand-off. The micro-batch, and so the tokens each weight pass carries, is then no longer
bounded by one block's activations but by the boundaries every recomputed block keeps
(``act_bytes_per_token_checkpointed`` per token), which may live on the device or in
pinned host memory (``Placement.boundaries``).

The functions here are pure: sizes in bytes, times in seconds, arrays over the candidates
of one batch shape where :mod:`~bb_lightning.planner.fit_price` passes them.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import numpy.typing as npt

from bb_lightning.planner.profile import HardwareProfile, ModelProfile
from storage.tiers import PRICED_LINKS, Link, Tier

__all__ = [
    "BOUNDARIES_IN_FLIGHT",
    "BOUNDARY_GRADS",
    "BOUNDARY_TIERS",
    "LAUNCHES_PER_BLOCK_CHUNK",
    "boundary_bytes",
    "boundary_link_bytes",
    "chunk_options",
    "chunk_peak_bytes",
    "chunks_per_pass",
    "launch_seconds",
    "swapped_blocks",
]

Arr = npt.NDArray[np.float64]

BOUNDARY_TIERS: dict[str, tuple[Tier, ...]] = {
    "cuda": (Tier.DEVICE, Tier.HOST, Tier.NVME),
    "cpu": (Tier.DEVICE,),
}
"""Tiers the search keeps the boundary inputs on, per device type (on a CPU device the
device and host tiers are the same RAM: there is nothing to move)."""

BOUNDARIES_IN_FLIGHT = 2
"""Boundary inputs of a whole micro-batch on the device at once when they live off it:
forward, the block's input (being copied out) and its output (the next block's input);
backward, the block's input fetched back and the next one's being prefetched. As many
pinned host buffers stage them when they live on NVMe."""

BOUNDARY_GRADS = 2
"""Gradients of a whole micro-batch's hidden states a chunked block's backward holds: the
gradient of its output flowing in and that of its input, filled chunk by chunk (each
``act_bytes_per_token_checkpointed`` per token); a chunk's own are slices of them."""

LAUNCHES_PER_BLOCK_CHUNK = 80
"""Kernels one chunk of a block launches in a training step: about 20 in the forward of a
decoder layer (two norms, four attention projections, rotary embedding, attention, three
MLP projections, the activation, products and residual additions), once without autograd,
once recomputed, and twice that in backward."""


def chunk_options(micro_batch: int) -> list[int | None]:
    """Rows per chunk the search tries for a micro-batch of ``micro_batch`` sequences:
    None (the micro-batch in one piece), every power of two below it, and the whole
    micro-batch as one chunk (which differs from None where the boundaries live off the
    device)."""
    out: list[int | None] = [None]
    rows = 1
    while rows < micro_batch:
        out.append(rows)
        rows *= 2
    return [*out, micro_batch]


def chunks_per_pass(micro_batch: int, chunk_rows: int | None) -> int:
    """Chunks a recomputed block runs per micro-batch: ``ceil(micro_batch / chunk_rows)``
    (1 unchunked)."""
    return 1 if chunk_rows is None else math.ceil(micro_batch / chunk_rows)


def boundary_bytes(
    model: ModelProfile, tokens: int, recomputed: Any, boundaries: Tier | None
) -> dict[Tier, Any]:
    """Bytes on each tier of the recomputed blocks' boundary inputs kept across a pass of
    ``tokens`` tokens, ``tokens * act_bytes_per_token_checkpointed`` per block: every one
    of the ``recomputed`` blocks' (an array or a number) on their tier (None: the device),
    and off the device :data:`BOUNDARIES_IN_FLIGHT` of them on the device besides (and, on
    NVMe, as many in pinned host buffers staging them)."""
    per_block = float(tokens * model.act_bytes_per_token_checkpointed)
    home = Tier.DEVICE if boundaries is None else boundaries
    out = {tier: 0.0 * recomputed for tier in Tier}
    out[home] = out[home] + per_block * recomputed
    if home is not Tier.DEVICE:
        out[Tier.DEVICE] = out[Tier.DEVICE] + BOUNDARIES_IN_FLIGHT * per_block
    if home is Tier.NVME:
        out[Tier.HOST] = out[Tier.HOST] + BOUNDARIES_IN_FLIGHT * per_block
    return out


def boundary_link_bytes(
    model: ModelProfile, tokens: int, recomputed: Any, boundaries: Tier | None
) -> dict[Link, Any]:
    """Bytes the boundary inputs move per micro-batch on each priced link: every recomputed
    block's input (``tokens * act_bytes_per_token_checkpointed``) leaves the device in
    forward and comes back in backward. On the host: device to host, then host to device.
    On NVMe: written from device memory as a file transfer (the store's
    ``nvme_write_direct``, priced as the disk's write), read back to the host and copied
    up. Nothing on the device."""
    moved = float(tokens * model.act_bytes_per_token_checkpointed) * recomputed
    out = {link: 0.0 * recomputed for link in PRICED_LINKS}
    if boundaries in (Tier.HOST, Tier.NVME):
        out[Link.HOST_TO_DEVICE] = moved
    if boundaries is Tier.HOST:
        out[Link.DEVICE_TO_HOST] = moved
    if boundaries is Tier.NVME:
        out[Link.HOST_TO_NVME] = out[Link.NVME_TO_HOST] = moved
    return out


def chunk_peak_bytes(model: ModelProfile, tokens: int, chunk_tokens: int) -> int:
    """Device bytes of a chunked block's backward beyond the kept boundaries:
    :data:`BOUNDARY_GRADS` gradients of the whole pass's hidden states, and one chunk's
    recomputed activations and what its backward holds beyond them
    (``act_bytes_per_token_full + act_bytes_per_token_backward`` per chunk token) less its
    slices of those gradients. One chunk of the whole pass is the unchunked block's
    ``tokens * (full + backward)``."""
    ckpt = model.act_bytes_per_token_checkpointed
    per_chunk = model.act_bytes_per_token_full + model.act_bytes_per_token_backward
    return chunk_tokens * (per_chunk - BOUNDARY_GRADS * ckpt) + BOUNDARY_GRADS * tokens * ckpt


def launch_seconds(hw: HardwareProfile, grad_accum: int, recomputed: Any, chunks: int) -> Any:
    """Seconds per step the chunks' extra kernel launches take: ``grad_accum * recomputed *
    (chunks - 1) * LAUNCHES_PER_BLOCK_CHUNK * hw.kernel_launch_seconds`` (each chunk beyond
    the first launches a block's kernels again)."""
    extra = grad_accum * (chunks - 1) * LAUNCHES_PER_BLOCK_CHUNK * hw.kernel_launch_seconds
    return extra * recomputed


def swapped_blocks(
    recomputed: Arr,
    compute_pass: Arr,
    block_forward: float,
    links_pass: Arr,
    swap_link: float,
    free_host: Arr,
    swap_bytes: float,
) -> Arr:
    """Recomputed blocks whose saved activations are cheaper kept on the host than
    recomputed (SSDTrain, Fuyou), per candidate.

    Swapping a block saves its recompute, ``block_forward`` seconds of compute per pass,
    and moves its saved activations (``swap_bytes``) to the host in forward and back in
    backward, ``swap_link`` seconds on each of the two links (whose busier one is
    ``links_pass``). In the overlap model a pass takes the longer of compute and each link,
    so swapping pays while the links keep headroom: ``s = floor((compute_pass - links_pass)
    / (swap_link + block_forward))`` blocks, at most ``recomputed`` and what the free host
    memory ``free_host`` holds of ``swap_bytes`` each."""
    headroom = np.floor(
        np.maximum(compute_pass - links_pass, 0.0) / max(swap_link + block_forward, 1e-30)
    )
    room = np.floor(np.maximum(free_host, 0.0) / max(swap_bytes, 1.0))
    return np.minimum(np.minimum(headroom, room), recomputed)
