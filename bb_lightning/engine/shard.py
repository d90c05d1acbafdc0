"""Data parallelism for the training engine: weights and optimizer state sharded across ranks.

With ``world_size`` N > 1 every rank holds one shard of each block's compute-dtype
weights and of each flat state (fp32 master weights, AdamW moments, gradient
accumulator), in the dim-0 layout of :class:`ShardLayout`: a parameter of ``rows`` rows
(its first dimension; a scalar is one row) is cut into N row ranges of
``C = ceil(rows / N)`` rows, and rank ``r`` holds rows ``[r * C, (r + 1) * C)`` of every
parameter, zero-padded to ``C`` rows, laid end to end. A rank's rows of a parameter are
therefore exactly chunk ``r`` of that parameter's array when it is chunked along dim 0
by ``C`` rows, which is how a checkpoint stores it (each rank writes its own chunks,
:mod:`bb_lightning.engine.checkpoint`). The ranks of a node thus hold one copy of the
weights between them (FSDP's and ZeRO-3's pattern).

Page-in: each rank copies its shard of a block's weights to the compute device, where the
whole block is assembled (:meth:`ShardComm.assemble`: an all-gather, then the shards'
rows unpacked into the flat weights the parameters view). After backward, per block and
micro-batch, the block's gradients are packed rank by rank into one fp32 buffer of
``N * S`` elements on the compute device (``S``: the shard's elements) and
reduce-scattered there (:meth:`ShardComm.reduce_scatter_async`, overlapped with the
backward of the next block): each rank receives the sum over the ranks of its own rows,
scales it by ``1 / N`` (gloo has no average) and only that shard leaves the device for
the host accumulator. After a rank's host AdamW step of its shard it writes the shard's
compute-dtype weights home; no rank gathers the weights on the host.

On a CUDA device the collectives run over NCCL (the groups' backend is
``cpu:gloo,cuda:nccl``), each on the communicator's own stream; on a CPU device the same
code runs over gloo on CPU tensors. The collectives run on two process groups of their
own (:meth:`ShardComm.from_world`), both from the training thread, in the same order on
every rank: the page-ins' all-gathers on one, everything else (the reduce-scatters, the
step's sums, the checkpoint's gathers, the initial weights check) on the other, so an
all-gather never waits behind a reduce-scatter another rank issues later. Lightning's
own reductions use the world group.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import Tensor

from storage.checksum import crc32c

__all__ = ["Piece", "Reduced", "ShardComm", "ShardLayout", "check_same_start", "digest"]


class ShardComm:
    """The engine's collectives over ``group``, for ``world_size`` ranks.

    The strategy runs one process without one (nothing to shard); a world of one rank
    still runs every collective (the GPU check runs the NCCL path so).

    Not thread-safe: one thread at a time calls it (see the module docstring).
    ``gather_group`` carries the page-ins' all-gathers (None: ``group``).
    """

    def __init__(
        self,
        group: dist.ProcessGroup | None,
        *,
        rank: int,
        world_size: int,
        gather_group: dist.ProcessGroup | None = None,
    ) -> None:
        """Collectives of rank ``rank`` of ``world_size`` over ``group`` (None: the world)."""
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(
                f"rank={rank} of world_size={world_size}: give world_size >= 1 and "
                "0 <= rank < world_size"
            )
        self.group = group
        self.gather_group = group if gather_group is None else gather_group
        self.rank = rank
        self.world_size = world_size
        self._stream: torch.cuda.Stream | None = None
        self.bytes_sent = 0
        """Bytes this rank handed to the collectives since it was built (payload, unpadded
        ring traffic not counted: ``(N - 1) / N`` of it crosses the network)."""

    @classmethod
    def from_world(cls, backend: str | None = None, timeout: timedelta | None = None) -> ShardComm:
        """A ShardComm on two new process groups of every rank of the initialised world.

        ``backend`` is the new groups' (None: ``"cpu:gloo,cuda:nccl"`` where CUDA and NCCL
        are available, so that tensors on a GPU are reduced over NCCL and host tensors
        over gloo; else ``"gloo"``). Every rank must call it, in the same order as its
        other ``new_group`` calls.
        """
        if not dist.is_available() or not dist.is_initialized():
            raise ValueError(
                "ShardComm.from_world needs an initialised torch.distributed world: run under "
                "a Lightning Trainer with devices > 1 or num_nodes > 1"
            )
        if backend is None:
            nccl = torch.cuda.is_available() and dist.is_nccl_available()
            backend = "cpu:gloo,cuda:nccl" if nccl else "gloo"
        group = dist.new_group(backend=backend, timeout=timeout)
        gathers = dist.new_group(backend=backend, timeout=timeout)
        return cls(
            group, rank=dist.get_rank(), world_size=dist.get_world_size(), gather_group=gathers
        )

    # -- collectives --------------------------------------------------------------

    def reduce_scatter_async(
        self,
        grads: Sequence[Tensor | None],
        layout: ShardLayout,
        device: torch.device | None = None,
    ) -> Reduced:
        """Start reducing the gradients of a flat state on their device: this rank's shard
        of their sum over the ranks, in a :class:`Reduced` (:meth:`Reduced.mean` waits).

        ``grads`` (tensors of any float dtype on the compute device, None for a parameter
        without one, counted as zeros) are shaped like ``layout``'s parameters; they are
        packed rank by rank into a new fp32 buffer on their device (``device`` where every
        one is None), so the caller may free them at once.
        """
        s = layout.shard_numel
        first = next((g.device for g in grads if g is not None), None)
        device = first or device or torch.device("cpu")
        pack = torch.empty(s * self.world_size, dtype=torch.float32, device=device)
        part = torch.empty(s, dtype=torch.float32, device=device)
        if s == 0:  # nothing to reduce (the same on every rank: the layouts are equal)
            return Reduced(part, None)
        layout.pack(grads, pack)
        pack.mul_(1.0 / self.world_size)  # the sum becomes the mean (gloo has no average)
        work = dist.reduce_scatter_tensor(
            part, pack, op=dist.ReduceOp.SUM, group=self.group, async_op=True
        )
        self.bytes_sent += pack.numel() * 4
        return Reduced(part, work, self._side_stream(device))

    def _side_stream(self, device: torch.device) -> torch.cuda.Stream | None:
        """The stream that waits for this rank's reduce-scatters on a CUDA ``device`` (the
        copies of their results to the host are queued after it), None elsewhere."""
        if device.type != "cuda":
            return None
        if self._stream is None:
            self._stream = torch.cuda.Stream(device)
        return self._stream

    def assemble(self, shard: Tensor, layout: ShardLayout) -> Tensor:
        """The whole flat tensor (``layout.full_numel`` elements) from every rank's
        ``shard`` of it, on ``shard``'s device: an all-gather on the gather group, then each
        rank's rows unpacked into place. Every rank calls it for the same tensors in the
        same order."""
        gathered = torch.empty(
            layout.shard_numel * self.world_size, dtype=shard.dtype, device=shard.device
        )
        full = torch.empty(layout.full_numel, dtype=shard.dtype, device=shard.device)
        if layout.shard_numel:
            src = shard[: layout.shard_numel].contiguous()
            dist.all_gather_into_tensor(gathered, src, group=self.gather_group)
            self.bytes_sent += src.numel() * src.element_size()
        return layout.unpack(gathered, full)

    def all_gather(self, shard: Tensor, out: Tensor) -> Tensor:
        """Every rank's ``shard`` laid end to end (rank order) in ``out``; returns ``out``.

        ``shard`` (host, contiguous) is one rank's shard of a flat state; ``out`` holds at
        least ``world_size`` times its elements, of the same dtype.
        """
        n = shard.numel() * self.world_size
        if out.numel() < n or out.dtype != shard.dtype:
            raise ValueError(
                f"all_gather output holds {out.numel()} {out.dtype} elements; need {n} "
                f"{shard.dtype} (world_size x shard)"
            )
        dst = out[:n]
        if n == 0:
            return dst
        dist.all_gather_into_tensor(dst, shard.contiguous(), group=self.group)
        self.bytes_sent += shard.numel() * shard.element_size()
        return dst

    def sum(self, value: float) -> float:
        """``value`` summed over the ranks (fp64)."""
        t = torch.tensor([value], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.SUM, group=self.group)
        return float(t.item())

    def all_true(self, flag: bool) -> bool:
        """Whether ``flag`` holds on every rank."""
        t = torch.tensor([1 if flag else 0], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.group)
        return bool(t.item())

    def broadcast_object(self, obj: object, src: int = 0) -> object:
        """Rank ``src``'s ``obj`` (picklable) on every rank."""
        box = [obj]
        dist.broadcast_object_list(box, src=src, group=self.group)
        return box[0]

    def barrier(self) -> None:
        """Wait until every rank of the group arrived here."""
        dist.barrier(group=self.group)

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


