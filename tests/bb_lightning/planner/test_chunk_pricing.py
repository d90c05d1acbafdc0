"""Chunked blocks in the fine-tuning price (``Placement.chunk_rows``, ``boundaries``):
device, host and NVMe bytes, link seconds and kernel launches against hand computations,
the swap of saved activations (priced only), and the search's larger passes."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest

from bb_lightning.planner import FitJob, make_plan, preset
from bb_lightning.planner.fit_price import FitPrice, price
from bb_lightning.planner.models import builtin_config
from bb_lightning.planner.plan import PlanOverrides
from bb_lightning.planner.profile import HardwareProfile, ModelProfile
from bb_lightning.probe import model_profile_from_config
from bb_lightning.shapes import SWAP_MARGIN
from storage.tiers import Tier

SEQ, MB, GLOBAL = 512, 8, 16  # two micro-batches of 8 x 512 = 4,096 tokens
T = MB * SEQ
NONE = np.array([0.0])  # no block resident: all four paged (and recomputed)


def _price(
    model: ModelProfile,
    hw: HardwareProfile,
    rows: int | None,
    tier: Tier | None,
    ov: PlanOverrides | None = None,
) -> FitPrice[float]:
    job = FitJob(seq_len=SEQ, global_batch_seqs=GLOBAL, loss_chunk_tokens=64)
    budgets = {Tier.DEVICE: 8 << 30, Tier.HOST: 64 << 30, Tier.NVME: 1 << 40}
    ov = ov or PlanOverrides()
    return price(model, hw, job, ov, budgets, True, 1, MB, NONE, NONE, False, False, rows, tier).at(
        0
    )


def test_a_chunked_pass_holds_one_chunk_and_the_boundaries(
    small_model: ModelProfile, small_gpu: HardwareProfile
) -> None:
    ckpt, full = small_model.act_bytes_per_token_checkpointed, small_model.act_bytes_per_token_full
    whole = _price(small_model, small_gpu, None, None)
    halves = _price(small_model, small_gpu, 4, Tier.DEVICE)  # 2 chunks of 2,048 tokens
    # the backward's peak: one block's whole activations (its input's and output's
    # gradients among them), against one chunk's and the whole pass's two gradients
    # (the boundaries of all 4 blocks held either way)
    assert whole.device_bytes - halves.device_bytes == (T - 4 * SEQ) * (full - 2 * ckpt)
    chunked = _price(small_model, small_gpu, 2, Tier.DEVICE)  # 4 chunks of 1,024 tokens
    on_host = _price(small_model, small_gpu, 2, Tier.HOST)
    # on the host: 2 of the 4 blocks' boundaries in flight on the device, all 4 pinned
    assert chunked.device_bytes - on_host.device_bytes == (4 - 2) * T * ckpt
    assert on_host.mandatory_host_bytes - chunked.mandatory_host_bytes == 4 * T * ckpt
    on_nvme = _price(small_model, small_gpu, 2, Tier.NVME)
    # on NVMe: all 4 there, 2 staged in pinned host memory, 2 in flight on the device
    assert on_nvme.device_bytes == on_host.device_bytes
    assert on_nvme.mandatory_host_bytes - chunked.mandatory_host_bytes == 2 * T * ckpt
    assert on_nvme.nvme_bytes - chunked.nvme_bytes == 4 * T * ckpt


def test_boundaries_off_the_device_cross_their_links_both_ways(
    small_model: ModelProfile, small_gpu: HardwareProfile
) -> None:
    moved = 2 * 4 * T * small_model.act_bytes_per_token_checkpointed  # 2 micro-batches, 4 blocks
    on_device = _price(small_model, small_gpu, 2, Tier.DEVICE)
    on_host = _price(small_model, small_gpu, 2, Tier.HOST)
    on_nvme = _price(small_model, small_gpu, 2, Tier.NVME)
    for v in (on_host, on_nvme):  # fetched back through the host
        assert v.h2d_seconds - on_device.h2d_seconds == pytest.approx(moved / 2e10, rel=1e-9)
    # written to the host, or to NVMe straight from the device (the store's direct write)
    assert on_host.d2h_seconds - on_device.d2h_seconds == pytest.approx(moved / 2e10, rel=1e-9)
    assert on_nvme.d2h_seconds == on_device.d2h_seconds
    assert on_host.nvme_write_seconds == on_device.nvme_write_seconds
    assert on_nvme.nvme_write_seconds - on_device.nvme_write_seconds == pytest.approx(
        moved / 3e9, rel=1e-9
    )
    assert on_nvme.nvme_read_seconds - on_device.nvme_read_seconds == pytest.approx(
        moved / 5e9, rel=1e-9
    )


@pytest.mark.parametrize(("rows", "chunks"), [(1, 8), (2, 4), (3, 3)])
def test_each_chunk_beyond_the_first_launches_a_blocks_kernels_again(
    small_model: ModelProfile, small_gpu: HardwareProfile, rows: int, chunks: int
) -> None:
    whole = _price(small_model, small_gpu, None, None)
    chunked = _price(small_model, small_gpu, rows, Tier.DEVICE)
    # 2 micro-batches x 4 blocks x (chunks - 1) x 80 kernels x 5 us
    launches = 2 * 4 * (chunks - 1) * 80 * 5e-6
    assert chunked.launch_seconds == pytest.approx(launches, rel=1e-12)
    assert chunked.compute_seconds - whole.compute_seconds == pytest.approx(launches, rel=1e-9)


def test_swapping_saved_activations_is_priced_where_the_links_have_headroom(
    small_model: ModelProfile, small_gpu: HardwareProfile
) -> None:
    m = small_model
    hw = small_gpu.replace(device_flops=1e12, h2d_bandwidth=1e9, d2h_bandwidth=1e9)
    base = _price(m, hw, 2, Tier.DEVICE, PlanOverrides(swap_activations=False))
    swap = _price(m, hw, 2, Tier.DEVICE)  # priced both ways by default, the cheaper kept
    assert base.swapped_blocks == 0.0 and swap.step_seconds < base.step_seconds
    # a block's forward over one micro-batch, and its saved activations on one link
    fwd = T * (2 * m.block_matmul_params + 4 * m.num_heads * m.head_dim * SEQ) / 1e12
    link = T * m.swap_bytes_per_token / 1e9
    c, busiest = base.compute_seconds / 2, max(base.h2d_seconds, base.d2h_seconds) / 2
    s = swap.swapped_blocks
    assert 0 < s < 4  # some, not all: the links' headroom runs out
    assert c - s * fwd >= busiest + s * link  # the links still hide behind the compute
    assert c - (s + 1) * fwd < busiest + (s + 1) * link  # one more would not
    assert base.compute_seconds - swap.compute_seconds == pytest.approx(
        2 * s * fwd + 2 * 80 * 5e-6 * s * (MB // 2 - 1), rel=1e-9
    )
    assert swap.h2d_seconds - base.h2d_seconds == pytest.approx(2 * s * link, rel=1e-9)
    assert swap.recomputed_blocks == 4 - s


def test_a_swapped_block_moves_no_boundary_inputs_and_holds_its_chunks_on_the_device(
    small_model: ModelProfile, small_gpu: HardwareProfile
) -> None:
    """With the boundary inputs on the host, a swapped block's input is among its saved
    activations: the plan moves and holds its activations instead of its boundary, and the
    device holds the store's slots for three chunks fetched back (a margin beyond the estimate)."""
    m = small_model
    full, ckpt = m.swap_bytes_per_token, m.act_bytes_per_token_checkpointed
    hw = small_gpu.replace(device_flops=1e12, h2d_bandwidth=1e9, d2h_bandwidth=1e9)
    base = _price(m, hw, 2, Tier.HOST, PlanOverrides(swap_activations=False))
    swap = _price(m, hw, 2, Tier.HOST, PlanOverrides(swap_activations=True))
    s = swap.swapped_blocks
    assert 0 < s < 4 and swap.recomputed_blocks == 4 - s
    for link in ("h2d_seconds", "d2h_seconds"):  # 2 micro-batches, each way
        grown = getattr(swap, link) - getattr(base, link)
        assert grown == pytest.approx(2 * s * T * (full - ckpt) / 1e9, rel=1e-9), link
    chunk = 2 * SEQ  # rows per chunk x tokens per row
    assert swap.device_bytes - base.device_bytes == pytest.approx(3 * SWAP_MARGIN * chunk * full)
    assert swap.host_bytes - base.host_bytes == pytest.approx(s * T * (SWAP_MARGIN * full - ckpt))


