"""The bytes a block's backward allocates beyond what its forward saved, found on ``meta``.

A checkpointed block is recomputed in backward: its forward saves its activations again
(``ModelProfile.act_bytes_per_token_full``), then its backward writes the gradients of
its intermediate activations (the gradient of the MLP's wide product, of the gated
branch, of the attention's projections) while the saved tensors they are computed from
are still held. :func:`backward_workspace_bytes` runs one block's forward and backward
on ``meta`` stand-ins (no memory, no arithmetic), its parameters frozen (their gradients
are priced as the gradients in flight), and counts the live bytes of every storage the
two make: the peak during backward less what was live when backward began, gradient
flowing in included.
"""

from __future__ import annotations

import functools
import weakref
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map
from transformers.cache_utils import Cache

__all__ = ["backward_workspace_bytes"]

_CACHE_KWARGS = ("past_key_values", "past_key_value", "layer_past", "cache_params", "cache")
"""Keyword arguments through which Hugging Face blocks receive a KV or state cache."""


class _LiveBytes(TorchDispatchMode):
    """Counts the bytes of the storages made while active that are still alive, and their peak."""

    def __init__(self) -> None:
        super().__init__()
        self.live = 0
        self.peak = 0
        self._refs: dict[int, weakref.ref[Any]] = {}

    def _free(self, key: int, size: int, _ref: object = None) -> None:
        if self._refs.pop(key, None) is not None:
            self.live -= size

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        flat, _ = tree_flatten((args, kwargs))
        viewed = {t.untyped_storage()._cdata for t in flat if isinstance(t, torch.Tensor)}
        made, _ = tree_flatten(out)
        for t in made:
            if isinstance(t, torch.Tensor):
                storage = t.untyped_storage()
                key = storage._cdata  # a view of an input is no new memory
                if key not in self._refs and key not in viewed and storage.nbytes() > 0:
                    size = storage.nbytes()
                    self._refs[key] = weakref.ref(storage, functools.partial(self._free, key, size))
                    self.live += size
        self.peak = max(self.peak, self.live)
        return out


def _first_tensor(out: Any) -> torch.Tensor:
    flat, _ = tree_flatten(out)
    for t in flat:
        if isinstance(t, torch.Tensor) and t.is_floating_point():
            return t
    raise ValueError("the block returned no floating-point tensor")


def backward_workspace_bytes(
    block: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> int:
    """Bytes ``block``'s backward holds at its peak beyond the live bytes when it begins
    (its saved activations, its output): the gradient flowing in and the gradients of its
    intermediate activations, for the call ``block(*args, **kwargs)`` as the forward made
    it (``meta`` tensors; the hidden states are the first floating-point tensor among
    ``args``, or ``kwargs["hidden_states"]``). The block runs in training mode; its
    parameters are taken as ``meta`` stand-ins in bf16 that need no gradient.
    """
    stand_ins = {
        name: torch.empty_like(
            p, device="meta", dtype=torch.bfloat16 if p.is_floating_point() else p.dtype
        )
        for name, p in [*block.named_parameters(), *block.named_buffers()]
    }

    def fresh(x: Any) -> Any:  # detached inputs: the trace's autograd graph is not reused
        return x.detach() if isinstance(x, torch.Tensor) else x

    args, kwargs = tree_map(fresh, (args, kwargs))
    for key, value in kwargs.items():  # a cache would tie the call to the traced forward's graph
        if key in _CACHE_KWARGS or isinstance(value, Cache):
            kwargs[key] = None
    if "use_cache" in kwargs:
        kwargs["use_cache"] = False
    hidden_pos = next(
        (i for i, a in enumerate(args) if isinstance(a, torch.Tensor) and a.is_floating_point()),
        None,
    )
    (args[hidden_pos] if hidden_pos is not None else kwargs["hidden_states"]).requires_grad_(True)
    tracker = _LiveBytes()
    was_training = block.training
    block.train()  # as in training: dropout's masks included
    try:
        with tracker:
            out = _first_tensor(torch.func.functional_call(block, stand_ins, args, kwargs))
            grad = torch.empty_like(out)
            start = tracker.live - grad.untyped_storage().nbytes()
            tracker.peak = tracker.live
            torch.autograd.backward(out, grad)
            del grad
    finally:
        block.train(was_training)
    return max(0, tracker.peak - start)
