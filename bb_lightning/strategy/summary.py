"""What a person reads at the start of a run: real parameter counts, the placement in words,
and a progress bar with the epoch count and the generation rate.

Under ``balance_beam`` the blocks' parameters are bound to one empty tensor whenever they
are not paged in (:class:`~bb_lightning.engine.pager.BlockPager`), so Lightning's model
summary, counting ``p.numel()``, sees only the embedding, final norm and head.
:class:`PagedSummary` counts each paged parameter at the shape the pager records for it;
:func:`use_paged_summary` swaps Lightning's default summary callbacks for ones that use it
(as Lightning's own summary callback does for DeepSpeed's sharded parameters).

:func:`describe_placement` says a :class:`~bb_lightning.placement.Placement` in one
line of words. :class:`BalanceBeamProgressBar` is Lightning's rich progress bar with the
number of epochs a ``max_steps`` run spans (Lightning prints ``Epoch 0/-2`` there) and the
generated tokens/s while predicting.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterable, Mapping
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import ModelSummary, RichModelSummary
from lightning.pytorch.callbacks.progress.rich_progress import RichProgressBar
from lightning.pytorch.utilities.model_summary import ModelSummary as Summary

from bb_lightning.placement import Placement
from storage.tiers import Tier

__all__ = [
    "BalanceBeamProgressBar",
    "PagedModelSummary",
    "PagedRichModelSummary",
    "PagedSummary",
    "describe_placement",
    "paged_sizes",
    "use_paged_summary",
]


# -- the placement in words ---------------------------------------------------------------


def _runs(tiers: tuple[Tier, ...]) -> str:
    """``blocks 0-3 on nvme, block 4 on host`` for consecutive blocks of one tier."""
    parts: list[str] = []
    start = 0
    for i in range(1, len(tiers) + 1):
        if i == len(tiers) or tiers[i] is not tiers[start]:
            span = f"block {start}" if i - 1 == start else f"blocks {start}-{i - 1}"
            parts.append(f"{span} on {tiers[start].value}")
            start = i
    return ", ".join(parts) if parts else "no blocks"


def describe_placement(placement: Placement) -> str:
    """One line of words: where each block's weights, optimizer state and gradients live.

    E.g. ``4 blocks; weights: blocks 0-3 on nvme (paged); master weights and AdamW
    moments: blocks 0-3 on nvme; gradients: blocks 0-3 on host; prefetch depth 1,
    optimizer state read 2 blocks ahead``.
    """
    n = len(placement.weights)
    resident = sum(w is Tier.DEVICE for w in placement.weights)
    paged = (
        "all resident" if resident == n else "paged" if resident == 0 else f"{resident} resident"
    )
    parts = [
        f"{n} block{'s' if n != 1 else ''}",
        f"weights: {_runs(placement.weights)} ({paged})",
        f"master weights and AdamW moments: {_runs(placement.master)}",
        f"gradients: {_runs(placement.grad_tiers)}",
        f"prefetch depth {placement.prefetch_depth}, optimizer state read "
        f"{placement.read_ahead} block{'s' if placement.read_ahead != 1 else ''} ahead"
        + (", resident blocks recomputed" if placement.recompute_resident else ""),
    ]
    return "; ".join(parts)


# -- the model summary with the paged parameters' real sizes -------------------------------


def paged_sizes(strategy: Any) -> dict[int, int]:
    """Elements of each paged parameter (keyed by ``id``) as its block's pager records them.

    Empty when ``strategy`` runs no paging engine (its ``engine`` or ``inference``).
    """
    engine = getattr(strategy, "engine", None) or getattr(strategy, "inference", None)
    pager = getattr(engine, "pager", None)
    if pager is None:
        return {}
    sizes: dict[int, int] = {}
    pairs = [*zip(pager.params, pager.shapes, strict=True)]
    pairs += [*zip(pager.frozen, pager.frozen_shapes, strict=True)]
    for params, shapes in pairs:
        for p, shape in zip(params, shapes, strict=True):
            sizes[id(p)] = math.prod(shape)
    return sizes


class PagedSummary(Summary):
    """Lightning's model summary counting paged parameters at their real sizes.

    ``sizes`` maps ``id(parameter)`` to its elements (:func:`paged_sizes`); every other
    parameter counts ``numel()`` as in Lightning. The estimated size in MB follows.
    """

    def __init__(
        self, model: pl.LightningModule, sizes: Mapping[int, int], max_depth: int = 1
    ) -> None:
        self._sizes = dict(sizes)
        super().__init__(model, max_depth=max_depth)

    def _count(self, params: Iterable[torch.nn.Parameter]) -> int:
        return sum(self._sizes.get(id(p), p.numel()) for p in params)

    @property
    def param_nums(self) -> list[int]:
        modules = dict(self.named_modules)
        return [self._count(modules[name].parameters()) for name in self.layer_names]

    @property
    def total_parameters(self) -> int:
        return self._count(self._model.parameters())

    @property
    def trainable_parameters(self) -> int:
        return self._count(p for p in self._model.parameters() if p.requires_grad)


class _PagedSummaryMixin:
    _max_depth: int

    def _summary(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> Summary:
        return PagedSummary(pl_module, paged_sizes(trainer.strategy), max_depth=self._max_depth)


class PagedModelSummary(_PagedSummaryMixin, ModelSummary):
    """Lightning's ``ModelSummary`` callback with :class:`PagedSummary` counts."""


