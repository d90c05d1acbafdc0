"""Gradient accumulators and optimizer state off the host: same steps as plain torch AdamW."""

from __future__ import annotations

import copy
import threading
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch

from bb_lightning.engine.budgets import required_budgets
from bb_lightning.engine.optim import AdamWConfig
from bb_lightning.engine.optimizer_step import ClipConfig
from bb_lightning.placement import Placement
from storage.io import IOConfig
from storage.nvme import NvmeTier
from storage.store import StoreConfig, Ticket, TieredStore
from storage.tiers import Tier

from ..tiny import LAYERS, cpu_engine, tiny_llama

STATES = ("exp_avg", "exp_avg_sq", "master")


def _store(tmp_path: Path, model: torch.nn.Module, placement: Placement) -> TieredStore:
    blocks = model.model.layers
    numels = [sum(p.numel() for p in b.parameters()) for b in blocks]
    rest = sum(p.numel() for p in model.parameters()) - sum(numels)
    need = required_budgets(numels, rest, replace(placement, compute_dtype="float32"))
    return TieredStore(
        StoreConfig(
            device_budget=need[Tier.DEVICE],
            host_budget=need[Tier.HOST],  # exactly what the engine registers
            nvme_path=str(tmp_path / "nvme"),
            nvme_budget=need[Tier.NVME] + (1 << 20),
            io=IOConfig(backend="posix", threads=2),
            device="cpu",
        )
    )


@pytest.mark.parametrize(
    ("grads", "accumulate", "overlap", "clip", "early", "sets", "hold"),
    [
        (Tier.NVME, 1, True, None, False, 2, False),  # the sum goes from scratch into the step
        (Tier.NVME, 2, True, None, False, 2, False),  # read-add-write on NVMe, stepped in backward
        (Tier.NVME, 2, False, 0.05, False, 2, False),  # clipping: every gradient stored, then norm
        (Tier.HOST, 2, True, None, False, 2, False),  # summed in place in the host arena
        (Tier.NVME, 2, True, None, True, 1, False),  # state read from the window's start, one set
        (Tier.HOST, 3, True, None, True, 3, False),  # ... every block's state held from the start
        # earlier micro-batches' gradients held and summed once, in the last backward ...
        (Tier.HOST, 3, True, None, False, 2, True),
        (Tier.NVME, 3, True, None, False, 2, True),
        # ... or, with clipping, when the norm and then each block's step ask for the sum
        (Tier.NVME, 3, False, 0.05, False, 2, True),
        (Tier.HOST, 2, False, 0.05, False, 2, True),
    ],
)
def test_engine_steps_equal_torch_adamw(
    tmp_path: Path,
    grads: Tier,
    accumulate: int,
    overlap: bool,
    clip: float | None,
    early: bool,
    sets: int,
    hold: bool,
) -> None:
    reference = tiny_llama()
    model = copy.deepcopy(reference)
    placement = Placement(
        weights=(Tier.NVME, Tier.DEVICE, Tier.HOST),
        master=(Tier.NVME, Tier.HOST, Tier.NVME),
        grads=(grads,) * LAYERS,
        prefetch_depth=1,
        read_ahead=sets,
        hold_grads=hold,
    )
    adamw = AdamWConfig(lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1)
    opt = torch.optim.AdamW(
        reference.parameters(), lr=adamw.lr, betas=adamw.betas, weight_decay=adamw.weight_decay
    )
    gen = torch.Generator().manual_seed(3)
    with _store(tmp_path, model, placement) as store:
        engine = cpu_engine(model, store, placement)
        ahead: list[str] = []
        read_async = store.read_async
        store.read_async = lambda name, out: (ahead.append(name), read_async(name, out))[1]  # type: ignore[method-assign]
        steps: list[list[str]] = []  # the states read ahead in each step
        for _ in range(3):
            done = len(ahead)
            for k in range(accumulate):
                ids = torch.randint(0, 128, (2, 16), generator=gen)
                if early and k == 0:
                    engine.read_state_ahead()  # before the window's first forward
                if overlap and k == accumulate - 1:
                    engine.begin_overlapped_step(adamw)
                loss = engine.model(input_ids=ids, labels=ids).loss / accumulate
                loss.backward()
                engine.after_backward()
                if not (overlap and k == accumulate - 1):  # else stepped in backward
                    assert [len(s.held) for s in engine.states] == [k + 1 if hold else 0] * (
                        LAYERS + 1
                    )
                want = reference(input_ids=ids, labels=ids).loss / accumulate
                want.backward()
                torch.testing.assert_close(loss, want, rtol=1e-5, atol=1e-6)
            engine.optimizer_step(adamw, ClipConfig(value=clip))
            if clip is not None:
                torch.nn.utils.clip_grad_norm_(reference.parameters(), clip)
            opt.step()
            opt.zero_grad()
            steps.append(ahead[done:])
        state = engine.state_dict()
        engine.close()
    # Only the NVMe-homed state (blocks 0 and 2) is read ahead, a block's three tensors
    # together, at most once per step. A read-ahead set whose write-back is still running
    # is skipped, never waited for (the block then reads its state when it steps), so after
    # the first step how many blocks come ahead depends on the disk; in the first step the
    # sets are fresh: every set takes a block, in step order (2 first when overlapping).
    expected = [f"block.{i}.{k}" for i in (0, 2) for k in STATES]
    for names in steps:
        blocks = {n.rsplit(".", 1)[0] for n in names}
        assert sorted(names) == sorted(f"{b}.{k}" for b in blocks for k in STATES)
        assert set(names) <= set(expected)
    if sets >= 2:
        assert sorted(steps[0]) == expected
    else:  # the one set takes the block stepped first; the other comes if it frees in time
        assert {f"block.{2 if overlap else 0}.{k}" for k in STATES} <= set(steps[0])
    stepped = sorted(i for i, _ in engine.overlap_starts)  # blocks stepped during backward
    assert stepped == (list(range(LAYERS)) if overlap else [])
    for key, value in reference.state_dict().items():
        torch.testing.assert_close(state[key], value, rtol=1e-4, atol=1e-5, msg=key)


