"""The dry run runs chunked blocks: its device peak holds one chunk's block internals.

A plan's placement with ``chunk_rows`` runs every recomputed block of a micro-batch of
many rows one row at a time on ``meta`` tensors, as a run would; the device peak the dry
run measures falls below the one-piece run's at the same micro-batch, by about the
block internals of the rows not in flight, and with the boundary inputs on the host it
falls further, by the boundaries of the blocks not paged in.
"""

from __future__ import annotations

import dataclasses

from bb_lightning.placement import Placement
from bb_lightning.planner import FitJob, Plan, make_plan, preset
from bb_lightning.probe import model_profile_from_config
from bb_lightning.strategy.dryrun import dry_fit
from storage.tiers import Link, Tier

from ..tiny import tiny_llama_config

CONFIG = tiny_llama_config(4, intermediate_size=512, max_position_embeddings=512)
ROWS, SEQ = 8, 256


def _plan(chunk_rows: int | None, boundaries: Tier | None) -> Plan:
    job = FitJob(seq_len=SEQ, global_batch_seqs=ROWS, compute_dtype="float32",
                 loss_chunk_tokens=256)  # fmt: skip
    plan = make_plan(model_profile_from_config(CONFIG), preset("a100-80gb"), job)
    placement = Placement(
        weights=(Tier.HOST,) * 4, master=(Tier.HOST,) * 4, compute_dtype="float32",
        chunk_rows=chunk_rows, boundaries=boundaries,
    )  # fmt: skip
    return dataclasses.replace(plan, placement=placement, micro_batch=ROWS, grad_accum=1)


def test_the_dry_run_device_peak_of_a_chunked_placement_is_one_chunks() -> None:
    whole = dry_fit(_plan(None, None), CONFIG)
    chunked = dry_fit(_plan(1, Tier.DEVICE), CONFIG)
    host = dry_fit(_plan(1, Tier.HOST), CONFIG)
    device = [r.peaks[Tier.DEVICE].bytes for r in (whole, chunked, host)]
    assert device[1] < device[0] / 2  # one row's internals of eight rows'
    assert device[2] < device[1]  # the boundaries of blocks not paged in are on the host
    boundary = ROWS * SEQ * CONFIG["hidden_size"] * 4  # one block's hidden states, fp32
    assert host.peaks[Tier.HOST].bytes - chunked.peaks[Tier.HOST].bytes >= 4 * boundary
    # each block's boundary inputs written to the host in forward, read back in backward
    for link in (Link.DEVICE_TO_HOST, Link.HOST_TO_DEVICE):
        assert host.links[link] - chunked.links[link] == 4 * boundary
    assert chunked.links == whole.links  # chunks move no more bytes than one piece
