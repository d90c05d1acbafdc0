"""The host kernels a ``fit`` on a CPU device runs with their own backward, installed and
taken back together: the attention's on the matrix tiles or vectors
(:mod:`~bb_lightning.engine.train_attention`, a mapping of transformers' ``sdpa`` for every
model of the process) and, over the fitted model, the Llama family's RMS norms'
(:mod:`~bb_lightning.engine.train_norm`). The norms keep the forward torch computes; the
attention computes its own, as close to float64 as torch's. Each serves only the calls it
computes as the class would; the strategy installs them at its setup for a fit and takes
them back first at its teardown."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from bb_lightning.engine import train_attention, train_norm

__all__ = ["install"]


def install(device: torch.device, model: nn.Module) -> Callable[[], None]:
    """The attention's backward (:func:`~bb_lightning.engine.train_attention.install`) and,
    over ``model``, its RMS norms' (:func:`~bb_lightning.engine.train_norm.
    install`); return the function that restores both, the norms first (the attention's
    mapping even where that raises)."""
    attention = train_attention.install(device)
    norms = train_norm.install(device, model)

    def restore() -> None:
        try:
            norms()
        finally:
            attention()

    return restore
