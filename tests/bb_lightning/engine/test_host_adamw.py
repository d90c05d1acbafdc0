"""Training's AdamW in one pass (``host_ops.c``'s ``bb_adamw``, :meth:`HostAdamW.step_host`):
the gradient summed in, the update, the weights cast out, against ``torch._fused_adamw_`` on
the gradient torch's own adds form; every element alike wherever a call's bounds fall; the
calls it declines left unchanged."""

from __future__ import annotations

import pytest
import torch
from torch import Tensor

from bb_lightning.engine import host_norm
from bb_lightning.engine.optim import AdamWConfig, HostAdamW

EXACT = torch.backends.cpu.get_cpu_capability() == "AVX512"
"""Where torch's kernels run their AVX-512 loops, the load check's claim (bit for bit) is
asserted; elsewhere within torch's own rounding, in case the build differs."""

CASES = [  # config, learning rate, step, gradient scale
    (AdamWConfig(betas=(0.9, 0.95), weight_decay=0.1), 3e-4, 1, 1.0),
    (AdamWConfig(betas=(0.9, 0.999), eps=1e-6), 1e-2, 7, 0.37),
    (AdamWConfig(betas=(0.3, 0.9), weight_decay=0.01), 2e-3, 2, 1.0),  # 1 - beta1 >= 0.5
]
SOURCES = {  # accumulator present, then the sources' dtypes
    "bf16": (False, [torch.bfloat16]),
    "acc+bf16": (True, [torch.bfloat16]),
    "acc+bf16+fp32": (True, [torch.bfloat16, torch.float32, torch.bfloat16]),
    "fp32": (False, [torch.float32]),
    "acc": (True, []),
    "none": (False, []),
}


def _state(n: int, seed: int) -> list[Tensor]:
    """Master weights, first and second moments of a run some steps in."""
    g = torch.Generator().manual_seed(seed)
    master = torch.randn(n, generator=g)
    exp_avg = torch.randn(n, generator=g).mul(1e-2)
    exp_avg_sq = torch.randn(n, generator=g).mul(1e-2).square()
    return [master, exp_avg, exp_avg_sq]


def _sources(n: int, seed: int, kind: str) -> tuple[Tensor | None, list[Tensor]]:
    has_acc, dtypes = SOURCES[kind]
    g = torch.Generator().manual_seed(seed + 1)
    acc = torch.randn(n, generator=g).mul(3e-2) if has_acc else None
    srcs = [torch.randn(n, generator=g).mul(1e-2).to(d) for d in dtypes]
    if srcs and n > 64:  # a non-finite gradient spreads as torch spreads it
        srcs[0][40] = float("inf")
        srcs[0][50] = float("nan")
    return acc, srcs


def _torch_step(
    state: list[Tensor], acc: Tensor | None, srcs: list[Tensor], case: tuple, n: int
) -> list[Tensor]:
    """torch's adds of the converted sources, then ``torch._fused_adamw_``, on copies."""
    cfg, lr, step, scale = case
    grad = torch.zeros(n) if acc is None else acc.clone()
    for k, s in enumerate(srcs):
        if acc is None and k == 0:
            grad.copy_(s)
        else:
            grad.add_(s.float())
    out = [t.clone() for t in state]
    torch._fused_adamw_(
        [out[0]], [grad], [out[1]], [out[2]], [], [torch.tensor(float(step))],
        lr=lr, beta1=cfg.betas[0], beta2=cfg.betas[1], weight_decay=cfg.weight_decay,
        eps=cfg.eps, amsgrad=False, maximize=False,
        grad_scale=None if scale == 1.0 else torch.tensor(1.0 / scale), found_inf=None,
    )  # fmt: skip
    return out


def _same(a: Tensor, b: Tensor) -> bool:
    """Equal bit for bit, NaN where NaN."""
    nan = a.isnan()
    return torch.equal(nan, b.isnan()) and torch.equal(
        a[~nan].view(torch.int32 if a.dtype == torch.float32 else torch.int16),
        b[~nan].view(torch.int32 if a.dtype == torch.float32 else torch.int16),
    )