class PagedRichModelSummary(_PagedSummaryMixin, RichModelSummary):
    """Lightning's ``RichModelSummary`` callback with :class:`PagedSummary` counts."""


def use_paged_summary(trainer: pl.Trainer) -> None:
    """Swap the Trainer's ``ModelSummary`` / ``RichModelSummary`` callbacks (those exact
    classes: Lightning's default, or the user's, with their ``max_depth`` and options) for
    :class:`PagedModelSummary` / :class:`PagedRichModelSummary`. Subclasses are kept."""
    swap: dict[type, type] = {
        ModelSummary: PagedModelSummary,
        RichModelSummary: PagedRichModelSummary,
    }
    callbacks = trainer.callbacks  # type: ignore[attr-defined]
    for i, cb in enumerate(callbacks):
        new = swap.get(type(cb))
        if new is not None:
            callbacks[i] = new(max_depth=cb._max_depth, **cb._summarize_kwargs)


# -- the progress bar ----------------------------------------------------------------------


def _generated_tokens(outputs: Any) -> int:
    """New tokens of a predict batch's outputs (``token_ids`` of each record)."""
    if not isinstance(outputs, list):
        return 0
    return sum(len(r.get("token_ids") or ()) for r in outputs if isinstance(r, dict))


class BalanceBeamProgressBar(RichProgressBar):
    """Lightning's rich progress bar, with the epochs a ``max_steps`` run spans and the
    generated tokens/s while predicting.

    ``Epoch e/E`` counts as Lightning does (``E`` the last epoch's index); when the run is
    bounded by ``max_steps`` (``max_epochs`` -1), ``E + 1 = ceil(max_steps x
    accumulate_grad_batches / training batches per epoch)``, and no ``/E`` when the epoch
    length is unknown. Predicting, the description reads ``Predicting · N tokens/s``:
    tokens generated (the ``token_ids`` of each output record) per second since the first
    predict batch started.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._predict_t0: float | None = None
        self._predict_tokens = 0
        self.predict_tokens_per_s: float | None = None
        """Generated tokens/s of the latest ``predict`` so far (None before its first batch)."""

    def last_epoch(self) -> int | None:
        """Index of the run's last epoch (None when the epoch length is unknown)."""
        trainer = self.trainer
        if trainer.max_epochs is not None and trainer.max_epochs >= 0:
            return trainer.max_epochs - 1
        batches = trainer.num_training_batches
        if (
            not trainer.max_steps
            or trainer.max_steps < 0
            or not math.isfinite(batches)
            or batches < 1
        ):
            return None
        total = trainer.max_steps * trainer.accumulate_grad_batches
        return max(1, math.ceil(total / batches)) - 1

    def _get_train_description(self, current_epoch: int) -> str:
        last = self.last_epoch()
        text = f"Epoch {current_epoch}" + ("" if last is None else f"/{last}")
        return f"{text:{len(self.validation_description)}}"

    def on_predict_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        super().on_predict_start(trainer, pl_module)
        self._predict_t0, self._predict_tokens, self.predict_tokens_per_s = None, 0, None

    def on_predict_batch_start(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        batch: Any,
        batch_idx: int,
        dataloader_idx: int = 0,
    ) -> None:
        super().on_predict_batch_start(trainer, pl_module, batch, batch_idx, dataloader_idx)
        if self._predict_t0 is None:
            self._predict_t0 = time.perf_counter()

    def on_predict_batch_end(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
        dataloader_idx: int = 0,
    ) -> None:
        self._predict_tokens += _generated_tokens(outputs)
        seconds = time.perf_counter() - (self._predict_t0 or time.perf_counter())
        if seconds > 0 and self._predict_tokens:
            self.predict_tokens_per_s = self._predict_tokens / seconds
            if self.progress is not None and self.predict_progress_bar_id is not None:
                text = f"{self.predict_description} · {self.predict_tokens_per_s:.4g} tokens/s"
                style = self.theme.description
                self.progress.update(
                    self.predict_progress_bar_id, description=f"[{style}]{text}" if style else text
                )
        super().on_predict_batch_end(trainer, pl_module, outputs, batch, batch_idx, dataloader_idx)