@pytest.fixture(scope="module")
def llama_30b() -> ModelProfile:
    return model_profile_from_config(builtin_config("llama-30b"))


def test_the_search_carries_more_tokens_per_weight_pass_in_chunks(llama_30b: ModelProfile) -> None:
    """llama-30b on the rtx4090 preset: unchunked, one block's activations stop the
    micro-batch at 4 sequences (128 micro-batches, each rewriting the NVMe gradient sums);
    chunked, the boundaries off the device let it grow and the step runs twice as fast."""
    hw, job = preset("rtx4090"), FitJob(seq_len=2048, global_batch_seqs=512)
    whole = make_plan(llama_30b, hw, job, overrides=PlanOverrides(chunked=False))
    plan = make_plan(llama_30b, hw, job)
    assert whole.micro_batch == 4 and whole.placement.chunk_rows is None
    p = plan.placement
    assert plan.micro_batch >= 16 and p.chunk_rows is not None
    assert p.boundaries in (Tier.HOST, Tier.NVME)
    assert plan.tokens_per_s >= 2 * whole.tokens_per_s
    assert plan.memory[0].used <= plan.memory[0].budget
    text = plan.explain()
    chunks = math.ceil(plan.micro_batch / p.chunk_rows)
    assert f"{plan.tokens_per_pass:,} tokens per weight pass in {chunks} chunk(s)" in text
    assert f"live on the {p.boundaries.value}" in text and "blocks 0-59 recompute" in text
    # a user's accumulation is honoured: 128 micro-batches of 4, chunked or not
    kept = make_plan(llama_30b, hw, job, overrides=PlanOverrides(grad_accum=128))
    assert (kept.micro_batch, kept.grad_accum) == (4, 128)


