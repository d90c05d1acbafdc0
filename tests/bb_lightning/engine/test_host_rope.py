"""The compiled rotary embedding (``host_rope``) against Hugging Face's
``apply_rotary_pos_emb``, bit for bit; which model files it serves; the calls it leaves to
the function; and the swap of the model file's global undone by the last restore."""

from __future__ import annotations

import contextlib
import functools
import types
from collections.abc import Callable, Iterator

import pytest
import torch
from torch import Tensor, nn
from transformers.models.cohere import modeling_cohere
from transformers.models.gpt_neox import modeling_gpt_neox
from transformers.models.llama import modeling_llama
from transformers.models.mistral import modeling_mistral
from transformers.models.qwen2 import modeling_qwen2

from bb_lightning.engine import host_norm, host_rope

APPLY = modeling_llama.apply_rotary_pos_emb
_CONFIG = modeling_llama.LlamaConfig(hidden_size=8, intermediate_size=8, num_attention_heads=2,
                                     num_key_value_heads=2)  # fmt: skip


def _inputs(
    batch: int, tokens: int, heads: int, kv_heads: int, dim: int, cos_rows: int,
    dtype: torch.dtype, seed: int = 0,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:  # fmt: skip
    """Queries and keys as an attention layer makes them (a projection's output viewed as
    heads and transposed: strided), and the rotary ``cos`` / ``sin`` of real positions."""
    g = torch.Generator().manual_seed(seed)
    q = (torch.randn(batch, tokens, heads * dim, generator=g) * 4).to(dtype)
    k = (torch.randn(batch, tokens, kv_heads * dim, generator=g) * 4).to(dtype)
    q = q.view(batch, tokens, heads, dim).transpose(1, 2)
    k = k.view(batch, tokens, kv_heads, dim).transpose(1, 2)
    inv = 1.0 / (10000 ** (torch.arange(0, dim, 2).float() / dim))
    pos = torch.arange(tokens).float()[None] + torch.randint(0, 300, (cos_rows, 1), generator=g)
    angles = torch.cat([pos[..., None] * inv] * 2, dim=-1)
    return q, k, angles.cos().to(dtype), angles.sin().to(dtype)


def test_the_plain_rotary_is_the_llama_family_s() -> None:
    for served in (modeling_llama, modeling_mistral, modeling_qwen2):
        assert host_rope.plain_rotary(served), served.__name__
    assert not host_rope.plain_rotary(modeling_cohere)  # rotate_half interleaves the pairs
    assert not host_rope.plain_rotary(modeling_gpt_neox)  # rotates a part of each head
    assert not host_rope.plain_rotary(torch)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("batch", "tokens", "heads", "kv_heads", "dim", "cos_rows"),
    [(3, 17, 4, 2, 64, 3), (5, 1, 6, 6, 10, 5), (2, 9, 4, 1, 128, 1), (1, 33, 2, 2, 34, 1)],
)
def test_the_kernel_equals_apply_rotary_pos_emb_bit_for_bit(
    host_kernel: host_norm._Kernel, dtype: torch.dtype, threads: int, batch: int, tokens: int,
    heads: int, kv_heads: int, dim: int, cos_rows: int,
) -> None:  # fmt: skip
    """Prefill and decode shapes, grouped keys, ``cos`` for each row or one for all, head
    widths of 10 and 34 (not a multiple of a vector), strided and contiguous queries."""
    assert (
        torch.bfloat16 in host_kernel.rope_dtypes
    )  # fp32 too, unless the build fused its products
    q, k, cos, sin = _inputs(batch, tokens, heads, kv_heads, dim, cos_rows, dtype)
    with torch.no_grad(), _threads(threads):
        for qq in (q, q.contiguous()):
            want = APPLY(qq, k, cos, sin)
            got = host_rope._rotary(host_kernel, APPLY, qq, k, cos, sin)
            for g, w in zip(got, want, strict=True):
                assert g.shape == w.shape  # and the layout (a dim of 1 has any stride)
                wide = [n > 1 for n in g.shape]
                assert [s for s, y in zip(g.stride(), wide, strict=True) if y] == [
                    s for s, y in zip(w.stride(), wide, strict=True) if y
                ]
                torch.testing.assert_close(g, w, rtol=0, atol=0)


