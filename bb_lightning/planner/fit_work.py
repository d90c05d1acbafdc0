"""The device's work in a fine-tuning step: compute per step and link seconds per pass,
after the recomputed blocks' chunks and the swapped ones (used by
:func:`~bb_lightning.planner.fit_price.price`)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from bb_lightning.planner import chunks, cost
from bb_lightning.planner.fit_memory import FitMemory, FitSizes
from bb_lightning.planner.profile import HardwareProfile, ModelProfile
from bb_lightning.shapes import SWAP_CHUNKS_IN_FLIGHT, SWAP_MARGIN
from storage.tiers import Link

Arr = npt.NDArray[np.float64]


@dataclass(frozen=True, kw_only=True)
class PassWork:
    """The device's work per step and the links' per pass: arrays over the candidates."""

    recomputed: Arr
    """Blocks whose forward runs again in backward."""
    swapped: Arr
    """Blocks whose saved activations go to the host and back instead."""
    compute: Arr
    """Device compute, seconds per step, the chunks' extra launches included."""
    launch: Arr
    """Of ``compute``, the seconds of the chunks' extra kernel launches."""
    links: dict[Link, Arr]
    """Busy seconds per link of one micro-batch pass."""
    swap_host_bytes: Arr
    """Host bytes the swapped activations of one micro-batch take (on a CPU device all of
    them, in the RAM the device shares)."""
    swap_device_bytes: Arr
    """Device bytes of the swapped blocks' chunks fetched back at once in backward (0
    where nothing swaps or the device is a CPU)."""
    boundary_bytes: Arr
    """Bytes of one recomputed block's boundary inputs on their home tier: the swapped
    blocks keep none (their inputs are among their saved activations)."""


def swap_bytes(model: ModelProfile, tokens: int) -> tuple[float, float]:
    """(bytes the store holds on the host per swapped block, bytes of its device slots
    beside the blocks' activations) for a pass or chunk of ``tokens`` tokens: the saved
    activations (``ModelProfile.swap_bytes_per_token``) with :data:`SWAP_MARGIN`, and
    :data:`SWAP_CHUNKS_IN_FLIGHT` of a chunk's on the device."""
    held = float(tokens * model.swap_bytes_per_token) * SWAP_MARGIN
    return held, SWAP_CHUNKS_IN_FLIGHT * held


