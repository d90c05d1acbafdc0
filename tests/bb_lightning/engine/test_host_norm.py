"""The compiled RMS norm (``host_norm``) against a float64 reference and against the class
``forward`` it stands in for, which classes it serves, and the calls it leaves to them."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch import Tensor, nn
from transformers.models.gemma.modeling_gemma import GemmaRMSNorm
from transformers.models.llama.modeling_llama import LlamaRMSNorm
from transformers.models.mistral.modeling_mistral import MistralRMSNorm
from transformers.models.qwen2.modeling_qwen2 import Qwen2RMSNorm

from bb_lightning.engine import host_norm


def _norm(dim: int, dtype: torch.dtype, eps: float = 1e-5) -> LlamaRMSNorm:
    norm = LlamaRMSNorm(dim, eps=eps).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(dim, generator=torch.Generator().manual_seed(dim)) * 2)
    return norm


def _reference(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """The norm in float64, before any rounding to ``x``'s dtype."""
    xd = x.double()
    return weight.double() * xd * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + eps)


def test_the_plain_norms_are_the_llama_family_s_and_not_gemma_s() -> None:
    assert all(map(host_norm.plain_rms_norm, (LlamaRMSNorm, Qwen2RMSNorm, MistralRMSNorm)))
    assert not host_norm.plain_rms_norm(GemmaRMSNorm)  # scales by 1 + weight

    class Scaled(LlamaRMSNorm):  # another forward: the class keeps it
        def forward(self, hidden_states: Tensor) -> Tensor:
            return 2 * super().forward(hidden_states)

    assert not host_norm.plain_rms_norm(Scaled)
    assert not host_norm.plain_rms_norm(nn.LayerNorm) and not host_norm.plain_rms_norm(nn.Module)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_kernel_equals_the_class_forward_to_its_rounding(
    host_kernel: host_norm._Kernel, dtype: torch.dtype, threads: int
) -> None:
    """Rows of an odd width, of magnitudes from 1e-3 to 1e3 (a row's scale must cancel)."""
    norm = _norm(1000, dtype)
    g = torch.Generator().manual_seed(7)
    x = torch.randn(3, 37, 1000, generator=g) * torch.logspace(-3, 3, 37)[None, :, None]
    x = x.to(dtype)
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got = host_kernel(x, norm.weight.detach(), norm.variance_epsilon)
    finally:
        torch.set_num_threads(previous)
    with torch.no_grad():
        theirs = LlamaRMSNorm.forward(norm, x)
    assert got.dtype == dtype and got.shape == x.shape
    ref = _reference(x, norm.weight.detach(), norm.variance_epsilon)
    if dtype == torch.float32:
        torch.testing.assert_close(got.double(), ref, rtol=1e-6, atol=0)
        torch.testing.assert_close(got, theirs, rtol=1e-6, atol=0)
    else:  # two bf16 roundings, as the class makes them: at most 1 in 1000 lands elsewhere
        torch.testing.assert_close(got.double(), ref, rtol=2**-7, atol=0)
        assert (got != theirs).float().mean().item() < 1e-3
        torch.testing.assert_close(got, theirs, rtol=2**-7, atol=0)


def test_installed_it_serves_calls_without_grad_and_leaves_the_rest_to_the_class(
    host_kernel: host_norm._Kernel, count_host_kernel: Callable[[str], list[int]]
) -> None:
    calls = count_host_kernel("__call__")
    model = nn.Sequential(_norm(64, torch.float32), GemmaRMSNorm(64), _norm(64, torch.bfloat16))
    restore = host_norm.install(model)
    assert ["forward" in vars(m) for m in model] == [True, False, True]
    x = torch.randn(5, 64)
    with torch.no_grad():
        torch.testing.assert_close(model[0](x), LlamaRMSNorm.forward(model[0], x), rtol=1e-6,
                                   atol=0)  # fmt: skip
    assert calls == [1]
    # with grad, a strided input, a mismatched dtype: the class forward, bit for bit
    y = x.clone().requires_grad_()
    out = model[0](y)
    out.sum().backward()
    assert y.grad is not None and model[0].weight.grad is not None
    torch.testing.assert_close(out, LlamaRMSNorm.forward(model[0], y), rtol=0, atol=0)
    with torch.no_grad():
        wide = torch.randn(64, 10).t()
        torch.testing.assert_close(model[0](wide), LlamaRMSNorm.forward(model[0], wide),
                                   rtol=0, atol=0)  # fmt: skip
        torch.testing.assert_close(model[2](x), LlamaRMSNorm.forward(model[2], x), rtol=0, atol=0)
        meta = _norm(64, torch.float32).to("meta")  # a weight not paged in: the class's error
        host_norm.install(meta)
        with pytest.raises((RuntimeError, NotImplementedError)):
            meta(x)
    assert calls == [1]
    restore()
    assert not any("forward" in vars(m) for m in model)


def test_bb_native_0_installs_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("BB_NATIVE", "0")
    model = nn.Sequential(_norm(8, torch.float32))
    host_norm.install(model)()
    assert "forward" not in vars(model[0])
    host_norm.install(model)
    assert "forward" not in vars(model[0])


def test_a_vmapped_or_traced_norm_runs_the_class(
    host_kernel: host_norm._Kernel, count_host_kernel: Callable[[str], list[int]]
) -> None:
    calls = count_host_kernel("__call__")
    norm = _norm(16, torch.float32)
    restore = host_norm.install(nn.Sequential(norm))
    x = torch.randn(3, 4, 16)
    with torch.no_grad():
        torch.testing.assert_close(torch.func.vmap(norm)(x), LlamaRMSNorm.forward(norm, x),
                                   rtol=0, atol=0)  # fmt: skip
        traced = torch.jit.trace(norm, (x,), check_trace=False)  # its check runs eagerly
        y = torch.randn(3, 4, 16)
        torch.testing.assert_close(traced(y), LlamaRMSNorm.forward(norm, y), rtol=0, atol=0)
    assert not calls
    restore()
