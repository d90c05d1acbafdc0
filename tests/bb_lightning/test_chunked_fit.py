"""Chunked block execution in training against plain Lightning, over the model families.

Each run forces the chunked path through the public surface,
``BalanceBeamStrategy(placement=Placement(..., chunk_rows=k, boundaries=tier))``: every
block recomputes, runs its micro-batch ``k`` rows at a time while paged in once, and keeps
its boundary inputs on ``tier``. Losses and final weights (fp32) must equal plain
Lightning's on the same ``save_pretrained`` directory, with gradient accumulation and
norm clipping. Micro-batches of 5 rows make chunks of 1, 2 (2 + 2 + 1: uneven) and 3
(3 + 2). Families whose training draws random numbers (dropout, a sampling router) are
left out: their chunks draw their masks per chunk, not as one batch does.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any
from unittest import mock

import lightning.pytorch as pl
import pytest
import torch
from torch.utils.data import DataLoader
from transformers import AutoConfig, AutoModelForCausalLM

from bb_lightning import BalanceBeamStrategy
from bb_lightning.engine import chunked
from bb_lightning.engine.chunked import row_spans
from bb_lightning.module import CausalLMModule
from bb_lightning.placement import Placement
from storage.tiers import Tier

from .test_families import JAMBA, ZAYA
from .tiny import VOCAB, saved

STEPS, ACCUM, ROWS, SEQ = 2, 2, 5, 12
D, H, N = Tier.DEVICE, Tier.HOST, Tier.NVME

pytestmark = pytest.mark.usefixtures("one_thread")


def _data(n: int, padded: bool = True) -> list[dict[str, torch.Tensor]]:
    """``n`` micro-batches of ``ROWS`` rows, row ``r`` padded on the left by ``r`` tokens
    (masked, no loss there): each row of the attention mask differs, and matters; without
    padding with ``padded`` False."""
    g = torch.Generator().manual_seed(3)
    mask = (torch.arange(SEQ)[None] >= torch.arange(ROWS)[:, None] * padded).long()
    out = []
    for _ in range(n):
        ids = torch.randint(1, VOCAB, (ROWS, SEQ), generator=g) * mask
        out.append(
            {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}
        )
    return out


def _fit(
    tiny: SimpleNamespace, strategy: Any, module: Any, padded: bool = True
) -> tuple[list[float], dict[str, Any]]:
    torch.manual_seed(0)
    trainer, recorder = tiny.make_trainer(
        strategy, STEPS, accumulate_grad_batches=ACCUM, gradient_clip_val=0.5
    )
    trainer.fit(module, DataLoader(_data(STEPS * ACCUM, padded), batch_size=None))  # type: ignore[arg-type]
    if strategy == "auto":
        return recorder.losses, {k: v.detach().clone() for k, v in module.state_dict().items()}
    return recorder.losses, dict(strategy.lightning_module_state_dict())


def _placement(blocks: int, chunk_rows: int | None, boundaries: Tier | None) -> Placement:
    return Placement(
        weights=(H,) * blocks, master=(H,) * blocks, recompute_resident=True,
        chunk_rows=chunk_rows, boundaries=boundaries,
    )  # fmt: skip


def _same_as_plain(tiny: SimpleNamespace, make: Any, blocks: int, chunk_rows: int | None,
                   boundaries: Tier | None, *, whole: bool = False,
                   nvme: str | None = None, forwards: int = 1) -> BalanceBeamStrategy:  # fmt: skip
    """Fit ``make()`` under plain Lightning and chunked; both agree, and the chunked run
    ran every recomputed block forward in the chunks of ``chunk_rows`` rows (``whole``: in
    one piece, hidden states not laid out by rows; Gemma 3n, whose padded rows give NaN
    losses in both runs, trains unpadded)."""
    want_losses, want = _fit(tiny, "auto", make(), not whole)
    strategy = BalanceBeamStrategy(
        placement=_placement(blocks, chunk_rows, boundaries), compute_dtype="fp32",
        nvme_path=nvme,
    )  # fmt: skip
    spans: list[list[tuple[int, int]]] = []

    def recorded(rows: int, k: int | None) -> list[tuple[int, int]]:
        spans.append(row_spans(rows, k))
        return spans[-1]

    with mock.patch.object(chunked, "row_spans", recorded):
        losses, got = _fit(tiny, strategy, make(), not whole)
    chunks = [] if whole else [row_spans(ROWS, chunk_rows)] * (blocks * STEPS * ACCUM * forwards)
    assert spans == chunks
    if boundaries in (H, N):  # kept in the store between forward and backward
        store = strategy.store
        assert store is not None
        names = [n for n in store.names() if n.startswith("boundary.")]
        assert names and all(store.home(n) is boundaries for n in names)
    assert len(losses) == STEPS * ACCUM
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(want_losses), rtol=1e-5, atol=0)
    assert got.keys() == want.keys()
    for key, value in want.items():
        torch.testing.assert_close(
            got[key], value, rtol=1e-5, atol=5e-5, msg=lambda m, k=key: f"{k}: {m}"
        )
    return strategy


@pytest.mark.parametrize(("chunk_rows", "boundaries"), [(1, D), (2, H), (3, None), (2, N)])
def test_a_dense_model_fits_in_row_chunks_like_plain_lightning(
    chunk_rows: int, boundaries: Tier | None, tiny: SimpleNamespace, tmp_path: Path
) -> None:
    path = saved("llama", tmp_path / "ckpt")
    strategy = _same_as_plain(
        tiny, lambda: CausalLMModule(str(path), learning_rate=1e-3, weight_decay=0.01), 2,
        chunk_rows, boundaries, nvme=str(tmp_path / "nvme") if boundaries is N else None,
    )  # fmt: skip
    strategy.close()


FAMILY_RUNS = {  # family: (rows per chunk, boundaries)
    "qwen2_tied": (2, H),
    "mixtral_aux_loss": (2, H),  # the routers' logits joined by rows for the auxiliary loss
    "mistral_sliding": (3, D),
    "gemma3n_per_layer_inputs": (2, H),  # stacked hidden states: one piece, kept on the host
    "qwen3_next_linear": (2, H),  # gated delta net (recurrent) beside attention
    "lfm2_conv": (1, D),
    "falcon_h1_state_and_keys": (3, H),
    "gpt2_tied": (2, H),
    "mamba_state": (2, H),
    "bloom_alibi_tied": (2, H),  # ALiBi's [rows * heads, 1, tokens]: cut by rows x heads
    "mpt_alibi": (3, D),
}


@pytest.mark.parametrize("family", sorted(FAMILY_RUNS))
def test_a_family_fits_in_row_chunks_like_plain_lightning(
    family: str, tiny: SimpleNamespace, tmp_path: Path
) -> None:
    path = saved(family, tmp_path / "ckpt")
    strategy = _same_as_plain(
        tiny, lambda: CausalLMModule(str(path), learning_rate=1e-3, weight_decay=0.01), 2,
        *FAMILY_RUNS[family], whole=family.startswith("gemma3n"),
    )  # fmt: skip
    strategy.close()


@pytest.mark.parametrize(("name", "chunk_rows"), [("jamba", 2), ("zaya", 3)])
def test_hybrid_and_state_handing_blocks_fit_in_row_chunks_like_plain_lightning(
    name: str, chunk_rows: int, tiny: SimpleNamespace, tmp_path: Path
) -> None:
    """Jamba's mamba and attention layers (two classes in one list); Zaya's blocks hand
    their router's state to the next one, a second output joined by rows."""
    torch.manual_seed(0)
    values = JAMBA if name == "jamba" else ZAYA
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(name, **values))
    model.save_pretrained(tmp_path / "ckpt")
    path = tmp_path / "ckpt"
    strategy = _same_as_plain(
        tiny, lambda: CausalLMModule(str(path), learning_rate=1e-3, weight_decay=0.01), 2,
        chunk_rows, H,
    )  # fmt: skip
    strategy.close()


