"""The host AdamW step in pieces of a block's flat state: the steps of torch AdamW, with
host buffers bounded by the piece rather than the block."""

from __future__ import annotations

import functools
import threading
from pathlib import Path

import pytest
import torch

from bb_lightning.engine.optim import AdamWConfig
from bb_lightning.engine.optimizer_step import ClipConfig
from bb_lightning.placement import (
    SCRATCH_FP32,
    SCRATCH_PREFIX,
    SCRATCH_SETS,
    STATE_KINDS,
    Placement,
)
from storage import TransferKind
from storage.tiers import Tier

from ..tiny import LAYERS, cpu_engine, tiny_llama
from .test_cuda_double import _double_store
from .test_grad_tiers import _store

PIECE = 6144
"""Elements per piece: a tiny Llama block's 36,992 trained elements make six whole pieces
and a last one of 128, and its parameters cross piece boundaries (the MLP's 8,192)."""

ADAMW = AdamWConfig(lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1)
STEPS = 2
"""Optimizer steps of each run: the second steps from the moments the first wrote back."""


def _train(
    placement: Placement,
    tmp_path: Path | None,
    accumulate: int,
    overlap: bool,
    clip: float | None,
) -> tuple[dict[str, torch.Tensor], list[torch.Tensor]]:
    """:data:`STEPS` optimizer steps of a tiny Llama through the engine (its store under the CUDA
    double where ``tmp_path`` is None): its state dict and losses."""
    model = tiny_llama()
    gen = torch.Generator().manual_seed(3)
    losses = []
    if tmp_path is not None:
        tmp_path.mkdir()
    store = (
        _double_store(model, placement) if tmp_path is None else _store(tmp_path, model, placement)
    )
    with store:
        engine = cpu_engine(model, store, placement)
        for _ in range(STEPS):
            for k in range(accumulate):
                ids = torch.randint(0, 128, (2, 16), generator=gen)
                if overlap and k == accumulate - 1:
                    engine.begin_overlapped_step(ADAMW, ClipConfig(value=clip))
                loss = engine.model(input_ids=ids, labels=ids).loss / accumulate
                loss.backward()
                engine.after_backward()
                losses.append(loss.detach())
            engine.optimizer_step(ADAMW, ClipConfig(value=clip))
        state = engine.state_dict()
        engine.close()
    return state, losses


@functools.cache
def _reference(
    accumulate: int, clip: float | None
) -> tuple[dict[str, torch.Tensor], list[torch.Tensor]]:
    """The same steps with torch.optim.AdamW on the plain module (one run per argument
    pair: the tests only read it)."""
    model = tiny_llama()
    opt = torch.optim.AdamW(
        model.parameters(), lr=ADAMW.lr, betas=ADAMW.betas, weight_decay=ADAMW.weight_decay
    )
    gen = torch.Generator().manual_seed(3)
    losses = []
    for _ in range(STEPS):
        for _ in range(accumulate):
            ids = torch.randint(0, 128, (2, 16), generator=gen)
            loss = model(input_ids=ids, labels=ids).loss / accumulate
            loss.backward()
            losses.append(loss.detach())
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        opt.zero_grad()
    return model.state_dict(), losses


@pytest.mark.parametrize(
    ("master", "grads", "accumulate", "overlap", "clip"),
    [
        (Tier.NVME, Tier.NVME, 2, True, None),  # read-add-write by piece, stepped in backward
        (Tier.NVME, Tier.NVME, 2, False, 0.05),  # clipping: norm by piece, then the step
        (Tier.NVME, Tier.NVME, 1, True, 0.05),  # norms in backward, blocks stepped after it
        (Tier.HOST, Tier.HOST, 2, True, None),  # state stepped in place, piece by piece
        (Tier.HOST, Tier.NVME, 2, False, 0.05),
    ],
    ids=lambda v: getattr(v, "value", str(v)),
)
def test_steps_in_pieces_equal_torch_adamw(
    tmp_path: Path,
    master: Tier,
    grads: Tier,
    accumulate: int,
    overlap: bool,
    clip: float | None,
) -> None:
    """With pieces smaller than a block (an uneven last one), weights on NVMe, the device
    and the host, the steps equal torch AdamW's, and equal the engine's whole-block steps
    to fp32 rounding."""
    placement = Placement(
        weights=(Tier.NVME, Tier.DEVICE, Tier.HOST),
        master=(master,) * LAYERS,
        grads=(grads,) * LAYERS,
        read_ahead=2,
        state_piece=PIECE,
    )
    numel = sum(p.numel() for p in tiny_llama().model.layers[0].parameters())
    assert numel > PIECE and numel % PIECE
    state, losses = _train(placement, tmp_path / "pieces", accumulate, overlap, clip)
    whole = Placement(**{**vars(placement), "state_piece": 64 * PIECE})
    state_whole, _ = _train(whole, tmp_path / "whole", accumulate, overlap, clip)
    want, want_losses = _reference(accumulate, clip)
    for got, ref in zip(losses, want_losses, strict=True):
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-6)
    # an element stepped with another piece's gradient or moments would be off by about
    # lr = 1e-2; fp32 rounding (the clipping norm summed by piece) leaves about 1e-6
    for key, value in want.items():
        torch.testing.assert_close(state[key], value, rtol=1e-6, atol=5e-6, msg=key)
        torch.testing.assert_close(state[key], state_whole[key], rtol=1e-6, atol=2e-6, msg=key)


