"""HostAdamW against torch.optim.AdamW on the same parameters."""

from __future__ import annotations

import time

import pytest
import torch
from torch import nn

from bb_lightning.engine.flat import flat_views
from bb_lightning.engine.optim import (
    AdamWConfig,
    HostAdamW,
    clip_coefficient,
    copy_bf16_,
    global_grad_norm,
)

KERNELS = ["fused", "foreach"] if hasattr(torch, "_fused_adamw_") else ["foreach"]


def _block() -> nn.Sequential:
    """A transformer-block-shaped module: weights, biases and a norm."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(24, 48), nn.GELU(), nn.Linear(48, 24), nn.LayerNorm(24))


def _run_pair(
    kernel: str,
    *,
    steps: int,
    weight_decay: float,
    lrs: list[float],
    grad_scales: list[float],
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Train the same block with torch AdamW and with HostAdamW over flat buffers."""
    ref = _block()
    params = list(ref.parameters())
    shapes = [p.shape for p in params]
    numel = sum(p.numel() for p in params)
    master = torch.cat([p.detach().reshape(-1) for p in params]).clone()
    grad = torch.zeros(numel)
    exp_avg = torch.zeros(numel)
    exp_avg_sq = torch.zeros(numel)

    betas = (0.9, 0.95)
    opt = torch.optim.AdamW(
        params, lr=lrs[0], betas=betas, eps=1e-8, weight_decay=weight_decay,
        foreach=False, fused=False,
    )  # fmt: skip
    config = AdamWConfig(lr=lrs[0], betas=betas, eps=1e-8, weight_decay=weight_decay)
    host = HostAdamW(config, kernel=kernel)  # type: ignore[arg-type]
    gen = torch.Generator().manual_seed(1)
    for step in range(1, steps + 1):
        grads = [torch.randn(s, generator=gen) for s in shapes]
        lr, scale = lrs[step - 1], grad_scales[step - 1]
        for group in opt.param_groups:
            group["lr"] = lr
        for p, g in zip(params, grads, strict=True):
            p.grad = g * scale
        opt.step()
        for view, g in zip(flat_views(grad, shapes), grads, strict=True):
            view.copy_(g)
        host.step_block(master, grad, exp_avg, exp_avg_sq, step=step, lr=lr, grad_scale=scale)
    return [p.detach() for p in params], flat_views(master, shapes)


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
def test_matches_torch_adamw_constant_lr(kernel: str, weight_decay: float) -> None:
    steps = 30
    want, got = _run_pair(
        kernel,
        steps=steps,
        weight_decay=weight_decay,
        lrs=[1e-2] * steps,
        grad_scales=[1.0] * steps,
    )
    for w, g in zip(want, got, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-6, atol=1e-7)
    # The parameters moved: the comparison is not between two untouched copies.
    assert not torch.allclose(got[0], _block()[0].weight.detach(), atol=1e-3)


@pytest.mark.parametrize("kernel", KERNELS)
def test_matches_torch_adamw_with_schedule_and_grad_scale(kernel: str) -> None:
    steps = 40
    lrs = [1e-2 * min(1.0, (i + 1) / 10) * (0.97**i) for i in range(steps)]
    scales = [0.25 + 0.05 * (i % 7) for i in range(steps)]
    want, got = _run_pair(kernel, steps=steps, weight_decay=0.05, lrs=lrs, grad_scales=scales)
    for w, g in zip(want, got, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-6, atol=1e-7)


def test_foreach_is_bitwise_torch_single_tensor() -> None:
    """The fallback performs torch's own sequence of operations."""
    steps = 10
    want, got = _run_pair(
        "foreach", steps=steps, weight_decay=0.1, lrs=[3e-3] * steps, grad_scales=[1.0] * steps
    )
    for w, g in zip(want, got, strict=True):
        assert torch.equal(g, w)