def test_installed_it_serves_calls_with_or_without_grad_and_leaves_the_rest_to_the_function(
    host_kernel: host_norm._Kernel, count_host_kernel: Callable[[str], list[int]]
) -> None:
    calls = count_host_kernel("rope")
    model = nn.Sequential(
        modeling_llama.LlamaMLP(_CONFIG),
        modeling_cohere.CohereLayerNorm(8),
    )
    first, second = host_rope.install(model), host_rope.install(model)
    assert modeling_llama.apply_rotary_pos_emb is not APPLY
    assert modeling_cohere.apply_rotary_pos_emb.__name__ == "apply_rotary_pos_emb"  # not plain
    q, k, cos, sin = _inputs(2, 5, 4, 2, 16, 2, torch.float32)
    with torch.no_grad():
        got = modeling_llama.apply_rotary_pos_emb(q, k, cos, sin)
    assert len(calls) == 2  # queries and keys
    for g, w in zip(got, APPLY(q, k, cos, sin), strict=True):
        torch.testing.assert_close(g, w, rtol=0, atol=0)
    # with grad: the kernel's forward for both, its backward for the queries only
    q.requires_grad_()
    out = modeling_llama.apply_rotary_pos_emb(q, k, cos, sin)
    out[0].sum().backward()
    assert q.grad is not None and len(calls) == 5
    want = q.detach().clone().requires_grad_()
    APPLY(want, k, cos, sin)[0].sum().backward()
    torch.testing.assert_close(q.grad, want.grad, rtol=0, atol=0)
    # another dtype, another unsqueeze_dim, a head of odd width: the function's
    with torch.no_grad():
        modeling_llama.apply_rotary_pos_emb(q, k, cos.double(), sin.double())
        qt, kt = q.transpose(1, 2), k.transpose(1, 2)
        torch.testing.assert_close(
            modeling_llama.apply_rotary_pos_emb(qt, kt, cos, sin, unsqueeze_dim=2)[0],
            APPLY(qt, kt, cos, sin, unsqueeze_dim=2)[0], rtol=0, atol=0,
        )  # fmt: skip
        odd = [t[..., :15] for t in (q, k, cos, sin)]
        torch.testing.assert_close(modeling_llama.apply_rotary_pos_emb(*odd)[1], APPLY(*odd)[1],
                                   rtol=0, atol=0)  # fmt: skip
    assert len(calls) == 5
    first()
    assert modeling_llama.apply_rotary_pos_emb is not APPLY  # the second install holds it
    second()
    assert modeling_llama.apply_rotary_pos_emb is APPLY


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("batch", "tokens", "heads", "kv_heads", "dim", "cos_rows"),
    [(3, 17, 4, 2, 64, 3), (2, 9, 4, 1, 128, 1), (1, 33, 2, 2, 34, 1)],
)
def test_its_gradients_equal_autograds_through_the_function_bit_for_bit(
    host_kernel: host_norm._Kernel, dtype: torch.dtype, threads: int, batch: int, tokens: int,
    heads: int, kv_heads: int, dim: int, cos_rows: int,
) -> None:  # fmt: skip
    """A training step's call (queries and keys needing gradients, the outputs' gradients
    strided as the attention's backward gives them): the outputs and both gradients equal
    autograd's through the function's own operations."""
    if dtype not in host_kernel.rope_dtypes:
        pytest.skip(f"this build does not compute {dtype} bit for bit")
    q, k, cos, sin = _inputs(batch, tokens, heads, kv_heads, dim, cos_rows, dtype)
    g = torch.Generator().manual_seed(5)
    grads = [(torch.randn(x.transpose(1, 2).shape, generator=g) * 3).to(dtype).transpose(1, 2)
             for x in (q, k)]  # fmt: skip
    results = []
    with _threads(threads):
        for fn in (APPLY, functools.partial(host_rope._rotary, host_kernel, APPLY)):
            qq, kk = q.detach().clone().requires_grad_(), k.detach().clone().requires_grad_()
            out = fn(qq, kk, cos, sin)
            torch.autograd.backward(out, grads)
            results.append((*out, qq.grad, kk.grad))
    for got, want in zip(*results, strict=True):
        assert got is not None and want is not None
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_a_sin_whose_halves_differ_or_a_second_derivative(host_kernel: host_norm._Kernel) -> None:
    """The rotation back by ``-sin`` is autograd's only where ``sin``'s halves are equal:
    otherwise the function runs (its own gradients); the kernel's backward cannot itself be
    differentiated."""
    q, k, cos, sin = _inputs(2, 5, 4, 2, 16, 2, torch.float32)
    ours = functools.partial(host_rope._rotary, host_kernel, APPLY)
    odd_sin = sin.clone()
    odd_sin[..., -1] += 0.5
    results = []
    for fn in (APPLY, ours):
        qq = q.detach().clone().requires_grad_()
        fn(qq, k, cos, odd_sin)[0].square().sum().backward()
        results.append(qq.grad)
    torch.testing.assert_close(results[1], results[0], rtol=0, atol=0)
    qq = q.detach().clone().requires_grad_()
    (dq,) = torch.autograd.grad(ours(qq, k, cos, sin)[0].square().sum(), qq, create_graph=True)
    with pytest.raises(RuntimeError, match="differentiate"):
        dq.sum().backward()