@pytest.mark.parametrize("clip", [None, 0.05])
def test_device_homes_step_in_pieces_under_the_cuda_double(clip: float | None) -> None:
    """Weights and optimizer state on the device and the host, under the CPU double of
    CUDA's copies: each piece read from the device and written back by range lands before
    the host uses its buffer again, so the steps equal torch AdamW's."""
    placement = Placement(
        weights=(Tier.DEVICE, Tier.HOST, Tier.DEVICE),
        master=(Tier.DEVICE, Tier.HOST, Tier.DEVICE),
        read_ahead=2,
        state_piece=PIECE,
    )
    state, losses = _train(placement, None, 2, True, clip)
    want, want_losses = _reference(2, clip)
    for got, ref in zip(losses, want_losses, strict=True):
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-6)
    for key, value in want.items():
        torch.testing.assert_close(state[key], value, rtol=1e-6, atol=5e-6, msg=key)


def _on_nvme(sets: int) -> Placement:
    """Weights and optimizer state on NVMe, ``sets`` read-ahead sets, pieces of PIECE."""
    placement = Placement.uniform(LAYERS, weights=Tier.NVME, master=Tier.NVME)
    return Placement(**{**vars(placement), "read_ahead": sets, "state_piece": PIECE})


def test_scratch_and_read_ahead_buffers_hold_one_piece(tmp_path: Path) -> None:
    """The optimizer's host buffers (scratch and read-ahead sets) the engine registers are
    sized by the piece, not by the largest block: 2 sets of four fp32 buffers and a cast,
    and 3 read-ahead sets of three fp32 buffers, of PIECE elements each."""
    sets = 3
    placement = _on_nvme(sets)
    model = tiny_llama()
    with _store(tmp_path, model, placement) as store:
        engine = cpu_engine(model, store, placement)
        scratch = [n for n in store.names() if n.startswith(SCRATCH_PREFIX)]
        held = sum(store.spec(n).nbytes for n in scratch)
        engine.close()
    fp32 = 4  # the CPU engine computes in fp32: its cast buffers too
    assert len(scratch) == SCRATCH_SETS * (len(SCRATCH_FP32) + 1) + sets * 3
    assert held == (SCRATCH_SETS * (len(SCRATCH_FP32) + 1) + sets * 3) * PIECE * fp32


class _StateReads:
    """Counts the reads of optimizer state the store starts."""

    def __init__(self) -> None:
        self.count = 0
        self._lock = threading.Lock()

    def transfer_started(self, kind: TransferKind, name: str) -> None:
        state = name.rsplit(".", 1)[-1] in STATE_KINDS
        if state and kind not in (TransferKind.PAGE_IN, TransferKind.WRITE_BACK):
            with self._lock:
                self.count += 1

    def transfer_finished(self, kind: TransferKind, name: str) -> None:
        pass


@pytest.mark.parametrize(("limit", "sets_read"), [(0, 0), (1, 1), (2, 2), (None, 3)])
def test_a_limit_bounds_the_read_ahead_sets_reading_at_once(
    tmp_path: Path, limit: int | None, sets_read: int
) -> None:
    """Under a limit of ``limit`` sets (0: hold), the read-ahead of a step's state issues
    that many sets' reads (three tensors each) and no more until asked again; no limit
    fills every set."""
    sets = 3
    placement = _on_nvme(sets)
    model = tiny_llama()
    with _store(tmp_path, model, placement) as store:
        engine = cpu_engine(model, store, placement)
        reads = _StateReads()
        store.add_observer(reads)
        engine.pool.limit_reads(limit)
        engine.read_state_ahead()
        engine.pool.settle()  # waits for the reads issued, drops the rest
        engine.close()
    assert reads.count == sets_read * len(STATE_KINDS)
