"""HardwareProfile presets, validation and round trips; ModelProfile cost formulas."""

from __future__ import annotations

import json

import pytest

from bb_lightning.planner.presets import datasheet_flops
from bb_lightning.planner.profile import HardwareProfile, ModelProfile, preset, preset_names

GB = 1e9


def test_preset_names_cover_the_table() -> None:
    names = preset_names()
    for required in ("a100-40gb", "a100-80gb", "h100", "h200", "rtx4090", "l4", "t4", "a6000"):
        assert required in names
    assert preset("A100-80GB") == preset("a100-80gb")
    with pytest.raises(ValueError, match=r"unknown hardware preset 'v100'.*a100-40gb"):
        preset("v100")


@pytest.mark.parametrize(
    "name", ["a100-40gb", "a100-80gb", "h100", "h200", "rtx4090", "l4", "t4", "a6000"]
)
def test_presets_are_below_their_datasheets(name: str) -> None:
    # datasheet peaks: device memory (bytes), dense bf16 (fp16 on T4) FLOP/s, PCIe x16 bytes/s,
    # memory bandwidth (bytes/s)
    datasheet = {
        "a100-40gb": (40 * 2**30, 312e12, 31.5 * GB, 1555 * GB),
        "a100-80gb": (80 * 2**30, 312e12, 31.5 * GB, 2039 * GB),
        "h100": (80 * 2**30, 989e12, 63 * GB, 3350 * GB),
        "h200": (141 * GB, 989e12, 63 * GB, 4800 * GB),
        "rtx4090": (24 * 2**30, 165.2e12, 31.5 * GB, 1008 * GB),
        "l4": (24 * GB, 121e12, 31.5 * GB, 300 * GB),
        "t4": (16 * GB, 65e12, 15.75 * GB, 320 * GB),
        "a6000": (48 * 2**30, 154.8e12, 31.5 * GB, 768 * GB),  # NVIDIA RTX A6000 datasheet
    }[name]
    p = preset(name)
    assert p.device_type == "cuda"
    values = (p.device_memory, p.device_flops, p.h2d_bandwidth, p.device_memory_bandwidth)
    for value, peak in zip(values, datasheet, strict=True):
        assert 0.45 * peak <= value < peak
    assert p.d2h_bandwidth == p.h2d_bandwidth
    assert p.nvme_write_bandwidth < p.nvme_read_bandwidth < p.h2d_bandwidth
    assert p.nvme_capacity > 10 * p.host_memory > 10 * p.device_memory / 2
    assert 1e9 < p.host_adam_params_per_s < 1e10
    assert 3e10 <= p.host_memory_bandwidth < 3e11  # DDR4/DDR5 hosts of one process
    assert p.cores > 0
    assert p.peak_flops == datasheet[1]


@pytest.mark.parametrize(
    ("device_name", "flops"),
    [
        ("NVIDIA H100 80GB HBM3", 989e12),
        ("NVIDIA A100-SXM4-80GB", 312e12),
        ("NVIDIA A10", 125e12),
        ("NVIDIA L40S", 362e12),
        ("NVIDIA L4", 121e12),
        ("NVIDIA L40", 0.0),
        ("NVIDIA GeForce RTX 4090", 165.2e12),
        ("Tesla T4", 65e12),
        ("NVIDIA RTX A6000", 154.8e12),
        ("NVIDIA B200", 0.0),
    ],
)
def test_a_gpu_name_gives_its_datasheet_peak(device_name: str, flops: float) -> None:
    # CUDA device names as torch.cuda.get_device_name prints them; unlisted GPUs get 0.0
    assert datasheet_flops(device_name) == flops


def test_intensity_ridge_matches_the_design_ballpark() -> None:
    # tokens per weight pass at which compute hides a bf16 weight copy (2 bytes, 2 FLOPs/token)
    def ridge(p: HardwareProfile) -> float:
        return p.device_flops / p.h2d_bandwidth

    assert 5_000 < ridge(preset("a100-80gb")) < 15_000
    assert 8_000 < ridge(preset("h100")) < 30_000
    assert ridge(preset("t4")) < ridge(preset("a100-80gb")) < ridge(preset("h100"))


def test_hardware_round_trip_replace_and_validation() -> None:
    p = preset("h200")
    assert HardwareProfile.from_dict(json.loads(json.dumps(p.to_dict()))) == p
    q = p.replace(host_memory=1 << 40, compute_efficiency=0.8)
    assert q.host_memory == 1 << 40 and q.compute_efficiency == 0.8 and p.host_memory != 1 << 40
    with pytest.raises(ValueError, match="device_type = 'tpu'"):
        p.replace(device_type="tpu")
    with pytest.raises(ValueError, match=r"h2d_bandwidth = -1\.0 is negative"):
        p.replace(h2d_bandwidth=-1.0)
    with pytest.raises(ValueError, match=r"nvme_efficiency = 0\.0 must be > 0"):
        p.replace(nvme_efficiency=0.0)
    with pytest.raises(ValueError, match=r"unknown HardwareProfile field\(s\) \['gpus'\]"):
        HardwareProfile.from_dict(p.to_dict() | {"gpus": 8})


def make_model(**changes: int) -> ModelProfile:
    fields = {
        "name": "toy",
        "num_blocks": 4,
        "hidden_size": 64,
        "num_heads": 4,
        "num_kv_heads": 2,
        "head_dim": 16,
        "vocab_size": 100,
        "max_positions": 128,
        "block_params": 1000,
        "block_matmul_params": 900,
        "embed_params": 6400,
        "head_params": 6400,
        "final_params": 64,
        "tied_embeddings": False,
        "act_bytes_per_token_checkpointed": 128,
        "act_bytes_per_token_full": 3000,
        "kv_bytes_per_token": 128,
    }
    return ModelProfile(**(fields | changes))  # type: ignore[arg-type]


def test_model_profile_formulas() -> None:
    m = make_model()
    assert m.total_params == 4 * 1000 + 6400 + 6400 + 64
    assert m.block_bytes == 2000
    assert m.block_flops_per_token(0) == 1800
    assert m.block_flops_per_token(512) == 1800 + 4 * 4 * 16 * 512
    assert m.head_flops_per_token() == 2 * 64 * 100
    with pytest.raises(ValueError, match="context = -1"):
        m.block_flops_per_token(-1)
    with pytest.raises(ValueError, match="block_params = -5 is negative"):
        make_model(block_params=-5)