def test_traced_transformed_or_dual_calls_run_the_function(host_kernel: host_norm._Kernel) -> None:
    """``jit.trace``, ``vmap`` and forward-mode AD see through the function's operations
    only: the kernel leaves those calls to it, even without grad."""
    import torch.autograd.forward_ad as fwad

    q, k, cos, sin = _inputs(2, 5, 4, 2, 16, 2, torch.float32)
    ours = functools.partial(host_rope._rotary, host_kernel, APPLY)
    with torch.no_grad():
        traced = torch.jit.trace(lambda a, b: ours(a, b, cos, sin)[0], (q, k))
        q2 = torch.randn_like(q)
        torch.testing.assert_close(traced(q2, k), APPLY(q2, k, cos, sin)[0], rtol=0, atol=0)
        mapped = torch.func.vmap(lambda a, b: ours(a, b, cos, sin)[0], in_dims=(0, 0))
        torch.testing.assert_close(mapped(q[None], k[None])[0], APPLY(q, k, cos, sin)[0],
                                   rtol=0, atol=0)  # fmt: skip
        with fwad.dual_level():
            dual = fwad.make_dual(q, torch.ones_like(q))
            tangent = fwad.unpack_dual(ours(dual, k, cos, sin)[0]).tangent
        assert tangent is not None  # the function is linear in q: its tangent is itself
        torch.testing.assert_close(tangent, APPLY(torch.ones_like(q), k, cos, sin)[0], rtol=0,
                                   atol=0)  # fmt: skip


def test_restore_keeps_a_patch_made_since_and_a_failed_install_undoes_itself(
    host_kernel: host_norm._Kernel, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = nn.Sequential(modeling_llama.LlamaMLP(_CONFIG), modeling_mistral.MistralMLP(_CONFIG))
    restore = host_rope.install(model)
    assert not host_rope.plain_rotary(modeling_mistral)  # swapped
    other = functools.partial(APPLY)
    modeling_llama.apply_rotary_pos_emb = other  # type: ignore[assignment]  # another's, since
    try:
        restore()
        assert modeling_llama.apply_rotary_pos_emb is other  # left as that other made it
    finally:
        modeling_llama.apply_rotary_pos_emb = APPLY
    assert host_rope.plain_rotary(modeling_mistral)  # its own function again
    seen: list[str] = []
    plain = host_rope.plain_rotary

    def fails_second(module: types.ModuleType) -> bool:
        ok = plain(module)
        if ok:
            seen.append(module.__name__)
            if len(seen) == 2:  # Llama's swapped first (in the order of names), then Mistral's
                raise RuntimeError("a model file that cannot be read")
        return ok

    monkeypatch.setattr(host_rope, "plain_rotary", fails_second)
    with pytest.raises(RuntimeError, match="cannot be read"):
        host_rope.install(model)
    assert modeling_llama.apply_rotary_pos_emb is APPLY and not host_rope._swapped


def test_bb_native_0_installs_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("BB_NATIVE", "0")
    model = modeling_llama.LlamaMLP(_CONFIG)
    restore = host_rope.install(model)
    assert modeling_llama.apply_rotary_pos_emb is APPLY
    restore()


@contextlib.contextmanager
def _threads(n: int) -> Iterator[None]:
    was = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(was)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("family", ["llama", "qwen2", "mistral"])
def test_a_models_training_step_through_it_equals_autograds_bit_for_bit(
    host_kernel: host_norm._Kernel,
    count_host_kernel: Callable[[str], list[int]],
    dtype: torch.dtype,
    family: str,
) -> None:
    """A forward + backward of a whole model with the swap installed (as a fit on a CPU
    device installs it): the loss and every parameter's gradient equal the function's."""
    from transformers import AutoConfig, AutoModelForCausalLM

    if dtype not in host_kernel.rope_dtypes:
        pytest.skip(f"this build does not compute {dtype} bit for bit")
    config = AutoConfig.for_model(
        family, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, vocab_size=128,
        max_position_embeddings=64,
    )  # fmt: skip
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).to(dtype).train()
    tokens = torch.randint(0, 128, (2, 24), generator=torch.Generator().manual_seed(0))
    calls = count_host_kernel("rope")
    grads = []
    for install in (False, True):
        model.zero_grad(set_to_none=True)
        restore = host_rope.install(model) if install else None
        try:
            loss = model(input_ids=tokens, labels=tokens).loss
            loss.backward()
        finally:
            if restore is not None:
                restore()
        grads.append((loss.detach(), {n: p.grad for n, p in model.named_parameters()}))
    assert len(calls) == 2 * 2 * 2  # each layer's queries and keys, forward and backward
    (want, theirs), (got, ours) = grads
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    for name, grad in theirs.items():
        torch.testing.assert_close(ours[name], grad, rtol=0, atol=0, msg=name)
