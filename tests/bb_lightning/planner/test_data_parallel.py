"""Data-parallel planning: one rank of N, priced against its share of the node.

One rank (the default layout) must plan exactly as without a layout; with N ranks (each
homing and paging in a 1/N shard of every block, all-gathering it and reduce-scattering
its gradients on the device) the collective seconds, the rank's bytes and its host AdamW
time follow the formulas, written out here from the profiles' numbers.
"""

from __future__ import annotations

import dataclasses
import math

import pytest

from bb_lightning.planner import (
    FitJob,
    HardwareProfile,
    MeasuredTimes,
    ModelProfile,
    Plan,
    PlanOverrides,
    PredictJob,
    adapt,
    make_plan,
    preset,
    preset_names,
)
from bb_lightning.planner.cost import ring_seconds
from bb_lightning.planner.data_parallel import collective_seconds
from bb_lightning.planner.models import builtin_config
from bb_lightning.planner.profile import LAYOUT_FIELDS
from bb_lightning.probe import model_profile_from_config
from storage.tiers import Link, Tier

GIB = 2**30

SEVEN_B = dict(
    builtin_config("llama-370m"),
    hidden_size=4096,
    num_hidden_layers=32,
    num_attention_heads=32,
    num_key_value_heads=32,
    intermediate_size=11008,
)
"""A 7B Llama shape (hidden 4096, 32 layers, ffn 11008)."""

MODELS = {
    "tiny": model_profile_from_config(builtin_config("tiny-llama")),
    "374m": model_profile_from_config(builtin_config("llama-370m")),
    "7b": model_profile_from_config(SEVEN_B),
}
JOBS = (
    FitJob(seq_len=256, global_batch_seqs=4),
    PredictJob(prompt_len=64, new_tokens=8, num_prompts=8),
)


def _one_rank_layout(hw: HardwareProfile) -> HardwareProfile:
    """``hw`` with a one-rank layout written out, and a network that one rank never uses."""
    return hw.replace(
        world_size=1,
        ranks_per_node=1,
        intra_node_bandwidth=1e11,
        inter_node_bandwidth=1e10,
        collective_latency=1e-5,
    )


@pytest.mark.parametrize("hw_name", preset_names())
def test_one_rank_plans_as_without_a_layout(hw_name: str) -> None:
    hw = preset(hw_name)
    # a preset's dict carries its machine's links, not a layout
    assert set(LAYOUT_FIELDS) & set(hw.to_dict()) == {
        "intra_node_bandwidth",
        "inter_node_bandwidth",
    }
    for model in MODELS.values():
        for job in JOBS:
            try:
                plain = make_plan(model, hw, job)
            except ValueError as err:  # does not fit this device: neither may the layout
                with pytest.raises(ValueError) as again:
                    make_plan(model, _one_rank_layout(hw), job)
                assert str(again.value) == str(err)
                continue
            laid_out = make_plan(model, _one_rank_layout(hw), job)
            d_plain, d_laid = plain.to_dict(), laid_out.to_dict()
            assert "net" not in d_plain["predicted"]
            assert d_plain["hardware"] == hw.to_dict()
            d_laid["hardware"] = d_plain["hardware"]
            assert d_laid == d_plain
            assert laid_out.explain() == plain.explain()
            assert "data parallel" not in plain.explain()


@pytest.fixture
def model(small_model: ModelProfile) -> ModelProfile:
    """The shared small model with parameter counts that do not divide by 2 or 4 (padded
    shards)."""
    return dataclasses.replace(small_model, name="odd", block_params=800_003, final_params=257)


@pytest.fixture
def node() -> HardwareProfile:
    """One node with 16 GiB devices, 256 GiB of host memory and one NVMe drive."""
    return HardwareProfile(
        name="node",
        device_type="cuda",
        device_memory=16 * GIB,
        device_flops=1e14,
        h2d_bandwidth=2e10,
        d2h_bandwidth=2e10,
        host_memory=256 * GIB,
        nvme_read_bandwidth=5e9,
        nvme_write_bandwidth=3e9,
        nvme_capacity=10**12,
        host_adam_params_per_s=2e9,
        cores=16,
    )


