"""Gradient sums through the compiled kernel (``host_ops.c``'s ``bb_sum_f32``): bit for bit
torch's conversions and adds, left to right, for what the accumulators take, and the calls
it declines left to torch."""

from __future__ import annotations

import pytest
import torch
from torch import Tensor

from bb_lightning.engine import grad_sink, host_norm
from bb_lightning.engine.grad_sink import add_converted, sum_tiles


def _strong(n: int, seed: int, dtype: torch.dtype) -> Tensor:
    """Values from 1e-30 to 1e30 of both signs, with zeros of both signs, infinities and a
    NaN among them (where n allows), in ``dtype``."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g) * torch.logspace(-30, 30, n).roll(seed)
    if n > 8:
        x[seed % 5] = -0.0
        x[seed % 5 + 1] = 0.0
    if n > 64:
        x[seed % 7 + 40] = float("inf")
        x[seed % 7 + 50] = float("nan")
    return x.to(dtype)


def _torch_sum(dst: Tensor, srcs: list[Tensor], into: bool) -> Tensor:
    out = dst.clone()
    if not into:
        out.copy_(srcs[0])
    for s in srcs if into else srcs[1:]:
        out.add_(s.float())
    return out


def _same(a: Tensor, b: Tensor) -> bool:
    """Equal bit for bit (NaN where NaN, the sign of each zero)."""
    return torch.equal(a.view(torch.int32), b.view(torch.int32)) or (
        torch.equal(a.isnan(), b.isnan())
        and torch.equal(a.nan_to_num(0.0), b.nan_to_num(0.0))
        and torch.equal(a.signbit()[~a.isnan()], b.signbit()[~b.isnan()])
    )


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("n", [1, 9, 4095, 4097, 17 * 4096 + 5, 300_001])
@pytest.mark.parametrize("into", [True, False])
def test_sums_equal_torch_s_conversions_and_adds_bit_for_bit(
    host_kernel: host_norm._Kernel, n: int, into: bool, threads: int
) -> None:
    """One to three sources of bf16 and fp32 mixed, into an accumulator or copied in; the
    sizes cross the kernel's spans (4096), its threshold for a team (16 spans), and end in
    partial spans."""
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for k, dtypes in enumerate(
            [
                [torch.bfloat16],
                [torch.float32],
                [torch.bfloat16, torch.float32, torch.bfloat16],
            ]
        ):
            srcs = [_strong(n, 10 * k + j, d) for j, d in enumerate(dtypes)]
            dst = _strong(n, 99 + k, torch.float32)
            want = _torch_sum(dst, srcs, into)
            assert host_kernel.sum_into(dst, srcs, into=into)
            assert _same(dst, want), (n, into, dtypes)
    finally:
        torch.set_num_threads(previous)


def test_the_kernel_declines_what_it_cannot_read_and_leaves_it_untouched(
    host_kernel: host_norm._Kernel,
) -> None:
    dst = torch.zeros(64)
    before = dst.clone()
    half = torch.ones(64, dtype=torch.float16)
    assert not host_kernel.sum_into(dst, [half], into=True)  # fp16: torch's add
    assert not host_kernel.sum_into(dst, [torch.ones(63)], into=True)  # another size
    assert not host_kernel.sum_into(dst, [torch.ones(128)[::2]], into=True)  # strided source
    assert not host_kernel.sum_into(torch.zeros(128)[::2], [torch.ones(64)], into=True)
    assert not host_kernel.sum_into(dst.bfloat16(), [torch.ones(64)], into=True)  # bf16 sum
    assert not host_kernel.sum_into(dst, [], into=False)
    assert torch.equal(dst, before)


@pytest.mark.parametrize("into", [True, False])
def test_sum_tiles_is_the_same_with_and_without_the_kernel(
    host_kernel: host_norm._Kernel, monkeypatch: pytest.MonkeyPatch, into: bool
) -> None:
    """What the accumulators compute (three micro-batches' gradients into views of one flat
    buffer, a view with no gradient, an fp16 one that torch adds) equals torch's path."""
    shapes = [(33, 70), (5,), (4096, 3), (11,)]
    numels = [a * (b[0] if b else 1) for a, *b in shapes]
    batches = [
        [
            _strong(numels[0], 3 * b, torch.bfloat16).view(shapes[0]),
            None,
            _strong(numels[2], 3 * b + 1, torch.float32).view(shapes[2]),
            _strong(numels[3], 3 * b + 2, torch.float16).view(shapes[3]),
        ]
        for b in range(3)
    ]
    start = _strong(sum(numels), 7, torch.float32)

    def run() -> Tensor:
        flat = start.clone()
        views, at = [], 0
        for shape, k in zip(shapes, numels, strict=True):
            views.append(flat[at : at + k].view(shape))
            at += k
        sum_tiles(views, batches, into=into)
        return flat

    got = run()
    monkeypatch.setattr(grad_sink.host_norm, "kernel", lambda: None)
    assert _same(got, run())
    if not into:
        assert torch.equal(got[numels[0] : numels[0] + 5], torch.zeros(5))  # no gradient


def test_add_converted_adds_a_bf16_gradient_exactly(host_kernel: host_norm._Kernel) -> None:
    grad = _strong(100_003, 1, torch.bfloat16)
    acc = _strong(100_003, 2, torch.float32)
    want = acc + grad.float()
    add_converted(acc, grad)
    assert _same(acc, want)
