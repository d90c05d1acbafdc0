"""A training step's bf16 attention forward and backward on the CPU's matrix tiles or vectors
(``train_attention``, ``host_linear``'s ``attention_forward`` and ``attention_backward``)
against float64 and torch's own fused attention, the calls it leaves to ``sdpa``, and its
mapping installed and restored.

Bound on the gradients: the norm of each gradient's error against float64 within 1.25 x the
error of torch's own bf16 backward on the same inputs (measured: the same for the queries,
0.5-0.8 x for the keys and values). A kernel that drops a term of the softmax's gradient
(the row sums of dO o), the causal cut, the scale, a query head of a group or the last
block of keys lands at least 20 x off.

Bound on the output and the loss: as close to float64 as ``sdpa``'s within the same ratio (a
forward without the scale, or that attends past the causal cut, lands far off).

Skipped where the CPU has neither bf16 matrix tiles (granted) nor AVX-512's bf16 products."""

from __future__ import annotations

import copy
import os
import shutil
from collections.abc import Iterator
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from transformers import AutoConfig, AutoModelForCausalLM
from transformers.integrations.sdpa_attention import repeat_kv, sdpa_attention_forward
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from bb_lightning.engine import host_linear, train_attention
from bb_lightning.engine.attention import decode_attention_for
from bb_lightning.engine.train_attention import training_attention
from tests.bb_lightning.engine.conftest import count_function_calls, thread_count

RATIO = 1.25
"""Error norm against float64 over torch's own error norm: measured 1.0 (dq), 0.5-0.8 (dk, dv)."""
MODEL_RATIO = 2.0
"""The same for each parameter of a whole model, whose gradients also carry the forward's
roundings (which differ from ``sdpa``'s in the last bits): measured up to 1.6 (OPT's, whose
bf16 gradients are 3-4 % off float64's); the mean over the parameters is held to
:data:`RATIO`."""


@pytest.fixture(autouse=True)
def tiles() -> None:
    if shutil.which(os.environ.get("CC", "cc")) is None:
        pytest.skip("no C compiler on PATH")
    if host_linear.attention_kernel() is None:
        pytest.skip(
            "neither bf16 matrix tiles (granted) nor AVX-512's bf16 products on this "
            "CPU: sdpa runs the backward"
        )