HOST_HOMES = PlanOverrides(
    weights_tier=Tier.HOST, master_tier=Tier.HOST, prefetch_depth=1, checkpointing=True
)
"""Every block paged from the host, its master weights, moments and gradients there too."""


def _host_bytes(n: int, p: int, rest: int, shard: int, page: int | None = None) -> int:
    """A rank's host bytes besides the homes (bf16 weights, ``n`` blocks of ``p`` trained
    parameters, ``rest`` outside): outside the store the larger of the engine's setup
    (fp32 ``rest`` values; then one block's fp32 values with the rank's fp32 shard of its
    weights and that shard's bf16 cast, or the whole block's bf16 cast on one rank) and two
    paging slots of ``page`` elements (the rank's weight shard; default ``p``) with two
    blocks' gradients in flight; in it two scratch sets (four fp32 block shards and one
    bf16 cast of the shard each), 1 MiB of slack and a 4 KiB slot per tensor."""
    page = p if page is None else page
    setup = max(4 * rest, 4 * p + (2 * p if page == p else (4 + 2) * page))
    scratch = 2 * (4 * 4 * shard + 2 * shard)
    return max(2 * 2 * page + 2 * 2 * p, setup) + scratch + 2**20 + 4096 * (9 * n + 32)


def _ring(nbytes: float, ranks: int, bandwidth: float, latency: float) -> float:
    """Seconds of one ring reduce-scatter or all-gather of ``nbytes`` over ``ranks``."""
    return (ranks - 1) / ranks * nbytes / bandwidth + (ranks - 1) * latency


