"""Bytes each tier of the store needs: the manifest's tensors summed as the arenas count them.

The manifest (:func:`~bb_lightning.placement.training_manifest`,
:func:`~bb_lightning.placement.weights_manifest`) lists every tensor an engine registers;
:func:`store_budgets` sums it per home tier, padded like the arenas, plus the device's
paging slots. :func:`model_sizes` counts a model's parameters as the manifest takes them
(:class:`~bb_lightning.placement.ModelSizes`), and :func:`check_budgets` refuses a store
too small before any tensor is written.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence

from torch import nn

from bb_lightning.engine.flat import block_params
from bb_lightning.engine.shard import ShardLayout
from bb_lightning.placement import (
    ModelSizes,
    Placement,
    StoredTensor,
    training_manifest,
    weights_manifest,
)
from storage.device import slot_bytes
from storage.tiers import Tier

__all__ = [
    "check_budgets",
    "frozen_shard_counts",
    "model_sizes",
    "param_counts",
    "required_budgets",
    "shard_counts",
    "store_budgets",
    "training_budgets",
    "weights_budgets",
]


def store_budgets(manifest: Sequence[StoredTensor], placement: Placement) -> dict[Tier, int]:
    """Bytes each tier needs to hold ``manifest`` and page its blocks as ``placement`` says.

    Each tensor counts :func:`storage.device.slot_bytes` of its size on its home, the
    arenas' accounting (padded to 4 KiB, at least 4 KiB even when empty), so many small
    tensors fit; on NVMe, which counts exact bytes, that is an upper bound. The device
    also holds ``prefetch_depth + 1`` paging slots of the largest block's compute-dtype
    weights. The parameters outside the blocks are ordinary device tensors, not counted.
    """
    need = dict.fromkeys(Tier, 0)
    per_block: dict[int, int] = {}
    for t in manifest:
        need[t.home] += slot_bytes(t.nbytes)
        if t.block is not None:
            per_block[t.block] = per_block.get(t.block, 0) + slot_bytes(t.nbytes)
    need[Tier.DEVICE] += (placement.prefetch_depth + 1) * max(per_block.values(), default=0)
    return need


def required_budgets(
    block_numels: Sequence[int],
    resident_numel: int,
    placement: Placement,
    frozen_numels: Sequence[int] | None = None,
    *,
    shards: int = 1,
    shard_numels: Sequence[int] = (),
    shard_rest: int = 0,
    shard_frozen: Sequence[int] = (),
) -> dict[Tier, int]:
    """Bytes each tier needs for this placement: :func:`store_budgets` of the :func:`~bb_lightning.placement.training_manifest` (every tensor
    the engine stores, padded like the arenas, plus the device's paging slots).

    ``block_numels`` and ``resident_numel`` count trainable parameters; ``frozen_numels``
    (None: none) the frozen parameters of each block, which cost only their
    compute-dtype weights on the weights' home and in the paging slots. ``shards`` is the
    data-parallel world size: each rank stores one shard of the fp32 state, of
    ``shard_numels`` elements per block and ``shard_rest`` outside (:func:`shard_counts`),
    and one shard of the weights (``shard_frozen`` of each block's frozen ones,
    :func:`frozen_shard_counts`).
    """
    sizes = ModelSizes(
        blocks=tuple(block_numels),
        frozen=() if frozen_numels is None else tuple(frozen_numels),
        rest=resident_numel,
        shard_blocks=tuple(shard_numels) if shards > 1 else (),
        shard_rest=shard_rest if shards > 1 else 0,
        shard_frozen=tuple(shard_frozen) if shards > 1 else (),
    )
    return training_budgets(sizes, placement, shards=shards)


def training_budgets(
    sizes: ModelSizes, placement: Placement, *, shards: int = 1
) -> dict[Tier, int]:
    """Bytes each tier needs to train a model of ``sizes`` (elements) as ``placement`` says
    over ``shards`` data-parallel ranks: :func:`store_budgets` of its training manifest."""
    return store_budgets(training_manifest(sizes, placement, shards=shards), placement)


def weights_budgets(
    block_numels: Sequence[int], placement: Placement, external: Collection[int] = ()
) -> dict[Tier, int]:
    """Bytes each tier needs to page these blocks' weights (no optimizer state):
    :func:`store_budgets` of the
    :func:`~bb_lightning.placement.weights_manifest` (each block's compute-dtype weights,
    padded like the arenas, on their home; plus the device's paging slots). The blocks
    ``external`` (NVMe-homed, read in place from files the run does not own) need no
    bytes on NVMe."""
    manifest = weights_manifest(ModelSizes(blocks=tuple(block_numels)), placement)
    need = store_budgets(manifest, placement)
    need[Tier.NVME] -= sum(slot_bytes(t.nbytes) for t in manifest if t.block in external)
    return need


def param_counts(model: nn.Module, blocks: Sequence[nn.Module]) -> tuple[list[int], int, list[int]]:
    """Parameters (elements) as :func:`required_budgets` takes them: trainable ones per
    block, trainable ones outside the blocks, frozen ones per block."""
    lists = [[p for _, p in block_params(b)] for b in blocks]
    in_blocks = {id(p) for ps in lists for p in ps}
    rest = sum(p.numel() for p in model.parameters() if id(p) not in in_blocks and p.requires_grad)
    trainable = [sum(p.numel() for p in ps if p.requires_grad) for ps in lists]
    frozen = [sum(p.numel() for p in ps if not p.requires_grad) for ps in lists]
    return trainable, rest, frozen


def shard_counts(
    model: nn.Module, blocks: Sequence[nn.Module], world_size: int
) -> tuple[list[int], int]:
    """Elements of one rank's shard of each block's trainable state, and of the trainable
    parameters outside the blocks, over ``world_size`` ranks (padding included)."""
    lists = [[p for _, p in block_params(b) if p.requires_grad] for b in blocks]
    in_blocks = {id(p) for b in blocks for _, p in block_params(b)}
    rest = [p for p in model.parameters() if id(p) not in in_blocks and p.requires_grad]
    per_block = [ShardLayout([p.shape for p in ps], world_size).shard_numel for ps in lists]
    return per_block, ShardLayout([p.shape for p in rest], world_size).shard_numel


def frozen_shard_counts(blocks: Sequence[nn.Module], world_size: int) -> list[int]:
    """Elements of one rank's shard of each block's frozen weights over ``world_size``
    ranks (padding included)."""
    lists = [[p for _, p in block_params(b) if not p.requires_grad] for b in blocks]
    return [ShardLayout([p.shape for p in ps], world_size).shard_numel for ps in lists]


def model_sizes(model: nn.Module, blocks: Sequence[nn.Module], world_size: int = 1) -> ModelSizes:
    """The elements of ``model``'s parameters as the training manifest takes them: trainable
    and frozen per block, trainable outside the blocks, and with ``world_size > 1`` one
    rank's shard of each (:func:`param_counts`, :func:`shard_counts`)."""
    trainable, rest, frozen = param_counts(model, blocks)
    shard_blocks, shard_rest = (
        ([], 0) if world_size == 1 else shard_counts(model, blocks, world_size)
    )
    return ModelSizes(
        blocks=tuple(trainable),
        frozen=tuple(frozen),
        rest=rest,
        shard_blocks=tuple(shard_blocks),
        shard_rest=shard_rest,
        shard_frozen=() if world_size == 1 else tuple(frozen_shard_counts(blocks, world_size)),
    )


def check_budgets(need: Mapping[Tier, int], have: Mapping[Tier, int]) -> None:
    """Raise ``ValueError`` naming every tier whose budget (bytes) is below ``need``.

    Called before the store opens, so a placement that cannot fit fails before any
    tensor is written.
    """
    short = [t for t in Tier if need[t] > have[t]]
    if short:
        lines = ", ".join(
            f"{t.value} budget {have[t]} bytes < {need[t]} bytes needed" for t in short
        )
        raise ValueError(
            f"the store budgets are too small for this model and placement: {lines}: raise "
            "those budgets in StoreConfig, or pass store=None to size them automatically, "
            "or home more blocks on a larger tier"
        )
