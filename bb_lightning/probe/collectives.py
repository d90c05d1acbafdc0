"""The ranks' collective rates, timed at start-up on their own process group.

The planner prices each block's all-gather and reduce-scatter on the devices in two
levels (:func:`~bb_lightning.planner.data_parallel.collective_seconds`): rings within a
node at ``intra_node_bandwidth``, then rings across the nodes at
``inter_node_bandwidth``, ``collective_latency`` a step. :func:`probe_collectives` times
both levels where the layout has them, on tensors of the ranks' device over the world
group's backend (NCCL beside a GPU, gloo on CPU tensors), and every rank gets the slowest
rank's figures; :meth:`CollectiveRates.apply` puts them in the profile the plan is made
against. Every rank calls it (it is a collective).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from bb_lightning.planner import HardwareProfile

__all__ = ["PROBE_BYTES", "PROBE_REPEATS", "CollectiveRates", "probe_collectives"]

PROBE_BYTES = 4 * 2**20
"""Bytes of the buffer each timed all-gather and reduce-scatter moves (all ranks' shards)."""
PROBE_REPEATS = 3
"""Timed all-gather and reduce-scatter pairs per level (after one untimed pair)."""


@dataclass(frozen=True, kw_only=True)
class CollectiveRates:
    """What the ranks' collectives sustain, the slowest rank's figures."""

    intra_node_bandwidth: float
    """Bytes/s per direction of a ring within a node (0.0: one rank a node, not timed)."""
    inter_node_bandwidth: float
    """Bytes/s per direction of a ring across the nodes (0.0: one node, not timed)."""
    collective_latency: float
    """Seconds a ring step waits besides its bytes (a one-element all-gather's time over
    its steps)."""

    def apply(self, hardware: HardwareProfile) -> HardwareProfile:
        """``hardware`` with the rates this probe timed (those it did not keep theirs)."""
        changes = {
            name: value
            for name, value in (
                ("intra_node_bandwidth", self.intra_node_bandwidth),
                ("inter_node_bandwidth", self.inter_node_bandwidth),
            )
            if value > 0
        }
        return hardware.replace(**changes, collective_latency=self.collective_latency)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _pair_seconds(
    group: dist.ProcessGroup | None, ranks: int, numel: int, device: torch.device, repeats: int
) -> float:
    """Seconds of one all-gather plus one reduce-scatter of ``numel`` fp32 elements over
    ``ranks`` ranks of ``group``: the mean of ``repeats`` pairs after an untimed one."""
    shard = max(1, numel // ranks)
    full = torch.ones(shard * ranks, dtype=torch.float32, device=device)
    part = torch.ones(shard, dtype=torch.float32, device=device)
    elapsed = 0.0
    for i in range(repeats + 1):
        dist.barrier(group=group)
        _sync(device)
        start = time.perf_counter()
        dist.all_gather_into_tensor(full, part, group=group)
        dist.reduce_scatter_tensor(part, full, op=dist.ReduceOp.SUM, group=group)
        _sync(device)
        if i:  # the first pair sets the communicators up
            elapsed += time.perf_counter() - start
    return elapsed / repeats


def _level(
    group: dist.ProcessGroup | None, ranks: int, device: torch.device, nbytes: int, repeats: int
) -> tuple[float, float]:
    """(bytes/s per direction, seconds per ring step) of rings of ``ranks`` over ``group``:
    each collective's ``(ranks - 1) / ranks`` of its buffer (``nbytes``, rounded down to
    whole fp32 shards) over its time less its ``ranks - 1`` steps' latency (the time of a
    pair of one element a rank)."""
    steps = ranks - 1
    numel = max(1, nbytes // 4 // ranks) * ranks
    latency = _pair_seconds(group, ranks, ranks, device, repeats) / 2 / steps
    each = _pair_seconds(group, ranks, numel, device, repeats) / 2
    moved = steps / ranks * numel * 4
    return moved / max(each - steps * latency, each / 100, 1e-9), latency


def _groups(
    world_size: int, ranks_per_node: int
) -> tuple[dist.ProcessGroup | None, dist.ProcessGroup | None]:
    """(this rank's node group, its group across the nodes: the ranks of its local rank);
    the world group (None) where one level spans every rank. Every rank creates every
    group, in the same order."""
    g, m = ranks_per_node, world_size // ranks_per_node
    if g == 1 or m == 1:
        return None, None
    nodes = [list(range(i * g, (i + 1) * g)) for i in range(m)]
    peers = [list(range(local, world_size, g)) for local in range(g)]
    node_group, _ = dist.new_subgroups_by_enumeration(nodes)
    peer_group, _ = dist.new_subgroups_by_enumeration(peers)
    return node_group, peer_group


def probe_collectives(
    *,
    world_size: int,
    ranks_per_node: int,
    device: torch.device,
    nbytes: int = PROBE_BYTES,
    repeats: int = PROBE_REPEATS,
) -> CollectiveRates:
    """Time the ranks' all-gathers and reduce-scatters on ``device`` tensors: within a
    node when it holds several ranks (``ranks_per_node``), across the nodes when there are
    several; each level ``repeats`` pairs of ``nbytes`` buffers (collective: every rank of
    the initialised world calls it). Every rank returns the slowest rank's rates."""
    if world_size < 2 or not dist.is_available() or not dist.is_initialized():
        raise ValueError(
            f"probe_collectives with world_size = {world_size}: it times the collectives of "
            "an initialised torch.distributed world of at least 2 ranks"
        )
    if nbytes < 4 * world_size or repeats < 1:
        raise ValueError(
            f"probe_collectives nbytes = {nbytes}, repeats = {repeats}: give at least 4 bytes "
            f"per rank ({4 * world_size}) and one repeat"
        )
    g, m = ranks_per_node, world_size // ranks_per_node
    node_group, peer_group = _groups(world_size, g)
    intra = inter = latency = 0.0
    if g > 1:
        intra, latency = _level(node_group, g, device, nbytes, repeats)
    if m > 1:  # each ring of a local rank carries 1 / G of the buffer across the nodes
        inter, lat = _level(peer_group, m, device, max(4 * m, nbytes // g), repeats)
        latency = max(latency, lat)
    slowest = torch.tensor(
        [1.0 / intra if intra else 0.0, 1.0 / inter if inter else 0.0, latency],
        dtype=torch.float64,
        device=device,
    )
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    inv_intra, inv_inter, latency = slowest.tolist()
    return CollectiveRates(
        intra_node_bandwidth=1.0 / inv_intra if inv_intra else 0.0,
        inter_node_bandwidth=1.0 / inv_inter if inv_inter else 0.0,
        collective_latency=latency,
    )