@pytest.fixture
def served(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The calls whose backward the tiles will compute (one entry each, at the forward)."""
    return count_function_calls(monkeypatch, train_attention, "_KernelAttention", "forward")


@pytest.fixture(params=[1, 2], ids=["1-thread", "2-threads"])
def threads(request: pytest.FixtureRequest) -> Iterator[int]:
    kern = host_linear.attention_kernel()
    yield from thread_count(request, kern is not None and kern.team)


class _Attention(nn.Module):
    """What ``sdpa_attention_forward`` reads of an attention module."""

    def __init__(self, groups: int, causal: bool = True) -> None:
        super().__init__()
        self.is_causal, self.num_key_value_groups = causal, groups


def _inputs(
    batch: int, heads: int, kv_heads: int, length: int, dim: int, seed: int
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Queries, keys and values as a model makes them (``[batch, len, heads, dim]``
    transposed, leaves that require grad) and an output gradient of the output's layout."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, length, heads, dim, generator=g).mul(2).bfloat16()
    k = torch.randn(batch, length, kv_heads, dim, generator=g).mul(2).bfloat16()
    v = torch.randn(batch, length, kv_heads, dim, generator=g).bfloat16()
    grad = torch.randn(batch, length, heads, dim, generator=g).bfloat16()
    q, k, v = (t.requires_grad_().transpose(1, 2) for t in (q, k, v))
    return q, k, v, grad


def _grads(out: Tensor, grad: Tensor, leaves: tuple[Tensor, ...]) -> list[Tensor]:
    return list(torch.autograd.grad(out, leaves, grad))


def _float64(q: Tensor, k: Tensor, v: Tensor, grad: Tensor, causal: bool) -> list[Tensor]:
    leaves = tuple(t.detach().double().requires_grad_() for t in (q, k, v))
    groups = q.shape[1] // k.shape[1]
    kk, vv = repeat_kv(leaves[1], groups), repeat_kv(leaves[2], groups)
    out = F.scaled_dot_product_attention(leaves[0], kk, vv, is_causal=causal)
    return _grads(out.transpose(1, 2), grad.double(), leaves)


def _error(got: Tensor, want: Tensor) -> float:
    """The error's norm relative to ``want``'s; absolute where ``want`` is zero (a query that
    attends one key has zero score gradients)."""
    size = want.norm()
    return float((got.double() - want).norm() / (size if size > 0 else 1.0))


@pytest.mark.parametrize(
    ("batch", "heads", "kv_heads", "length", "dim", "causal"),
    [
        (1, 2, 2, 64, 64, True),
        (2, 4, 2, 100, 64, True),  # GQA, a length off the blocks of 32
        (1, 4, 1, 37, 32, True),
        (2, 2, 2, 96, 128, False),
        (1, 2, 1, 70, 64, False),  # keys past the length masked without the causal cut
        (1, 2, 2, 64, 256, True),
        (1, 2, 2, 1, 64, False),  # one position (sdpa takes it in the engine)
        (3, 16, 16, 512, 64, True),  # a training step's shape
    ],
)
def test_gradients_are_as_close_to_float64_as_torchs(
    threads: int, batch: int, heads: int, kv_heads: int, length: int, dim: int, causal: bool
) -> None:
    q, k, v, grad = _inputs(batch, heads, kv_heads, length, dim, seed=length + dim)
    module = _Attention(heads // kv_heads, causal)
    want = _float64(q, k, v, grad, causal)
    leaves = (q, k, v)
    theirs = _grads(sdpa_attention_forward(module, q, k, v, None)[0], grad, leaves)
    ours_out = _tiles_call(module, q, k, v, causal)
    ours = _grads(ours_out, grad, leaves)
    for name, o, t, w in zip("qkv", ours, theirs, want, strict=True):
        assert o.dtype == torch.bfloat16 and o.shape == t.shape
        assert _error(o, w) <= RATIO * _error(t, w) + 1e-6, (name, _error(o, w), _error(t, w))


def _tiles_call(module: nn.Module, q: Tensor, k: Tensor, v: Tensor, causal: bool) -> Tensor:
    """The output of ``q, k, v`` (``[batch, len, heads, dim]``) through the compiled attention
    directly (the attention function itself declines one position)."""
    return train_attention._KernelAttention.apply(q, k, v, causal, q.shape[-1] ** -0.5)


def test_a_call_is_served_as_close_to_float64_as_sdpa(served: list[int]) -> None:
    q, k, v, grad = _inputs(2, 8, 2, 77, 64, seed=3)
    module = _Attention(4)
    ours, weights = training_attention(module, q, k, v, None, scaling=0.11)
    theirs, _ = sdpa_attention_forward(module, q, k, v, None, scaling=0.11)
    assert len(served) == 1 and weights is None
    assert ours.shape == theirs.shape and ours.is_contiguous() and ours.dtype == torch.bfloat16
    groups = q.shape[1] // k.shape[1]
    exact = F.scaled_dot_product_attention(
        q.double(), repeat_kv(k.double(), groups), repeat_kv(v.double(), groups),
        is_causal=True, scale=0.11,
    ).transpose(1, 2)  # fmt: skip
    assert _error(ours, exact) <= RATIO * _error(theirs, exact)
    assert (ours != theirs).float().mean() < 0.05  # the rest one rounding of a sum apart
    want = _float64_scaled(q, k, v, grad, 0.11)
    theirs_g = _grads(theirs, grad, (q, k, v))
    for o, t, w in zip(_grads(ours, grad, (q, k, v)), theirs_g, want, strict=True):
        assert _error(o, w) <= RATIO * _error(t, w) + 1e-6


def _float64_scaled(q: Tensor, k: Tensor, v: Tensor, grad: Tensor, scale: float) -> list[Tensor]:
    leaves = tuple(t.detach().double().requires_grad_() for t in (q, k, v))
    groups = q.shape[1] // k.shape[1]
    out = F.scaled_dot_product_attention(
        leaves[0], repeat_kv(leaves[1], groups), repeat_kv(leaves[2], groups),
        is_causal=True, scale=scale,
    )  # fmt: skip
    return _grads(out.transpose(1, 2), grad.double(), leaves)


@pytest.mark.parametrize(
    "case",
    ["mask", "dropout", "fp32", "no-grad", "dim-48", "too-long", "bias", "meta", "groups",
     "longer-keys", "one-position", "attentions"],
)  # fmt: skip
def test_calls_it_does_not_serve_run_sdpa(
    case: str, monkeypatch: pytest.MonkeyPatch, served: list[int]
) -> None:
    dim = 48 if case == "dim-48" else 64
    q, k, v, _ = _inputs(1, 4, 2, 1 if case == "one-position" else 40, dim, seed=5)
    if case == "longer-keys":  # a cache's keys before the queries: sdpa cuts them if causal
        k2, v2, _, _ = _inputs(1, 2, 2, 52, dim, seed=6)
        k, v = k2, v2
    module = _Attention(1 if case == "groups" else 2)
    kwargs: dict[str, object] = {}
    mask = None
    if case == "attentions":
        kwargs["output_attentions"] = True
    if case == "mask":
        mask = torch.ones(40, 40, dtype=torch.bool).tril()[None, None]
    if case == "dropout":
        kwargs["dropout"] = 0.1
    if case == "fp32":
        q, k, v = (t.detach().float().requires_grad_() for t in (q, k, v))
    if case == "too-long":
        monkeypatch.setattr(train_attention, "MAX_LEN", 39)
    if case == "bias":
        kwargs["position_bias"] = torch.zeros(1, 4, 40, 40, dtype=torch.bfloat16)
    if case == "meta":
        q, k, v = (t.detach().to("meta").requires_grad_() for t in (q, k, v))
    if case == "groups":  # a module whose groups do not say so: sdpa's error, not ours
        with pytest.raises(RuntimeError, match=r"size of tensor a .* must match"):
            training_attention(module, q, k, v, None)
        return
    with torch.set_grad_enabled(case != "no-grad"):
        torch.manual_seed(0)
        ours, _ = training_attention(module, q, k, v, mask, **kwargs)  # type: ignore[arg-type]
        torch.manual_seed(0)
        theirs, _ = sdpa_attention_forward(module, q, k, v, mask, **kwargs)  # type: ignore[arg-type]
    assert not served
    if case != "meta":
        assert torch.equal(ours, theirs)


def test_softcap_is_sdpas_error() -> None:
    q, k, v, _ = _inputs(1, 2, 2, 40, 64, seed=8)
    with pytest.raises(ValueError, match="does not support `softcap`"):
        training_attention(_Attention(1), q, k, v, None, softcap=30.0)


def test_install_maps_sdpa_for_the_cpu_and_restores_it() -> None:
    assert ALL_ATTENTION_FUNCTIONS["sdpa"] is sdpa_attention_forward
    restore = train_attention.install(torch.device("meta"))
    assert ALL_ATTENTION_FUNCTIONS["sdpa"] is sdpa_attention_forward
    restore()
    restore = train_attention.install(torch.device("cpu"))
    try:
        assert ALL_ATTENTION_FUNCTIONS["sdpa"] is training_attention
    finally:
        restore()
    assert ALL_ATTENTION_FUNCTIONS["sdpa"] is sdpa_attention_forward
    restore()  # twice: nothing more
    assert ALL_ATTENTION_FUNCTIONS["sdpa"] is sdpa_attention_forward


def test_a_second_derivative_through_it_is_refused() -> None:
    q, k, v, grad = _inputs(1, 2, 2, 40, 32, seed=7)
    out, _ = training_attention(_Attention(1), q, k, v, None)
    (first,) = torch.autograd.grad(out, (q,), grad, create_graph=True)
    with pytest.raises(RuntimeError, match="attention backward has no derivative"):
        first.float().sum().backward()


def test_install_leaves_a_mapping_of_someone_elses_alone() -> None:
    """Over a user's own ``sdpa``, or :func:`decode_attention_for`'s, or its own: nothing."""

    def users(*args: object, **kwargs: object) -> object:
        return sdpa_attention_forward(*args, **kwargs)  # type: ignore[arg-type]

    ALL_ATTENTION_FUNCTIONS["sdpa"] = users
    try:
        restore = train_attention.install(torch.device("cpu"))
        assert ALL_ATTENTION_FUNCTIONS["sdpa"] is users
        restore()
        assert ALL_ATTENTION_FUNCTIONS["sdpa"] is users
    finally:
        del ALL_ATTENTION_FUNCTIONS["sdpa"]
    model = nn.Linear(2, 2)
    model.config = SimpleNamespace(_attn_implementation="sdpa")  # type: ignore[assignment]
    with decode_attention_for(model) as on:
        assert on
        decode = ALL_ATTENTION_FUNCTIONS["sdpa"]
        train_attention.install(torch.device("cpu"))()
        assert ALL_ATTENTION_FUNCTIONS["sdpa"] is decode
    outer = train_attention.install(torch.device("cpu"))
    inner = train_attention.install(torch.device("cpu"))  # the probe inside a fit's setup
    inner()
    assert ALL_ATTENTION_FUNCTIONS["sdpa"] is training_attention
    with decode_attention_for(model):
        assert ALL_ATTENTION_FUNCTIONS["sdpa"] is not training_attention
    assert ALL_ATTENTION_FUNCTIONS["sdpa"] is training_attention
    outer()
    assert ALL_ATTENTION_FUNCTIONS["sdpa"] is sdpa_attention_forward


_FAMILIES = {
    "llama": {"num_key_value_heads": 2},
    "qwen2": {"num_key_value_heads": 2},
    "qwen3": {"num_key_value_heads": 2, "head_dim": 32},
    "gemma": {"num_key_value_heads": 1, "head_dim": 32},
    "olmo2": {"num_key_value_heads": 2},
    "starcoder2": {"num_key_value_heads": 2, "residual_dropout": 0.0, "embedding_dropout": 0.0},
    "gpt2": {"n_embd": 128, "n_layer": 2, "n_head": 4, "n_positions": 64, "resid_pdrop": 0.0,
             "embd_pdrop": 0.0, "attn_pdrop": 0.0},
    "opt": {"ffn_dim": 256, "word_embed_proj_dim": 128, "dropout": 0.0},
}  # fmt: skip


@pytest.mark.parametrize("family", sorted(_FAMILIES))
def test_families_train_as_close_to_float64_as_with_sdpa(family: str, served: list[int]) -> None:
    """A bf16 forward + backward of each family's model (heads of 32) with the mapping
    installed: every call served, the loss as close to the float64 model's as with ``sdpa``
    (within 1.25 x its distance and 1e-4 of the loss), and each parameter's
    gradient as close to the float64 model's as with ``sdpa`` (within :data:`MODEL_RATIO`, and
    their mean within :data:`RATIO`) (a parameter whose exact
    gradient is zero, as a key bias's is, left out)."""
    config = AutoConfig.for_model(
        family, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=4, vocab_size=256, max_position_embeddings=64,
        attention_dropout=0.0, **_FAMILIES[family],
    )  # fmt: skip
    torch.manual_seed(0)
    exact = AutoModelForCausalLM.from_config(config).double().train()
    theirs, ours = (copy.deepcopy(exact).to(torch.bfloat16) for _ in range(2))
    ids = torch.randint(0, 256, (2, 48), generator=torch.Generator().manual_seed(1))
    exact_loss = exact(input_ids=ids, labels=ids).loss
    exact_loss.backward()
    loss = theirs(input_ids=ids, labels=ids).loss
    loss.backward()
    restore = train_attention.install(torch.device("cpu"))
    try:
        ours_loss = ours(input_ids=ids, labels=ids).loss
        ours_loss.backward()
    finally:
        restore()
    assert len(served) == 2  # both blocks
    far, near = (abs(float(x) - float(exact_loss)) for x in (ours_loss, loss))
    assert far <= RATIO * near + 1e-4 * float(exact_loss), (far, near)
    largest = max(float(p.grad.norm()) for p in exact.parameters() if p.grad is not None)
    errors: list[tuple[float, float]] = []
    for (name, want), t, o in zip(exact.named_parameters(), theirs.parameters(), ours.parameters(),
                                  strict=True):  # fmt: skip
        if want.grad is None or float(want.grad.norm()) < 1e-9 * largest:
            continue
        err_o, err_t = _error(o.grad, want.grad), _error(t.grad, want.grad)
        assert err_o <= MODEL_RATIO * err_t + 1e-3, (name, err_o, err_t)
        errors.append((err_o, err_t))
    mean_o, mean_t = (sum(e[i] for e in errors) / len(errors) for i in (0, 1))
    assert mean_o <= RATIO * mean_t, (mean_o, mean_t)
