"""A training step's bf16 gated-MLP activation with its backward through the host kernel
(``train_mlp``, ``host_norm``'s ``silu_mul`` and ``silu_mul_backward``) against float64 and
autograd through the class's own operations: the output and the up projection's gradient
bit for bit autograd's, the gate projection's as close to float64 as autograd's; the calls
it leaves to the class, and the forwards installed and restored.

Bound on the gate's gradient: the norm of its error against float64 within
:data:`RATIO` x the error of autograd's bf16 backward on the same inputs (measured 0.7 x: one
rounding where autograd rounds twice). A kernel that takes the SiLU for its derivative, drops
the up projection from the gate's gradient or a thread's share of the elements lands far off.

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
from transformers.models.llama.modeling_llama import LlamaConfig, LlamaMLP

from bb_lightning.engine import host_mlp, host_norm, train_kernels, train_mlp
from tests.bb_lightning.engine.conftest import count_function_calls, thread_count

RATIO = 1.0
"""Error norm of the gate's gradient against float64 over autograd's own error norm."""
CPU = torch.device("cpu")


@pytest.fixture(autouse=True)
def built() -> None:
    if shutil.which(os.environ.get("CC", "cc")) is None:
        pytest.skip("no C compiler on PATH")
    kern = host_norm.kernel()
    if kern is None or not kern.silu_mul_exact:
        pytest.skip("the host kernels did not build (BB_NATIVE=0?): autograd runs the backward")


@pytest.fixture
def served(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The calls whose backward the kernel computes (one entry each, at the backward)."""
    return count_function_calls(monkeypatch, train_mlp, "_SiluMul", "backward")


@pytest.fixture(params=[1, 2], ids=["1-thread", "2-threads"])
def threads(request: pytest.FixtureRequest) -> Iterator[int]:
    kern = host_norm.kernel()
    yield from thread_count(request, kern is not None and kern.team)


def _mlp(hidden: int, inner: int, act: str = "silu") -> LlamaMLP:
    config = LlamaConfig(hidden_size=hidden, intermediate_size=inner, hidden_act=act)
    torch.manual_seed(0)
    return LlamaMLP(config).to(torch.bfloat16)


def _error(got: Tensor, exact: Tensor) -> float:
    return float((got.double() - exact).norm() / exact.norm())


