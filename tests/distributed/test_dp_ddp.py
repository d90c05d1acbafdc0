"""Data-parallel training with the weights sharded equals Lightning's own DDP on the same
ranks and data.

Each case trains the tiny Llama (fp32, AdamW with weight decay 0.1, 3 steps) twice at the
same world size: under ``balance_beam`` (every rank homes its shard of each block's
weights and of the optimizer state, assembles each block on the device at its page-in
and reduce-scatters the block's gradients there) and under Lightning's ``ddp`` strategy
with ``torch.optim.AdamW`` (a whole model per rank, gradients all-reduced). The
per-micro-batch losses (rtol 1e-5), the trained weights (rtol 1e-5) and AdamW's moments
(rtol 1e-4) agree (:func:`assert_like_ddp`). A run that forgot the reduction's ``1 / N`` or assembled a
block from its shards in another rank order trains other weights from the first step on.

The cases cover the samplers whose rows differ with the world size (a plain ``DataLoader``
that Lightning shards, a user's seeded ``RandomSampler`` that Lightning wraps),
accumulation, LoRA adapters over frozen (sharded) base weights, a head tied to the
embedding, a mixture of experts with its routers' auxiliary loss, and 4 ranks (with the
user's sampler and the tied head). The strided
``DistributedSampler`` subclass of ``dp_run.py`` gives every world size the same rows per
step, so that Lightning's DDP over it trains as one plain process: ``test_dp_fit.py``
compares 2 ranks with one process and that one with plain Lightning (host and NVMe state,
global-norm clipping), and resuming at another world size.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

CASES: dict[str, tuple[int, int, tuple[str, ...]]] = {
    # name: (ranks, micro-batches per rank and step, arguments of both runs)
    "plain-loader-lora": (2, 2, ("--loader", "plain", "--lora", "4")),
    "four-ranks-user-sampler-tied": (4, 1, ("--loader", "user", "--tied")),
    "plain-loader-moe": (2, 2, ("--loader", "plain", "--moe")),
}


def _args(runs: Any, args: tuple[str, ...]) -> list[str]:
    """``args`` with ``--tied`` or ``--moe`` replaced by that model's directory."""
    out = [a for a in args if a not in ("--tied", "--moe")]
    if "--tied" in args:
        return [*out, "--model", str(runs.tied_model)]
    return [*out, "--model", str(runs.moe_model)] if "--moe" in args else out


MASTER_ATOL = 5e-6
"""Absolute tolerance of a trained weight: DDP sums each gradient in another order (its
all-reduce against the reduce-scatter; a tied weight's two uses), and AdamW's normalised
step magnifies that fp32 rounding where a gradient is near zero: half a percent of one
step at lr 1e-3 (seen: 3.9e-6, one element of a tied model's)."""
MOMENT_ATOL = 1e-8
"""Absolute tolerance of a moment (seen: 6e-9 on first moments of about 1e-5)."""


def assert_like_ddp(ours: Any, ddp: Any) -> None:
    """Losses of every micro-batch of every step (rtol 1e-5), the trained weights (rtol
    1e-5, atol :data:`MASTER_ATOL`) and AdamW's moments (rtol 1e-4, atol
    :data:`MOMENT_ATOL`) of two runs. A reduction that forgot its ``1 / N`` leaves
    AdamW's update nearly as it is (the moments' ratio), not the moments."""
    assert ours.result()["step"] == ddp.result()["step"] == 3
    assert ours.losses().keys() == ddp.losses().keys()
    for step, values in ddp.losses().items():  # rank by rank, micro-batch by micro-batch
        torch.testing.assert_close(
            torch.tensor(ours.losses()[step]), torch.tensor(values), rtol=1e-5, atol=0, msg=step
        )
    got, want = ours.state(), ddp.state()
    assert got["master"].keys() == want["master"].keys()
    for name, value in want["master"].items():
        torch.testing.assert_close(
            got["master"][name], value, rtol=1e-5, atol=MASTER_ATOL, msg=name
        )
        for kind in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(
                got[kind][name],
                want[kind][name],
                rtol=1e-4,
                atol=MOMENT_ATOL,
                msg=f"{kind} {name}",
            )


@pytest.mark.parametrize("case", sorted(CASES))
def test_sharded_ranks_train_as_lightning_ddp(runs: Any, case: str) -> None:
    ranks, accum, args = CASES[case]
    ours = runs.fit(ranks, accum, *_args(runs, args))
    ddp = runs.fit(ranks, accum, "--plain", *_args(runs, args))
    assert ours.result()["world_size"] == ddp.result()["world_size"] == ranks
    assert len(ours.loss_files()) == ranks
    assert_like_ddp(ours, ddp)
    if "--lora" in args:  # only the adapters train; the base weights have no state
        assert ours.state()["master"] and all("lora_" in k for k in ours.state()["master"])
    if "--tied" in args:  # one parameter for the embedding and the head
        assert not any("lm_head" in k for k in ours.state()["master"])