class _Block(torch.nn.Module):
    """A block reading, beside its hidden states, a trainable per-row input and a trainable
    gate without rows (passed whole to every chunk, its gradient summed over them)."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.mix = torch.nn.Linear(width, width)
        self.out = torch.nn.Linear(width, width)

    def forward(
        self, hidden: torch.Tensor, extra: torch.Tensor, gate: torch.Tensor
    ) -> torch.Tensor:
        mixed = torch.tanh(self.mix(hidden) + extra) * gate
        weights = torch.softmax(mixed @ mixed.transpose(1, 2) / 8.0, dim=-1)  # across tokens
        return hidden + self.out(weights @ mixed)


class _OwnModule(pl.LightningModule):
    """A user's own LightningModule: its own model, loss and optimizer."""

    def __init__(self, width: int = 16) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Embedding(VOCAB, width)
        self.side = torch.nn.Linear(width, width)
        self.gate = torch.nn.Parameter(torch.rand(width) + 0.5)
        self.layers = torch.nn.ModuleList(_Block(width) for _ in range(3))
        self.head = torch.nn.Linear(width, VOCAB)

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x = self.embed(batch["input_ids"])
        extra = self.side(x)
        for layer in self.layers:
            x = layer(x, extra, self.gate)
        logits = self.head(x)[:, :-1]
        labels = batch["labels"][:, 1:]
        return torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3, weight_decay=0.01)


