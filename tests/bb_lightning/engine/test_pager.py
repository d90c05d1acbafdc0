"""The paging engine without Lightning: paged forward/backward equal Hugging Face's own."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch

from bb_lightning.engine.budgets import required_budgets
from bb_lightning.engine.grad_sink import CONVERT_CHUNK, add_converted
from bb_lightning.engine.trainer_engine import TrainingEngine
from bb_lightning.placement import Placement
from storage.store import StoreConfig, TieredStore
from storage.tiers import Residency, Tier

from ..tiny import cpu_engine, tiny_llama


@pytest.fixture
def engine_and_reference() -> tuple[TrainingEngine, torch.nn.Module, TieredStore]:
    reference = tiny_llama()
    model = copy.deepcopy(reference)
    store = TieredStore(StoreConfig(device_budget=8 << 20, host_budget=16 << 20, device="cpu"))
    placement = Placement(
        weights=(Tier.HOST, Tier.DEVICE, Tier.HOST), master=(Tier.HOST,) * 3, prefetch_depth=2
    )
    engine = cpu_engine(model, store, placement)
    yield engine, reference, store
    engine.close()
    store.close()


def test_paged_backward_equals_plain_backward(engine_and_reference) -> None:
    engine, reference, _ = engine_and_reference
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(1))
    for _ in range(2):  # two micro-batches accumulate
        _backward_both(engine, reference, ids)
    names = {id(p): n for n, p in reference.named_parameters()}
    ref_params = dict(reference.named_parameters())
    got: dict[str, torch.Tensor] = {}
    for params, state in [
        *zip(engine.pager.params, engine.pager.states, strict=True),
        (engine.resident_params, engine.resident),
    ]:
        model_names = {id(p): n for n, p in engine.model.named_parameters()}
        for p, g in zip(params, state.master_views(state.gradient()), strict=True):
            got[model_names[id(p)]] = g
    assert len(got) == len(names)
    for name, grad in got.items():
        torch.testing.assert_close(grad, ref_params[name].grad, rtol=1e-5, atol=1e-6, msg=name)


def _backward_both(engine: TrainingEngine, reference: torch.nn.Module, ids: torch.Tensor) -> None:
    """One micro-batch's forward and backward through the engine and the reference; the
    losses equal."""
    loss = engine.model(input_ids=ids, labels=ids).loss
    loss.backward()
    engine.after_backward()
    want = reference(input_ids=ids, labels=ids).loss
    want.backward()
    torch.testing.assert_close(loss, want, rtol=1e-6, atol=1e-6)


def test_no_grad_forward_pages_within_the_window(engine_and_reference) -> None:
    engine, reference, store = engine_and_reference
    ids = torch.randint(0, 128, (1, 8), generator=torch.Generator().manual_seed(2))
    seen: list[int] = []
    hooks = [
        b.register_forward_hook(lambda *_: seen.append(_resident(engine, store)))
        for b in engine.paged.blocks
    ]
    with torch.inference_mode():
        got = engine.model(input_ids=ids).logits
    for h in hooks:
        h.remove()
    with torch.no_grad():
        want = reference(input_ids=ids).logits
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    assert max(seen) <= engine.pager.placement.prefetch_depth + 1
    assert all(p.numel() == 0 for p in engine.pager.params[0])  # released block holds nothing


def _resident(engine: TrainingEngine, store: TieredStore) -> int:
    return sum(store.state(n) is not Residency.RELEASED for n in engine.pager.names)


def test_install_once_and_remove_restores_forward(engine_and_reference) -> None:
    engine, _, _ = engine_and_reference
    forwards = [b.forward for b in engine.paged.blocks]
    engine.paged.install()
    assert [b.forward for b in engine.paged.blocks] == forwards
    engine.paged.remove()
    assert all("forward" not in vars(b) for b in engine.paged.blocks)


def test_required_budgets_counts_each_tier() -> None:
    placement = Placement(
        weights=(Tier.DEVICE, Tier.HOST, Tier.NVME),
        master=(Tier.HOST, Tier.NVME, Tier.HOST),
        prefetch_depth=2,
    )
    need = required_budgets([1024, 1024, 2048], 512, placement)
    assert need[Tier.DEVICE] == 4096 + 3 * 4096  # resident block 0 + 3 slots of the largest
    # weights, masters + moments, gradients (as master), resident 16 B/param, 2 scratch
    # sets, and (block 1's state is on NVMe) 2 read-ahead sets of 3 fp32 buffers
    grads = 4096 + 8192
    scratch = 2 * (4 * 8192 + 4096)
    ahead = 2 * 3 * 8192
    assert need[Tier.HOST] == 4096 + 3 * 4096 + 3 * 8192 + grads + 4 * 4096 + scratch + ahead
    assert need[Tier.NVME] == 4096 + 3 * 4096 + 4096
    apart = Placement(
        weights=placement.weights, master=placement.master, grads=(Tier.NVME,) * 3,
        prefetch_depth=2,
    )  # fmt: skip
    moved = required_budgets([1024, 1024, 2048], 512, apart)
    assert moved[Tier.HOST] == need[Tier.HOST] - grads
    assert moved[Tier.NVME] == need[Tier.NVME] + grads
    deeper = dataclasses.replace(placement, read_ahead=5)  # 3 more read-ahead sets
    more = required_budgets([1024, 1024, 2048], 512, deeper)
    assert more[Tier.HOST] == need[Tier.HOST] + 3 * 3 * 8192
    on_host = dataclasses.replace(deeper, master=(Tier.HOST,) * 3)  # nothing to read ahead
    shallow = dataclasses.replace(on_host, read_ahead=1)
    assert (
        required_budgets([1024, 1024, 2048], 512, on_host)[Tier.HOST]
        == required_budgets([1024, 1024, 2048], 512, shallow)[Tier.HOST]
    )


def test_placement_rejects_bad_input() -> None:
    with pytest.raises(ValueError, match="prefetch_depth=0"):
        Placement.uniform(2, weights=Tier.HOST, prefetch_depth=0)
    with pytest.raises(ValueError, match="read_ahead=0"):
        Placement(weights=(Tier.HOST,), master=(Tier.NVME,), read_ahead=0)
    with pytest.raises(ValueError, match="2 weight tiers but 1 master"):
        Placement(weights=(Tier.HOST, Tier.HOST), master=(Tier.HOST,))
    with pytest.raises(ValueError, match=r"master=<Tier.HOST: 'host'> is one tier.*\(<Tier"):
        Placement(weights=(Tier.HOST,) * 4, master=Tier.HOST)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="weights='nvme' is one tier"):
        Placement(weights="nvme", master=())  # type: ignore[arg-type]


@pytest.mark.parametrize("src_dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_add_converted_equals_the_exact_sum_rounded(src_dtype: torch.dtype) -> None:
    """fp32 += gradient of any dtype, chunked through the conversion buffer: each element
    is the float64 sum of the two values rounded to fp32, as a same-dtype add gives."""
    g = torch.Generator().manual_seed(0)
    n = 3 * CONVERT_CHUNK + 5  # a partial last chunk
    dst = torch.randn(n, generator=g)
    src = (torch.randn(n, generator=g) * 3).to(src_dtype)
    want = (dst.double() + src.double()).float()
    add_converted(dst, src)
    assert torch.equal(dst, want)
    rows = torch.zeros(8, 6)  # a non-contiguous destination takes PyTorch's own add
    cols = rows.t()
    add_converted(cols, torch.ones(6, 8, dtype=torch.bfloat16))
    assert torch.equal(rows, torch.ones(8, 6))


def _nvme_store(tmp_path) -> tuple[TieredStore, Placement]:
    """A CPU store with an NVMe tier, and a placement paging 3 blocks' weights from it
    (every block recomputed in backward)."""
    store = TieredStore(
        StoreConfig(
            device_budget=8 << 20, host_budget=16 << 20, device="cpu",
            nvme_path=str(tmp_path / "nvme"), nvme_budget=64 << 20,
        )
    )  # fmt: skip
    placement = Placement(weights=(Tier.NVME,) * 3, master=(Tier.HOST,) * 3, prefetch_depth=1)
    return store, placement


def _scaled_rotary(model: torch.nn.Module) -> None:
    """Every decoder layer gets its rotary cosines times a trainable scalar of the model
    (outside the blocks), passed in the ``position_embeddings`` tuple."""
    model.model.rotary_scale = torch.nn.Parameter(torch.tensor(1.25))

    def scaled(layer: torch.nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        cos, sin = kwargs["position_embeddings"]
        kwargs["position_embeddings"] = (cos * model.model.rotary_scale, sin)
        return args, kwargs

    for layer in model.model.layers:
        layer.register_forward_pre_hook(scaled, with_kwargs=True)


def test_a_recomputed_block_passes_gradient_to_its_other_tensor_arguments(tmp_path) -> None:
    """A block argument besides the hidden states that requires gradient (here in the
    ``position_embeddings`` tuple) gets it from the recomputed block as from autograd."""
    reference = tiny_llama()
    model = copy.deepcopy(reference)
    _scaled_rotary(reference)
    _scaled_rotary(model)
    store, placement = _nvme_store(tmp_path)
    engine = cpu_engine(model, store, placement)
    try:
        assert not engine.paged.autograd_blocks  # every block recomputed in backward
        ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(3))
        _backward_both(engine, reference, ids)
        names = {id(p): n for n, p in engine.model.named_parameters()}
        views = engine.resident.master_views(engine.resident.gradient())
        got = {names[id(p)]: g for p, g in zip(engine.resident_params, views, strict=True)}
        grad = reference.model.rotary_scale.grad
        assert grad is not None and grad.abs() > 0
        torch.testing.assert_close(got["model.rotary_scale"], grad, rtol=1e-5, atol=1e-6)
    finally:
        engine.close()
        store.close()


class _BiasBlock(torch.nn.Module):
    """Returns the position bias it was given beside its output, as WavLM's layers do."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(16, 16)

    def forward(self, hidden: torch.Tensor, bias: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return torch.tanh(self.linear(hidden) + bias), bias


class _BiasStack(torch.nn.Module):
    """Blocks that hand a bias made without gradient down the stack; the last bias beside
    the loss."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(_BiasBlock() for _ in range(3))
        self.head = torch.nn.Linear(16, 1)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        bias = torch.linspace(-1, 1, 16)
        for layer in self.layers:
            x, bias = layer(x, bias)
        return self.head(x).square().mean(), bias


def test_a_tensor_a_block_hands_through_stays_outside_the_graph(tmp_path) -> None:
    """A recomputed block returning an argument it was given (a bias that needs no
    gradient) returns it without gradient, and the weights' gradients equal autograd's."""
    torch.manual_seed(0)
    reference = _BiasStack()
    model = copy.deepcopy(reference)
    store, placement = _nvme_store(tmp_path)
    engine = TrainingEngine(
        model,
        model.layers,
        store,
        dataclasses.replace(placement, compute_dtype="float32"),
        device=torch.device("cpu"),
    )
    try:
        assert not engine.paged.autograd_blocks  # every block recomputed in backward
        x = torch.randn(2, 5, 16, generator=torch.Generator().manual_seed(4))
        loss, bias = engine.model(x)
        assert not bias.requires_grad and bias.grad_fn is None
        loss.backward()
        engine.after_backward()
        want, _ = reference(x)
        want.backward()
        torch.testing.assert_close(loss, want)
        names = {id(p): n for n, p in engine.model.named_parameters()}
        got = {}
        for params, state in zip(engine.pager.params, engine.pager.states, strict=True):
            for p, g in zip(params, state.master_views(state.gradient()), strict=True):
                got[names[id(p)]] = g
        for name, p in reference.layers.named_parameters(prefix="layers"):
            torch.testing.assert_close(got[name], p.grad, rtol=1e-5, atol=1e-6, msg=name)
    finally:
        engine.close()
        store.close()
