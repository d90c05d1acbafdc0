"""One rank of the sharded-engine test (``test_shard.py``): ``python shard_worker.py RANK
PORT DIR`` trains every case of :data:`CASES` on its half of each global batch over a
2-process gloo world and saves the gathered state to ``DIR/rank<RANK>.pt``."""

from __future__ import annotations

import os
import sys
import traceback
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).parent))  # run as a script: the tiny model beside it

from tiny import LAYERS, tiny_llama

from bb_lightning.engine.optim import AdamWConfig
from bb_lightning.engine.pager import Placement
from bb_lightning.engine.shard import ShardComm
from bb_lightning.engine.trainer_engine import (
    ClipConfig,
    TrainingEngine,
    required_budgets,
)
from storage.io import IOConfig
from storage.store import StoreConfig, TieredStore
from storage.tiers import Tier

WORLD = 2
ROWS, SEQ, STEPS = 4, 16, 3
ADAMW = AdamWConfig(lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1)
CASES = {
    # name: (weights, state, accumulate, overlapped step, clip norm)
    "host": (Tier.HOST, Tier.HOST, 1, True, None),
    "nvme-clip": (Tier.NVME, Tier.NVME, 2, False, 0.05),
    "nvme-overlap": (Tier.HOST, Tier.NVME, 2, True, None),
}


def batches() -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(7)
    return [torch.randint(0, 128, (ROWS, SEQ), generator=gen) for _ in range(STEPS)]


def _store(path: Path, model: torch.nn.Module, placement: Placement, shards: int) -> TieredStore:
    blocks = model.model.layers
    numels = [sum(p.numel() for p in b.parameters()) for b in blocks]
    rest = sum(p.numel() for p in model.parameters()) - sum(numels)
    need = required_budgets(numels, rest, placement, shards=shards)
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


def _placement(weights: Tier, state: Tier) -> Placement:
    return Placement(
        weights=(weights,) * LAYERS,
        master=(state,) * LAYERS,
        prefetch_depth=1,
        compute_dtype="float32",
    )


def _train(rank: int, comm: ShardComm, tmp: Path, case: str) -> dict[str, torch.Tensor]:
    weights, state, accumulate, overlap, clip = CASES[case]
    model = tiny_llama()
    placement = _placement(weights, state)
    out: dict[str, torch.Tensor] = {}
    with _store(tmp / f"{case}-rank{rank}", model, placement, WORLD) as store:
        engine = TrainingEngine(
            model, model.model.layers, store, placement, device=torch.device("cpu"), comm=comm
        )
        share = ROWS // WORLD
        for ids in batches():
            mine = ids[rank * share : (rank + 1) * share]
            for k, micro in enumerate(mine.chunk(accumulate)):
                if overlap and k == accumulate - 1:
                    engine.begin_overlapped_step(ADAMW)
                loss = engine.model(input_ids=micro, labels=micro).loss / accumulate
                loss.backward()
                engine.after_backward()
            engine.optimizer_step(ADAMW, ClipConfig(value=clip))
        for key, s in engine.iter_state():  # a collective: both ranks iterate it
            for kind, value in s.items():
                out[f"{kind}/{key}"] = value.clone()
        out["bytes_sent"] = torch.tensor(comm.bytes_sent)
        engine.close()
    return out


def _rank(rank: int, port: int, tmp: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    try:
        comm = ShardComm.from_world()
        results = {case: _train(rank, comm, Path(tmp), case) for case in CASES}
        try:  # a rank whose weights differ: both ranks refuse, naming the block
            model = tiny_llama()
            if rank == 1:
                with torch.no_grad():
                    model.model.layers[1].mlp.up_proj.weight[0, 0] += 1.0
            placement = _placement(Tier.HOST, Tier.HOST)
            with _store(Path(tmp) / f"bad-rank{rank}", model, placement, WORLD) as store:
                TrainingEngine(
                    model, model.model.layers, store, placement, device=torch.device("cpu"),
                    comm=comm,
                )  # fmt: skip
            results["refused"] = {"message": ""}  # type: ignore[dict-item]
        except ValueError as exc:
            results["refused"] = {"message": str(exc)}  # type: ignore[dict-item]
        torch.save(results, Path(tmp) / f"rank{rank}.pt")
    except BaseException:
        (Path(tmp) / f"rank{rank}.err").write_text(traceback.format_exc())
        raise
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    _rank(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3])
