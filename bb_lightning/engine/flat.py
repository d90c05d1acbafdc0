"""Flat tensors: a block's parameters laid end to end, and how they reach the store.

The engines store each block's parameters as one flat 1-D tensor per kind (compute-dtype
weights, fp32 master weights, moments, gradient sums; see :mod:`bb_lightning.engine.pager`).
This module holds the helpers both engines share: laying parameters end to end in fp32
(from the module or a checkpoint, one tensor at a time), views of a flat buffer shaped like
the parameters, binding a value to a parameter (also one on the meta device), moving the
buffers, the compute dtype's names, and registering a manifest entry in the store.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch
from torch import Tensor, nn

from bb_lightning.placement import Placement, StoredTensor
from storage.store import TieredStore

__all__ = [
    "BlockLoader",
    "ParamLoader",
    "block_params",
    "buffers_to",
    "cat_fp32",
    "dtype_name",
    "flat_from",
    "flat_views",
    "flatten_fp32",
    "register_stored",
    "set_data",
    "split_frozen",
    "torch_dtype",
]

ParamLoader = Callable[[Tensor], Tensor]
"""A (meta) parameter -> its value as a CPU tensor, read from a checkpoint."""

BlockLoader = Callable[[int], Tensor]
"""Block index -> the block's parameters as one flat fp32 CPU tensor, laid out like its
:class:`FlatState` (used to fill the store from a checkpoint one block at a time)."""


def register_stored(store: TieredStore, entry: StoredTensor, value: Tensor | None = None) -> None:
    """Register manifest ``entry`` in ``store``: ``value`` (flat, cast to the entry's dtype)
    or zeros. Raises ``ValueError`` when ``value`` has another number of elements.

    Every tensor an engine stores is the store's scratch: this run writes it (here, from
    the module, a checkpoint or zeros) before reading it, and only this run reads it, so
    on NVMe it goes without a CRC-32C trailer unless ``StoreConfig.scratch_checksums``;
    the checksum pass would otherwise cost a core-second per ~6 GB read or written, on
    every weight pass and optimizer step. Checkpoints carry their own checksums.
    """
    dtype = getattr(torch, entry.dtype)
    if value is None:
        store.register(entry.name, shape=(entry.numel,), dtype=dtype, home=entry.home, scratch=True)
        return
    if value.numel() != entry.numel:
        raise ValueError(
            f"{entry.name!r} has {value.numel()} elements but the manifest {entry.numel}: "
            "build the manifest from this model's sizes"
        )
    store.register(entry.name, value.reshape(-1).to(dtype), home=entry.home, scratch=True)


def torch_dtype(placement: Placement) -> torch.dtype:
    """The torch dtype of ``placement.compute_dtype``."""
    dtype = getattr(torch, placement.compute_dtype)
    assert isinstance(dtype, torch.dtype)
    return dtype


def dtype_name(dtype: torch.dtype) -> str:
    """The name :attr:`Placement.compute_dtype` gives ``dtype`` (``torch.bfloat16`` ->
    ``"bfloat16"``)."""
    return str(dtype).removeprefix("torch.")


def block_params(module: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """Named parameters of ``module`` in registration order, shared ones once."""
    return list(module.named_parameters(remove_duplicate=True))


def set_data(param: Tensor, value: Tensor) -> None:
    """``param.data = value``, also for a parameter on the meta device (swapped in place,
    so the parameter object and every reference to it stay the same)."""
    if param.is_meta and not value.is_meta:
        # a parameter of its own holding ``value``: ``nn.Parameter(value)`` would share
        # value's version counter, as an alias does, so parameters bound to one tensor (the
        # empty stand-in of unbound ones) would share one, and an in-place change to one
        # (peft's parametrization of fused experts) would void the others' saved tensors
        new = nn.Parameter(
            torch.empty(0, dtype=value.dtype, device=value.device),
            requires_grad=param.requires_grad,
        )
        new.data = value
        torch.utils.swap_tensors(param, new)
    else:
        param.data = value


def flatten_fp32(params: Sequence[Tensor]) -> Tensor:
    """The parameters laid end to end as one flat fp32 CPU tensor."""
    if any(p.is_meta for p in params):
        raise ValueError(
            "parameters are on the meta device and no initial values were given: "
            "load the weights (or pass a BlockLoader) before paging the model"
        )
    return cat_fp32([p.detach() for p in params])


def flat_from(params: Sequence[Tensor], load: ParamLoader) -> Tensor:
    """The values ``load(p)`` of ``params`` laid end to end in one fp32 CPU buffer.

    Reads one tensor at a time (a checkpoint never needs to be whole in memory);
    raises ``ValueError`` when a loaded value's shape differs from its parameter's.
    """
    flat = torch.empty(sum(p.numel() for p in params), dtype=torch.float32)
    offset = 0
    for p in params:
        value = load(p)
        if tuple(value.shape) != tuple(p.shape):
            raise ValueError(
                f"checkpoint tensor has shape {tuple(value.shape)} but the model expects "
                f"{tuple(p.shape)}: the checkpoint does not match the model config"
            )
        flat[offset : offset + p.numel()].copy_(value.reshape(-1))
        offset += p.numel()
        del value
    return flat


def buffers_to(model: nn.Module, device: torch.device, compute_dtype: torch.dtype) -> None:
    """Move the model's buffers to ``device``; floating-point ones in ``compute_dtype``."""
    for module in model.modules():
        for key, buf in module._buffers.items():
            if buf is not None:
                dtype = compute_dtype if buf.is_floating_point() else buf.dtype
                module._buffers[key] = buf.to(device, dtype)


def cat_fp32(views: Sequence[Tensor]) -> Tensor:
    """Tensors laid end to end as one flat fp32 CPU tensor (empty for none)."""
    if not views:
        return torch.empty(0, dtype=torch.float32)
    return torch.cat([v.reshape(-1).to("cpu", torch.float32) for v in views])


def split_frozen(flat: Tensor, params: Sequence[Tensor]) -> tuple[Tensor, Tensor]:
    """A block's flat values (laid out like ``params``) as two flat fp32 tensors: those of
    the trainable parameters, then those of the frozen ones, each in ``params`` order."""
    views = flat_views(flat, [p.shape for p in params])
    trained = [v for p, v in zip(params, views, strict=True) if p.requires_grad]
    frozen = [v for p, v in zip(params, views, strict=True) if not p.requires_grad]
    return cat_fp32(trained), cat_fp32(frozen)


def flat_views(flat: Tensor, shapes: Sequence[Sequence[int] | torch.Size]) -> list[Tensor]:
    """Views of consecutive slices of a 1-D buffer with the given shapes (no copy).

    Args:
        flat: contiguous 1-D tensor holding at least ``sum(prod(shape))`` elements.
        shapes: shapes of the tensors laid end to end in ``flat``.

    Returns:
        One view per shape, sharing storage with ``flat``.
    """
    if flat.dim() != 1 or not flat.is_contiguous():
        raise ValueError(
            f"flat has shape {tuple(flat.shape)} (contiguous={flat.is_contiguous()}): "
            "pass a contiguous 1-D buffer"
        )
    sizes = [math.prod(s) for s in shapes]
    total = sum(sizes)
    if total > flat.numel():
        raise ValueError(
            f"shapes need {total} elements but flat holds {flat.numel()}: "
            "allocate the buffer with the sum of the tensors' numel"
        )
    views = []
    offset = 0
    for shape, size in zip(shapes, sizes, strict=True):
        views.append(flat[offset : offset + size].view(tuple(shape)))
        offset += size
    return views
