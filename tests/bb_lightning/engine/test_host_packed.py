"""A block's linear layers on weights laid out once for its row chunks (``engine.host_packed``):
torch's ``F.linear`` bit for bit, each weight laid out once per call, and the class
``forward`` wherever the packed product does not apply or differs."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from bb_lightning.engine import host_linear, host_packed
from bb_lightning.engine.rows import call_in_row_chunks, chunk_count

pytestmark = [
    pytest.mark.usefixtures("one_thread"),
    pytest.mark.skipif(not host_packed.available(), reason="no oneDNN packed linear here"),
]


@pytest.fixture(autouse=True)
def fresh_checks(monkeypatch: pytest.MonkeyPatch) -> dict[tuple[int, int, int, bool], bool]:
    """A process-fresh record of which product shapes the packed product serves."""
    exact: dict[tuple[int, int, int, bool], bool] = {}
    monkeypatch.setattr(host_packed, "_exact", exact)
    return exact


@pytest.fixture
def spied(monkeypatch: pytest.MonkeyPatch) -> dict[str, list[Any]]:
    """Calls of the layout (``pack``: the weight's shape) and the packed product
    (``product``: the input's rows)."""
    seen: dict[str, list[Any]] = {"pack": [], "product": []}
    pack, product = host_packed.pack_weight, host_packed.packed_product

    def counted_pack(weight: Tensor, tokens: int) -> Tensor:
        seen["pack"].append(tuple(weight.shape))
        return pack(weight, tokens)

    def counted_product(x: Tensor, packed: Tensor, bias: Tensor | None) -> Tensor:
        seen["product"].append(x.numel() // x.shape[-1])
        return product(x, packed, bias)

    monkeypatch.setattr(host_packed, "pack_weight", counted_pack)
    monkeypatch.setattr(host_packed, "packed_product", counted_product)
    return seen


class _Block(nn.Module):
    """Two projections with an activation between them, the first with a bias, as a
    transformer block's MLP, called on ``[rows, tokens, width]`` hidden states."""

    def __init__(self, dtype: torch.dtype = torch.bfloat16) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.up = nn.Linear(64, 96, bias=True, dtype=dtype)
        self.down = nn.Linear(96, 64, bias=False, dtype=dtype)
        for p in self.parameters():
            nn.init.normal_(p, std=0.5)  # strong weights: products far from ties

    def forward(self, hidden_states: Tensor) -> Tensor:
        return hidden_states + self.down(F.gelu(self.up(hidden_states)))


def _reference(block: _Block, x: Tensor) -> Tensor:
    up = F.linear(x, block.up.weight, block.up.bias)
    return x + F.linear(F.gelu(up), block.down.weight)


def _run(block: nn.Module, x: Tensor, tokens: int) -> Tensor:
    with host_packed.packed_linears(block, tokens):
        out: Tensor = call_in_row_chunks(block, (x,), {}, tokens)
    return out


def test_row_chunks_on_packed_weights_equal_torch_bit_for_bit(
    spied: dict[str, list[Any]], fresh_checks: dict[tuple[int, int, int, bool], bool]
) -> None:
    block = _Block()
    x = torch.randn(7, 5, 64, dtype=torch.bfloat16)
    with torch.no_grad():
        out = _run(block, x, tokens=10)  # 2 rows a chunk: 4 chunks, the last of 1 row
        want = _reference(block, x)
    assert torch.equal(out, want)
    # each weight laid out once for the call, every chunk's product on it
    assert sorted(spied["pack"]) == [(64, 96), (96, 64)]
    assert spied["product"] == [10, 10, 10, 10, 10, 10, 5, 5]
    # each shape checked against F.linear once, and served
    assert fresh_checks == {
        (10, 64, 96, True): True, (10, 96, 64, False): True,
        (5, 64, 96, True): True, (5, 96, 64, False): True,
    }  # fmt: skip
    # the class forward back; a second call lays the weights out again (they may have moved)
    assert [m for m in block.modules() if "forward" in vars(m)] == []
    with torch.no_grad():
        assert torch.equal(_run(block, x, tokens=10), want)
    assert len(spied["pack"]) == 4


def test_a_shape_whose_packed_product_differs_runs_f_linear(
    monkeypatch: pytest.MonkeyPatch, fresh_checks: dict[tuple[int, int, int, bool], bool]
) -> None:
    product = host_packed.packed_product
    monkeypatch.setattr(host_packed, "packed_product", lambda x, w, b: product(x, w, b) * 1.01)
    block = _Block()
    x = torch.randn(6, 5, 64, dtype=torch.bfloat16)
    with torch.no_grad():
        assert torch.equal(_run(block, x, tokens=10), _reference(block, x))
    assert fresh_checks == {(10, 64, 96, True): False, (10, 96, 64, False): False}


@pytest.mark.parametrize("case", ["fp32", "grad", "hook", "subclass", "native_off"])
def test_calls_it_does_not_serve_run_the_class_forward(
    case: str, spied: dict[str, list[Any]], monkeypatch: pytest.MonkeyPatch
) -> None:
    block = _Block(torch.float32 if case == "fp32" else torch.bfloat16)
    x = torch.randn(4, 5, 64).to(block.up.weight.dtype)
    hooked: list[int] = []
    if case == "hook":
        block.up.register_forward_hook(lambda m, i, o: hooked.append(1))
    if case == "subclass":
        kind = type("MyLinear", (nn.Linear,), {})
        block.down.__class__ = kind
    if case == "native_off":
        monkeypatch.setenv("BB_NATIVE", "0")
    grad: Callable[[], Any] = torch.enable_grad if case == "grad" else torch.no_grad
    with grad():
        out = _run(block, x, tokens=10)
        want = _reference(block, x)
    assert torch.equal(out, want)
    if case == "hook":  # the hooked layer runs the class's; the other one is served
        assert hooked == [1, 1] and spied["pack"] == [(64, 96)]
    elif case == "subclass":
        assert spied["pack"] == [(96, 64)]
    else:
        assert spied == {"pack": [], "product": []}
    if case == "grad":
        assert out.requires_grad


def test_over_host_linear_s_kernel_chunks_of_few_rows_stay_the_kernel_s(
    spied: dict[str, list[Any]], count_host_kernel: Callable[..., list[int]]
) -> None:
    """Layers that host_linear's kernel holds: a chunk of more rows than it serves multiplies
    on the packed weights, a chunk of at most :data:`host_linear.MAX_ROWS` rows runs the
    kernel, and the kernel's ``forward`` comes back after the call."""
    if host_linear.kernel() is None:
        pytest.skip("no compiled bf16 product of few rows on this CPU")
    calls = count_host_kernel("__call__", host_linear._Kernel)
    block = _Block()
    block.up.bias = None  # the kernel serves no bias
    restore = host_linear.install(block)
    x = torch.randn(12, 30, 64, dtype=torch.bfloat16)
    with torch.no_grad():
        out = _run(block, x, tokens=300)  # 10 rows a chunk: 300 and 60 rows
        assert len(calls) == 2
        few = block(x[10:])  # the kernel's
        assert len(calls) == 4
    assert 60 <= host_linear.MAX_ROWS < 300
    assert sorted(spied["pack"]) == [(64, 96), (96, 64)] and spied["product"] == [300, 300]
    assert torch.equal(out[:10], _reference(block, x[:10]))
    assert torch.equal(out[10:], few)
    assert all(host_linear.installed(vars(m)["forward"]) for m in (block.up, block.down))
    restore()
    assert [m for m in block.modules() if "forward" in vars(m)] == []


def test_chunk_count_counts_the_chunks_call_in_row_chunks_cuts() -> None:
    x = torch.zeros(7, 5, 8)
    assert chunk_count((x,), {}, 10) == 4  # 2 rows a chunk
    assert chunk_count((), {"hidden_states": x}, 35) == 1
    assert chunk_count((x,), {}, 3) == 7  # a row is never split
    assert chunk_count((torch.zeros(7, 8),), {}, 3) == 1  # not [rows, tokens, ...]
    assert chunk_count(("text",), {}, 3) == 1
    seen: list[int] = []
    call_in_row_chunks(lambda h: seen.append(h.shape[0]) or h, (x,), {}, 10)
    assert len(seen) == chunk_count((x,), {}, 10)