@pytest.mark.parametrize(("world", "per_node"), [(2, 2), (4, 2), (2, 1)])
def test_rank_follows_the_formulas(
    model: ModelProfile, node: HardwareProfile, world: int, per_node: int
) -> None:
    intra, inter, lat = 1.5e11, 1.25e10, 2e-5
    hw = node.replace(
        world_size=world,
        ranks_per_node=per_node,
        intra_node_bandwidth=intra,
        inter_node_bandwidth=inter,
        collective_latency=lat,
    )
    job = FitJob(seq_len=512, global_batch_seqs=10)
    plan = make_plan(model, hw, job, overrides=HOST_HOMES)

    n, p, rest = model.num_blocks, model.block_params, model.rest_params  # all trained
    shard, rest_shard = math.ceil(p / world), math.ceil(rest / world)  # dim-0, padded
    rank_seqs = math.ceil(10 / world)
    ga = plan.grad_accum
    assert ga == math.ceil(rank_seqs / plan.micro_batch)
    assert plan.job == job and plan.hardware == hw

    # the rank's host memory: outside the store the larger of its setup and the paging
    # slot pair (of its weight shards) with the gradients in flight; its shards of the
    # paged bf16 weights, the fp32 master + 2 moments (12 B) and accumulators (4 B)
    state = n * (2 + 12 + 4) * shard + (12 + 4) * rest_shard
    host = next(m for m in plan.memory if m.tier is Tier.HOST)
    assert host.used == _host_bytes(n, p, rest, shard, page=shard) + state
    assert host.capacity == 256 * GIB // per_node
    assert host.budget == int(256 * GIB // per_node * 0.95)
    nvme = next(m for m in plan.memory if m.tier is Tier.NVME)
    assert nvme.capacity == 10**12 // per_node

    # host AdamW over the rank's shards, at the node's update rate shared by its ranks
    assert plan.predicted.optimizer == pytest.approx((n * shard + rest_shard) / (2e9 / per_node))

    # on the devices, two levels: a ring within the node, then rings across the nodes
    # of 1/G of the buffer each; buffers of N padded shards
    nodes = world // per_node

    def coll(nbytes: float) -> float:
        return _ring(nbytes, per_node, intra, lat) + _ring(nbytes / per_node, nodes, inter, lat)

    # per micro-batch: each block all-gathered at its two page-ins (bf16), its gradients
    # and the outside parameters' reduce-scattered (fp32); per step: the outside
    # parameters' updated shards all-gathered (no block is resident)
    per_pass = n * (2 * coll(world * shard * 2) + coll(world * shard * 4))
    per_pass += coll(world * rest_shard * 4)
    assert plan.predicted.net == pytest.approx(ga * per_pass + coll(world * rest_shard * 2))
    # the page-ins copy the rank's shard only; its reduced fp32 shard comes back
    ups = ga * 2 * n * shard * 2 + rest_shard * 2  # and the outside shards after the step
    assert plan.predicted.h2d == pytest.approx(ups / 2e10)
    assert plan.predicted.d2h == pytest.approx(ga * (n * shard + rest_shard) * 4 / 2e10)
    # a pass's bytes in the roofline: the shards, as above
    assert plan.roofline.bytes_per_pass[Link.HOST_TO_DEVICE] == 2 * n * shard * 2
    assert plan.roofline.bytes_per_pass[Link.DEVICE_TO_HOST] == n * shard * 4

    # the job's throughput: every rank trains its share of the batch in one step
    assert plan.tokens_per_s == pytest.approx(world * rank_seqs * 512 / plan.predicted.total)
    text = plan.explain()
    assert f"data parallel: {world} ranks, {per_node} per node" in text
    assert f"collectives on the devices: {plan.predicted.net:.3g} s busy per step" in text
    per_node_host = f"host {_fmt(per_node * host.used)} of {_fmt(per_node * host.capacity)}"
    assert per_node_host in text
    assert f"hold {per_node}/{world} of one copy of the weights" in text
    assert Plan.from_json(plan.to_json()) == plan


def test_resident_blocks_home_a_shard_and_gather_once_a_pass(
    model: ModelProfile, node: HardwareProfile
) -> None:
    """Every block resident, nothing recomputed: each block is all-gathered once a pass (its
    assembled weights kept for its backward), none after the step; the device holds each
    block's assembled weights and the rank's shard beside them."""
    intra = 1e11
    hw = node.replace(world_size=2, ranks_per_node=2, intra_node_bandwidth=intra)
    n, p, rest = model.num_blocks, model.block_params, model.rest_params
    job = FitJob(seq_len=512, global_batch_seqs=8)
    resident = PlanOverrides(
        resident_blocks=n, checkpointing=False, master_tier=Tier.HOST, micro_batch=1
    )
    plan = make_plan(model, hw, job, overrides=resident)
    assert set(plan.placement.weights) == {Tier.DEVICE} and plan.grad_accum == 4
    shard, rest_shard = math.ceil(p / 2), math.ceil(rest / 2)

    def coll(nbytes: float) -> float:
        return _ring(nbytes, 2, intra, 0.0)

    per_pass = n * (coll(2 * shard * 2) + coll(2 * shard * 4)) + coll(2 * rest_shard * 4)
    per_step = coll(2 * rest_shard * 2)
    assert plan.predicted.net == pytest.approx(plan.grad_accum * per_pass + per_step)
    one = make_plan(model, node, job, overrides=resident)  # resident whole, one rank
    dev = [next(m.used for m in x.memory if m.tier is Tier.DEVICE) for x in (one, plan)]
    # more on the device: each block's shard, one block's assembly, the reduce-scatter's
    # buffers (3 fp32 shards); less: the activations and gradients of half the batch
    shards = n * 2 * shard + 2 * p + 4 * 3 * shard
    assert dev[1] - dev[0] <= shards


def test_collectives_go_two_levels_within_and_between_nodes(node: HardwareProfile) -> None:
    """16 ranks, 8 a node: 8 GB over NVLink-class links within the node, then 1/8 of it
    across the two nodes (not the whole buffer over the slowest hop, as a flat ring)."""
    hw = node.replace(
        world_size=16, ranks_per_node=8, intra_node_bandwidth=4e11, inter_node_bandwidth=5e10
    )
    assert collective_seconds(8e9, hw) == pytest.approx(7 / 8 * 8e9 / 4e11 + 1 / 2 * 1e9 / 5e10)
    one_node = hw.replace(world_size=8)
    assert collective_seconds(8e9, one_node) == pytest.approx(7 / 8 * 8e9 / 4e11)
    assert collective_seconds(8e9, node) == 0.0


def test_a_node_homes_one_copy_of_the_weights(model: ModelProfile, node: HardwareProfile) -> None:
    """The node's G ranks home one copy of the paged weights between them, not G copies:
    G x a rank's bytes less the state is one copy (to the padding of the shards)."""
    job = FitJob(seq_len=512, global_batch_seqs=8)
    n, p, rest = model.num_blocks, model.block_params, model.rest_params
    for g in (2, 4):
        hw = node.replace(world_size=g, ranks_per_node=g, intra_node_bandwidth=1e11)
        plan = make_plan(model, hw, job, overrides=HOST_HOMES)
        shard, rest_shard = math.ceil(p / g), math.ceil(rest / g)
        host = next(m.used for m in plan.memory if m.tier is Tier.HOST)
        other = _host_bytes(n, p, rest, shard, page=shard) + n * 16 * shard + 16 * rest_shard
        weights = g * (host - other)
        assert n * 2 * p <= weights <= n * 2 * (p + g)


def test_collectives_hide_behind_compute_until_they_outlast_it(
    model: ModelProfile, node: HardwareProfile
) -> None:
    """The reduce-scatters, on their own stream, cost nothing while the compute outlasts
    them; the all-gathers, issued as each block is paged in before its compute, are
    exposed (a faster link shortens the step by less than the collectives' busy time it
    saves); and once the collectives outlast the compute the step is at least their busy
    time, not compute plus collectives."""
    job = FitJob(seq_len=512, global_batch_seqs=8)

    fast_adam = node.replace(host_adam_params_per_s=1e14)  # the step hides behind backward

    def plan_at(bandwidth: float) -> Plan:
        hw = fast_adam.replace(world_size=2, ranks_per_node=2, intra_node_bandwidth=bandwidth)
        return make_plan(model, hw, job, overrides=HOST_HOMES)

    fast, faster, slow = plan_at(1e12), plan_at(1e13), plan_at(5e9)
    assert fast.predicted.net > faster.predicted.net > 0
    gained = fast.predicted.total - faster.predicted.total
    assert 0 < gained < fast.predicted.net - faster.predicted.net
    p = slow.predicted
    # the passes' collectives outlast their compute and set the step; the outside
    # parameters' all-gather after the step runs beside the host AdamW
    after_step = _ring(2 * math.ceil(model.rest_params / 2) * 2, 2, 5e9, 0.0)
    assert 2 * p.compute < p.net - after_step <= p.total < p.compute + p.net


def _fmt(nbytes: int) -> str:
    from storage.tiers import format_bytes

    return format_bytes(nbytes)


def test_a_rank_needs_less_state_than_one_process(
    model: ModelProfile, node: HardwareProfile
) -> None:
    job = FitJob(seq_len=512, global_batch_seqs=8)
    one = make_plan(model, node, job, overrides=HOST_HOMES)
    two = make_plan(
        model,
        node.replace(world_size=2, ranks_per_node=1, inter_node_bandwidth=1e10),
        job,
        overrides=HOST_HOMES,
    )
    n, p, rest = model.num_blocks, model.block_params, model.rest_params
    shard, rest_shard = math.ceil(p / 2), math.ceil(rest / 2)
    saved = n * (2 + 16) * (p - shard) + 16 * (rest - rest_shard)  # weights and state
    saved += _host_bytes(n, p, rest, p) - _host_bytes(n, p, rest, shard, page=shard)
    used = [next(m.used for m in plan.memory if m.tier is Tier.HOST) for plan in (one, two)]
    assert used[0] - used[1] == saved
    assert one.predicted.net == 0.0 and two.predicted.net > 0.0


def test_predict_ranks_share_the_prompts(model: ModelProfile, node: HardwareProfile) -> None:
    hw = node.replace(world_size=2, ranks_per_node=2, intra_node_bandwidth=1e11)
    job = PredictJob(prompt_len=64, new_tokens=8, num_prompts=9)
    plan = make_plan(model, hw, job)
    assert plan.job == job
    assert plan.concurrent_seqs <= math.ceil(9 / 2)
    c = plan.concurrent_seqs
    assert plan.tokens_per_s == pytest.approx(2 * c * 8 / plan.predicted.total)
    host = next(m for m in plan.memory if m.tier is Tier.HOST)
    assert host.capacity == 256 * GIB // 2
    assert "2 ranks x" in plan.explain()


def test_ring_seconds_formula() -> None:
    assert ring_seconds(1000.0, 1, 100.0, 0.5) == 0.0
    assert ring_seconds(1000.0, 4, 100.0, 0.5) == pytest.approx(3 / 4 * 1000 / 100 + 3 * 0.5)


def test_layout_round_trips(node: HardwareProfile) -> None:
    hw = node.replace(
        world_size=8, ranks_per_node=4, intra_node_bandwidth=2e11, inter_node_bandwidth=2.5e10
    )
    d = hw.to_dict()
    assert d["world_size"] == 8 and "collective_latency" not in d  # defaults left out
    assert HardwareProfile.from_dict(d) == hw
    assert HardwareProfile.from_dict(node.to_dict()) == node
    assert hw.num_nodes == 2 and hw.network_bandwidth == 2.5e10


@pytest.mark.parametrize(
    ("changes", "match"),
    [
        ({"world_size": 0}, "world_size = 0"),
        ({"world_size": 2.0}, "world_size = 2.0"),
        ({"ranks_per_node": True}, "ranks_per_node = True"),
        ({"world_size": 4, "ranks_per_node": 3, "intra_node_bandwidth": 1e11}, "multiple"),
        ({"world_size": 2, "ranks_per_node": 2}, "intra_node_bandwidth = 0.0"),
        (
            {"world_size": 4, "ranks_per_node": 2, "intra_node_bandwidth": 1e11},
            "inter_node_bandwidth = 0.0",
        ),
        ({"collective_latency": -1e-6}, "collective_latency"),
    ],
)
def test_invalid_layouts_raise(node: HardwareProfile, changes: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        node.replace(**changes)


def test_too_small_a_job_for_the_ranks_raises(model: ModelProfile, node: HardwareProfile) -> None:
    hw = node.replace(world_size=4, ranks_per_node=4, intra_node_bandwidth=1e11)
    with pytest.raises(ValueError, match="at least 4 sequences"):
        make_plan(model, hw, FitJob(seq_len=128, global_batch_seqs=3))
    with pytest.raises(ValueError, match="at least 4 prompts"):
        make_plan(model, hw, PredictJob(prompt_len=16, new_tokens=4, num_prompts=2))


def test_replanning_keeps_the_layout_and_divides_once(
    model: ModelProfile, node: HardwareProfile
) -> None:
    hw = node.replace(world_size=2, ranks_per_node=2, intra_node_bandwidth=1e11)
    plan = make_plan(model, hw, FitJob(seq_len=512, global_batch_seqs=8), overrides=HOST_HOMES)
    again = adapt(plan, MeasuredTimes(optimizer_s=2.0 * plan.predicted.optimizer))
    assert again.hardware.world_size == 2 and again.hardware.host_memory == 256 * GIB
    assert next(m for m in again.memory if m.tier is Tier.HOST).capacity == 256 * GIB // 2
    assert again.predicted.optimizer == pytest.approx(2.0 * plan.predicted.optimizer)


def test_a_cpu_node_shares_its_memory_and_cores(model: ModelProfile, node: HardwareProfile) -> None:
    cpu = node.replace(device_type="cpu", device_memory=64 * GIB, device_flops=1e11)
    hw = cpu.replace(world_size=2, ranks_per_node=2, intra_node_bandwidth=1e10)
    job = FitJob(seq_len=128, global_batch_seqs=4)
    one, two = make_plan(model, cpu, job), make_plan(model, hw, job)
    # a CPU device's tiers share the node's RAM (device and host shares), split by rank
    ram = (64 * GIB + cpu.host_memory) // 2
    assert next(m for m in two.memory if m.tier is Tier.DEVICE).capacity == ram
    # each rank computes half the batch on half the cores: the same compute seconds
    assert two.predicted.compute == pytest.approx(one.predicted.compute)
