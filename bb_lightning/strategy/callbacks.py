"""Seeing what happens: throughput in the progress bar and loggers, and an end-of-run summary.

:class:`ThroughputCallback` measures, per training batch, tokens/s, model
FLOP/s (and model FLOPs utilisation where the device's peak is known) and the
bytes/s moved on each copy link of the strategy's store
(:meth:`storage.store.TieredStore.stats`), shows them in the progress bar and
logs them to every Lightning logger. At the end of ``fit`` it prints the
predicted and measured seconds per optimizer step for each phase
(:func:`phase_summary`).
"""

from __future__ import annotations

import time
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_info

from bb_lightning.planner import ModelProfile
from bb_lightning.planner.cost import model_flops_per_token
from bb_lightning.probe import model_profile_from_config
from bb_lightning.probe.machine import datasheet_peak

__all__ = ["ThroughputCallback", "phase_summary"]


def _hf_model(module: pl.LightningModule) -> torch.nn.Module | None:
    from transformers import PreTrainedModel

    return next((m for m in module.modules() if isinstance(m, PreTrainedModel)), None)


def _tokens(batch: Any) -> tuple[int, int]:
    """(tokens, sequence length) of a batch holding ``input_ids`` (attention mask counted)."""
    if not isinstance(batch, dict) or not isinstance(batch.get("input_ids"), torch.Tensor):
        return 0, 0
    ids = batch["input_ids"]
    mask = batch.get("attention_mask")
    tokens = int(mask.sum()) if isinstance(mask, torch.Tensor) else ids.numel()
    return tokens, int(ids.shape[-1])


def _link_bytes(trainer: pl.Trainer) -> dict[str, int]:
    store = getattr(trainer.strategy, "store", None)
    if store is None:
        return {}
    try:
        return {link: s.bytes for link, s in store.stats().items()}
    except ValueError:  # a closed store
        return {}


def _peak_flops(trainer: pl.Trainer) -> float | None:
    """The device's datasheet dense bf16 FLOP/s, as the plan's MFU takes it
    (:func:`~bb_lightning.planner.presets.datasheet_flops`); None off CUDA or for a GPU
    without a listed figure."""
    return datasheet_peak(trainer.strategy.root_device) or None


class ThroughputCallback(Callback):
    """tokens/s, FLOP/s or MFU and bytes/s per copy link, per training batch.

    Logged names: ``tokens/s`` (tokens per second), ``GFLOP/s`` (1e9 model FLOPs
    per second, :func:`~bb_lightning.planner.cost.model_flops_per_token`, as the plan
    counts them), ``MFU`` (FLOP/s over the device's datasheet peak, where known) and ``<link> MB/s`` (1e6 bytes per second on each store
    link that moved bytes during the batch, e.g. ``nvme_read MB/s``). Rates are
    measured from the end of one training batch to the end of the next, so they
    include the optimizer step and data loading.
    """

    def __init__(self, *, prog_bar: bool = True, peak_flops: float | None = None) -> None:
        """Args:
        prog_bar: show the metrics in the progress bar (they are logged either way).
        peak_flops: the device's peak FLOP/s for MFU; None takes the datasheet figure of
            a listed GPU (none on a CPU).
        """
        if peak_flops is not None and not peak_flops > 0:
            raise ValueError(f"peak_flops={peak_flops} must be > 0 FLOP/s or None")
        self.prog_bar = prog_bar
        self.peak_flops = peak_flops
        self._profile: ModelProfile | None = None
        self._last: float | None = None
        self._links: dict[str, int] = {}
        self.last_metrics: dict[str, float] = {}
        """The metrics of the latest training batch."""
        self.totals = {"tokens": 0.0, "seconds": 0.0}
        """Training tokens and seconds measured since fit started."""

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        net = _hf_model(pl_module)
        config = getattr(net, "config", None)  # the blocks' parameters are paged out by now
        self._profile = model_profile_from_config(config) if config is not None else None
        if self.peak_flops is None:
            self.peak_flops = _peak_flops(trainer)

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if self._last is None:
            self._last = time.perf_counter()
            self._links = _link_bytes(trainer)

    def on_train_batch_end(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
    ) -> None:
        now = time.perf_counter()
        seconds = now - (self._last if self._last is not None else now)
        self._last = now
        links = _link_bytes(trainer)
        tokens, seq_len = _tokens(batch)
        if seconds <= 0.0 or tokens == 0:
            self._links = links
            return
        metrics = {"tokens/s": tokens / seconds}
        if self._profile is not None:
            flops = tokens * model_flops_per_token(self._profile, "fit", seq_len)
            metrics["GFLOP/s"] = flops / seconds / 1e9
            if self.peak_flops:
                metrics["MFU"] = flops / seconds / self.peak_flops
        for link, nbytes in links.items():
            moved = nbytes - self._links.get(link, 0)
            if moved > 0:
                metrics[f"{link} MB/s"] = moved / seconds / 1e6
        self._links = links
        self.totals["tokens"] += tokens
        self.totals["seconds"] += seconds
        self.last_metrics = metrics
        for key, value in metrics.items():
            pl_module.log(
                key, value, prog_bar=self.prog_bar, on_step=True, on_epoch=False, batch_size=1
            )

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.totals["seconds"] > 0:
            rank_zero_info(
                f"throughput: {self.totals['tokens'] / self.totals['seconds']:.4g} tokens/s "
                f"over {self.totals['tokens']:.0f} tokens"
            )
        for line in phase_summary(trainer.strategy):
            rank_zero_info(line)


def phase_summary(strategy: Any) -> list[str]:
    """Lines comparing predicted with measured seconds per optimizer step, per phase.

    Uses the strategy's plan (``strategy.plan.predicted``) and the engine's phase
    timer (``strategy.engine.timer``); prints what is available of either.
    """
    engine = getattr(strategy, "engine", None)
    timer = getattr(engine, "timer", None)
    measured = timer.mean(skip=1) if timer is not None and timer.steps else None
    plan = getattr(strategy, "plan", None)
    predicted = getattr(plan, "predicted", None)
    if measured is None and predicted is None:
        return []
    exposed = None if measured is None else measured.wait_page_in + measured.wait_grads
    rows: list[tuple[str, float | None, float | None]] = [
        ("step", getattr(predicted, "total", None), getattr(measured, "step", None)),
        ("compute", getattr(predicted, "compute", None), getattr(measured, "compute", None)),
        ("exposed copy", getattr(predicted, "exposed", None), exposed),
        ("optimizer", getattr(predicted, "optimizer", None), getattr(measured, "optimizer", None)),
    ]

    def fmt(x: float | None) -> str:
        return "-" if x is None else f"{x:.4g}"

    n = getattr(timer, "count", 0)
    lines = [f"seconds per optimizer step ({n} steps measured; predicted from the plan):"]
    lines.append(f"  {'phase':<14}{'predicted':>12}{'measured':>12}")
    lines += [f"  {name:<14}{fmt(p):>12}{fmt(m):>12}" for name, p, m in rows]
    return lines
