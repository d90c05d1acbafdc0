"""The device's work in a fine-tuning step: compute per step and link seconds per pass,
after the recomputed blocks' chunks and the swapped ones (used by
:func:`~bb_lightning.planner.fit_price.price`)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from bb_lightning.planner import chunks, cost
from bb_lightning.planner.fit_memory import FitMemory, FitSizes
from bb_lightning.planner.plan import PlanOverrides
from bb_lightning.planner.profile import HardwareProfile, ModelProfile
from storage.tiers import Link

Arr = npt.NDArray[np.float64]


@dataclass(frozen=True, kw_only=True)
class PassWork:
    """The device's work per step and the links' per pass: arrays over the candidates."""

    recomputed: Arr
    """Blocks whose forward runs again in backward."""
    swapped: Arr
    """Blocks whose saved activations go to the host and back instead (priced only)."""
    compute: Arr
    """Device compute, seconds per step, the chunks' extra launches included."""
    launch: Arr
    """Of ``compute``, the seconds of the chunks' extra kernel launches."""
    links: dict[Link, Arr]
    """Busy seconds per link of one micro-batch pass."""
    swap_host_bytes: Arr
    """Host bytes the swapped activations of one micro-batch take."""


def pass_work(
    model: ModelProfile,
    hw: HardwareProfile,
    ov: PlanOverrides,
    sz: FitSizes,
    mem: FitMemory,
    ckpt: bool,
    recomputed: Arr,
    links: dict[Link, Arr],
) -> PassWork:
    """Compute per step and link seconds per pass of every candidate.

    Resident blocks (and blocks used in place) keep their activations: never recomputed.
    ``links``: the busy seconds per link of one pass, the boundary inputs' copies
    included (:func:`chunks.boundary_link_bytes`). With ``ov.swap_activations`` the recomputed blocks
    the links have headroom for keep their saved activations on the host instead
    (:func:`chunks.swapped_blocks`: their recompute saved, their activations on both links).
    Each chunk beyond the first launches the block's kernels again
    (:func:`chunks.launch_seconds`).
    """
    n, ga, pass_tokens = sz.blocks, sz.grad_accum, sz.micro_batch * sz.seq_len
    tokens = float(sz.seqs_per_step * sz.seq_len)
    links = dict(links)
    flops = tokens * cost.train_flops_per_token(model, sz.seq_len, ckpt, n - recomputed)
    compute = cost.compute_seconds(flops, hw) + 0.0 * recomputed
    swapped = 0.0 * recomputed
    swap_bytes = float(pass_tokens * model.act_bytes_per_token_full)
    if ov.swap_activations and ckpt:
        head = model.head_flops_per_token()
        block_fwd = (cost.forward_flops_per_token(model, sz.seq_len) - head) / max(n, 1)
        fwd_pass = cost.compute_seconds(pass_tokens * block_fwd, hw)
        swap_link = max(
            cost.link_seconds(swap_bytes, hw.h2d_bandwidth, hw.h2d_efficiency),
            cost.link_seconds(swap_bytes, hw.d2h_bandwidth, hw.d2h_efficiency),
        )
        busiest = np.maximum(links[Link.HOST_TO_DEVICE], links[Link.DEVICE_TO_HOST])
        swapped = chunks.swapped_blocks(
            recomputed, compute / ga, fwd_pass, busiest, swap_link, mem.free_host_bytes, swap_bytes
        )
        compute = compute - ga * swapped * fwd_pass
        for link, bw, eff in (
            (Link.HOST_TO_DEVICE, hw.h2d_bandwidth, hw.h2d_efficiency),
            (Link.DEVICE_TO_HOST, hw.d2h_bandwidth, hw.d2h_efficiency),
        ):
            links[link] = links[link] + cost.link_seconds(swapped * swap_bytes, bw, eff)
    launch = chunks.launch_seconds(hw, ga, recomputed - swapped, sz.chunks)
    return PassWork(
        recomputed=recomputed - swapped,
        swapped=swapped,
        compute=compute + launch,
        launch=launch,
        links=links,
        swap_host_bytes=swapped * swap_bytes,
    )