def _eager(start: Callable[..., Ticket]) -> Callable[..., Ticket]:
    """``start`` whose transfer has landed when it returns (as on an instant disk)."""

    def run(*args: Any, **kwargs: Any) -> Ticket:
        ticket = start(*args, **kwargs)
        ticket.wait()
        return ticket

    return run


@pytest.mark.parametrize("overlap", [True, False])
def test_read_ahead_set_refilled_at_once_keeps_each_blocks_weights(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, overlap: bool
) -> None:
    """A block's read-ahead set is refilled with the next block's state as soon as its
    writes are done. With every write-back and read landing before it returns, the refill
    comes at once after a block steps: each block's weights must still be written from its
    own stepped master weights, so the steps equal torch AdamW."""
    reference = tiny_llama()
    model = copy.deepcopy(reference)
    placement = Placement(
        weights=(Tier.HOST,) * LAYERS, master=(Tier.DEVICE,) * LAYERS, read_ahead=1
    )
    adamw = AdamWConfig(lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1)
    opt = torch.optim.AdamW(
        reference.parameters(), lr=adamw.lr, betas=adamw.betas, weight_decay=adamw.weight_decay
    )
    gen = torch.Generator().manual_seed(4)
    with _store(tmp_path, model, placement) as store:
        monkeypatch.setattr(store, "write_back_async", _eager(store.write_back_async))
        monkeypatch.setattr(store, "read_async", _eager(store.read_async))
        engine = cpu_engine(model, store, placement)
        for _ in range(3):
            ids = torch.randint(0, 128, (2, 16), generator=gen)
            if overlap:
                engine.begin_overlapped_step(adamw)
            loss = engine.model(input_ids=ids, labels=ids).loss
            loss.backward()
            engine.after_backward()
            engine.optimizer_step(adamw)
            want = reference(input_ids=ids, labels=ids).loss
            want.backward()
            opt.step()
            opt.zero_grad()
            torch.testing.assert_close(loss, want, rtol=1e-5, atol=1e-6)
        state = engine.state_dict()
        engine.close()
    for key, value in reference.state_dict().items():
        torch.testing.assert_close(state[key], value, rtol=1e-4, atol=1e-5, msg=key)


