"""The planner prices a training pass's backward as the dry run counts it on ``meta``.

Two peaks of ``CausalLMModule``'s chunked loss: the loss's backward, where the output head's
weight gradient is summed over the chunks (the running sum, a chunk's and their sum, each
``vocab x hidden``), and a recomputed block's backward, which holds the gradients of its
intermediate activations beside what its forward saved. The reference is the dry run's
accountant (:mod:`bb_lightning.strategy.dryrun_memory`): run with the device budget cut to the plan's
device figure, the dry run must fit it, and the figure must not exceed the peak by more
than a few per cent.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from bb_lightning.planner import FitJob, make_plan, preset
from bb_lightning.planner.cost import loss_chunk_tokens
from bb_lightning.planner.models import builtin_config
from bb_lightning.probe import model_profile_from_config
from bb_lightning.strategy.dryrun import dry_fit
from storage.tiers import Tier

LLAMA_3B = {
    "model_type": "llama", "hidden_size": 3072, "intermediate_size": 8192,
    "num_hidden_layers": 28, "num_attention_heads": 24, "num_key_value_heads": 8,
    "vocab_size": 128256, "max_position_embeddings": 2048, "tie_word_embeddings": False,
}  # fmt: skip
"""Llama 3.2 3B's shape (an untied 128k head of 0.73 GiB in bf16): the head's gradient
summed over the loss's chunks is the device's peak. A 70B's peak is the backward of a
recomputed block (about 15 s on 2 cores)."""

CASES: dict[str, tuple[dict[str, Any], str, float | None, int, int]] = {
    # config, preset, device GiB (None: the preset's), tokens per sequence, sequences per step
    "head-gradient-sum": (LLAMA_3B, "h200", 7.0, 2048, 2),
    "block-backward": (builtin_config("llama-70b"), "h100", None, 2048, 512),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_the_dry_run_of_a_chunked_loss_plan_fits_and_the_plan_is_close(case: str) -> None:
    config, hardware, gib, seq, seqs = CASES[case]
    model = model_profile_from_config(config)
    hw = preset(hardware)
    if gib is not None:
        hw = hw.replace(device_memory=int(gib * (1 << 30)))
    job = FitJob(
        seq_len=seq, global_batch_seqs=seqs, loss_chunk_tokens=loss_chunk_tokens(model.vocab_size)
    )
    plan = make_plan(model, hw, job)
    used = {m.tier: m for m in plan.memory}[Tier.DEVICE].used
    # the device budget cut to the plan's figure: the store's arena takes no headroom
    # (room for re-plans), so the dry run's peak is what the plan priced
    exact = dataclasses.replace(
        plan,
        memory=tuple(
            dataclasses.replace(m, budget=used) if m.tier is Tier.DEVICE else m for m in plan.memory
        ),
    )
    report = dry_fit(exact, config)
    peak = report.peaks[Tier.DEVICE]
    assert report.over == [], (peak, used)
    assert peak.phase.startswith("backward"), peak
    assert peak.bytes <= used <= 1.08 * peak.bytes, (peak, used)
