"""Data-parallel planning: one rank's share of a node and of the job.

With ``world_size`` N > 1 (:class:`~bb_lightning.planner.profile.HardwareProfile`) the
ranks shard the model FSDP's way: every rank homes only a dim-0 shard of each block
(about ``ceil(numel / N)`` elements: :func:`~bb_lightning.planner.cost.shard_numel`) of
its compute-dtype weights, fp32 master weights, AdamW moments and gradient
accumulators, in its own host and NVMe tiers. A node's G ranks thus hold G / N of one
copy of the weights together (one copy on one node), not G copies. Per block and
micro-batch, on the devices (:func:`collective_seconds`):

- at each page-in a rank copies only its weight shard to its device and the block is
  all-gathered there before the block's compute, exposed (the engine issues it as the
  block is paged in; a
  block resident on the device homes the rank's shard there and is all-gathered at its
  use alike; without recompute it keeps the assembled weights for its backward);
- after the block's backward its gradients are reduce-scattered there, beside the next
  block's backward, and only the rank's reduced fp32 shard goes to the host, where the
  host AdamW steps it; the updated shard goes home until the next use gathers it (the
  parameters outside the blocks, whole on every device, all-gather their updated shards
  once per step).

The planner plans ONE rank: against :func:`rank_share` of the node's profile and
:func:`rank_job` of the job. The plan keeps the node's profile and the whole job; its
throughput is the job's, N times one rank's.
"""

from __future__ import annotations

import dataclasses
import math

from bb_lightning.planner.cost import ring_seconds
from bb_lightning.planner.job import FitJob, PredictJob
from bb_lightning.planner.profile import HardwareProfile

__all__ = ["REDUCE_BYTES", "collective_seconds", "rank_job", "rank_share"]

REDUCE_BYTES = 4
"""Bytes per gradient element in the reduce-scatter (gradients are reduced in fp32)."""


def rank_share(hw: HardwareProfile) -> HardwareProfile:
    """The profile one rank is priced against: ``hw`` with what a node's
    ``ranks_per_node`` (G) ranks share divided among them.

    Host memory and NVMe capacity (bytes) are floor-divided by G, NVMe read and write
    bandwidth, host AdamW updates/s and host memory bandwidth divided by G, cores floor-divided (at least 1).
    A CPU device is the node's own memory and cores: its device memory, FLOP/s, memory
    bandwidth and copy bandwidths are divided too. The layout fields stay (the pricing
    reads N and the network from them). With G = 1 it returns ``hw`` itself.
    """
    g = hw.ranks_per_node
    if g == 1:
        return hw
    changes: dict[str, float | int] = {
        "host_memory": hw.host_memory // g,
        "nvme_capacity": hw.nvme_capacity // g,
        "nvme_read_bandwidth": hw.nvme_read_bandwidth / g,
        "nvme_write_bandwidth": hw.nvme_write_bandwidth / g,
        "host_adam_params_per_s": hw.host_adam_params_per_s / g,
        "host_memory_bandwidth": hw.host_memory_bandwidth / g,
        "cores": max(1, hw.cores // g),
    }
    if hw.device_type == "cpu":
        changes |= {
            "device_memory": hw.device_memory // g,
            "device_flops": hw.device_flops / g,
            "device_memory_bandwidth": hw.device_memory_bandwidth / g,
            "h2d_bandwidth": hw.h2d_bandwidth / g,
            "d2h_bandwidth": hw.d2h_bandwidth / g,
        }
    return hw.replace(**changes)


def rank_job(job: FitJob | PredictJob, world_size: int) -> FitJob | PredictJob:
    """One rank's share of ``job`` over ``world_size`` ranks (``job`` itself for one).

    Fit: ``ceil(global batch / N)`` sequences per optimizer step (the global batch is a
    hyper-parameter; each rank computes its share and the reduce-scatter sums them).
    Predict: ``ceil(num_prompts / N)`` prompts (each rank generates a strided share).
    A job with fewer sequences or prompts than ranks raises ``ValueError``.
    """
    n = world_size
    if n == 1:
        return job
    if isinstance(job, FitJob):
        g = job.seqs_per_step
        if g < n:
            raise ValueError(
                f"the global batch of {g} sequences cannot give each of world_size = {n} "
                f"ranks one: use a global batch of at least {n} sequences or fewer ranks"
            )
        return dataclasses.replace(
            job, global_batch_tokens=None, global_batch_seqs=math.ceil(g / n)
        )
    if job.num_prompts < n:
        raise ValueError(
            f"{job.num_prompts} prompts cannot give each of world_size = {n} ranks one: "
            f"use at least {n} prompts or fewer ranks"
        )
    return dataclasses.replace(job, num_prompts=math.ceil(job.num_prompts / n))


def collective_seconds(nbytes: float, hw: HardwareProfile) -> float:
    """Seconds of one reduce-scatter, or one all-gather, of a buffer of ``nbytes`` (the
    whole buffer, every rank's shard) over the ``world_size`` N = G x M ranks of ``hw``
    (G a node, M nodes), on the devices.

    Two levels (hierarchical): a ring of the node's G ranks over the devices' own links
    (``intra_node_bandwidth``), then, for the inter-node part, M rings of the ranks of
    one local rank, each carrying ``nbytes / G`` over its rank's share of the network
    (``inter_node_bandwidth``); an all-gather runs the two levels the other way round:

    ``ring(nbytes, G, intra) + ring(nbytes / G, M, inter)``, each
    :func:`~bb_lightning.planner.cost.ring_seconds` with ``collective_latency`` per step.
    0 for one rank.
    """
    g, m, lat = hw.ranks_per_node, hw.num_nodes, hw.collective_latency
    within = ring_seconds(nbytes, g, hw.intra_node_bandwidth, lat)
    return within + ring_seconds(nbytes / g, m, hw.inter_node_bandwidth, lat)
