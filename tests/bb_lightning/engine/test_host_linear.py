"""The bf16 product of few rows (``engine.host_linear``, on the matrix tiles or on AVX-512's
bf16 pair products) against exact integer arithmetic, float64 and ``F.linear``, its
fallbacks to the class ``forward``, and its install / restore.

Skipped where the CPU has neither (the kernel is then never installed, which the last test
checks)."""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from bb_lightning.engine import host_linear


@pytest.fixture
def tiles() -> Callable[..., torch.Tensor]:
    """The kernel's product ``x @ w.T``; skips the test where the kernel is unavailable."""
    if shutil.which(os.environ.get("CC", "cc")) is None:
        pytest.skip("no C compiler on PATH")
    kern = host_linear.kernel()
    if kern is None:
        pytest.skip("no bf16 matrix tiles or vector pair products here: torch's products run")
    return kern


def _ulp(t: torch.Tensor) -> torch.Tensor:
    """The spacing of bf16 numbers at ``t`` (float64; 8 significand bits)."""
    exp = torch.frexp(t.abs().clamp_min(1e-30))[1].double()
    return torch.pow(2.0, exp - 8)


SHAPES = [(1, 32, 32), (7, 64, 96), (16, 1024, 64), (20, 64, 32), (33, 256, 64), (50, 96, 64),
          (100, 96, 128), (128, 2816, 96), (192, 128, 64), (241, 64, 32), (256, 32, 64)]  # fmt: skip


@pytest.mark.parametrize(("m", "k", "n"), SHAPES)
@pytest.mark.parametrize("threads", [1, 2])
def test_integer_products_are_exact(
    tiles: Callable[..., torch.Tensor], m: int, k: int, n: int, threads: int
) -> None:
    """Small integers: every product and partial sum is exact in fp32, so the kernel, torch
    and the exact result agree bit for bit, whatever the order of the sums (a misplaced
    row, column or block of k shows as a wrong integer)."""
    g = torch.Generator().manual_seed(m * 7 + k + n)
    x = torch.randint(-4, 5, (m, k), generator=g).to(torch.bfloat16)
    w = torch.randint(-4, 5, (n, k), generator=g).to(torch.bfloat16)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got = tiles(x, w)
    finally:
        torch.set_num_threads(before)
    exact = (x.double() @ w.double().T).to(torch.bfloat16)  # |sums| < 2**24: exact, then rounded
    assert torch.equal(got, exact)
    assert torch.equal(got, F.linear(x, w))