def test_grad_norm_and_clip_coefficient_match_clip_grad_norm() -> None:
    torch.manual_seed(3)
    block = _block()
    grads = [torch.randn_like(p) * 3.0 for p in block.parameters()]
    for p, g in zip(block.parameters(), grads, strict=True):
        p.grad = g.clone()
    max_norm = 1.5
    total = torch.nn.utils.clip_grad_norm_(block.parameters(), max_norm)
    norm = global_grad_norm(grads)
    assert norm == pytest.approx(float(total), rel=1e-6)
    coef = clip_coefficient(norm, max_norm)
    assert coef < 1.0
    for p, g in zip(block.parameters(), grads, strict=True):
        assert p.grad is not None
        torch.testing.assert_close(g * coef, p.grad, rtol=1e-6, atol=1e-8)
    # Below the threshold the coefficient is exactly 1, as in torch (clamp to 1.0).
    assert clip_coefficient(norm, norm * 10) == 1.0
    assert global_grad_norm([]) == 0.0


def test_flat_views_share_storage_and_copy_bf16() -> None:
    flat = torch.arange(2 * 3 + 4, dtype=torch.float32)
    a, b = flat_views(flat, [(2, 3), (4,)])
    assert a.shape == (2, 3) and b.shape == (4,)
    a.fill_(-1.0)
    assert torch.all(flat[:6] == -1.0)
    dst = torch.empty(10, dtype=torch.bfloat16)
    master = torch.randn(10)
    copy_bf16_(dst, master)
    assert torch.equal(dst, master.to(torch.bfloat16))


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"lr": -1.0}, "lr=-1.0"),
        ({"betas": (0.9, 1.0)}, r"betas=\(0.9, 1.0\)"),
        ({"eps": -1e-8}, "eps="),
        ({"weight_decay": float("nan")}, "weight_decay=nan"),
    ],
)
def test_config_rejects_bad_values(kwargs: dict[str, object], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        AdamWConfig(**kwargs)  # type: ignore[arg-type]


def test_step_block_rejects_bad_input() -> None:
    host = HostAdamW()
    z = torch.zeros(8)
    with pytest.raises(ValueError, match="step=0"):
        host.step_block(z, z.clone(), z.clone(), z.clone(), step=0)
    with pytest.raises(ValueError, match=r"grad_scale=0\.0"):
        host.step_block(z, z.clone(), z.clone(), z.clone(), step=1, grad_scale=0.0)
    with pytest.raises(ValueError, match="exp_avg has shape"):
        host.step_block(z, z.clone(), torch.zeros(7), z.clone(), step=1)
    with pytest.raises(ValueError, match=r"grad has dtype torch\.bfloat16"):
        host.step_block(z, z.to(torch.bfloat16), z.clone(), z.clone(), step=1)
    with pytest.raises(ValueError, match="shapes need 12 elements but flat holds 8"):
        flat_views(z, [(3, 4)])
    with pytest.raises(ValueError, match="max_norm=0"):
        clip_coefficient(1.0, 0.0)


@pytest.mark.parametrize("kernel", KERNELS)
def test_throughput_is_vectorised(kernel: str) -> None:
    """Prints params/s (run with -s); a Python loop over elements would manage ~1e6."""
    n = 4_000_000
    bufs = [torch.randn(n), torch.randn(n), torch.zeros(n), torch.zeros(n)]
    before = bufs[0].clone()
    host = HostAdamW(AdamWConfig(lr=1e-3, weight_decay=0.1), kernel=kernel)  # type: ignore[arg-type]
    host.step_block(*bufs, step=1)
    reps = 3
    start = time.perf_counter()
    for i in range(reps):
        host.step_block(*bufs, step=2 + i, grad_scale=0.5)
    rate = reps * n / (time.perf_counter() - start)
    print(f"HostAdamW[{kernel}]: {rate / 1e6:.0f} M params/s on {torch.get_num_threads()} threads")
    # Every parameter moved (by about lr, Adam's normalised step).
    assert torch.all((bufs[0] - before).abs() > 1e-4)
