"""Global-norm clipping with an overlapped optimizer step: each block's gradient norm is
taken as its gradients are summed in the last backward, and the blocks step on the
gradient worker while the next forward runs, block 0 first. Under the CPU double of
CUDA's copies (the gradient work runs on the worker, as on CUDA)."""

from __future__ import annotations

import copy
import threading
from typing import Any

import pytest
import torch

from bb_lightning.engine.optim import AdamWConfig
from bb_lightning.engine.optimizer_step import ClipConfig
from bb_lightning.placement import Placement
from storage.tiers import Tier

from ..tiny import LAYERS, cpu_engine, tiny_llama
from .test_cuda_double import _double_store

ADAMW = AdamWConfig(lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1)
CLIP = 0.05
"""Below the tiny model's gradient norms (about 1-3), so every step is clipped."""


def _torch_run(model: torch.nn.Module, batches: list[list[torch.Tensor]]) -> list[float]:
    opt = torch.optim.AdamW(
        model.parameters(), lr=ADAMW.lr, betas=ADAMW.betas, weight_decay=ADAMW.weight_decay
    )
    losses = []
    for window in batches:
        for ids in window:
            loss = model(input_ids=ids, labels=ids).loss / len(window)
            loss.backward()
            losses.append(float(loss.detach()))
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        assert float(norm) > 2 * CLIP  # the clipping changes the step
        opt.step()
        opt.zero_grad()
    return losses


def _batches(steps: int, accumulate: int) -> list[list[torch.Tensor]]:
    gen = torch.Generator().manual_seed(7)
    return [
        [torch.randint(0, 128, (2, 16), generator=gen) for _ in range(accumulate)]
        for _ in range(steps)
    ]


@pytest.mark.parametrize(
    ("weights", "master", "accumulate"),
    [(Tier.HOST, Tier.HOST, 2), (Tier.DEVICE, Tier.HOST, 1), (Tier.HOST, Tier.DEVICE, 2)],
)
def test_norm_clipped_overlapped_step_equals_torch(
    weights: Tier, master: Tier, accumulate: int
) -> None:
    reference = tiny_llama()
    model = copy.deepcopy(reference)
    batches = _batches(3, accumulate)
    want = _torch_run(reference, batches)
    placement = Placement.uniform(LAYERS, weights=weights, master=master)
    got = []
    with _double_store(model, placement) as store:
        engine = cpu_engine(model, store, placement)
        engine.grads.inline = False  # the gradient work on the worker, as on CUDA
        for window in batches:
            for k, ids in enumerate(window):
                if k == len(window) - 1:
                    assert engine.begin_overlapped_step(ADAMW, ClipConfig(value=CLIP))
                loss = model(input_ids=ids, labels=ids).loss / len(window)
                loss.backward()
                engine.after_backward()
                got.append(float(loss.detach()))
            engine.optimizer_step(ADAMW, ClipConfig(value=CLIP))
        state = engine.state_dict()  # waits for the last step's updates
        assert [i for i, _ in engine.overlap_starts] == list(range(LAYERS))  # block 0 first
        engine.close()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    for key, value in reference.state_dict().items():
        torch.testing.assert_close(state[key], value, rtol=1e-5, atol=1e-6, msg=key)


def test_next_forward_starts_before_the_last_block_update_ends() -> None:
    """The last block's update is held until the next forward has bound block 0 (for at
    most 20 s): a step that updated every block before returning would leave the hold
    by its deadline with block 0 not yet bound. Block ``i``'s page-in waits for its
    update only: each block is bound after its update ended."""
    model = tiny_llama()
    placement = Placement.uniform(LAYERS, weights=Tier.HOST, master=Tier.HOST)
    events: list[tuple[str, int]] = []
    lock = threading.Lock()
    first_bound = threading.Event()

    class Record:
        def block_acquiring(self, i: int) -> None:
            pass

        def block_acquired(self, i: int) -> None:
            with lock:
                events.append(("bound", i))
            if i == 0 and stepping:
                first_bound.set()

        def block_released(self, i: int) -> None:
            pass

    stepping = False
    with _double_store(model, placement) as store:
        engine = cpu_engine(model, store, placement)
        engine.grads.inline = False  # the gradient work on the worker, as on CUDA
        step_block_state = engine.steps.step_block_state

        def held(block: int, *args: Any, **kwargs: Any) -> None:
            if block == LAYERS - 1:
                first_bound.wait(timeout=20.0)
            step_block_state(block, *args, **kwargs)
            with lock:
                events.append(("updated", block))

        engine.steps.step_block_state = held  # type: ignore[method-assign]
        engine.pager.add_observer(Record())
        ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(3))
        assert engine.begin_overlapped_step(ADAMW, ClipConfig(value=CLIP))
        model(input_ids=ids, labels=ids).loss.backward()
        engine.after_backward()
        with lock:
            events.clear()  # the binds of backward's recomputation
        stepping = True
        engine.optimizer_step(ADAMW, ClipConfig(value=CLIP))
        model(input_ids=ids, labels=ids).loss.backward()
        engine.after_backward()
        engine.close()
    updated = [i for kind, i in events if kind == "updated"]
    assert updated == list(range(LAYERS))  # in the order the forward needs them
    assert events.index(("bound", 0)) < events.index(("updated", LAYERS - 1))
    for i in range(LAYERS):
        assert events.index(("updated", i)) < events.index(("bound", i)), (i, events)
