"""A preset's links and its node: the collective rates of its datasheets, and the node of
G such GPUs the data-parallel plans run on, scaling as the acceptance figures demand."""

from __future__ import annotations

import pytest

from bb_lightning.planner import FitJob, make_plan, preset
from bb_lightning.planner.models import builtin_config
from bb_lightning.probe import model_profile_from_config
from bb_lightning.strategy import world

GB = 1e9


@pytest.mark.parametrize(
    ("name", "intra", "inter"),
    [
        ("h100", 900 * GB / 2, 400 * GB / 8),  # NVLink 4 (900 GB/s both ways), NDR 400 Gb/s
        ("a100-80gb", 600 * GB / 2, 200 * GB / 8),  # NVLink 3, HDR 200 Gb/s
        ("rtx4090", 31.5 * GB, 10 * GB / 8),  # PCIe 4 x16 through the host, 10 GbE
        ("t4", 15.75 * GB, 25 * GB / 8),  # PCIe 3 x16 peer-to-peer, 25 Gb/s instance
    ],
)
def test_presets_carry_their_collective_links(name: str, intra: float, inter: float) -> None:
    hw = preset(name)
    assert hw.intra_node_bandwidth == pytest.approx(0.8 * intra)
    assert hw.inter_node_bandwidth == pytest.approx(0.8 * inter)
    laid_out = world.with_world(hw, 16, 8)  # the preset's own links, not gloo's defaults
    assert (laid_out.intra_node_bandwidth, laid_out.inter_node_bandwidth) == (
        hw.intra_node_bandwidth,
        hw.inter_node_bandwidth,
    )


def test_a_preset_node_has_each_gpu_s_host_share() -> None:
    one, node = preset("h100"), preset("h100", gpus=8)
    assert node.host_memory == pytest.approx(8 * one.host_memory, abs=8)  # a DGX's 2 TB
    assert node.nvme_capacity == 8 * one.nvme_capacity  # a data drive per GPU
    assert node.nvme_read_bandwidth == pytest.approx(8 * one.nvme_read_bandwidth)
    assert node.nvme_write_bandwidth == pytest.approx(8 * one.nvme_write_bandwidth)
    # the node's sockets: cores, host AdamW and memory bandwidth stay
    assert (node.cores, node.host_adam_params_per_s) == (one.cores, one.host_adam_params_per_s)
    assert node.device_memory == one.device_memory and node.name.endswith("node of 8")
    with pytest.raises(ValueError, match=r"gpus = 0 GPUs per node: give a positive integer"):
        preset("h100", gpus=0)


def test_llama_30b_scales_over_eight_gpus_and_two_nodes() -> None:
    """``bb-lightning plan --model llama-30b --hardware h100 --seq-len 2048 --global-batch
    512s``: 8 GPUs at least 0.8 x 8 x one GPU's tokens/s, 2 nodes of 8 at least 0.7 x 16 x,
    with one copy of the weights per node."""
    model = model_profile_from_config(builtin_config("llama-30b"))
    job = FitJob(seq_len=2048, global_batch_seqs=512)
    one = make_plan(model, preset("h100"), job)
    node = world.with_world(preset("h100", gpus=8), 8, 8)
    eight = make_plan(model, node, job)
    assert eight.tokens_per_s >= 0.8 * 8 * one.tokens_per_s
    two_nodes = make_plan(model, world.with_world(preset("h100", gpus=8), 16, 8), job)
    assert two_nodes.tokens_per_s >= 0.7 * 16 * one.tokens_per_s
    assert "hold 8/8 of one copy of the weights" in eight.explain()
    assert "hold 8/16 of one copy of the weights" in two_nodes.explain()
