"""Sharded optimizer state over 2 gloo processes: the same steps as torch AdamW on one.

Each rank (``shard_worker.py``, its own process) builds the training engine over the
same tiny Llama with a :class:`~bb_lightning.engine.shard.ShardComm`, trains on its half
of every global batch, and the masters and moments gathered from the two shards must
equal one process's ``torch.optim.AdamW`` on the whole batch.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
import zarr

from bb_lightning.engine.budgets import required_budgets, shard_counts
from bb_lightning.engine.checkpoint import verify_checkpoint
from bb_lightning.engine.shard import ShardComm, ShardLayout
from storage.tiers import Tier

from ..tiny import tiny_llama
from .shard_worker import (
    CASES,
    FROZEN,
    RESUMED,
    SAVED,
    STEPS,
    WORLD,
    batches,
    engine_for,
    freeze_outside,
    placement_of,
    restore,
    run_steps,
    save,
    state_of,
    torch_adamw,
)

WORKER = Path(__file__).with_name("shard_worker.py")


def _reference(case: str, steps: int = STEPS) -> dict[str, torch.Tensor]:
    """One process, torch AdamW, the whole global batch per step."""
    _, _, _, _, clip = CASES[case]
    model = tiny_llama()
    if case == FROZEN:
        freeze_outside(model)
    trained = [p for p in model.parameters() if p.requires_grad]
    opt = torch_adamw(case, model)
    for ids in batches()[:steps]:
        model(input_ids=ids, labels=ids).loss.backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(trained, clip)
        opt.step()
        opt.zero_grad()
    out: dict[str, torch.Tensor] = {}
    for key, p in model.named_parameters():
        if not p.requires_grad:
            continue
        out[f"master/{key}"] = p.detach().clone()
        out[f"exp_avg/{key}"] = opt.state[p]["exp_avg"].clone()
        out[f"exp_avg_sq/{key}"] = opt.state[p]["exp_avg_sq"].clone()
    return out


ATOL = 5e-5
"""Tolerance of a trained value against one process's (absolute): the ranks sum each
gradient in another order, and AdamW's normalised step magnifies that fp32 rounding where
a gradient is near zero; half a percent of one step at lr 1e-2 (seen: 1.6e-5)."""

Ranks = list[dict[str, dict[str, torch.Tensor]]]


@pytest.fixture(scope="module")
def shard_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Where the two ranks ran: their results, ``one.ckpt`` (1 process, all steps but the
    last, resumed by the ranks) and ``two.ckpt`` (saved by the ranks before the last step)."""
    tmp = tmp_path_factory.mktemp("shard")
    engine, store = engine_for(RESUMED, tmp / "one", None)
    with store:
        run_steps(engine, RESUMED, 0, 1, range(STEPS - 1))
        save(engine, tmp / "one.ckpt")
        engine.close()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen([sys.executable, str(WORKER), str(r), str(tmp)], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for r in range(WORLD)]  # fmt: skip
    logs = []
    for p in procs:
        try:
            logs.append(p.communicate(timeout=300)[0])
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise
    assert all(p.returncode == 0 for p in procs), "\n".join(logs)
    return tmp


@pytest.fixture(scope="module")
def two_ranks(shard_dir: Path) -> Ranks:
    return [torch.load(shard_dir / f"rank{r}.pt") for r in range(WORLD)]


@pytest.mark.slow
@pytest.mark.parametrize("case", sorted(CASES))
def test_two_shards_step_like_torch_adamw_on_the_whole_batch(two_ranks: Ranks, case: str) -> None:
    want = _reference(case)
    for rank in range(WORLD):
        got = two_ranks[rank][case]
        assert set(want) <= set(got)
        for key, value in want.items():
            torch.testing.assert_close(got[key], value, rtol=1e-4, atol=ATOL, msg=key)
    # every rank handed its gradients and its stepped shards to the collectives
    assert all(int(r[case]["bytes_sent"]) > 0 for r in two_ranks)


@pytest.mark.slow
@pytest.mark.parametrize("case", sorted(CASES))
def test_each_rank_stores_only_its_shard_of_the_weights(two_ranks: Ranks, case: str) -> None:
    """The ranks' stores hold one copy of the block weights between them: each its own
    rows (padding included), and the blocks assembled from them trained as above."""
    blocks = list(tiny_llama().model.layers)
    whole = sum(p.numel() for b in blocks for p in b.parameters())
    shard = sum(ShardLayout([p.shape for p in b.parameters()], WORLD).shard_numel for b in blocks)
    assert whole <= WORLD * shard < whole * 1.05  # a few padded rows at most
    for rank in range(WORLD):
        assert int(two_ranks[rank][case]["weight_numel"]) == shard


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["refused", "refused-frozen"])
def test_ranks_that_start_from_different_weights_are_refused(two_ranks: Ranks, kind: str) -> None:
    for rank in range(WORLD):
        message = str(two_ranks[rank][kind]["message"])
        assert "differ between the 2 ranks" in message
        where = "the frozen weights of block 1" if kind == "refused-frozen" else "block 1"
        assert f"{where} (model.layers.1)" in message
        assert "block 0" not in message and "block 2" not in message