@pytest.mark.parametrize("recompute", [False, True])
def test_resident_blocks_are_not_recomputed(tmp_path: Path, recompute: bool) -> None:
    """Blocks used in place (DEVICE-home, and HOST-home on a CPU device except under the
    CPU double, which pages them by copy as on CUDA) keep their activations (one forward
    per step); a block paged in by copy runs twice (forward, then recompute in backward). Every block hands its gradients on during backward, in
    reverse order; gradients equal plain autograd."""
    reference = tiny_llama()
    model = copy.deepcopy(reference)
    placement = Placement(
        weights=(Tier.HOST, Tier.DEVICE, Tier.NVME),
        master=(Tier.HOST,) * LAYERS,
        prefetch_depth=1,
        recompute_resident=recompute,
    )
    calls = [0] * LAYERS
    for i, layer in enumerate(model.model.layers):
        layer.mlp.register_forward_pre_hook(lambda *_, i=i: calls.__setitem__(i, calls[i] + 1))
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(5))
    with _store(tmp_path, model, placement) as store:
        host_runs = 1 if store.pages_host_in_place else 2
        engine = cpu_engine(model, store, placement)
        handed: list[int] = []
        engine.paged.on_block_backward = handed.append
        engine.model(input_ids=ids, labels=ids).loss.backward()
        assert handed == [2, 1, 0], "each block's gradients leave as soon as they exist"
        engine.after_backward()
        reference(input_ids=ids, labels=ids).loss.backward()
        grads = [s.master_views(s.gradient()) for s in engine.states]
        params = [*engine.pager.params, engine.resident_params]
        engine.close()
    assert calls == ([2, 2, 2] if recompute else [host_runs, 1, 2])
    names = {id(p): n for n, p in model.named_parameters()}
    want = dict(reference.named_parameters())
    for group, views in zip(params, grads, strict=True):
        for p, g in zip(group, views, strict=True):
            torch.testing.assert_close(g, want[names[id(p)]].grad, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("overlap", [True, False])
def test_optimizer_writes_leave_the_training_thread(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, overlap: bool
) -> None:
    """No NVMe write starts on the training thread during training steps (not even the
    start of one, which opens the file): the optimizer's writes go back on the store's
    threads, ordered before the next page-in."""
    model = tiny_llama()
    placement = Placement.uniform(LAYERS, weights=Tier.NVME, master=Tier.NVME, prefetch_depth=1)
    adamw = AdamWConfig(lr=1e-2)
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(7))
    with _store(tmp_path, model, placement) as store:
        engine = cpu_engine(model, store, placement)
        threads: list[str] = []
        for method in ("write_async", "begin_write"):
            original = getattr(NvmeTier, method)

            def starting(self: NvmeTier, *args: Any, _original: Any = original) -> Any:
                threads.append(threading.current_thread().name)
                return _original(self, *args)

            monkeypatch.setattr(NvmeTier, method, starting)
        for _ in range(2):
            if overlap:
                engine.begin_overlapped_step(adamw)
            engine.model(input_ids=ids, labels=ids).loss.backward()
            engine.after_backward()
            engine.optimizer_step(adamw)
        engine.close()
    assert threads  # the weights and optimizer state were written to NVMe...
    assert threading.main_thread().name not in threads  # ...never from the training thread
