"""Small hand-written profiles shared by the planner tests."""

from __future__ import annotations

import pytest

from bb_lightning.planner.profile import HardwareProfile, ModelProfile


@pytest.fixture
def small_model() -> ModelProfile:
    """A 4-block, width-256 model with round numbers (parameters, bytes per token)."""
    return ModelProfile(
        name="small",
        num_blocks=4,
        hidden_size=256,
        num_heads=4,
        num_kv_heads=4,
        head_dim=64,
        vocab_size=1000,
        max_positions=2048,
        block_params=800_000,
        block_matmul_params=790_000,
        embed_params=256_000,
        head_params=256_000,
        final_params=256,
        tied_embeddings=False,
        act_bytes_per_token_checkpointed=512,
        act_bytes_per_token_full=12_000,
        kv_bytes_per_token=1024,
    )


@pytest.fixture
def small_gpu() -> HardwareProfile:
    """A 16 GiB, 100 TFLOP/s device with 20 GB/s links; change fields with ``.replace()``."""
    return HardwareProfile(
        name="hw",
        device_type="cuda",
        device_memory=16 * 2**30,
        device_flops=1e14,
        h2d_bandwidth=2e10,
        d2h_bandwidth=2e10,
        host_memory=64 * 2**30,
        nvme_read_bandwidth=5e9,
        nvme_write_bandwidth=3e9,
        nvme_capacity=10**12,
        host_adam_params_per_s=2e9,
        cores=8,
    )
