"""The host kernels a ``fit`` on a CPU device runs with their own backward, installed and
taken back together: the attention's on the matrix tiles
(:mod:`~bb_lightning.engine.train_attention`, a mapping of transformers' ``sdpa`` for every
model of the process) and, over the fitted model, the Llama family's RMS norms'
(:mod:`~bb_lightning.engine.train_norm`). Each keeps the forward torch computes (the loss bit
for bit plain Lightning's) and serves only the calls it computes as the class would; the
strategy installs them at its setup for a fit and takes them back first at its teardown."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from bb_lightning.engine import host_norm, train_attention, train_norm

__all__ = ["backward_kind", "install", "install_modules"]


def install_modules(device: torch.device, model: nn.Module) -> Callable[[], None]:
    """The kernels over ``model``'s own modules (its RMS norms); return their restore."""
    return train_norm.install(device, model)


def install(device: torch.device, model: nn.Module | None) -> Callable[[], None]:
    """The attention's backward (:func:`~bb_lightning.engine.train_attention.install`) and,
    over ``model`` when given, :func:`install_modules`; return the function that restores
    all of them, the modules first (the attention's mapping even where that raises)."""
    attention = train_attention.install(device)
    if model is None:
        return attention
    modules = install_modules(device, model)

    def restore() -> None:
        try:
            modules()
        finally:
            attention()

    return restore


def backward_kind(device: torch.device, dtype: torch.dtype) -> str:
    """Which backward a fit on ``device`` computing in ``dtype`` gives the RMS norms:
    ``"kernel"`` or ``"autograd"`` (the model-shaped probe keys its recorded rate by it)."""
    served = device.type == "cpu" and dtype == torch.bfloat16 and host_norm.kernel() is not None
    return "kernel" if served else "autograd"
