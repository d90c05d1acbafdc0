"""One rank of the collective probe's test (``test_collective_probe.py``): ``python
probe_worker.py RANK WORLD PER_NODE DIR`` joins a gloo world of ``WORLD`` ranks,
``PER_NODE`` a "node", through a file in ``DIR`` (``file://`` rendezvous), times the
collectives into the tests' CPU profile as the strategy does at start-up
(:func:`world.measured_collectives`) and writes the profile to ``DIR/rank<RANK>.json``.
It imports no Lightning and no transformers (seconds to start on 2 cores)."""

from __future__ import annotations

import json
import sys
import traceback
from pathlib import Path

import torch
import torch.distributed as dist

from bb_lightning.planner import HardwareProfile
from bb_lightning.strategy import world


def node_profile() -> HardwareProfile:
    """A CPU node without collective rates (the tests' ``cpu_profile`` figures)."""
    return HardwareProfile(
        name="test cpu",
        device_type="cpu",
        device_memory=2 << 30,
        device_flops=5e10,
        h2d_bandwidth=5e9,
        d2h_bandwidth=5e9,
        host_memory=4 << 30,
        nvme_read_bandwidth=0.0,
        nvme_write_bandwidth=0.0,
        nvme_capacity=0,
        host_adam_params_per_s=2e8,
        cores=2,
    )


def _rank(rank: int, world_size: int, per_node: int, tmp: Path) -> None:
    torch.set_num_threads(1)
    meeting = (tmp / "rendezvous").resolve().as_uri()
    dist.init_process_group("gloo", init_method=meeting, rank=rank, world_size=world_size)
    try:
        timed = world.measured_collectives(
            node_profile(), world_size, per_node, torch.device("cpu")
        )
        (tmp / f"rank{rank}.json").write_text(json.dumps(timed.to_dict()))
    except BaseException:
        (tmp / f"rank{rank}.err").write_text(traceback.format_exc())
        raise
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    _rank(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), Path(sys.argv[4]))