def _activation(fn: Any, gate: Tensor, up: Tensor, grad: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """(output, the gate's gradient, the up projection's) of ``fn(gate, up)``."""
    g, u = gate.detach().clone().requires_grad_(), up.detach().clone().requires_grad_()
    out = fn(g, u)
    out.backward(grad.to(out.dtype))
    assert g.grad is not None and u.grad is not None
    return out, g.grad, u.grad


@pytest.mark.parametrize(
    "shape",
    [(7, 64), (3, 5, 100), (1, 4099), (2, 512, 704), (2048, 2816)],
    ids=["7x64", "3x5x100", "1x4099", "2x512x704", "2048x2816"],
)
def test_gradients_are_as_close_to_float64_as_autograds(
    shape: tuple[int, ...], threads: int
) -> None:
    g = torch.Generator().manual_seed(1)
    gate = (3 * torch.randn(*shape, generator=g)).to(torch.bfloat16)
    up = torch.randn(*shape, generator=g).to(torch.bfloat16)
    grad = torch.randn(*shape, generator=g).to(torch.bfloat16)

    def theirs(a: Tensor, b: Tensor) -> Tensor:
        return torch.nn.functional.silu(a) * b

    reference = _activation(theirs, gate, up, grad)
    exact = _activation(theirs, gate.double(), up.double(), grad.double())
    ours = _activation(train_mlp._SiluMul.apply, gate, up, grad)
    assert torch.equal(ours[0], reference[0])  # torch's forward, bit for bit
    assert torch.equal(ours[2], reference[2])  # the up projection's gradient too
    assert ours[1].dtype == torch.bfloat16 and ours[1].shape == gate.shape
    assert _error(ours[1], exact[1]) <= RATIO * _error(reference[1], exact[1])


def test_the_gates_gradient_at_the_edges_of_bf16() -> None:
    # infinities, zeros of both signs, the largest finite values, a NaN: as float64 gives
    # them where float64 is finite (and NaN where autograd's is)
    edges = [float("inf"), float("-inf"), 0.0, -0.0, 3.3e38, -3.3e38, 1e-40, -88.0, 20.0]
    gate = torch.tensor([*edges, float("nan")]).to(torch.bfloat16)
    up = torch.full_like(gate, 0.5)
    grad = torch.ones_like(gate)
    ours = _activation(train_mlp._SiluMul.apply, gate, up, grad)
    v = gate.double()
    s = torch.sigmoid(v)
    want = (0.5 * s * (1 + v * (1 - s))).to(torch.bfloat16)
    want[0], want[1] = 0.5, 0.0  # the limits at +-inf
    assert torch.equal(ours[1][:-1], want[:-1])
    assert ours[1][-1].isnan()
    theirs = _activation(lambda a, b: torch.nn.functional.silu(a) * b, gate, up, grad)
    assert torch.equal(ours[2].isnan(), theirs[2].isnan())
    assert torch.equal(ours[2].nan_to_num(7.0), theirs[2].nan_to_num(7.0))


@pytest.mark.parametrize("case", ["fp32", "no grad", "strided", "gelu", "no kernel", "traced"])
def test_calls_it_does_not_serve_run_the_class(
    case: str, served: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    mlp = _mlp(32, 48, act="gelu" if case == "gelu" else "silu")
    x = torch.randn(4, 32, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    if case == "fp32":
        mlp, x = mlp.float(), x.float()
    elif case == "strided":  # the projections' outputs strided: a gate that is a view
        mlp.gate_proj.register_forward_hook(lambda _m, _a, out: out.t().contiguous().t())
    elif case == "no kernel":
        monkeypatch.setattr(host_norm, "kernel", lambda: None)
    twin = copy.deepcopy(mlp)
    restore = train_mlp.install(CPU, mlp)
    try:
        assert ("forward" in vars(mlp)) == (case != "no kernel")  # none installed without it
        if case == "no grad":
            with torch.no_grad():
                assert torch.equal(mlp(x), twin(x))
        elif case == "traced":
            given = x.clone().requires_grad_()
            traced = torch.jit.trace(mlp, (given,), check_trace=False)
            assert torch.equal(traced(given), twin(given))
        else:
            given, again = x.clone().requires_grad_(), x.clone().requires_grad_()
            mlp(given).float().square().sum().backward()
            twin(again).float().square().sum().backward()
            assert given.grad is not None and again.grad is not None
            assert torch.equal(given.grad, again.grad)  # the class's operations, by autograd
            for p, q in zip(mlp.parameters(), twin.parameters(), strict=True):
                assert p.grad is not None and q.grad is not None and torch.equal(p.grad, q.grad)
    finally:
        restore()
    assert served == []


def test_install_swaps_only_plain_mlps_on_the_cpu_and_restores_them() -> None:
    model = nn.Sequential(_mlp(32, 48), nn.Linear(32, 32))
    assert train_mlp.install(torch.device("meta"), model)() is None  # another device: nothing
    assert not any("forward" in vars(m) for m in model)
    restore = train_mlp.install(CPU, model)
    assert "forward" in vars(model[0]) and "forward" not in vars(model[1])
    restore()
    assert not any("forward" in vars(m) for m in model)
    assert train_mlp.backward_kind(CPU, torch.bfloat16) == "kernel"
    assert train_mlp.backward_kind(CPU, torch.float32) == "autograd"
    assert train_kernels.backward_kinds(CPU, torch.bfloat16) == "kernel/kernel/kernel"
    restore = train_kernels.install(CPU, model)  # a fit's kernels install it too
    try:
        assert "forward" in vars(model[0])
    finally:
        restore()
    assert "forward" not in vars(model[0])


def test_a_second_derivative_through_it_is_refused() -> None:
    mlp = _mlp(32, 48)
    x = torch.randn(3, 32).to(torch.bfloat16).requires_grad_()
    restore = train_mlp.install(CPU, mlp)
    try:
        (dx,) = torch.autograd.grad(mlp(x).float().square().sum(), x, create_graph=True)
        with pytest.raises(RuntimeError, match="differentiate"):
            dx.float().sum().backward()
    finally:
        restore()


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2", "qwen3", "gemma"])
def test_families_train_as_close_to_float64_as_with_autograd(
    family: str, served: list[int]
) -> None:
    """A bf16 forward + backward of each family: the loss bit for bit the class's, and each
    parameter's gradient as close to the float64 model's as autograd's (within its noise:
    the gate's gradient changes what the layers below see). Gemma's MLP runs a tanh GELU:
    the class's, none served."""
    config = AutoConfig.for_model(
        family, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, vocab_size=256,
        max_position_embeddings=128,
    )  # fmt: skip
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).to(torch.bfloat16).train()
    twin, exact = copy.deepcopy(model), copy.deepcopy(model).double()
    tokens = torch.randint(0, 256, (2, 48), generator=torch.Generator().manual_seed(0))
    exact(input_ids=tokens, labels=tokens).loss.backward()
    theirs = twin(input_ids=tokens, labels=tokens).loss
    theirs.backward()
    restore = train_mlp.install(CPU, model)
    try:
        ours = model(input_ids=tokens, labels=tokens).loss
        ours.backward()
    finally:
        restore()
    mlps = sum(host_mlp.plain_gated_mlp(type(m)) for m in model.modules())
    assert mlps == 2
    assert len(served) == (0 if family == "gemma" else 2)  # every block's
    assert torch.equal(ours, theirs)
    named = dict(twin.named_parameters())
    for name, p in exact.named_parameters():
        assert p.grad is not None
        got, want = dict(model.named_parameters())[name].grad, named[name].grad
        assert got is not None and want is not None
        assert _error(got, p.grad) <= 1.25 * _error(want, p.grad) + 1e-6, name
