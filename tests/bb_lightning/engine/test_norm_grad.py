"""A training step's bf16 RMS norms with their backward through the host kernel
(``train_norm``, ``host_norm``'s ``norm_backward``) against float64 and autograd through the
class's own operations, their forward against the class's bit for bit, the calls they leave
to the class, and the forwards installed and restored.

Bound on the gradients: the norm of each gradient's error against float64 within 1.25 x the
error of autograd's bf16 backward on the same inputs (measured: 0.7 x for the input's, 0.65-0.95
x for the weight's). A kernel that drops the mean's term of the input's gradient, the weight
from it, or the rows of one thread from the weight's lands far off.

Skipped where no C compiler builds the kernel."""

from __future__ import annotations

import copy
import os
import shutil
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch import Tensor, nn
from transformers import AutoConfig, AutoModelForCausalLM
from transformers.models.gemma.modeling_gemma import GemmaRMSNorm
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from bb_lightning.engine import host_norm, train_attention, train_kernels, train_norm
from tests.bb_lightning.engine.conftest import count_function_calls, thread_count

RATIO = 1.25
"""Error norm against float64 over autograd's own error norm."""
CPU = torch.device("cpu")


@pytest.fixture(autouse=True)
def built() -> None:
    if shutil.which(os.environ.get("CC", "cc")) is None:
        pytest.skip("no C compiler on PATH")
    if host_norm.kernel() is None:
        pytest.skip("the host kernels did not build (BB_NATIVE=0?): autograd runs the backward")


