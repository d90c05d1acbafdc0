"""fp32 master weights, AdamW moments and gradient sums of one block, in the store.

A :class:`FlatState` holds, each as one flat 1-D tensor laid out like its parameters,
``<name>.master``, ``.exp_avg``, ``.exp_avg_sq`` (homes: ``Placement.master``) and the
fp32 gradient accumulator ``<name>.grad`` (home: ``Placement.grads``), summed over the
micro-batches of an accumulation window. On HOST it is summed in place; elsewhere it is
read into a scratch buffer, summed and written back, and only when the sum must outlive
the backward pass (see :meth:`FlatState.accumulate`). Under data parallelism each holds
this rank's shard (:mod:`bb_lightning.engine.shard`).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping, Sequence

import torch
from torch import Tensor

from bb_lightning.engine.flat import flat_views, flatten_fp32, register_stored
from bb_lightning.engine.grad_sink import sum_tiles
from bb_lightning.engine.shard import ShardComm, ShardLayout, digest
from bb_lightning.placement import StoredTensor, state_pieces
from storage.io import aligned_empty
from storage.store import Ticket, TieredStore
from storage.tiers import Tier

__all__ = ["FlatState", "read_piece", "read_piece_now", "write_piece"]


def read_piece(store: TieredStore, name: str, buf: Tensor, a: int, b: int) -> Ticket:
    """Start reading elements ``[a, b)`` of flat tensor ``name`` into the start of ``buf``
    (a host buffer of one piece, 4 KiB-padded): the whole tensor in one read when the
    range is all of it, else the range alone."""
    if a == 0 and b == store.spec(name).shape[0]:
        return store.read_async(name, buf[:b])
    return store.read_range_async(name, buf, a, b - a)


def read_piece_now(store: TieredStore, name: str, buf: Tensor, a: int, b: int) -> Tensor:
    """Elements ``[a, b)`` of flat tensor ``name`` read into the start of ``buf`` now (as
    :func:`read_piece`, the whole tensor by :meth:`~storage.store.TieredStore.read`)."""
    if a == 0 and b == store.spec(name).shape[0]:
        return store.read(name, out=buf[:b])
    read_piece(store, name, buf, a, b).wait_host()
    return buf[: b - a]


def write_piece(store: TieredStore, name: str, buf: Tensor, a: int, b: int) -> Ticket:
    """Start writing the start of ``buf`` over elements ``[a, b)`` of flat tensor ``name``
    (as :func:`read_piece`); ``buf`` stays unchanged until the ticket's ``wait_host``."""
    if a == 0 and b == store.spec(name).shape[0]:
        return store.write_back_async(name, buf[:b])
    return store.write_range_async(name, buf, a, b - a)


ZERO_PIECE = 16 << 20
"""Elements of the zeros written at a time over a moment homed on NVMe (64 MiB of fp32)."""


def _write_zeros(store: TieredStore, name: str) -> None:
    """Write zeros over flat fp32 tensor ``name`` where it is homed on NVMe (its chunk is
    then on disk, as every later step finds it), a piece at a time from one small buffer:
    no tensor of the whole state is made. A checksummed array is written whole."""
    if store.home(name) is not Tier.NVME:
        return
    spec = store.spec(name)
    numel = spec.shape[0]
    if spec.checksum:
        store.write(name, torch.zeros(numel, dtype=torch.float32))
        return
    buf = aligned_empty(4 * min(numel, ZERO_PIECE)).view(torch.float32).zero_()
    for a, b in state_pieces(numel, ZERO_PIECE):
        store.write_range_async(name, buf, a, b - a).wait_host()


