"""Sharded optimizer state over 2 gloo processes: the same steps as torch AdamW on one.

Each rank (``shard_worker.py``, its own process) builds the training engine over the
same tiny Llama with a :class:`~bb_lightning.engine.shard.ShardComm`, trains on its half
of every global batch, and the masters and moments gathered from the two shards must
equal one process's ``torch.optim.AdamW`` on the whole batch.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from bb_lightning.engine.pager import Placement
from bb_lightning.engine.shard import ShardComm
from bb_lightning.engine.trainer_engine import required_budgets
from storage.tiers import Tier

from .shard_worker import ADAMW, CASES, LAYERS, WORLD, batches
from .tiny import tiny_llama

WORKER = Path(__file__).with_name("shard_worker.py")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _placement(weights: Tier, state: Tier) -> Placement:
    return Placement(
        weights=(weights,) * LAYERS,
        master=(state,) * LAYERS,
        prefetch_depth=1,
        compute_dtype="float32",
    )


def _reference(case: str) -> dict[str, torch.Tensor]:
    """One process, torch AdamW, the whole global batch per step."""
    _, _, _, _, clip = CASES[case]
    model = tiny_llama()
    opt = torch.optim.AdamW(
        model.parameters(), lr=ADAMW.lr, betas=ADAMW.betas, weight_decay=ADAMW.weight_decay
    )
    for ids in batches():
        model(input_ids=ids, labels=ids).loss.backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        opt.zero_grad()
    out: dict[str, torch.Tensor] = {}
    for key, p in model.named_parameters():
        out[f"master/{key}"] = p.detach().clone()
        out[f"exp_avg/{key}"] = opt.state[p]["exp_avg"].clone()
        out[f"exp_avg_sq/{key}"] = opt.state[p]["exp_avg_sq"].clone()
    return out


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, dict[str, torch.Tensor]]]:
    tmp = tmp_path_factory.mktemp("shard")
    port = str(_free_port())
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen([sys.executable, str(WORKER), str(r), port, str(tmp)], env=env,
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
    return [torch.load(tmp / f"rank{r}.pt") for r in range(WORLD)]


@pytest.mark.slow
@pytest.mark.parametrize("case", sorted(CASES))
def test_two_shards_step_like_torch_adamw_on_the_whole_batch(
    two_ranks: list[dict[str, dict[str, torch.Tensor]]], case: str
) -> None:
    want = _reference(case)
    for rank in range(WORLD):
        got = two_ranks[rank][case]
        assert set(want) <= set(got)
        for key, value in want.items():
            torch.testing.assert_close(got[key], value, rtol=1e-4, atol=1e-5, msg=key)
    # every rank handed its gradients and its stepped shards to the collectives
    assert all(int(r[case]["bytes_sent"]) > 0 for r in two_ranks)


@pytest.mark.slow
def test_ranks_that_start_from_different_weights_are_refused(
    two_ranks: list[dict[str, dict[str, torch.Tensor]]],
) -> None:
    for rank in range(WORLD):
        message = str(two_ranks[rank]["refused"]["message"])
        assert "differ between the 2 ranks" in message
        assert "block 1 (model.layers.1)" in message
        assert "block 0" not in message and "block 2" not in message


@pytest.mark.parametrize(("numel", "world"), [(10, 2), (11, 2), (7, 3), (1, 4), (0, 2)])
def test_the_shards_tile_the_flat_state(numel: int, world: int) -> None:
    flat = torch.arange(numel, dtype=torch.float32)
    shards = [ShardComm(None, rank=r, world_size=world).shard_of(flat) for r in range(world)]
    size = -(-numel // world)
    assert all(s.numel() == size for s in shards)
    torch.testing.assert_close(torch.cat(shards)[:numel], flat)
    assert not torch.cat(shards)[numel:].any()  # the padding is zeros


def test_one_process_needs_no_shard_comm() -> None:
    with pytest.raises(ValueError, match="world_size >= 2"):
        ShardComm(None, rank=0, world_size=1)


def test_sharded_budgets_hold_one_shard_of_the_state() -> None:
    model = tiny_llama()
    numels = [sum(p.numel() for p in b.parameters()) for b in model.model.layers]
    rest = sum(p.numel() for p in model.parameters()) - sum(numels)
    placement = replace(_placement(Tier.HOST, Tier.NVME), compute_dtype="float32")
    one = required_budgets(numels, rest, placement)
    two = required_budgets(numels, rest, placement, shards=2)
    state = 4 * 3 * sum(numels)  # master, exp_avg, exp_avg_sq in fp32 on NVMe
    assert two[Tier.NVME] < one[Tier.NVME]
    assert one[Tier.NVME] - two[Tier.NVME] >= state // 2 - 4096
