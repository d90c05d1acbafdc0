"""A recomputed block over its micro-batch in row chunks, its weights paged in once.

With :attr:`~bb_lightning.placement.Placement.chunk_rows` set (or the boundary inputs
placed off the device, :attr:`~bb_lightning.placement.Placement.boundaries`), a block
that recomputes in backward runs inside :class:`_ChunkedBlockFunction` instead of one
checkpointed call:

- forward: page the block in, run it under ``no_grad`` on rows ``[0, k)``, ``[k, 2k)``,
  ... of the micro-batch (the last chunk may be shorter), join the chunks' outputs by
  rows, and keep only the block's boundary inputs (its hidden states and the other
  tensor arguments that need gradient), where :class:`Boundaries` says: on the device,
  or as store tensors on the host (NVMe) tier, written while later blocks compute;
- backward: page the block in again, fetch its boundary inputs back (the store prefetches
  the next blocks' ahead), recompute the block chunk by chunk from them (each chunk with
  the RNG state its forward had), summing its weight gradients over the chunks on the
  device, and hand them to the gradient sink once; the boundary inputs are freed then.

The device holds one chunk's block internals at a time, plus the boundary buffers in
flight. The other arguments are cut by rows as
:func:`~bb_lightning.engine.rows.call_in_row_chunks` cuts them: a tensor of two or more
dimensions whose first is the micro-batch's rows (masks, position ids, rotary tables)
gives its chunk's rows, ALiBi's heads folded into the rows its chunk's rows' heads; anything else (a mask broadcast over rows, 1-D
``cache_position``, flags) passes whole, and the gradient of such an argument that
needs one is summed over the chunks. Tensors the block returns, and those transformers'
output capture records inside it (router logits of an MoE's auxiliary loss, whose rows
are tokens, row-major), are joined along their first dimension; a tensor the block hands
back whole from its arguments is returned once. Hidden states not laid out as
``[rows, tokens, width]`` (Gemma 3n's stacked predictions, ``[k, rows, tokens, width]``)
run in one piece, their boundary inputs still kept where the placement says.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from bb_lightning.engine.hf_quirks import CapturedOutputs, recording
from bb_lightning.engine.rows import cut_rows, row_factor
from bb_lightning.placement import BOUNDARY_PREFIX, Placement, boundary_manifest
from storage.device import slot_bytes
from storage.store import Ticket, TieredStore
from storage.tiers import Tier

if TYPE_CHECKING:
    from bb_lightning.engine.blocks import PagedBlocks, _BlockCall

__all__ = [
    "Boundaries",
    "Chunking",
    "boundary_budgets",
    "chunking_for",
    "row_spans",
    "run_chunked",
]


class Chunking:
    """How recomputed blocks run in training: rows per chunk and where boundaries live."""

    def __init__(self, rows: int | None, boundaries: Boundaries) -> None:
        if rows is not None and rows < 1:
            raise ValueError(f"chunk_rows={rows} must be >= 1 rows per chunk, or None")
        self.rows = rows
        """Rows per chunk (None: the micro-batch in one piece)."""
        self.boundaries = boundaries
        """Where the boundary inputs are kept from forward to backward."""


def chunking_for(placement: Placement, store: TieredStore) -> Chunking | None:
    """How ``placement`` runs recomputed blocks in training (None: one piece, on the
    device); ``ValueError`` for NVMe boundaries in a store without an NVMe tier."""
    tier = placement.boundaries
    if placement.chunk_rows is None and tier in (None, Tier.DEVICE):
        return None
    if tier is Tier.NVME and store.config.nvme_path is None:
        raise ValueError(
            "boundaries=nvme but the store has no NVMe tier: give it an nvme_path, or keep "
            "the boundary inputs on Tier.HOST or Tier.DEVICE"
        )
    return Chunking(placement.chunk_rows, Boundaries(store, tier))


def boundary_budgets(placement: Placement, numel: int) -> dict[Tier, int]:
    """Bytes each tier of the store needs for the boundary inputs of one micro-batch, each
    block's ``numel`` elements (:func:`~bb_lightning.placement.boundary_manifest`, padded
    as the arenas pad them): on their home, and on the device the slots of the ones paged
    in at once in backward (the block's own and those of ``prefetch_depth`` blocks ahead).
    NVMe boundaries need an NVMe tier whatever ``numel``."""
    need = dict.fromkeys(Tier, 0)
    if placement.boundaries is Tier.NVME:  # the tier exists even with no size given
        need[Tier.NVME] = slot_bytes(0)
    entries = boundary_manifest(placement, numel)
    for t in entries:
        need[t.home] += slot_bytes(t.nbytes)
    if entries:
        need[Tier.DEVICE] += (placement.prefetch_depth + 1) * slot_bytes(entries[0].nbytes)
    return need


def row_spans(rows: int, chunk_rows: int | None) -> list[tuple[int, int]]:
    """``[start, end)`` of each chunk of ``rows`` rows, ``chunk_rows`` each (the last may be
    shorter); one span of every row for None."""
    step = max(1, rows if chunk_rows is None else chunk_rows)
    return [(a, min(rows, a + step)) for a in range(0, max(rows, 1), step)]


class Boundaries:
    """The boundary inputs of recomputed blocks from their forward to their backward.

    ``tier`` None or DEVICE keeps them as autograd's saved tensors on the device. HOST
    (pinned beside a GPU) or NVME keeps them as store tensors ``boundary.<i>.<n>.<k>``
    (block ``i``, its ``n``-th forward in the micro-batch, input ``k``): written back from
    the device as the forward leaves them, paged in again ahead of their block in
    backward (:meth:`prefetch`), and released after; registered at their first use with
    the micro-batch's shape and registered again when it changes.
    """

    def __init__(
        self, store: TieredStore | None, tier: Tier | None, prefix: str = BOUNDARY_PREFIX
    ) -> None:
        off_device = tier is not None and tier is not Tier.DEVICE
        if off_device and store is None:
            raise ValueError(f"boundaries={tier}: keeping them off the device needs the store")
        self.store = store if off_device else None
        self.tier: Tier = tier if tier is not None and off_device else Tier.DEVICE
        self.prefix = prefix
        """Store name prefix of the tensors kept (``<prefix>.<i>.<n>.<k>``)."""
        self._saved: dict[int, list[list[str]]] = {}
        """Per block, the store names of each forward's boundary inputs not yet used."""
        self._tickets: dict[tuple[str, ...], Ticket] = {}
        self._registered: dict[str, tuple[tuple[int, ...], torch.dtype, Tier]] = {}
        """Shape, dtype and home of each boundary tensor registered in the store (an earlier
        placement's too, registered again on this one's tier at their next use)."""
        if self.store is not None:
            for name in self.store.names():
                if name.startswith(f"{prefix}."):
                    spec = self.store.spec(name)
                    self._registered[name] = (spec.shape, spec.dtype, self.store.home(name))

    @property
    def on_device(self) -> bool:
        """Whether the boundary inputs stay on the device (autograd's saved tensors)."""
        return self.store is None

    def save(self, i: int, tensors: Sequence[Tensor]) -> list[str]:
        """Write block ``i``'s boundary ``tensors`` to the store; their names."""
        assert self.store is not None
        runs = self._saved.setdefault(i, [])
        taken = {r[0] for r in runs}  # forwards of block i whose backward is still to come
        n = next(n for n in range(len(runs) + 1) if f"{self.prefix}.{i}.{n}.0" not in taken)
        names = [f"{self.prefix}.{i}.{n}.{k}" for k in range(len(tensors))]
        for name, t in zip(names, tensors, strict=True):
            self._ensure(name, t)
            self.store.write_back_async(name, t.detach().contiguous(), from_device=True)
        runs.append(names)
        return names

    def _ensure(self, name: str, t: Tensor) -> None:
        assert self.store is not None
        held = self._registered.get(name)
        if held == (tuple(t.shape), t.dtype, self.tier):
            return
        if held is not None:  # a micro-batch of another shape
            self.store.unregister(name)
        self.store.register(name, shape=tuple(t.shape), dtype=t.dtype, home=self.tier,
                            scratch=True)  # fmt: skip
        self._registered[name] = (tuple(t.shape), t.dtype, self.tier)

    def prefetch(self, blocks: Sequence[int]) -> None:
        """Start paging in the last saved boundary inputs of each of ``blocks``."""
        assert self.store is not None
        for i in blocks:
            runs = self._saved.get(i)
            if runs and tuple(runs[-1]) not in self._tickets:
                self._tickets[tuple(runs[-1])] = self.store.prefetch_async(runs[-1])

    def prefetch_names(self, names: Sequence[str]) -> None:
        """Start paging in ``names`` (tensors one :meth:`save` wrote), unless under way."""
        assert self.store is not None
        if tuple(names) not in self._tickets:
            self._tickets[tuple(names)] = self.store.prefetch_async(list(names))

    def load(self, i: int, names: Sequence[str]) -> list[Tensor]:
        """Block ``i``'s boundary inputs ``names`` on the device (waiting for their page-in)."""
        assert self.store is not None
        ticket = self._tickets.pop(tuple(names), None)
        if ticket is None:
            ticket = self.store.prefetch_async(list(names))
        got = ticket.wait()
        return [_own_version(got[n]) for n in names]

    def free(self, i: int, names: Sequence[str]) -> None:
        """Release the device copies of ``names`` (block ``i``'s; their home stays for the
        next micro-batch's forward to overwrite)."""
        assert self.store is not None
        self.store.release(list(names))
        runs = self._saved.get(i, [])
        if list(names) in runs:
            runs.remove(list(names))

    def forget(self) -> None:
        """Drop what a backward that did not run left (its page-ins waited for and released)."""
        if self.store is None:
            return
        for names, ticket in self._tickets.items():
            ticket.wait()
            self.store.release(list(names))
        self._tickets = {}
        self._saved = {}


def _own_version(t: Tensor) -> Tensor:
    """``t``'s memory as a tensor whose version counter is its own: a page-in is a view of
    the device arena, whose counter every other slot's writes advance, which autograd would
    take for an in-place change of a tensor it saved."""
    out = torch.empty(0, dtype=t.dtype, device=t.device)
    return out.set_(t.untyped_storage(), t.storage_offset(), t.size(), t.stride())


def run_chunked(
    runner: PagedBlocks,
    i: int,
    original: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
) -> Any:
    """Block ``i`` (its forward ``original``) on ``args`` / ``kwargs`` through
    :class:`_ChunkedBlockFunction`; its output as the block returns it."""
    chunking = runner.chunking
    assert chunking is not None
    return run_in_row_chunks(
        runner, i, original, args, kwargs, chunking.rows, _ChunkedBlockFunction
    )


def run_in_row_chunks(
    runner: PagedBlocks,
    i: int,
    original: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    per_chunk: int | None,
    function: Any,
) -> Any:
    """Block ``i`` on ``args`` / ``kwargs`` through the autograd ``function`` (this module's
    or :mod:`~bb_lightning.engine.swapped`'s), its calls cut into chunks of ``per_chunk``
    rows (None: one piece; hidden states not laid out by rows: one piece); its output as
    the block returns it."""
    from bb_lightning.engine.blocks import _repack, _split

    hidden, call = _split(original, args, kwargs)
    runner._runs[i] = runner._runs.get(i, 0) + 1
    rows = hidden.shape[0]
    spans = row_spans(rows, per_chunk) if hidden.ndim == 3 else [(0, rows)]
    calls = [
        (
            a,
            b,
            call
            if (a, b) == (0, rows)
            else _split(original, *cut_rows(args, kwargs, rows, a, b))[1],
        )
        for a, b in spans
    ]
    holder: list[Any] = []
    outputs = function.apply(runner, i, calls, holder, runner._dummy, hidden, *call.extras)
    out, captured, made = holder
    captured.replace(list(outputs[made:]))
    return _repack(out, outputs[:made])


def _rng_state(t: Tensor) -> tuple[Tensor, Tensor | None]:
    return torch.get_rng_state(), torch.cuda.get_rng_state() if t.is_cuda else None


class _ChunkedBlockFunction(torch.autograd.Function):
    """One recomputed block over its micro-batch in row chunks (see the module docstring):
    only its boundary inputs are kept, where :class:`Boundaries` says."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        runner: PagedBlocks,
        i: int,
        calls: list[tuple[int, int, _BlockCall]],
        holder: list[Any],
        dummy: Tensor,
        hidden: Tensor,
        *extras: Tensor,
    ) -> tuple[Tensor, ...]:
        from bb_lightning.engine.blocks import _outputs

        rows = hidden.shape[0] if len(calls) > 1 else -1
        cut = [row_factor(e, rows) if rows > 0 else 0 for e in extras]
        ctx.runner, ctx.i, ctx.calls, ctx.cut, ctx.rngs = runner, i, calls, cut, []
        made: list[list[Tensor]] = []
        first: Any = None
        captured = CapturedOutputs(None)
        handed: list[set[int]] = []
        upcoming = runner.enter(i, "forward_grad")
        try:
            for k, (a, b, call) in enumerate(calls):
                ctx.rngs.append(_rng_state(hidden))
                h = hidden[a:b] if rows > 0 else hidden
                e = [x[a * c : b * c] if c else x for x, c in zip(extras, cut, strict=True)]
                if k == 0:
                    captured = CapturedOutputs.since_now()
                    first = call(h, *e)
                    ctx.layout = captured.layout()
                    made.append([*_outputs(first), *captured.tensors()])
                else:
                    with recording(ctx.layout) as redo:
                        out = call(h, *e)
                    made.append([*_outputs(out), *redo.tensors()])
                handed.append(call.passed(exclude=(h, *e)))
                call.drop_inputs()
        finally:
            runner.leave(i, upcoming)
        holder.extend((first, captured, len(_outputs(first))))
        bounds = runner.chunking.boundaries if runner.chunking is not None else None
        if bounds is None or bounds.on_device:
            ctx.names = None
            ctx.save_for_backward(hidden, *extras)
        else:
            ctx.names = bounds.save(i, [hidden, *extras])
        outputs, passive = _joined(made, handed)
        ctx.sizes = [[m[j].shape[0] if m[j].ndim else 0 for m in made] for j in range(len(outputs))]
        ctx.set_materialize_grads(False)  # an output nothing reads gets None, not zeros
        ctx.mark_non_differentiable(
            *(o for o, p in zip(outputs, passive, strict=True) if p or not o.is_floating_point())
        )
        return tuple(outputs)

    @staticmethod
    def backward(ctx: Any, *grad_outs: Tensor | None) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        runner: PagedBlocks = ctx.runner
        i: int = ctx.i
        bounds = runner.chunking.boundaries if runner.chunking is not None else None
        wants = [bool(w) for w in ctx.needs_input_grad[5:]]  # hidden, then the extras
        upcoming = runner.enter(i, "backward")
        try:
            if ctx.names is None:
                saved = list(ctx.saved_tensors)
            else:
                assert bounds is not None
                saved = bounds.load(i, ctx.names)
            runner.prefetch_saved(upcoming)
            params = runner.pager.params[i]
            summed: list[Tensor | None] = [None] * len(params)
            of_inputs: list[Tensor | None] = [None] * len(saved)
            for k, (a, b, call) in enumerate(ctx.calls):
                _chunk_backward(ctx, k, (a, b, call), saved, wants, grad_outs, summed, of_inputs)
        finally:
            runner.leave(i, upcoming)
            if ctx.names is not None:
                assert bounds is not None
                bounds.free(i, ctx.names)
            ctx.calls = None
        runner.backward_ran(i)
        runner.hand_off(i, summed)
        return (None,) * 5 + tuple(g if w else None for g, w in zip(of_inputs, wants, strict=True))


def _chunk_backward(
    ctx: Any,
    k: int,
    chunk: tuple[int, int, _BlockCall],
    saved: Sequence[Tensor],
    wants: Sequence[bool],
    grad_outs: Sequence[Tensor | None],
    summed: list[Tensor | None],
    of_inputs: list[Tensor | None],
) -> None:
    """Recompute chunk ``k`` of the block and add its gradients: the weights' into
    ``summed``, the inputs' into their rows of ``of_inputs`` (summed for inputs passed whole)."""
    from bb_lightning.engine.blocks import _outputs, _rng_restored

    a, b, call = chunk
    params = ctx.runner.pager.params[ctx.i]
    chunked = len(ctx.calls) > 1
    cut = [int(chunked), *(c if chunked else 0 for c in ctx.cut)]
    given = [
        (t[a * c : b * c] if c else t).detach().requires_grad_(w)
        for t, c, w in zip(saved, cut, wants, strict=True)
    ]
    wanted = [t for t, w in zip(given, wants, strict=True) if w]
    inputs = [*wanted, *params]
    if not inputs:  # nothing of this block trains and no gradient flows through it
        return
    with torch.enable_grad(), _rng_restored(ctx.rngs[k]), recording(ctx.layout) as redone:
        outputs = [*_outputs(call(*given)), *redone.tensors()]
    read = []
    for j, (o, g) in enumerate(zip(outputs, grad_outs, strict=True)):
        if g is None or not o.requires_grad:
            continue
        if len(ctx.calls) > 1:
            start = sum(ctx.sizes[j][:k])
            g = g[start : start + ctx.sizes[j][k]]
        read.append((o, g))
    call.drop_inputs()
    if not read:
        return
    grads = torch.autograd.grad(
        [o for o, _ in read], inputs, [g for _, g in read], allow_unused=True
    )
    for j, g in enumerate(grads[len(wanted) :]):
        if g is not None:
            before = summed[j]
            summed[j] = g if before is None else before + g
    got = iter(grads[: len(wanted)])
    for n, (t, c, w) in enumerate(zip(saved, cut, wants, strict=True)):
        g = next(got) if w else None
        if g is None:
            continue
        held = of_inputs[n]
        if not c:
            of_inputs[n] = g if held is None else held + g
            continue
        if held is None:
            held = of_inputs[n] = torch.zeros(t.shape, dtype=g.dtype, device=g.device)
        held[a * c : b * c].copy_(g)


def _joined(made: list[list[Tensor]], handed: list[set[int]]) -> tuple[list[Tensor], list[bool]]:
    """Each output of the chunks joined by rows, and whether it is an argument handed back
    (returned once, detached, when every chunk handed back the same tensor)."""
    outputs: list[Tensor] = []
    passive: list[bool] = []
    for j in range(len(made[0])):
        items = [m[j] for m in made]
        back = all(id(t) in h for t, h in zip(items, handed, strict=True))
        passive.append(back)
        if len(items) == 1 or all(t is items[0] for t in items):
            outputs.append(items[0].detach() if back else items[0])
            continue
        if any(t.ndim == 0 for t in items):
            raise ValueError(
                "a block returned a tensor without rows, which row chunks cannot join: run "
                "it in one piece (Placement.chunk_rows=None)"
            )
        outputs.append(torch.cat(items))
    return outputs, passive
