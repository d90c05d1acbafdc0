"""Data parallelism for the training engine: optimizer state sharded across ranks.

With ``world_size`` N > 1 every rank pages a full copy of the weights, but holds only
one shard of each flat state (fp32 master weights, AdamW moments, gradient
accumulator): a flat state of ``numel`` elements is cut into N contiguous ranges of
``S = ceil(numel / N)`` elements, the last padded with zeros, and rank ``r`` holds range
``r`` (:meth:`ShardComm.bounds`). The shard of one rank is therefore
:func:`~bb_lightning.planner.cost.shard_numel` elements, as the planner prices it.

Per block, per micro-batch: the block's gradients are laid end to end in one padded
fp32 buffer of ``N * S`` elements, scaled by ``1 / N`` (gloo has no average) and
reduce-scattered (:meth:`ShardComm.reduce_scatter`): each rank receives the mean over
the ranks of its own range and adds it to its shard accumulator. After the rank's host
AdamW step of a shard, the shard is cast to the compute dtype and all-gathered
(:meth:`ShardComm.all_gather`) into the full flat weights every rank writes home.

The collectives run on a process group of their own (:meth:`ShardComm.from_world`),
from one thread at a time, in the same order on every rank: the gradient worker's
FIFO during backward, the caller's thread while the worker is idle (the step, a
checkpoint, the initial weights check). Lightning's own reductions use the world group.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import Tensor

__all__ = ["ShardComm", "digest"]


class ShardComm:
    """The engine's collectives over ``group``, for ``world_size`` > 1 ranks.

    Not thread-safe: one thread at a time calls it (see the module docstring). Its
    buffers (a padded fp32 gradient buffer and a shard buffer) grow once to the largest
    flat state and are reused.
    """

    def __init__(self, group: dist.ProcessGroup | None, *, rank: int, world_size: int) -> None:
        """Collectives of rank ``rank`` of ``world_size`` over ``group`` (None: the world)."""
        if world_size < 2 or not 0 <= rank < world_size:
            raise ValueError(
                f"rank={rank} of world_size={world_size}: sharding needs world_size >= 2 and "
                "0 <= rank < world_size (one process runs without a ShardComm)"
            )
        self.group = group
        self.rank = rank
        self.world_size = world_size
        self._pack = torch.empty(0, dtype=torch.float32)
        self._part = torch.empty(0, dtype=torch.float32)
        self.bytes_sent = 0
        """Bytes this rank handed to the collectives since it was built (payload, unpadded
        ring traffic not counted: ``(N - 1) / N`` of it crosses the network)."""

    @classmethod
    def from_world(cls, backend: str = "gloo", timeout: timedelta | None = None) -> ShardComm:
        """A ShardComm on a new process group of every rank of the initialised world.

        ``backend`` is the new group's (``"gloo"`` reduces host tensors, which is where
        the engine's gradients and optimizer state are). Every rank must call it, in the
        same order as its other ``new_group`` calls.
        """
        if not dist.is_available() or not dist.is_initialized():
            raise ValueError(
                "ShardComm.from_world needs an initialised torch.distributed world: run under "
                "a Lightning Trainer with devices > 1 or num_nodes > 1"
            )
        group = dist.new_group(backend=backend, timeout=timeout)
        return cls(group, rank=dist.get_rank(), world_size=dist.get_world_size())

    # -- layout -------------------------------------------------------------------

    def shard_numel(self, numel: int) -> int:
        """Elements of one rank's shard of a flat state of ``numel`` elements."""
        return -(-numel // self.world_size)

    def bounds(self, numel: int) -> tuple[int, int]:
        """``[start, stop)`` of this rank's range in a flat state of ``numel`` elements
        (``stop - start`` is below :meth:`shard_numel` for the last ranks when padded)."""
        s = self.shard_numel(numel)
        start = min(self.rank * s, numel)
        return start, min(start + s, numel)

    def shard_of(self, full: Tensor) -> Tensor:
        """A copy of this rank's range of the flat ``full``, zero-padded to the shard size."""
        numel = full.numel()
        start, stop = self.bounds(numel)
        out = torch.zeros(self.shard_numel(numel), dtype=full.dtype)
        out[: stop - start].copy_(full.reshape(-1)[start:stop])
        return out

    # -- collectives --------------------------------------------------------------

    def reduce_scatter(
        self, grads: Sequence[Tensor | None], shapes: Sequence[tuple[int, ...]]
    ) -> Tensor:
        """This rank's shard of the mean over ranks of the gradients laid end to end.

        ``grads`` (host tensors of any float dtype, None for a parameter without one,
        counted as zeros) are shaped like ``shapes``. Returns a view of the comm's shard
        buffer (fp32, :meth:`shard_numel` elements), valid until the next call.
        """
        numel = sum(math.prod(s) for s in shapes)
        s = self.shard_numel(numel)
        pack = self._buffer("_pack", s * self.world_size)
        offset = 0
        for shape, g in zip(shapes, grads, strict=True):
            size = math.prod(shape)
            view = pack[offset : offset + size]
            if g is None:
                view.zero_()
            else:
                view.copy_(g.reshape(-1))
            offset += size
        pack[numel:].zero_()
        pack.mul_(1.0 / self.world_size)
        part = self._buffer("_part", s)
        dist.reduce_scatter_tensor(part, pack, op=dist.ReduceOp.SUM, group=self.group)
        self.bytes_sent += pack.numel() * 4
        return part

    def all_gather(self, shard: Tensor, out: Tensor) -> Tensor:
        """Every rank's ``shard`` laid end to end (rank order) in ``out``; returns ``out``.

        ``shard`` (host, contiguous) has :meth:`shard_numel` elements of the flat state;
        ``out`` holds at least ``world_size`` times that, of the same dtype.
        """
        n = shard.numel() * self.world_size
        if out.numel() < n or out.dtype != shard.dtype:
            raise ValueError(
                f"all_gather output holds {out.numel()} {out.dtype} elements; need {n} "
                f"{shard.dtype} (world_size x shard)"
            )
        dst = out[:n]
        dist.all_gather_into_tensor(dst, shard.contiguous(), group=self.group)
        self.bytes_sent += shard.numel() * shard.element_size()
        return dst

    def sum(self, value: float) -> float:
        """``value`` summed over the ranks (fp64)."""
        t = torch.tensor([value], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.SUM, group=self.group)
        return float(t.item())

    def check_equal(self, labels: Sequence[str], digests: Sequence[int]) -> None:
        """Raise ``ValueError`` naming every ``labels[i]`` whose ``digests[i]`` differs
        between ranks (the initial weights must be the same on every rank)."""
        mine = torch.tensor(list(digests), dtype=torch.int64)
        low, high = mine.clone(), mine.clone()
        dist.all_reduce(low, op=dist.ReduceOp.MIN, group=self.group)
        dist.all_reduce(high, op=dist.ReduceOp.MAX, group=self.group)
        bad = [labels[i] for i in torch.nonzero(low != high).flatten().tolist()]
        if bad:
            raise ValueError(
                f"the initial weights differ between the {self.world_size} ranks in "
                f"{', '.join(bad)}: every rank must start from the same weights: load them "
                "from one checkpoint (save_pretrained) or seed the model's initialisation "
                "identically on every rank (lightning.seed_everything before building it)"
            )

    def _buffer(self, attr: str, numel: int) -> Tensor:
        buf: Tensor = getattr(self, attr)
        if buf.numel() < numel:
            buf = torch.empty(numel, dtype=torch.float32)
            setattr(self, attr, buf)
        return buf[:numel]


def digest(flat: Tensor) -> int:
    """A CRC-32C of a flat tensor's bytes (the same values give the same digest)."""
    from storage.checksum import crc32c

    data = flat.detach().contiguous().reshape(-1).cpu()
    return int(crc32c(data.view(torch.uint8)))
