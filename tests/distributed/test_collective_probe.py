"""The collective probe on gloo ranks: every rank times the same positive rates, and the
plan made on the profile they went into is priced on them (not on gloo's defaults)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from bb_lightning.planner import FitJob, HardwareProfile, make_plan
from bb_lightning.planner.data_parallel import collective_seconds
from bb_lightning.probe import model_profile_from_config
from bb_lightning.strategy import world

from ..bb_lightning.tiny import tiny_llama_config
from .probe_worker import node_profile

WORKER = Path(__file__).with_name("probe_worker.py")


def _run(tmp: Path, world_size: int, per_node: int) -> list[dict[str, Any]]:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen([sys.executable, str(WORKER), str(r), str(world_size),
                               str(per_node), str(tmp)], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True)
             for r in range(world_size)]  # fmt: skip
    logs = []
    for p in procs:
        try:
            logs.append(p.communicate(timeout=120)[0])
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise
    assert all(p.returncode == 0 for p in procs), "\n".join(logs)
    return [json.loads((tmp / f"rank{r}.json").read_text()) for r in range(world_size)]


@pytest.mark.parametrize(("world_size", "per_node"), [(2, 2), (4, 2)])
def test_the_probe_times_positive_rates_the_plan_uses(
    tmp_path: Path, world_size: int, per_node: int
) -> None:
    results = _run(tmp_path, world_size, per_node)
    assert all(r == results[0] for r in results)  # every rank has the slowest rank's
    timed = HardwareProfile.from_dict(results[0])
    assert timed.intra_node_bandwidth > 0 and timed.collective_latency > 0
    assert (timed.inter_node_bandwidth > 0) == (world_size > per_node)  # timed where used
    node = node_profile()
    assert timed == node.replace(
        intra_node_bandwidth=timed.intra_node_bandwidth,
        inter_node_bandwidth=timed.inter_node_bandwidth,
        collective_latency=timed.collective_latency,
    )
    # the plan is priced on the timed rates, as the strategy's session lays them out
    planned = world.with_world(timed, world_size, per_node)
    assert planned.intra_node_bandwidth == timed.intra_node_bandwidth
    defaults = world.with_world(node, world_size, per_node)
    assert collective_seconds(1e6, planned) != collective_seconds(1e6, defaults)
    model = model_profile_from_config(tiny_llama_config(2))
    job = FitJob(seq_len=64, global_batch_seqs=8)
    plan = make_plan(model, planned, job)
    assert plan.hardware == planned and plan.predicted.net > 0
    assert plan.predicted.net != make_plan(model, defaults, job).predicted.net
