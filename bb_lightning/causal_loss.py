"""The causal-LM training loss with the head and the cross-entropy run chunk by chunk.

transformers' causal-LM forward projects every position onto the vocabulary and upcasts
the logits to fp32 before the loss: a 64k-token pass at a 128k vocabulary holds 32 GiB of
fp32 logits, and the loss's backward three buffers of that size
(:func:`bb_lightning.planner.cost.logits_bytes`). :func:`causal_lm_loss` runs the model
with its head skipped (the hidden states the head would see are kept), then the head,
the family's transform of its output (:func:`~bb_lightning.engine.hf_quirks.head_logits_of`)
and the summed cross-entropy of ``chunk_tokens`` positions at a time, each chunk but the
last under activation checkpointing: one chunk's logits live at a time, in forward and in
backward. The last chunk's backward is the first to run, so the log-softmax it keeps from
its forward is what a recompute would rebuild at that moment: it is kept, and the head's
product and the cross-entropy of a pass that fits in one chunk run once.
The result is transformers' loss (labels shifted one to the left, ``-100`` ignored, the
mean over the labels kept, an MoE's load-balancing loss added as its forward adds it),
with the same gradients.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from bb_lightning.engine.hf_quirks import head_logits_of, unchunked_head

__all__ = ["IGNORE_INDEX", "causal_lm_loss"]

IGNORE_INDEX = -100
"""Label of a position the loss skips (transformers' and torch's ``ignore_index``)."""


@contextmanager
def _head_skipped(head: nn.Module) -> Iterator[list[Tensor]]:
    """Within the block the head returns an empty projection of its input (no vocabulary
    entries) and records that input (the hidden states) in the list yielded."""
    seen: list[Tensor] = []
    own = head.__dict__.get("forward")

    def skip(hidden: Tensor, *args: Any, **kwargs: Any) -> Tensor:
        seen.append(hidden)
        return hidden[..., :0]

    head.forward = skip  # type: ignore[method-assign]
    try:
        yield seen
    finally:
        if own is None:
            del head.forward
        else:
            head.forward = own  # type: ignore[method-assign]


def _chunk_loss(head: nn.Module, config: Any, hidden: Tensor, labels: Tensor) -> Tensor:
    """Summed cross-entropy (nats) of one chunk: ``hidden`` [n, width], ``labels`` [n]."""
    logits = head_logits_of(config, head(hidden)).float()
    return F.cross_entropy(logits, labels, ignore_index=IGNORE_INDEX, reduction="sum")


def causal_lm_loss(
    net: nn.Module,
    input_ids: Tensor,
    attention_mask: Tensor | None,
    labels: Tensor,
    chunk_tokens: int,
) -> Tensor:
    """Mean next-token cross-entropy (nats per kept label) of a causal LM, its head and loss
    run over ``chunk_tokens`` positions at a time (``input_ids``, ``labels`` [batch, seq]).

    Equal to ``net(input_ids, attention_mask=..., labels=labels).loss``, gradients too.
    A family whose head transform :func:`head_logits_of` does not reproduce
    (:func:`~bb_lightning.engine.hf_quirks.unchunked_head`) runs that whole forward instead.
    """
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens={chunk_tokens!r}: must be >= 1 (tokens per loss chunk)")
    config = getattr(net, "config", None)
    getter = getattr(net, "get_output_embeddings", None)
    head = getter() if callable(getter) else None
    if not isinstance(head, nn.Module) or unchunked_head(config) is not None:
        return net(input_ids=input_ids, attention_mask=attention_mask, labels=labels).loss
    with _head_skipped(head) as seen:
        out = net(input_ids=input_ids, attention_mask=attention_mask)
    if len(seen) != 1:
        raise RuntimeError(
            f"the model's forward ran its head {len(seen)} times, not once: pass "
            "loss_chunk_tokens=0 to compute its loss whole"
        )
    hidden = seen[0]
    width = hidden.shape[-1]
    shifted = F.pad(labels, (0, 1), value=IGNORE_INDEX)[..., 1:].reshape(-1)
    flat = hidden.reshape(-1, width)
    if flat.shape[0] != shifted.shape[0]:
        raise RuntimeError(
            f"the head saw {flat.shape[0]} positions for {shifted.shape[0]} labels: pass "
            "loss_chunk_tokens=0 to compute the loss whole"
        )
    shifted = shifted.to(flat.device)
    grad = torch.is_grad_enabled()
    total: Tensor | None = None
    positions = flat.shape[0]
    for start in range(0, positions, chunk_tokens):
        h, y = flat[start : start + chunk_tokens], shifted[start : start + chunk_tokens]
        # The last chunk's backward runs first, right after this forward: what it keeps
        # (its log-softmax) is what a recompute would rebuild there, so it keeps it.
        part = (
            checkpoint(_chunk_loss, head, config, h, y, use_reentrant=False)
            if grad and start + chunk_tokens < positions
            else _chunk_loss(head, config, h, y)
        )
        total = part if total is None else total + part
    assert total is not None
    loss = total / (shifted != IGNORE_INDEX).sum()
    aux = getattr(out, "aux_loss", None)
    if isinstance(aux, Tensor):  # an MoE's load-balancing loss, added as its forward adds it
        loss = loss + getattr(config, "router_aux_loss_coef", 0.0) * aux.to(loss.device)
    return loss