def _close(a: Tensor, b: Tensor) -> None:
    torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-12, equal_nan=True)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("n", [16, 4096 + 32, 17 * 4096 + 48, 300_000])
@pytest.mark.parametrize("kind", list(SOURCES))
def test_one_pass_equals_torch_s_adds_then_its_fused_adamw(
    host_kernel: host_norm._Kernel, n: int, kind: str, threads: int
) -> None:
    """Sizes that are whole vectors of 16 (torch's vector loop) across the kernel's spans
    (4,096) and its threshold for a team (16 spans); the weights cast to bf16 and fp32."""
    assert host_kernel.adamw_exact or not EXACT
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for k, case in enumerate(CASES):
            state = _state(n, k)
            acc, srcs = _sources(n, k, kind)
            want = _torch_step(state, acc, srcs, case, n)
            acc_before = None if acc is None else acc.clone()
            out_dtype = (torch.bfloat16, torch.float32)[k % 2]
            out = torch.full((n,), float("nan"), dtype=out_dtype)
            cfg, lr, step, scale = case
            served = HostAdamW(cfg).step_host(
                state, acc, srcs, out, step=step, lr=lr, grad_scale=scale
            )
            assert served or not host_kernel.adamw_exact
            if not served:
                continue
            check = _same if EXACT else lambda a, b: _close(a, b) is None
            for got, expect in zip(state, want, strict=True):
                assert check(got, expect), (case, kind)
            assert _same(out, want[0].to(out_dtype)), (case, kind)
            assert acc is None or _same(acc, acc_before), "the accumulator was written"
    finally:
        torch.set_num_threads(previous)


def test_every_element_is_computed_alike_wherever_a_call_s_bounds_fall(
    host_kernel: host_norm._Kernel,
) -> None:
    """One call over 1,000 elements and three over its pieces give the same bits (torch's
    own loop computes a call's last n % 16 elements another way: within its rounding)."""
    if not host_kernel.adamw_exact:
        pytest.skip("the load check found this build's AdamW unlike torch's: it is not used")
    n, case = 1000, CASES[1]
    whole, pieces = _state(n, 3), _state(n, 3)
    acc, srcs = _sources(n, 3, "acc+bf16")
    cfg, lr, step, scale = case
    stepper = HostAdamW(cfg)
    assert stepper.step_host(whole, acc, srcs, None, step=step, lr=lr, grad_scale=scale)
    for a, b in ((0, 7), (7, 500), (500, n)):
        assert stepper.step_host(
            [t[a:b] for t in pieces], None if acc is None else acc[a:b],
            [s[a:b] for s in srcs], None, step=step, lr=lr, grad_scale=scale,
        )  # fmt: skip
    for got, expect in zip(pieces, whole, strict=True):
        assert _same(got, expect)
    for got, expect in zip(whole, _torch_step(_state(n, 3), acc, srcs, case, n), strict=True):
        _close(got, expect)


@pytest.mark.parametrize(
    "wrong",
    ["fp16 source", "strided source", "fp16 weights", "size", "foreach kernel", "bf16 state"],
)
def test_what_it_does_not_serve_is_declined_unchanged(
    host_kernel: host_norm._Kernel, wrong: str
) -> None:
    n = 64
    state = _state(n, 0)
    acc, srcs = _sources(n, 0, "acc+bf16")
    out: Tensor | None = torch.empty(n, dtype=torch.bfloat16)
    kernel = "foreach" if wrong == "foreach kernel" else "auto"
    if wrong == "fp16 source":
        srcs = [srcs[0].to(torch.float16)]
    elif wrong == "strided source":
        srcs = [torch.zeros(2 * n, dtype=torch.bfloat16)[::2]]
    elif wrong == "fp16 weights":
        out = torch.empty(n, dtype=torch.float16)
    elif wrong == "size":
        srcs = [srcs[0][:-1]]
    elif wrong == "bf16 state":
        state[1] = state[1].to(torch.bfloat16)
    before = [t.clone() for t in state]
    stepper = HostAdamW(AdamWConfig(), kernel=kernel)
    assert not stepper.step_host(state, acc, srcs, out, step=1)
    assert all(_same(a, b) for a, b in zip(state, before, strict=True))