@pytest.mark.parametrize(("chunk_rows", "boundaries"), [(2, H), (3, D)])
def test_a_users_own_module_fits_in_row_chunks_like_plain_lightning(
    chunk_rows: int, boundaries: Tier, tiny: SimpleNamespace
) -> None:
    """Gradients of an argument cut by rows are joined, those of one passed whole summed."""
    strategy = _same_as_plain(tiny, _OwnModule, 3, chunk_rows, boundaries)
    strategy.close()


def test_lora_adapters_fit_in_row_chunks_like_plain_lightning(
    tiny: SimpleNamespace, tmp_path: Path
) -> None:
    """Frozen base weights paged with the adapters; only the adapters' gradients summed."""
    path = saved("llama", tmp_path / "ckpt")
    lora = {"rank": 4, "alpha": 8.0, "target_modules": ["q_proj", "v_proj", "up_proj"]}
    strategy = _same_as_plain(
        tiny, lambda: CausalLMModule(str(path), learning_rate=1e-2, lora=lora, seed=3), 2, 2, H
    )
    assert strategy.engine is not None and all(strategy.engine.pager.frozen)
    strategy.close()


def test_a_given_placement_sizes_the_store_for_its_host_boundaries(
    tiny: SimpleNamespace, tmp_path: Path
) -> None:
    """Boundary inputs larger than the store's slack: the strategy reads the first batch's
    shape and the model's width and sizes the host tier (and the device's slots) for them."""
    path = saved("llama", tmp_path / "ckpt")
    rows, seq, width = 96, 64, 32  # 768 KiB of fp32 hidden states per block
    strategy = BalanceBeamStrategy(placement=_placement(2, 16, H), compute_dtype="fp32")
    trainer, recorder = tiny.make_trainer(strategy, 1)
    ids = torch.randint(0, VOCAB, (rows, seq), generator=torch.Generator().manual_seed(0))
    module = CausalLMModule(str(path), learning_rate=1e-3)
    trainer.fit(module, DataLoader([{"input_ids": ids}], batch_size=None))  # type: ignore[arg-type]
    store = strategy.store
    assert store is not None and len(recorder.losses) == 1
    assert store.spec("boundary.1.0.0").nbytes == rows * seq * width * 4
    assert store.config.host_budget >= 2 * rows * seq * width * 4 + (1 << 20)
    strategy.close()


class _TwoForwards(pl.LightningModule):
    """Two forwards of the model before one backward (a preference pair's two sides)."""

    def __init__(self, path: Path) -> None:
        super().__init__()
        self.net = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        mask, labels = batch["attention_mask"], batch["labels"]
        first = self.net(input_ids=batch["input_ids"], attention_mask=mask, labels=labels)
        second = self.net(input_ids=batch["input_ids"].flip(1), labels=labels.flip(1))
        return first.loss + 0.5 * second.loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3, weight_decay=0.01)


def test_two_forwards_before_one_backward_keep_two_sets_of_boundaries(
    tiny: SimpleNamespace, tmp_path: Path
) -> None:
    path = saved("llama", tmp_path / "ckpt")
    strategy = _same_as_plain(tiny, lambda: _TwoForwards(path), 2, 2, H, forwards=2)
    assert strategy.store is not None and "boundary.0.1.0" in strategy.store.names()
    strategy.close()
