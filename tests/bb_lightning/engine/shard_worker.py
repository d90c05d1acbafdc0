"""One rank of the sharded-engine test (``test_shard.py``): ``python shard_worker.py RANK
DIR`` trains every case of :data:`CASES` on its half of each global batch over a
2-process gloo world, saves and resumes checkpoints, and saves the gathered state to
``DIR/rank<RANK>.pt``. The ranks meet through a file in ``DIR`` (``file://``
rendezvous), not a port chosen beforehand that another process could take. The test
imports its helpers for the 1-process runs."""

from __future__ import annotations

import sys
import traceback
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).parents[1]))  # run as a script: the tiny model factory

from tiny import LAYERS, tiny_llama

from bb_lightning.engine import checkpoint as ckpt
from bb_lightning.engine.budgets import required_budgets, shard_counts
from bb_lightning.engine.optim import AdamWConfig
from bb_lightning.engine.optimizer_step import ClipConfig, adamw_groups_from_optimizer
from bb_lightning.engine.shard import ShardComm
from bb_lightning.engine.trainer_engine import TrainingEngine
from bb_lightning.placement import Placement
from storage.io import IOConfig
from storage.store import StoreConfig, TieredStore
from storage.tiers import Tier

WORLD = 2
ROWS, SEQ, STEPS = 4, 16, 2
"""Rows and tokens of each global batch; optimizer steps (the last steps from moments that
the ranks, or a checkpoint, hold from the first)."""
ADAMW = AdamWConfig(lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1)
CASES = {
    # name: (weights, state, accumulate, overlapped step, clip norm)
    "host": (Tier.HOST, Tier.HOST, 1, True, None),
    "nvme-clip": (Tier.NVME, Tier.NVME, 2, False, 0.05),
    "nvme-overlap": (Tier.HOST, Tier.NVME, 2, True, None),
    "frozen-outside": (Tier.HOST, Tier.HOST, 1, True, None),
    "late-block": (Tier.HOST, Tier.HOST, 2, True, None),
    "two-forwards": (Tier.NVME, Tier.HOST, 1, True, None),
    "param-groups": (Tier.HOST, Tier.NVME, 2, True, None),
}
LATE = "late-block"
"""The case in which rank 1's last block is handed on after the block before it (as when
which parameters get a gradient depends on the data): the reductions keep their order."""
FROZEN = "frozen-outside"
"""The case that trains the blocks only: nothing outside them has optimizer state."""
SAVED = "nvme-clip"
"""The case whose 2 ranks save a checkpoint after 2 steps (``two.ckpt``)."""
RESUMED = "host"
"""The case a 1-process checkpoint after 2 steps (``one.ckpt``) resumes on 2 ranks."""
GROUPS = "param-groups"
"""The case whose AdamW has two param groups (:func:`param_groups`)."""
TWICE = "two-forwards"
"""The case whose micro-batches run the model twice (a row each) before one backward:
every recomputed block hands its gradients on twice."""


def batches() -> list[torch.Tensor]:
    """The global batch of every step (the same in every process)."""
    gen = torch.Generator().manual_seed(7)
    return [torch.randint(0, 128, (ROWS, SEQ), generator=gen) for _ in range(STEPS)]


def _store(path: Path, model: torch.nn.Module, placement: Placement, shards: int) -> TieredStore:
    blocks = model.model.layers
    numels = [sum(p.numel() for p in b.parameters()) for b in blocks]
    rest = sum(p.numel() for p in model.parameters()) - sum(numels)
    parts, rest_part = shard_counts(model, list(blocks), shards)
    need = required_budgets(
        numels, rest, placement, shards=shards, shard_numels=parts, shard_rest=rest_part
    )
    return TieredStore(
        StoreConfig(
            device_budget=need[Tier.DEVICE],
            host_budget=need[Tier.HOST],  # exactly what the engine registers
            nvme_path=str(path),
            nvme_budget=need[Tier.NVME] + (1 << 20),
            io=IOConfig(backend="posix", threads=2),
            device="cpu",
        )
    )


