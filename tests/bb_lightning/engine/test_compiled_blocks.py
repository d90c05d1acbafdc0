"""Paged blocks under torch.compile: the same losses and weights as eager, and one graph
per way a block is called (the training forward without grad, its recomputation with grad,
a plain forward without grad) whatever the block or the arena slot it is paged into."""

from __future__ import annotations

import copy
from collections.abc import Iterator

import pytest
import torch
import torch._dynamo
from torch._dynamo.utils import counters

from bb_lightning.engine.compiled import compile_blocks
from bb_lightning.engine.optim import AdamWConfig
from bb_lightning.engine.optimizer_step import ClipConfig
from bb_lightning.placement import Placement
from storage.tiers import Tier

from ..tiny import LAYERS, cpu_engine, tiny_llama
from .test_cuda_double import _double_store

PLACEMENT = Placement(
    weights=(Tier.HOST,) * LAYERS,  # paged into the device arena's slots at each use
    master=(Tier.HOST,) * LAYERS,
    grads=(Tier.HOST,) * LAYERS,
    prefetch_depth=1,
)


@pytest.fixture
def one_compile_per_mode() -> Iterator[None]:
    """Dynamo from a clean cache, failing past three graphs of the block forward (one per
    way it is called; a recompile per block would need six for three blocks)."""
    torch._dynamo.reset()
    counters.clear()
    with torch._dynamo.config.patch(recompile_limit=3, fail_on_recompile_limit_hit=True):
        yield
    torch._dynamo.reset()


def _train(model: torch.nn.Module, compiled: bool) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Three steps of the engine on the CUDA double (each block paged in by copies);
    the losses and the final weights."""
    adamw = AdamWConfig(lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1)
    gen = torch.Generator().manual_seed(3)
    losses = []
    with _double_store(model, PLACEMENT) as store:
        engine = cpu_engine(model, store, PLACEMENT)
        if compiled:
            compile_blocks(engine.paged, backend="aot_eager")
        for _ in range(3):
            ids = torch.randint(0, 128, (2, 16), generator=gen)
            loss = engine.model(input_ids=ids, labels=ids).loss
            loss.backward()
            engine.after_backward()
            engine.optimizer_step(adamw, ClipConfig())
            losses.append(loss.detach())
        with torch.no_grad():  # a forward without grad: the paged path's other graph
            losses.append(engine.model(input_ids=ids, labels=ids, use_cache=False).loss)
        weights = [s["master"].clone() for _, s in engine.iter_state(("master",))]
        engine.close()
    return losses, weights


def test_compiled_blocks_train_as_eager_without_a_recompile_per_block(
    one_compile_per_mode: None,
) -> None:
    model = tiny_llama()
    eager_losses, eager_weights = _train(copy.deepcopy(model), compiled=False)
    assert counters["stats"]["unique_graphs"] == 0
    losses, weights = _train(model, compiled=True)
    # three graphs, shared by every block and every slot it was paged into over three
    # steps (a recompile past 3 raises)
    assert counters["stats"]["unique_graphs"] == 3
    torch.testing.assert_close(losses, eager_losses, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(weights, eager_weights, rtol=1e-5, atol=1e-6)


def test_an_unknown_backend_is_refused_naming_it() -> None:
    model = tiny_llama()
    with _double_store(model, PLACEMENT) as store:
        engine = cpu_engine(model, store, PLACEMENT)
        with pytest.raises(ValueError, match=r"compile_blocks=.nope. is not a torch\.compile"):
            compile_blocks(engine.paged, backend="nope")
        engine.close()