def pass_work(
    model: ModelProfile,
    hw: HardwareProfile,
    sz: FitSizes,
    mem: FitMemory,
    ckpt: bool,
    recomputed: Arr,
    links: dict[Link, Arr],
    device_budget: float,
    swap: bool,
) -> PassWork:
    """Compute per step and link seconds per pass of every candidate.

    Resident blocks (and blocks used in place) keep their activations: never recomputed.
    ``links``: the busy seconds per link of one pass, every recomputed block's boundary
    inputs' copies included (:func:`chunks.boundary_link_bytes`). With ``swap`` (not data
    parallel, where no run has checked it), the recomputed blocks the links have headroom
    for keep their saved activations on the host instead (:func:`chunks.swapped_blocks`:
    their recompute saved, their activations on both links, their boundary inputs' copies
    not made), where the free host memory holds them and the device ``device_budget`` the
    store's slots for their chunks fetched back (:func:`swap_bytes`). On a CPU device,
    whose host is its own memory, a swapped block's activations move nowhere: every copied
    block whose saved activations the free memory holds swaps, for no link time. Each
    chunk beyond the first launches the block's kernels again
    (:func:`chunks.launch_seconds`).
    """
    n, ga, pass_tokens = sz.blocks, sz.grad_accum, sz.micro_batch * sz.seq_len
    tokens = float(sz.seqs_per_step * sz.seq_len)
    links = dict(links)
    flops = tokens * cost.train_flops_per_token(model, sz.seq_len, ckpt, n - recomputed)
    compute = cost.compute_seconds(flops, hw) + 0.0 * recomputed
    swapped = 0.0 * recomputed
    moved = float(pass_tokens * model.swap_bytes_per_token)
    held, _ = swap_bytes(model, pass_tokens)
    _, slots = swap_bytes(model, sz.chunk_tokens)
    head = model.head_flops_per_token()
    block_fwd = (cost.forward_flops_per_token(model, sz.seq_len) - head) / max(n, 1)
    fwd_pass = cost.compute_seconds(pass_tokens * block_fwd, hw)
    on_host, on_device = 0.0 * recomputed, 0.0 * recomputed
    if swap and ckpt and hw.device_type == "cpu" and not sz.data_parallel:
        # the host is the device's own memory: a copied block's saved activations stay where
        # its forward made them (the engine's swap with nothing to move), so every copied
        # block whose activations the RAM pool's free bytes hold keeps them instead of
        # recomputing (a block used in place that checkpointing forced on recomputes keeps
        # recomputing); they are counted on the host side of the pool, as a block used in
        # place counts its own
        copied = np.minimum(recomputed, mem.paged_blocks - mem.in_place_blocks)
        room = np.floor(np.maximum(mem.free_host_bytes, 0.0) / max(held, 1.0))
        swapped = np.minimum(copied, room)
        on_host = swapped * held
    elif swap and ckpt and not sz.data_parallel:
        swap_link = max(
            cost.link_seconds(moved, hw.h2d_bandwidth, hw.h2d_efficiency),
            cost.link_seconds(moved, hw.d2h_bandwidth, hw.d2h_efficiency),
        )
        busiest = np.maximum(links[Link.HOST_TO_DEVICE], links[Link.DEVICE_TO_HOST])
        swapped = chunks.swapped_blocks(
            recomputed, compute / ga, fwd_pass, busiest, swap_link, mem.free_host_bytes, held
        )
        # only paged blocks swap (a resident block recomputed by force keeps its weights)
        swapped = np.minimum(swapped, mem.paged_blocks)
        swapped = np.where(mem.device_bytes + slots <= device_budget, swapped, 0.0)
        on_host, on_device = swapped * held, np.where(swapped > 0, slots, 0.0)
        for link, bw, eff in (
            (Link.HOST_TO_DEVICE, hw.h2d_bandwidth, hw.h2d_efficiency),
            (Link.DEVICE_TO_HOST, hw.d2h_bandwidth, hw.d2h_efficiency),
        ):
            links[link] = links[link] + cost.link_seconds(swapped * moved, bw, eff)
    # a swapped block's recompute is saved, and its boundary inputs are not copied
    compute = compute - ga * swapped * fwd_pass
    bound = chunks.boundary_link_bytes(model, pass_tokens, swapped, sz.boundaries)
    for link, (bw, eff) in _rates(hw).items():
        links[link] = links[link] - cost.link_seconds(bound[link], bw, eff)
    launch = chunks.launch_seconds(hw, ga, recomputed - swapped, sz.chunks)
    per_block = float(pass_tokens * model.act_bytes_per_token_checkpointed)
    return PassWork(
        recomputed=recomputed - swapped,
        swapped=swapped,
        compute=compute + launch,
        launch=launch,
        links=links,
        swap_host_bytes=on_host,
        swap_device_bytes=on_device,
        boundary_bytes=swapped * per_block,
    )


def _rates(hw: HardwareProfile) -> dict[Link, tuple[float, float]]:
    """(bandwidth, efficiency) of each priced link."""
    return {
        Link.HOST_TO_DEVICE: (hw.h2d_bandwidth, hw.h2d_efficiency),
        Link.DEVICE_TO_HOST: (hw.d2h_bandwidth, hw.d2h_efficiency),
        Link.NVME_TO_HOST: (hw.nvme_read_bandwidth, hw.nvme_efficiency),
        Link.HOST_TO_NVME: (hw.nvme_write_bandwidth, hw.nvme_efficiency),
    }