def _piece_tiles(
    shapes: Sequence[tuple[int, ...]],
    batches: Sequence[Sequence[Tensor | None]],
    a: int,
    b: int,
) -> list[tuple[int, int, list[Tensor | None]]]:
    """``(lo, hi, slices)`` of each tensor that elements ``[a, b)`` of a flat buffer laid out
    as ``shapes`` cover: its elements ``[lo, hi)`` of the piece, and each batch's flat slice
    of its tensor there (None where a batch has none)."""
    tiles: list[tuple[int, int, list[Tensor | None]]] = []
    start = 0
    for j, shape in enumerate(shapes):
        end = start + math.prod(shape)
        lo, hi = max(a, start), min(b, end)
        if lo < hi:
            slices = [None if (g := batch[j]) is None else g.reshape(-1)[lo - start : hi - start]
                      for batch in batches]  # fmt: skip
            tiles.append((lo - a, hi - a, slices))
        start = end
    return tiles


def _piece_views(
    shapes: Sequence[tuple[int, ...]],
    batches: Sequence[Sequence[Tensor | None]],
    a: int,
    b: int,
    out: Tensor,
) -> tuple[list[Tensor], list[list[Tensor | None]]]:
    """The parts of ``out`` (elements ``[a, b)`` of a flat buffer laid out as ``shapes``)
    that each tensor covers, and the matching flat slices of each batch's tensors."""
    tiles = _piece_tiles(shapes, batches, a, b)
    views = [out[lo:hi] for lo, hi, _ in tiles]
    return views, [[slices[k] for _, _, slices in tiles] for k in range(len(batches))]


