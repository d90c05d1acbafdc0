"""Cost functions against hand-derived references (numpy / closed forms)."""

from __future__ import annotations

import numpy as np
import pytest

from bb_lightning.planner import cost
from bb_lightning.planner.profile import HardwareProfile, ModelProfile


def test_train_flops_are_6n_plus_attention_and_8n_with_recompute(small_model: ModelProfile) -> None:
    m = small_model
    # Kaplan et al. 2020: forward 2N per token + 2 * n_layer * n_ctx * d_attn (QK^T and AV).
    n_mat = m.num_blocks * m.block_matmul_params + m.hidden_size * m.vocab_size
    attn = 4 * m.num_blocks * m.num_heads * m.head_dim * 128
    assert cost.forward_flops_per_token(m, 128) == pytest.approx(2 * n_mat + attn)
    assert cost.train_flops_per_token(m, 128, False) == pytest.approx(6 * n_mat + 3 * attn)
    head = 2 * m.hidden_size * m.vocab_size
    blocks = 2 * m.num_blocks * m.block_matmul_params + attn
    assert cost.train_flops_per_token(m, 128, True) == pytest.approx(4 * blocks + 3 * head)
    # PaLM, Appendix B: 6N + 12 L H Q T per trained token, a third of it per generated one
    assert cost.model_flops_per_token(m, "fit", 128) == pytest.approx(6 * n_mat + 3 * attn)
    assert cost.model_flops_per_token(m, "predict", 128) == pytest.approx(2 * n_mat + attn)


def test_seconds_scale_with_efficiency_and_arrays(small_gpu: HardwareProfile) -> None:
    hw = small_gpu.replace(compute_efficiency=0.5, optimizer_efficiency=2.0)
    assert cost.compute_seconds(1e14, hw) == pytest.approx(2.0)
    assert cost.host_adam_seconds(4e9, hw) == pytest.approx(1.0)
    nbytes = np.array([0.0, 1e10, 4e10])
    np.testing.assert_allclose(cost.link_seconds(nbytes, 2e10, 0.5), [0.0, 1.0, 4.0])
    assert cost.link_seconds(0.0, 0.0) == 0.0
    assert cost.link_seconds(1e9, 0.0) >= 1e9  # no bandwidth: priced prohibitively


def test_overlap_model_exposes_only_the_excess_of_the_slowest_link() -> None:
    links = {"h2d": np.array([1.0, 3.0, 5.0]), "nvme_read": np.array([2.5, 0.5, 6.0])}
    exposed = cost.pass_exposed_seconds(np.array([2.0, 2.0, 2.0]), links)
    ref = np.maximum.reduce([np.full(3, 2.0), links["h2d"], links["nvme_read"]]) - 2.0
    np.testing.assert_allclose(exposed, ref)
    np.testing.assert_allclose(exposed, [0.5, 1.0, 4.0])


def test_optimizer_overlap_and_clipping() -> None:
    assert cost.optimizer_exposed_seconds(10.0, 4.0, 10.0, False) == pytest.approx(6.0 + 1.0)
    assert cost.optimizer_exposed_seconds(2.0, 4.0, 10.0, False) == pytest.approx(0.2)
    assert cost.optimizer_exposed_seconds(2.0, 4.0, 10.0, True) == 2.0


def test_budgets_keep_the_stated_margins(small_gpu: HardwareProfile) -> None:
    hw = small_gpu.replace(device_memory=20 * 2**30, host_memory=100 * 2**30)
    assert cost.device_budget(hw) == int(20 * 2**30 * 0.9 - 2**30)
    assert cost.host_budget(hw) == int(100 * 2**30 * 0.95)
    assert cost.nvme_budget(hw.replace(nvme_read_bandwidth=0.0)) == 0


def test_memory_terms(small_model: ModelProfile) -> None:
    m = small_model
    assert cost.activation_bytes(m, 2, 100, True) == 200 * (512 * 4 + 12_000)
    assert cost.activation_bytes(m, 2, 100, False) == 200 * 12_000 * 4
    assert cost.logits_bytes(m, 10) == 10 * 1000 * 12  # three fp32 buffers in the loss
    assert cost.kv_cache_bytes(m, 3, 50) == 3 * 50 * 1024 * 4


def test_hide_tokens_matches_design_example() -> None:
    # docs/architecture.md, "Intensity first": A100 (312 TFLOP/s) over ~25 GB/s, 2 bytes per
    # param per link and 8 FLOPs per param per token with recompute, two weight passes ->
    # about 12,000 tokens per pass.
    t = cost.hide_tokens_per_pass(8.0, 4.0, 312e12, 25e9)
    assert 5_000 < t < 13_000