class Reduced:
    """A reduce-scatter in flight (:meth:`ShardComm.reduce_scatter_async`): this rank's
    shard of the mean of the gradients over the ranks in :attr:`part`, once
    :meth:`mean` returned or within :meth:`ordered`."""

    def __init__(
        self, part: Tensor, work: dist.Work | None, stream: torch.cuda.Stream | None = None
    ) -> None:
        self.part = part
        """This rank's shard (fp32, on the compute device)."""
        self._work = work
        self._stream = stream

    def mean(self) -> Tensor:
        """:attr:`part`, once the collective is done: the caller waits for it (on CUDA the
        caller's stream does)."""
        if self._work is not None:
            self._work.wait()
            self._work = None
        return self.part

    @contextlib.contextmanager
    def ordered(self) -> Iterator[None]:
        """Meanwhile the current stream is one that waits for the collective: device
        work queued here (the copy of :attr:`part` to the host) runs after it, while the
        compute stream goes on with the next block's backward. Without CUDA the caller
        waits for the collective here."""
        if self._stream is None:
            self.mean()
            yield
            return
        with torch.cuda.stream(self._stream):
            self.mean()  # the side stream waits for the reduce-scatter, not the compute
            yield

    def then(self, work: Callable[[Sequence[Tensor | None]], object]) -> Callable[..., object]:
        """``work`` (of a batch of gradients) run after :meth:`mean`, on whichever thread
        runs it (the gradient sink's worker)."""

        def run(batch: Sequence[Tensor | None]) -> object:
            self.mean()
            return work(batch)

        return run