class FlatState:
    """fp32 master weights, AdamW moments and gradient accumulator, in the store.

    ``params`` are laid end to end in one flat buffer of ``numel`` elements.
    The master weights are initialised from ``initial`` (flat fp32) when given,
    else from the parameters' current values (which may then not be on the meta device).
    Its four tensors (``<name>.master``, ``.exp_avg``, ``.exp_avg_sq``, ``.grad``) are
    registered as the ``manifest`` entries of those names say (homes, sizes, dtypes).

    With ``comm`` (data parallelism, :mod:`bb_lightning.engine.shard`) the four hold this
    rank's shard only: :attr:`numel` is the shard's elements, :attr:`full_numel` the
    parameters'; :meth:`accumulate` takes this rank's shard of the reduced gradients, and
    :meth:`gather` gives the whole flat state from every rank's shard.
    """

    def __init__(
        self,
        store: TieredStore,
        name: str,
        params: Sequence[Tensor],
        *,
        manifest: Mapping[str, StoredTensor],
        initial: Tensor | None = None,
        comm: ShardComm | None = None,
    ) -> None:
        self.store = store
        self.name = name
        self.comm = comm
        """The collectives of data parallelism (None: one process holds the whole state)."""
        self.shapes = [tuple(p.shape) for p in params]
        self.full_numel = sum(math.prod(s) for s in self.shapes)
        """Elements of the parameters laid end to end."""
        self.layout = None if comm is None else ShardLayout(self.shapes, comm.world_size)
        """Where each parameter's rows lie in a shard (None without ``comm``)."""
        self.numel = self.full_numel if self.layout is None else self.layout.shard_numel
        """Elements of each stored tensor (this rank's shard under ``comm``)."""
        master = initial if initial is not None else flatten_fp32(params)
        if master.shape != (self.full_numel,) or master.dtype != torch.float32:
            raise ValueError(
                f"initial values of {name!r} have shape {tuple(master.shape)} and {master.dtype}; "
                f"expected ({self.full_numel},) and torch.float32: lay the parameters end to end"
            )
        self.digest = digest(master) if comm is not None else None
        """CRC-32C of the initial values under ``comm`` (checked equal on every rank)."""
        if comm is not None:
            master = self.local(master, torch.empty(self.numel, dtype=torch.float32))
        register_stored(store, manifest[self.master_name], master)
        for kind in ("exp_avg", "exp_avg_sq"):  # zeros, made by the store
            register_stored(store, manifest[f"{name}.{kind}"])
            _write_zeros(store, f"{name}.{kind}")
        register_stored(store, manifest[self.grad_name])
        self.grad_pending = False
        """Whether the accumulator holds gradients since the last :meth:`clear_grad`."""
        self.held: list[Sequence[Tensor | None]] = []
        """Gradients of earlier micro-batches kept as they came (:meth:`hold`), not yet
        summed into the accumulator."""

    @property
    def grad_name(self) -> str:
        """Store name of the flat fp32 gradient accumulator."""
        return f"{self.name}.grad"

    def accumulate(
        self, grads: Sequence[Tensor | None], scratch: Tensor | None, *, persist: bool = True
    ) -> Tensor:
        """Add per-parameter gradients (any dtype, host) to the accumulator; the flat sum.

        A HOST-home accumulator is summed in place (``scratch`` unused). Otherwise the
        sum is formed in ``scratch`` (fp32, at least ``numel`` elements; the stored sum
        is read first when one is pending) and, with ``persist``, written to its home
        before returning (the gradient worker calls it; the training thread only where
        nothing is homed on NVMe, see ``TrainingEngine._inline_grads``).
        Without ``persist`` the sum lives only in ``scratch`` (the caller steps from it).
        Gradients :meth:`hold` kept are summed first, in the order they came. Under
        ``comm`` ``grads`` is one flat tensor, this rank's shard of the mean over the ranks
        (reduced on the device: :meth:`ShardComm.reduce_scatter_async`).
        """
        if self.comm is not None:  # this rank's shard of the mean, reduced on the device
            self._check_reduced(grads)
            return self._sum([grads], [(self.numel,)], scratch, persist)
        return self._sum([*self.held, grads], self.shapes, scratch, persist)

    def hold(self, grads: Sequence[Tensor | None]) -> None:
        """Keep ``grads`` (host tensors the caller no longer touches) to sum later.

        Adding a micro-batch's gradient to an fp32 accumulator reads and writes the
        accumulator each time (``compute bytes + 8`` per element); held gradients are
        summed once, tile by tile, when the next :meth:`accumulate` or :meth:`gradient`
        needs the sum (``compute bytes`` per element each, plus 4 for the sum), in the
        same order and fp32 arithmetic, so the sum is the same. Each held micro-batch
        keeps its gradients' memory until then. Not under ``comm``: the ranks reduce
        every micro-batch's gradient.
        """
        if self.comm is not None:
            raise ValueError(
                f"{self.name!r} is sharded over {self.comm.world_size} ranks: its gradients "
                "are reduce-scattered as they come; call accumulate"
            )
        self.held.append(grads)

    def _sum(
        self,
        batches: Sequence[Sequence[Tensor | None]],
        shapes: Sequence[tuple[int, ...]],
        scratch: Tensor | None,
        persist: bool,
    ) -> Tensor:
        """The accumulator plus ``batches`` (each one gradient per view), stored as
        :meth:`accumulate` says; forgets the held gradients."""
        first = not self.grad_pending
        if self.store.home(self.grad_name) is Tier.HOST:
            flat = self.store.host_view(self.grad_name)
            persist = False
        else:
            if scratch is None or scratch.numel() < self.numel:
                raise ValueError(
                    f"{self.grad_name!r} is homed on {self.store.home(self.grad_name).value}: "
                    f"pass an fp32 scratch buffer of at least {self.numel} elements"
                )
            flat = scratch[: self.numel]
            if not first:
                self.store.read(self.grad_name, out=flat)
        # nothing to add to: the first gradients are copied in (absent ones as zeros)
        sum_tiles(flat_views(flat, shapes), batches, into=not first)
        self.held = []
        self.grad_pending = True
        if persist:
            self.store.write(self.grad_name, flat)
        return flat

    def pieces(self, piece: int) -> list[tuple[int, int]]:
        """``(start, end)`` of the pieces of ``piece`` elements this state is stepped in."""
        return state_pieces(self.numel, piece)

    def _check_reduced(self, grads: Sequence[Tensor | None]) -> None:
        """Under ``comm``: ``ValueError`` unless ``grads`` is this rank's reduced shard."""
        if self.comm is not None and (
            len(grads) != 1 or grads[0] is None or grads[0].numel() != self.numel
        ):
            raise ValueError(
                f"{self.name!r} is sharded over {self.comm.world_size} ranks: accumulate "
                f"takes this rank's reduced shard, one flat tensor of {self.numel} "
                "elements (ShardComm.reduce_scatter_async)"
            )

    def gradient_piece(
        self, a: int, b: int, out: Tensor, fresh: Sequence[Tensor | None] | None = None
    ) -> Tensor:
        """Elements ``[a, b)`` of the accumulated gradient, the held gradients and ``fresh``
        (per-parameter gradients, or this rank's reduced shard under ``comm``) summed, in
        ``out[: b - a]`` (fp32, a piece buffer); nothing is stored. For an accumulator homed
        off the host (a HOST one is summed in place: :meth:`accumulate`)."""
        dst = out[: b - a]
        batches = [*self.held, *([] if fresh is None else [fresh])]
        if fresh is not None:
            self._check_reduced(fresh)
        if self.grad_pending:
            read_piece_now(self.store, self.grad_name, out, a, b)
        elif not batches:
            return dst.zero_()
        if batches:
            shapes = [(self.numel,)] if self.comm is not None else self.shapes
            views, sliced = _piece_views(shapes, batches, a, b, dst)
            sum_tiles(views, sliced, into=self.grad_pending)
        return dst

    def gradient_parts(
        self, a: int, b: int, buf: Tensor, fresh: Sequence[Tensor | None] | None = None
    ) -> tuple[Tensor | None, list[tuple[int, int, list[Tensor]]]]:
        """What :meth:`gradient_piece` sums for elements ``[a, b)``, unsummed: the
        accumulated gradient's piece (a HOST home's view, else read into ``buf``, fp32; None
        when none is pending) and each tensor's ``(lo, hi, sources)`` in the piece, its held
        gradients' and ``fresh``'s slices in order (a one-pass optimizer step sums them)."""
        if fresh is not None:
            self._check_reduced(fresh)
        acc = None
        if self.grad_pending and self.store.home(self.grad_name) is Tier.HOST:
            acc = self.store.host_view(self.grad_name)[a:b]
        elif self.grad_pending:
            read_piece_now(self.store, self.grad_name, buf, a, b)
            acc = buf[: b - a]
        batches = [*self.held, *([] if fresh is None else [fresh])]
        shapes = [(self.numel,)] if self.comm is not None else self.shapes
        tiles = _piece_tiles(shapes, batches, a, b)
        return acc, [(lo, hi, [g for g in srcs if g is not None]) for lo, hi, srcs in tiles]

    def accumulate_pieces(
        self,
        grads: Sequence[Tensor | None],
        buf: Tensor | None,
        piece: int,
        *,
        norm: bool = False,
    ) -> Tensor | None:
        """:meth:`accumulate`: in place on the host (``buf`` unused), else through ``buf``
        one piece of ``piece`` elements at a time (read, summed, written back); with
        ``norm`` the fp32 2-norm of the new sum (0-d), else None."""
        if self.store.home(self.grad_name) is Tier.HOST or buf is None:
            flat = self.accumulate(grads, buf)
            return torch.linalg.vector_norm(flat, 2.0, dtype=torch.float32) if norm else None
        norms = []
        for a, b in self.pieces(piece):
            flat = self.gradient_piece(a, b, buf, grads)
            if norm:
                norms.append(torch.linalg.vector_norm(flat, 2.0, dtype=torch.float32))
            write_piece(self.store, self.grad_name, buf, a, b).wait_host()
        self.held = []
        self.grad_pending = True
        return torch.linalg.vector_norm(torch.stack(norms), 2.0) if norm and norms else None

    def grad_norm(self, buf: Tensor | None, piece: int) -> Tensor:
        """The fp32 2-norm of the accumulated gradient (held gradients included): read
        piece by piece through ``buf`` where the accumulator is homed off the host."""
        if self.store.home(self.grad_name) is Tier.HOST or buf is None:
            return torch.linalg.vector_norm(self.gradient(buf), 2.0, dtype=torch.float32)
        norms = [
            torch.linalg.vector_norm(self.gradient_piece(a, b, buf), 2.0, dtype=torch.float32)
            for a, b in self.pieces(piece)
        ]
        if len(norms) == 1:
            return norms[0]
        return torch.linalg.vector_norm(torch.stack(norms), 2.0)

    def gradient(self, scratch: Tensor | None = None) -> Tensor:
        """The accumulated gradient (zeros when none is pending), flat fp32 on the host.

        A HOST-home accumulator is returned as a view of its home (no copy), the held
        gradients summed into it; another is read into ``scratch`` (a new tensor when
        None) and the held gradients are added there, still held (nothing is written).
        """
        if self.store.home(self.grad_name) is Tier.HOST:
            if self.held:
                return self._sum(self.held, self.shapes, None, False)
            flat = self.store.host_view(self.grad_name)
            return flat if self.grad_pending else flat.zero_()
        out = torch.empty(self.numel) if scratch is None else scratch[: self.numel]
        if self.held:
            if self.grad_pending:
                self.store.read(self.grad_name, out=out)
            sum_tiles(flat_views(out, self.shapes), self.held, into=self.grad_pending)
            return out
        if self.grad_pending:
            return self.store.read(self.grad_name, out=out)
        return out.zero_()

    def clear_grad(self) -> None:
        """Forget the accumulated and held gradients (after the optimizer step); nothing
        is written."""
        self.grad_pending = False
        self.held = []

    @property
    def master_name(self) -> str:
        """Store name of the flat fp32 master weights."""
        return f"{self.name}.master"

    @property
    def state_names(self) -> tuple[str, str, str]:
        """Store names of master weights, first and second moment."""
        return (self.master_name, f"{self.name}.exp_avg", f"{self.name}.exp_avg_sq")

    def read_master(self, out: Tensor | None = None) -> Tensor:
        """The fp32 master weights as a flat host tensor (into ``out`` when given)."""
        return self.store.read(self.master_name, out=out)

    def ranges(self) -> list[tuple[int, int]]:
        """Where each parameter's elements lie in a stored tensor, ``(start, end)``: end to
        end, or under ``comm`` its rows in this rank's shard (with their padding)."""
        if self.layout is None:
            ends = list(itertools.accumulate(math.prod(s) for s in self.shapes))
            return list(zip([0, *ends], ends, strict=False))
        return [(q.offset, q.offset + q.chunk * q.row) for q in self.layout.pieces]

    def master_views(self, flat: Tensor) -> list[Tensor]:
        """Per-parameter views of a whole flat buffer laid out like this state (under
        ``comm`` a shard must be gathered first: :meth:`gather`)."""
        return flat_views(flat, self.shapes)

    def gather(self, shard: Tensor, buf: Tensor | None = None, out: Tensor | None = None) -> Tensor:
        """The whole flat state (:attr:`full_numel` elements) from every rank's ``shard``.

        Without ``comm`` that is ``shard`` itself. Under ``comm`` it is a collective:
        every rank calls it for the same state in the same order; the shards arrive in
        ``buf`` (at least ``world_size * numel`` elements of ``shard``'s dtype) and are
        unpacked into ``out`` (at least ``full_numel``); None allocates either.
        """
        if self.comm is None:
            return shard[: self.full_numel]
        assert self.layout is not None
        if buf is None:
            buf = torch.empty(self.numel * self.comm.world_size, dtype=shard.dtype)
        if out is None:
            out = torch.empty(self.full_numel, dtype=shard.dtype)
        gathered = self.comm.all_gather(shard[: self.numel], buf)
        return self.layout.unpack(gathered, out)

    def local(self, full: Tensor, out: Tensor) -> Tensor:
        """This rank's shard of the whole flat ``full`` written into ``out`` (``numel``
        elements, zero-padded); without ``comm`` that is ``full`` copied."""
        if self.comm is None or self.layout is None:
            return out[: self.numel].copy_(full[: self.numel])
        return self.layout.take(full, self.comm.rank, out)

    def move(self, home: Tier, grad_home: Tier | None = None) -> None:
        """Change the home tier of the master weights and moments (they must be released)
        and of the gradient accumulator (None: ``home``)."""
        for name in self.state_names:
            self.store.move(name, home)
        self.store.move(self.grad_name, home if grad_home is None else grad_home)