@pytest.mark.slow
def test_a_two_rank_checkpoint_reads_whole_with_zarr_and_resumes_in_one_process(
    shard_dir: Path, tmp_path: Path
) -> None:
    path = shard_dir / "two.ckpt"
    assert json.loads((path / "meta.json").read_text())["world_size"] == WORLD
    assert not verify_checkpoint(path).problems
    want = _reference(SAVED, steps=STEPS - 1)
    group = zarr.open_group(str(path / "state.zarr"), mode="r")
    for key, value in want.items():
        torch.testing.assert_close(
            torch.from_numpy(np.asarray(group[key][...])), value, rtol=1e-4, atol=ATOL, msg=key
        )
    # each rank wrote its own rows: a matrix's array has one chunk per rank
    array = path / "state.zarr" / "master" / "model.layers.0.mlp.up_proj.weight"
    assert sorted(p.name for p in (array / "c").iterdir()) == ["0", "1"]
    engine, store = engine_for(SAVED, tmp_path / "resume", None)
    with store:
        restore(engine, path)
        assert engine.step_count == STEPS - 1
        run_steps(engine, SAVED, 0, 1, range(STEPS - 1, STEPS))
        got = state_of(engine)
        engine.close()
    for key, value in _reference(SAVED).items():
        torch.testing.assert_close(got[key], value, rtol=1e-4, atol=ATOL, msg=key)


@pytest.mark.slow
def test_a_one_process_checkpoint_resumes_on_two_ranks(two_ranks: Ranks) -> None:
    want = _reference(RESUMED)
    for rank in range(WORLD):
        got = two_ranks[rank]["resumed"]
        assert int(got["step_count"]) == STEPS
        for key, value in want.items():
            torch.testing.assert_close(got[key], value, rtol=1e-4, atol=ATOL, msg=key)


@pytest.mark.parametrize("world", [2, 3, 5])
def test_every_rank_holds_its_rows_of_every_parameter(world: int) -> None:
    shapes = [(7, 3), (4,), (), (1, 2, 2), (0, 5)]  # rows fewer than ranks, a scalar, empty
    layout = ShardLayout(shapes, world)
    full = torch.arange(1, layout.full_numel + 1, dtype=torch.float32)
    shards = [layout.take(full, r, torch.full((layout.shard_numel,), -1.0)) for r in range(world)]
    # the shards, rank by rank, unpack to the whole state
    whole = layout.unpack(torch.cat(shards), torch.empty(layout.full_numel))
    torch.testing.assert_close(whole, full)
    # rank r's rows of a parameter are rows [r * C, (r + 1) * C) of it, zero-padded
    params = torch.split(full, [math.prod(s) for s in shapes])
    for piece, shape, value in zip(layout.pieces, shapes, params, strict=True):
        rows = value.reshape(piece.rows, piece.row)
        for r in range(world):
            got = layout.rows_in_shard(piece, shards[r])
            lo, hi = piece.rows_of(r)
            torch.testing.assert_close(
                got[: hi - lo], rows[r * piece.chunk : (r + 1) * piece.chunk]
            )
            assert not got[hi - lo :].any()
        assert piece.chunk == -(-(shape[0] if shape else 1) // world)
    # packing per-parameter gradients gives the same rank-ordered buffer
    packed = layout.pack(list(params), torch.empty(layout.shard_numel * world))
    torch.testing.assert_close(packed, torch.cat(shards))


def test_a_shard_comm_needs_its_rank_within_the_world() -> None:
    assert ShardComm(None, rank=0, world_size=1).world_size == 1  # a group of one runs too
    for rank, world in ((1, 1), (-1, 2), (0, 0)):
        with pytest.raises(ValueError, match=f"rank={rank} of world_size={world}"):
            ShardComm(None, rank=rank, world_size=world)


def test_sharded_budgets_hold_one_shard_of_the_state() -> None:
    model = tiny_llama()
    numels = [sum(p.numel() for p in b.parameters()) for b in model.model.layers]
    rest = sum(p.numel() for p in model.parameters()) - sum(numels)
    placement = replace(placement_of(Tier.HOST, Tier.NVME), compute_dtype="float32")
    one = required_budgets(numels, rest, placement)
    parts, rest_part = shard_counts(model, list(model.model.layers), 2)
    two = required_budgets(
        numels, rest, placement, shards=2, shard_numels=parts, shard_rest=rest_part
    )
    state = 4 * 3 * sum(numels)  # master, exp_avg, exp_avg_sq in fp32 on NVMe
    assert two[Tier.NVME] < one[Tier.NVME]
    assert one[Tier.NVME] - two[Tier.NVME] >= state // 2 - 4096