def placement_of(weights: Tier, state: Tier) -> Placement:
    """Every block's weights on ``weights`` and its optimizer state on ``state``, fp32."""
    return Placement(
        weights=(weights,) * LAYERS,
        master=(state,) * LAYERS,
        prefetch_depth=1,
        compute_dtype="float32",
    )


def param_groups(model: torch.nn.Module) -> list[dict[str, Any]]:
    """torch AdamW param groups of the :data:`GROUPS` case: matrices at twice the
    learning rate, vectors (norms) without weight decay and with an eps of their own."""
    trained = [p for p in model.parameters() if p.requires_grad]
    return [
        {"params": [p for p in trained if p.dim() >= 2], "lr": 2 * ADAMW.lr},
        {"params": [p for p in trained if p.dim() < 2], "weight_decay": 0.0, "eps": 1e-3},
    ]


def torch_adamw(case: str, model: torch.nn.Module) -> torch.optim.AdamW:
    """The torch AdamW of ``case`` over ``model``'s trained parameters."""
    trained = [p for p in model.parameters() if p.requires_grad]
    groups = param_groups(model) if case == GROUPS else trained
    return torch.optim.AdamW(
        groups, lr=ADAMW.lr, betas=ADAMW.betas, weight_decay=ADAMW.weight_decay
    )


def run_steps(engine: TrainingEngine, case: str, rank: int, world: int, steps: range) -> None:
    """Optimizer steps ``steps`` of ``case``: this rank's share of each global batch."""
    _, _, accumulate, overlap, clip = CASES[case]
    with engine.pager.shaped():  # the blocks' parameters with their shapes, to group them
        adamw = adamw_groups_from_optimizer(torch_adamw(case, engine.model))
    share = ROWS // world
    for step in steps:
        mine = batches()[step][rank * share : (rank + 1) * share]
        for k, micro in enumerate(mine.chunk(accumulate)):
            if overlap and k == accumulate - 1:
                engine.begin_overlapped_step(adamw)
            if case == TWICE:  # the mean of the rows' losses, as of the whole micro-batch
                halves = [engine.model(input_ids=m, labels=m).loss for m in micro.chunk(2)]
                loss = sum(halves) / len(halves)
            else:
                loss = engine.model(input_ids=micro, labels=micro).loss / accumulate
            loss.backward()
            engine.after_backward()
        engine.optimizer_step(adamw, ClipConfig(value=clip))


def state_of(engine: TrainingEngine) -> dict[str, torch.Tensor]:
    """Every parameter's master and moments (gathered: every rank calls it)."""
    out = {}
    for key, s in engine.iter_state():
        for kind, value in s.items():
            out[f"{kind}/{key}"] = value.clone()
    return out


def freeze_outside(model: torch.nn.Module) -> None:
    """Freeze every parameter outside the decoder layers."""
    inside = {id(p) for p in model.model.layers.parameters()}
    for p in model.parameters():
        if id(p) not in inside:
            p.requires_grad_(False)


def engine_for(case: str, path: Path, comm: ShardComm | None) -> tuple[TrainingEngine, TieredStore]:
    """A training engine of ``case``'s placement over a fresh tiny Llama and store."""
    weights, state = CASES[case][:2]
    model = tiny_llama()
    if case == FROZEN:
        freeze_outside(model)
    placement = placement_of(weights, state)
    store = _store(path, model, placement, WORLD if comm is not None else 1)
    engine = TrainingEngine(
        model, model.model.layers, store, placement, device=torch.device("cpu"), comm=comm
    )
    return engine, store


def save(engine: TrainingEngine, path: Path) -> None:
    """A checkpoint of the engine (rank 0 saves, the other ranks follow)."""
    if engine.comm is None or engine.comm.rank == 0:
        ckpt.save_checkpoint(engine, path, {"state_dict": {}})
    else:
        ckpt.follow_save(engine)


def restore(engine: TrainingEngine, path: Path) -> None:
    """Masters, moments and step count from the checkpoint at ``path``."""
    state_dict = ckpt.load_checkpoint(path)["state_dict"]
    ckpt.restore_weights(engine, state_dict)
    ckpt.restore_optimizer(engine, state_dict)