def test_a_chunked_pass_of_many_tokens_fits_its_dry_run_at_the_final_norm() -> None:
    """Chunked blocks leave the final norm's backward over the whole pass (131,072 tokens
    of a 2,048-wide model, in fp32) as the device's peak: the plan prices it, and the dry
    run of the plan at the model's real size stays within the plan's device bytes."""
    from bb_lightning.strategy.dryrun import dry_fit

    config = builtin_config("llama-1.5b")
    model = model_profile_from_config(config)
    job = FitJob(seq_len=2048, global_batch_seqs=64, loss_chunk_tokens=697)
    ov = PlanOverrides(micro_batch=64, chunk_rows=8, boundaries=Tier.HOST, resident_blocks=0)
    plan = make_plan(model, preset("h100"), job, overrides=ov)
    used = plan.memory[0].used
    # the device budget cut to the plan's figure: the store's arena takes no headroom
    exact = dataclasses.replace(
        plan,
        memory=tuple(
            dataclasses.replace(m, budget=used) if m.tier is Tier.DEVICE else m for m in plan.memory
        ),
    )
    report = dry_fit(exact, config)
    peak = report.peaks[Tier.DEVICE]
    assert report.over == [], (peak, used)
    assert peak.phase.startswith("backward") and peak.block is None, peak  # not a block's
    assert peak.bytes <= used <= 1.05 * peak.bytes, (peak, used)
