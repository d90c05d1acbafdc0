"""The compiled gated-MLP activation (``host_mlp``: ``silu(gate) * up`` in one pass) against
torch's two operations bit for bit and a float64 reference, which MLP classes it serves, and
the calls it leaves to them."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from transformers import LlamaConfig, Phi3Config
from transformers.models.gemma.modeling_gemma import GemmaMLP
from transformers.models.llama.modeling_llama import LlamaMLP
from transformers.models.mistral.modeling_mistral import MistralMLP
from transformers.models.phi3.modeling_phi3 import Phi3MLP
from transformers.models.qwen2.modeling_qwen2 import Qwen2MLP

from bb_lightning.engine import host_mlp, host_norm


def _same(got: Tensor, want: Tensor) -> None:
    """Bit for bit, a NaN matching a NaN."""
    assert got.dtype == want.dtype and got.shape == want.shape
    assert torch.equal(got.isnan(), want.isnan())
    assert torch.equal(got.nan_to_num(0.0), want.nan_to_num(0.0))


def _mlp(act: str = "silu", dtype: torch.dtype = torch.bfloat16) -> LlamaMLP:
    config = LlamaConfig(hidden_size=64, intermediate_size=176, hidden_act=act)
    torch.manual_seed(0)
    return LlamaMLP(config).to(dtype)


def test_the_plain_mlps_are_the_llama_family_s() -> None:
    assert all(map(host_mlp.plain_gated_mlp, (LlamaMLP, Qwen2MLP, MistralMLP, GemmaMLP)))
    assert not host_mlp.plain_gated_mlp(Phi3MLP)  # one fused gate_up_proj, chunked

    class Scaled(LlamaMLP):
        def forward(self, x: Tensor) -> Tensor:
            return 2 * super().forward(x)

    assert not host_mlp.plain_gated_mlp(Scaled) and not host_mlp.plain_gated_mlp(nn.Linear)


@pytest.mark.parametrize("threads", [1, 2])
def test_the_kernel_equals_torch_s_silu_and_product_bit_for_bit(
    host_kernel: host_norm._Kernel, threads: int
) -> None:
    """Every bf16 gate (zeros, subnormals, infinities, NaNs among them), then activations of
    a width that leaves a tail of fewer than 16 elements."""
    g = torch.Generator().manual_seed(11)
    every = torch.arange(-(1 << 15), 1 << 15, dtype=torch.int16).view(torch.bfloat16)
    up = (torch.randn(every.shape, generator=g) * 3).to(torch.bfloat16)
    gate2 = (torch.randn(5, 7, 179, generator=g) * 4).to(torch.bfloat16)
    up2 = (torch.randn(5, 7, 179, generator=g) * 2).to(torch.bfloat16)
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got, got2 = host_kernel.silu_mul(every, up), host_kernel.silu_mul(gate2, up2)
    finally:
        torch.set_num_threads(previous)
    _same(got, F.silu(every) * up)
    _same(got2, F.silu(gate2) * up2)
    # against float64: two bf16 roundings (the SiLU, the product), each within 2^-8
    x, u = gate2.double(), up2.double()
    torch.testing.assert_close(got2.double(), x * torch.sigmoid(x) * u, rtol=2**-7, atol=1e-30)


def test_installed_it_serves_bf16_calls_without_grad_and_leaves_the_rest_to_the_class(
    host_kernel: host_norm._Kernel, count_host_kernel: Callable[[str], list[int]]
) -> None:
    calls = count_host_kernel("silu_mul")
    bf16, fp32, gelu = _mlp(), _mlp(dtype=torch.float32), _mlp("gelu_pytorch_tanh")
    model = nn.ModuleList([bf16, fp32, gelu])
    restore = host_mlp.install(model)
    assert all("forward" in vars(m) for m in model)
    x = torch.randn(3, 9, 64, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        _same(bf16(x.bfloat16()), LlamaMLP.forward(bf16, x.bfloat16()))
        assert len(calls) == 1
        _same(fp32(x), LlamaMLP.forward(fp32, x))  # another dtype
        _same(gelu(x.bfloat16()), LlamaMLP.forward(gelu, x.bfloat16()))  # not a SiLU
        seen: list[int] = []
        hook = bf16.act_fn.register_forward_hook(lambda *a: seen.append(1))
        _same(bf16(x.bfloat16()), LlamaMLP.forward(bf16, x.bfloat16()))  # the hook runs
        hook.remove()
        assert len(seen) == 2 and len(calls) == 1
    # with grad: the class's operations, their backward intact
    xg = x.bfloat16().requires_grad_()
    bf16(xg).float().sum().backward()
    assert xg.grad is not None and len(calls) == 1
    with torch.no_grad():
        bf16(x.bfloat16())
    assert len(calls) == 2
    restore()
    assert not any("forward" in vars(m) for m in model)


def test_a_fused_gate_and_up_keeps_its_own_forward(host_kernel: host_norm._Kernel) -> None:
    phi = Phi3MLP(Phi3Config(hidden_size=32, intermediate_size=64)).to(torch.bfloat16)
    assert host_mlp.install(phi) is not None and "forward" not in vars(phi)