@dataclass(frozen=True)
class Piece:
    """Where one parameter lies in a flat state and in a shard of it."""

    start: int
    """Offset (elements) of the parameter in the whole flat state."""
    rows: int
    """Rows of the parameter (its first dimension; 1 for a scalar)."""
    row: int
    """Elements per row."""
    chunk: int
    """Rows per rank: ``ceil(rows / world_size)``."""
    offset: int
    """Offset (elements) of the parameter's rows in every shard."""

    def rows_of(self, rank: int) -> tuple[int, int]:
        """``[lo, hi)``: the rows rank ``rank`` holds (empty for the last ranks of a
        parameter with fewer rows than ranks)."""
        lo = min(rank * self.chunk, self.rows)
        return lo, min(lo + self.chunk, self.rows)


class ShardLayout:
    """The dim-0 shard layout of one flat state over ``world_size`` ranks (see the module
    docstring): every rank's shard has :attr:`shard_numel` elements."""

    def __init__(self, shapes: Sequence[Sequence[int]], world_size: int) -> None:
        if world_size < 1:
            raise ValueError(f"world_size={world_size} must be >= 1")
        self.world_size = world_size
        self.pieces: list[Piece] = []
        full = shard = 0
        for shape in shapes:
            rows = int(shape[0]) if len(shape) else 1
            row = math.prod(shape[1:]) if len(shape) else 1
            chunk = -(-rows // world_size)
            self.pieces.append(Piece(start=full, rows=rows, row=row, chunk=chunk, offset=shard))
            full += rows * row
            shard += chunk * row
        self.full_numel = full
        """Elements of the whole flat state."""
        self.shard_numel = shard
        """Elements of one rank's shard (padding included)."""

    def _rank_rows(self, piece: Piece, buf: Tensor, rank: int) -> Tensor:
        """Rank ``rank``'s ``chunk`` rows of ``piece`` in a rank-ordered buffer of shards."""
        at = rank * self.shard_numel + piece.offset
        return buf[at : at + piece.chunk * piece.row].view(piece.chunk, piece.row)

    def pack(self, grads: Sequence[Tensor | None], out: Tensor) -> Tensor:
        """Per-parameter tensors (None: zeros) into ``out``, rank by rank (``world_size``
        shards, padding zeroed); returns ``out``."""
        for piece, g in zip(self.pieces, grads, strict=True):
            rows = None if g is None else g.reshape(piece.rows, piece.row)
            for rank in range(self.world_size):
                lo, hi = piece.rows_of(rank)
                dst = self._rank_rows(piece, out, rank)
                if rows is not None:
                    dst[: hi - lo].copy_(rows[lo:hi])
                    dst[hi - lo :].zero_()
                else:
                    dst.zero_()
        return out

    def unpack(self, gathered: Tensor, out: Tensor) -> Tensor:
        """The whole flat state (``out``, :attr:`full_numel` elements) from every rank's
        shard laid end to end in rank order (``gathered``); returns ``out``."""
        for piece in self.pieces:
            for rank in range(self.world_size):
                lo, hi = piece.rows_of(rank)
                if hi > lo:
                    dst = out[piece.start + lo * piece.row : piece.start + hi * piece.row]
                    dst.view(hi - lo, piece.row).copy_(
                        self._rank_rows(piece, gathered, rank)[: hi - lo]
                    )
        return out[: self.full_numel]

    def take(self, full: Tensor, rank: int, out: Tensor) -> Tensor:
        """Rank ``rank``'s shard of the whole flat ``full`` into ``out`` (zero-padded)."""
        flat = full.reshape(-1)
        for piece in self.pieces:
            lo, hi = piece.rows_of(rank)
            dst = out[piece.offset : piece.offset + piece.chunk * piece.row].view(
                piece.chunk, piece.row
            )
            src = flat[piece.start + lo * piece.row : piece.start + hi * piece.row]
            dst[: hi - lo].copy_(src.view(hi - lo, piece.row))
            dst[hi - lo :].zero_()
        return out[: self.shard_numel]

    def rows_in_shard(self, piece: Piece, shard: Tensor) -> Tensor:
        """``piece``'s ``chunk`` rows (padding included) in one rank's ``shard``."""
        return shard[piece.offset : piece.offset + piece.chunk * piece.row].view(
            piece.chunk, piece.row
        )


def check_same_start(
    comm: ShardComm,
    model: torch.nn.Module,
    blocks: Sequence[torch.nn.Module],
    digests: Sequence[int | None],
    frozen_digests: Sequence[int | None],
    frozen_params: Sequence[Tensor],
) -> None:
    """Raise ``ValueError`` unless every rank starts from the same weights: ``digests`` of
    each block's flat state then of the resident one, ``frozen_digests`` of each block's
    frozen weights (None: none), and the frozen parameters outside the blocks."""
    where = {id(m): name for name, m in model.named_modules()}
    labels = [f"block {i} ({where.get(id(b), '?')})" for i, b in enumerate(blocks)]
    labels.append("the parameters outside the blocks (embedding, final norm, head)")
    found = list(digests)
    for i, frozen in enumerate(frozen_digests):  # a LoRA base, say
        if frozen is not None:
            labels.append(f"the frozen weights of block {i} ({where.get(id(blocks[i]), '?')})")
            found.append(frozen)
    if frozen_params:
        values = [p.detach().reshape(-1).to("cpu", torch.float32) for p in frozen_params]
        labels.append("the frozen parameters outside the blocks")
        found.append(digest(torch.cat(values)))
    assert all(d is not None for d in found)
    comm.check_equal(labels, [int(d) for d in found if d is not None])


def digest(flat: Tensor) -> int:
    """A CRC-32C of a flat tensor's bytes (the same values give the same digest)."""
    data = flat.detach().contiguous().reshape(-1).cpu()
    return int(crc32c(data.view(torch.uint8)))
