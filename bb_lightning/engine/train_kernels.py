"""The host kernels a ``fit`` on a CPU device runs with their own backward, installed and
taken back together: the attention's on the matrix tiles or vectors
(:mod:`~bb_lightning.engine.train_attention`, a mapping of transformers' ``sdpa`` for every
model of the process) and, over the fitted model, the Llama family's RMS norms'
(:mod:`~bb_lightning.engine.train_norm`) and gated MLP activations'
(:mod:`~bb_lightning.engine.train_mlp`), and its rotary embeddings'
(:mod:`~bb_lightning.engine.host_rope`). The norms, the activations and the rotary
embeddings keep the forward torch computes; the attention computes its own, as close to
float64 as torch's. Each serves only the calls it computes as the class would; the strategy
installs them at its setup for a fit and takes them back first at its teardown."""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
from torch import nn

from bb_lightning.engine import host_rope, train_attention, train_mlp, train_norm

__all__ = ["backward_kinds", "install", "install_model", "undo_all"]


def install(device: torch.device, model: nn.Module) -> Callable[[], None]:
    """The attention's backward (:func:`~bb_lightning.engine.train_attention.install`) and,
    over ``model``, :func:`install_model`'s; return the function that restores both, the
    model's first (the attention's mapping even where that raises)."""
    attention = train_attention.install(device)
    try:
        others = install_model(device, model)
    except BaseException:
        attention()
        raise

    def restore() -> None:
        try:
            others()
        finally:
            attention()

    return restore


def install_model(device: torch.device, model: nn.Module) -> Callable[[], None]:
    """Over ``model``, the RMS norms' backward (:func:`~bb_lightning.engine.train_norm.
    install`), the gated MLP activations' (:func:`~bb_lightning.engine.train_mlp.install`)
    and, on a CPU device, the rotary embeddings' (swapped in the model files,
    :func:`~bb_lightning.engine.host_rope.install`: the process's until restored); return the
    function that restores them, in the reverse order (:func:`undo_all`)."""
    restores = [train_norm.install(device, model)]
    try:
        restores.append(train_mlp.install(device, model))
        if device.type == "cpu":
            restores.append(host_rope.install(model))
    except BaseException:
        undo_all(restores)
        raise
    return functools.partial(undo_all, restores)


def undo_all(restores: list[Callable[[], None]]) -> None:
    """Call each of ``restores`` from the last (emptying it), each even where a later one
    raised."""
    if restores:
        last = restores.pop()
        try:
            last()
        finally:
            undo_all(restores)


def backward_kinds(device: torch.device, dtype: torch.dtype) -> str:
    """The backwards :func:`install_model` gives a fit on ``device`` in ``dtype``: the norms',
    the activations' and the rotary embeddings' kinds (the model-shaped probe keys its
    recorded rate by them)."""
    rope = host_rope.backward_kind(device, dtype)
    return (
        f"{train_norm.backward_kind(device, dtype)}/{train_mlp.backward_kind(device, dtype)}/{rope}"
    )