@pytest.mark.parametrize(
    ("m", "k", "n"), [*SHAPES, (128, 1024, 2816), (256, 2816, 1024), (600, 64, 96)]
)
def test_products_round_the_fp32_sum_like_torch(
    tiles: Callable[..., torch.Tensor], m: int, k: int, n: int
) -> None:
    """Random bf16: each output is within half a bf16 spacing of the float64 product plus the
    fp32 sums' error, and equals ``F.linear``'s but where the two orders of the fp32 sums
    straddle a bf16 rounding midpoint (a few in ten thousand, one spacing apart)."""
    g = torch.Generator().manual_seed(m + k + n)
    x = (torch.randn(m, k, generator=g) * 2).to(torch.bfloat16)
    w = (torch.randn(n, k, generator=g) * 0.05).to(torch.bfloat16)
    got = tiles(x, w).double()
    exact = x.double() @ w.double().T
    slack = k * 2.0**-24 * (x.double().abs() @ w.double().abs().T)  # the fp32 sums' error
    assert ((got - exact).abs() <= _ulp(exact) / 2 + slack).all()
    theirs = F.linear(x, w).double()
    differ = got != theirs
    assert int(differ.sum()) <= max(2, got.numel() // 1000)
    assert ((got - theirs).abs() <= torch.maximum(_ulp(theirs), 2 * slack)).all()


def test_the_output_has_the_input_shape_and_nan_stays_nan(
    tiles: Callable[..., torch.Tensor],
) -> None:
    x = torch.randn(2, 3, 64).to(torch.bfloat16)
    x[0, 1, 5] = float("nan")
    w = torch.randn(32, 64).to(torch.bfloat16)
    got = tiles(x, w)
    assert got.shape == (2, 3, 32)
    assert (got[0, 1].view(torch.int16) == 0x7FC0).all()  # the quiet NaN torch converts to
    assert not got[1].isnan().any()
    assert torch.equal(got[1], F.linear(x[1], w))


def test_a_weight_that_is_a_view_of_rows(tiles: Callable[..., torch.Tensor]) -> None:
    """A weight cut out of a larger one (rows 32-95: a storage offset) is read from its own
    first row."""
    g = torch.Generator().manual_seed(1)
    big = torch.randint(-4, 5, (160, 64), generator=g).to(torch.bfloat16)
    x = torch.randint(-4, 5, (40, 64), generator=g).to(torch.bfloat16)
    w = big[32:96]
    assert w.storage_offset() > 0 and w.is_contiguous()
    assert torch.equal(tiles(x, w), (x.double() @ w.double().T).to(torch.bfloat16))


def test_calls_outside_the_kernel_run_the_class_forward(
    tiles: Callable[..., torch.Tensor], count_host_kernel: Callable[..., list[int]]
) -> None:
    calls = count_host_kernel("__call__", host_linear._Kernel)
    model = nn.Sequential(nn.Linear(64, 96, bias=False), nn.Linear(96, 64, bias=True)).bfloat16()
    restore = host_linear.install(model)
    lin, biased = model[0], model[1]
    x = torch.randn(5, 64).to(torch.bfloat16)
    with torch.no_grad():
        assert torch.equal(lin(x), F.linear(x, lin.weight)) and len(calls) == 1
        biased(lin(x))  # a bias: the class's
        strided = x.t().contiguous().t()  # its rows not contiguous
        assert torch.equal(lin(strided), F.linear(strided, lin.weight))
        assert len(calls) == 2
        lin(torch.randn(host_linear.MAX_ROWS + 1, 64).to(torch.bfloat16))  # too many rows
        assert len(calls) == 2
    odd = nn.Linear(64, 40, bias=False).bfloat16()  # 40 columns: not a multiple of 32
    host_linear.install(odd)
    with torch.no_grad():
        assert torch.equal(odd(x), F.linear(x, odd.weight))
    assert len(calls) == 2
    # fp32, autograd, tracing and vmap run the class forward too
    lin32 = nn.Linear(64, 32, bias=False)
    host_linear.install(lin32)
    with torch.no_grad():
        lin32(x.float())
    out = lin(x.requires_grad_())
    out.sum().backward()
    assert x.grad is not None and len(calls) == 2
    with torch.no_grad():
        traced = torch.jit.trace(lin, x.detach(), check_trace=False)  # its check runs eagerly
        assert torch.equal(traced(x.detach()), F.linear(x.detach(), lin.weight))
        torch.vmap(lin)(x.detach()[None])
    assert len(calls) == 2
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        lin(x.detach())  # under autocast: the class's
    assert len(calls) == 2
    restore()
    assert "forward" not in vars(lin) and "forward" not in vars(biased)


def test_install_swaps_only_plain_linears_and_restores(
    tiles: Callable[..., torch.Tensor],
) -> None:
    class Mine(nn.Linear):
        pass

    model = nn.Sequential(nn.Linear(32, 32, bias=False), Mine(32, 32, bias=False), nn.ReLU())
    restore = host_linear.install(model)
    assert [type(m).__name__ for m in model.modules() if "forward" in vars(m)] == ["Linear"]
    restore()
    assert [m for m in model.modules() if "forward" in vars(m)] == []
    restore = host_linear.install(model)
    later = model[0].forward = lambda x: x  # set over ours after the install: it stays
    restore()
    assert vars(model[0])["forward"] is later


def test_no_kernel_no_swap(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("BB_NATIVE", "0")
    monkeypatch.setattr(host_linear, "_loaded", {})
    model = nn.Sequential(nn.Linear(32, 32, bias=False))
    host_linear.install(model)()
    assert host_linear.kernel() is None
    assert "forward" not in vars(model[0])