def _hand_last_block_late(engine: TrainingEngine) -> None:
    """Block ``LAYERS - 1``'s gradients reach the engine after block ``LAYERS - 2``'s."""
    handed = engine.paged.on_block_grads
    assert handed is not None
    held: list[tuple[int, Any]] = []

    def late(i: int, grads: Any) -> None:
        if i == LAYERS - 1:
            held.append((i, list(grads)))
            return
        handed(i, grads)
        if i == LAYERS - 2:
            handed(*held.pop())

    engine.paged.on_block_grads = late


def _train(rank: int, comm: ShardComm, tmp: Path, case: str) -> dict[str, torch.Tensor]:
    engine, store = engine_for(case, tmp / f"{case}-rank{rank}", comm)
    if case == LATE and rank == 1:
        _hand_last_block_late(engine)
    with store:
        if case == SAVED:  # a 2-rank checkpoint before the last step, then the last step
            run_steps(engine, case, rank, WORLD, range(STEPS - 1))
            save(engine, tmp / "two.ckpt")
            run_steps(engine, case, rank, WORLD, range(STEPS - 1, STEPS))
        else:
            run_steps(engine, case, rank, WORLD, range(STEPS))
        out = state_of(engine)
        out["bytes_sent"] = torch.tensor(comm.bytes_sent)
        stored = [int(torch.Size(store.spec(n).shape).numel()) for n in engine.pager.names]
        out["weight_numel"] = torch.tensor(sum(stored))  # this rank's store's block weights
        engine.close()
    return out


def _resume(rank: int, comm: ShardComm, tmp: Path) -> dict[str, torch.Tensor]:
    """A 1-process checkpoint before the last step (``one.ckpt``), resumed by 2 ranks for
    the last step."""
    engine, store = engine_for(RESUMED, tmp / f"resume-rank{rank}", comm)
    with store:
        restore(engine, tmp / "one.ckpt")
        run_steps(engine, RESUMED, rank, WORLD, range(STEPS - 1, STEPS))
        out = state_of(engine)
        out["step_count"] = torch.tensor(engine.step_count)
        engine.close()
    return out


def _refusal(rank: int, comm: ShardComm, tmp: Path, *, frozen: bool) -> dict[str, str]:
    """Rank 1 changes a weight of block 1 (frozen, under ``frozen``, as a LoRA base is)
    before the engine is built: the message each rank's engine refuses with."""
    model = tiny_llama()
    weight = model.model.layers[1].mlp.up_proj.weight
    if frozen:
        weight.requires_grad_(False)
    if rank == 1:
        with torch.no_grad():
            weight[0, 0] += 1.0
    placement = placement_of(Tier.HOST, Tier.HOST)
    name = f"bad-{'frozen-' if frozen else ''}rank{rank}"
    try:
        with _store(tmp / name, model, placement, WORLD) as store:
            TrainingEngine(
                model, model.model.layers, store, placement, device=torch.device("cpu"), comm=comm
            )
    except ValueError as exc:
        return {"message": str(exc)}
    return {"message": ""}


def _rank(rank: int, tmp: str) -> None:
    torch.set_num_threads(1)
    meeting = (Path(tmp) / "rendezvous").resolve().as_uri()
    dist.init_process_group("gloo", init_method=meeting, rank=rank, world_size=WORLD)
    try:
        comm = ShardComm.from_world()
        results = {case: _train(rank, comm, Path(tmp), case) for case in CASES}
        results["resumed"] = _resume(rank, comm, Path(tmp))
        results["refused"] = _refusal(rank, comm, Path(tmp), frozen=False)
        results["refused-frozen"] = _refusal(rank, comm, Path(tmp), frozen=True)
        torch.save(results, Path(tmp) / f"rank{rank}.pt")
    except BaseException:
        (Path(tmp) / f"rank{rank}.err").write_text(traceback.format_exc())
        raise
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    _rank(int(sys.argv[1]), sys.argv[2])