@pytest.fixture
def served(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The calls whose backward the kernel computes (one entry each, at the backward)."""
    return count_function_calls(monkeypatch, train_norm, "_NormBackward", "backward")


@pytest.fixture(params=[1, 2], ids=["1-thread", "2-threads"])
def threads(request: pytest.FixtureRequest) -> Iterator[int]:
    kern = host_norm.kernel()
    yield from thread_count(request, kern is not None and kern.team)


def _norm(dim: int, seed: int = 0) -> LlamaRMSNorm:
    """A norm with a strong weight (1 + 0.3 N(0, 1)), in bf16."""
    norm = LlamaRMSNorm(dim, eps=1e-6)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.3 * torch.randn(dim, generator=torch.Generator().manual_seed(seed)))
    return norm.to(torch.bfloat16)


def _error(got: Tensor, exact: Tensor) -> float:
    return float((got.double() - exact).norm() / exact.norm())


def _grads(norm: nn.Module, x: Tensor, grad: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """(output, the input's gradient, the weight's) of ``norm`` at ``x``."""
    norm.zero_grad(set_to_none=True)
    given = x.detach().clone().requires_grad_()
    out = norm(given)
    out.backward(grad.to(out.dtype))
    assert given.grad is not None and norm.weight.grad is not None
    return out, given.grad, norm.weight.grad


@pytest.mark.parametrize(
    "shape",
    [(7, 64), (3, 5, 100), (1, 4096), (2, 512, 1024), (2048, 1024)],
    ids=["7x64", "3x5x100", "1x4096", "2x512x1024", "2048x1024"],
)
def test_gradients_are_as_close_to_float64_as_autograds(
    shape: tuple[int, ...], threads: int, served: list[int]
) -> None:
    g = torch.Generator().manual_seed(1)
    x = (3 * torch.randn(*shape, generator=g)).to(torch.bfloat16)
    grad = torch.randn(*shape, generator=g).to(torch.bfloat16)
    norm = _norm(shape[-1])
    reference = _grads(norm, x, grad)
    exact = _grads(copy.deepcopy(norm).double(), x.double(), grad.double())
    restore = train_norm.install(CPU, norm)
    try:
        ours = _grads(norm, x, grad)
    finally:
        restore()
    assert served == [1]
    assert torch.equal(ours[0], reference[0])  # the class's own forward, bit for bit
    for got, theirs, truth in zip(ours[1:], reference[1:], exact[1:], strict=True):
        assert got.dtype == torch.bfloat16 and got.shape == truth.shape
        assert _error(got, truth) <= RATIO * _error(theirs, truth)


@pytest.mark.parametrize(
    "case",
    ["fp32", "no grad", "strided input", "fp32 weight", "meta", "no kernel", "traced"],
)
def test_calls_it_does_not_serve_run_the_class(
    case: str, served: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    g = torch.Generator().manual_seed(2)
    x = (3 * torch.randn(4, 64, generator=g)).to(torch.bfloat16)
    grad = torch.randn(4, 64, generator=g).to(torch.bfloat16)
    norm = _norm(64)
    if case == "fp32":
        norm, x, grad = norm.float(), x.float(), grad.float()
    elif case == "strided input":  # dense, so that a clone keeps its strides
        x = x.t().contiguous().t()
    elif case == "fp32 weight":
        norm = norm.float()
    elif case == "meta":
        norm, x, grad = norm.to("meta"), x.to("meta"), grad.to("meta")
    elif case == "no kernel":
        monkeypatch.setattr(host_norm, "kernel", lambda: None)
    twin = copy.deepcopy(norm)
    restore = train_norm.install(CPU, norm)
    try:
        assert ("forward" in vars(norm)) == (case != "no kernel")  # none installed without it
        if case == "no grad":
            with torch.no_grad():
                assert torch.equal(norm(x), twin(x))
        elif case == "traced":
            given = x.clone().requires_grad_()
            traced = torch.jit.trace(norm, (given,), check_trace=False)
            assert torch.equal(traced(given), twin(given))
        elif case == "meta":
            out, dx, dw = _grads(norm, x, grad)
            assert out.device.type == dx.device.type == dw.device.type == "meta"
        else:
            for got, want in zip(_grads(norm, x, grad), _grads(twin, x, grad), strict=True):
                assert torch.equal(got, want)  # the class's operations, recorded by autograd
    finally:
        restore()
    assert served == []


def test_install_swaps_only_plain_norms_on_the_cpu_and_restores_them() -> None:
    model = nn.Sequential(_norm(32), GemmaRMSNorm(32), nn.Linear(32, 32))
    assert train_norm.install(torch.device("meta"), model)() is None  # another device: nothing
    assert not any("forward" in vars(m) for m in model)
    restore = train_norm.install(CPU, model)
    assert "forward" in vars(model[0])  # Llama's
    assert "forward" not in vars(model[1])  # Gemma's 1 + weight: its own forward
    assert "forward" not in vars(model[2])
    restore()
    assert not any("forward" in vars(m) for m in model)


def test_the_fits_kernels_install_together_and_restore_together() -> None:
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    model = nn.Sequential(_norm(32))
    restore = train_kernels.install(CPU, model)
    try:
        assert "forward" in vars(model[0])
        compiled = train_attention.backward_kind(CPU, torch.bfloat16, 64, 128) != "sdpa"
        assert (ALL_ATTENTION_FUNCTIONS["sdpa"] is not sdpa_attention_forward) == compiled
    finally:
        restore()
    assert "forward" not in vars(model[0])
    assert ALL_ATTENTION_FUNCTIONS["sdpa"] is sdpa_attention_forward
    assert train_norm.backward_kind(CPU, torch.bfloat16) == "kernel"
    assert train_norm.backward_kind(CPU, torch.float32) == "autograd"


def test_a_second_derivative_through_it_is_refused() -> None:
    norm = _norm(64)
    x = torch.randn(3, 64).to(torch.bfloat16).requires_grad_()
    restore = train_norm.install(CPU, norm)
    try:
        (dx,) = torch.autograd.grad(norm(x).float().square().sum(), x, create_graph=True)
        with pytest.raises(RuntimeError, match="differentiate"):
            dx.float().sum().backward()
    finally:
        restore()


_FAMILIES: dict[str, dict[str, Any]] = {
    "llama": {"num_key_value_heads": 2},
    "mistral": {"num_key_value_heads": 2},
    "qwen2": {"num_key_value_heads": 2},
    "qwen3": {"num_key_value_heads": 2, "head_dim": 32},  # its queries' and keys' norms too
    "phi3": {"num_key_value_heads": 2, "pad_token_id": 0},
}


@pytest.mark.parametrize("family", sorted(_FAMILIES))
def test_families_train_as_close_to_float64_as_with_autograd(
    family: str, served: list[int]
) -> None:
    """A bf16 forward + backward of each family: the loss bit for bit the class's, and each
    parameter's gradient as close to the float64 model's as autograd's."""
    config = AutoConfig.for_model(
        family, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=4, vocab_size=256, max_position_embeddings=128,
        **_FAMILIES[family],
    )  # fmt: skip
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).to(torch.bfloat16).train()
    with torch.no_grad():  # strong norm weights: a dropped weight term shows
        for m in model.modules():
            if host_norm.plain_rms_norm(type(m)):
                m.weight.copy_(1 + 0.3 * torch.randn(m.weight.shape))
    twin, exact = copy.deepcopy(model), copy.deepcopy(model).double()
    tokens = torch.randint(0, 256, (2, 48), generator=torch.Generator().manual_seed(0))
    exact(input_ids=tokens, labels=tokens).loss.backward()
    theirs = twin(input_ids=tokens, labels=tokens).loss
    theirs.backward()
    restore = train_norm.install(CPU, model)
    try:
        ours = model(input_ids=tokens, labels=tokens).loss
        ours.backward()
    finally:
        restore()
    norms = sum(host_norm.plain_rms_norm(type(m)) for m in model.modules())
    assert norms >= 2 * 2 + 1 and len(served) == norms  # every norm of every block
    assert torch.equal(ours, theirs)
    named = dict(twin.named_parameters())
    for name, p in exact.named_parameters():
        assert p.grad is not None
        got, want = dict(model.named_parameters())[name].grad, named[name].grad
        assert got is not None and want is not None
        assert _error(got, p.grad) <= RATIO * _error(want, p.grad) + 1e-6, name
