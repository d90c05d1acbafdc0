"""A paged block whose saved activations go to the host instead of being recomputed.

With :attr:`~bb_lightning.placement.Placement.swapped` naming block ``i``, the block runs
inside :class:`_SwappedBlockFunction` instead of being checkpointed:

- forward: page the block in, run it with autograd on detached copies of its inputs under
  ``torch.autograd.graph.saved_tensors_hooks``: each tensor autograd saves is packed by
  :class:`SavedActivations`: one of the block's own paged parameters (or a view of one) as
  a reference to it, an integer or broadcast tensor (indices, masks) as itself, and every
  other one as a store tensor ``swap.<i>.<n>.<k>`` on the host tier, written from the
  device as the block's forward ends (:class:`~bb_lightning.engine.chunked.Boundaries`:
  tickets, observers and per-link counters as the boundary inputs have); the block is
  released and its inner graph kept without them;
- backward: page the block in again, fetch its saved activations back (the store
  prefetches those of the next blocks ahead), run the inner graph's backward with
  ``torch.autograd.grad`` (the references re-bound to the weights paged in now), hand the
  weight gradients to the gradient sink once, and free the fetched copies.

With :attr:`~bb_lightning.placement.Placement.chunk_rows` set, a swapped block runs its
micro-batch in the row chunks the recomputed blocks run in (cut as
:mod:`~bb_lightning.engine.chunked` cuts them), each chunk's saved activations stored as
its forward ends and fetched back one chunk ahead in backward, the weight gradients summed
over the chunks on the device: the device holds one chunk's activations at a time.

Nothing of the block runs twice: the compute of a recompute is traded for the saved
activations' copies to the host and back. On a CPU device (whose host is its own memory,
not under the store's CPU double) there is nothing to copy: the runner's ``swap`` is None
and every saved tensor but the weights' views stays where the forward made it, as a bound
block's activations do, so the block keeps its activations while its weights are paged
out between its forward and its backward.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor
from torch.autograd.graph import get_gradient_edge

from bb_lightning.engine.chunked import Boundaries, _joined, run_in_row_chunks
from bb_lightning.engine.hf_quirks import CapturedOutputs, recording
from bb_lightning.engine.rows import row_factor
from bb_lightning.placement import Placement
from bb_lightning.shapes import SWAP_CHUNKS_IN_FLIGHT, SWAP_MARGIN
from storage.device import slot_bytes
from storage.tiers import Tier

if TYPE_CHECKING:
    from bb_lightning.engine.blocks import PagedBlocks, _BlockCall

__all__ = [
    "SWAP_BYTES_PER_ELEMENT",
    "SWAP_CHUNKS_IN_FLIGHT",
    "SavedActivations",
    "run_swapped",
    "swap_budgets",
]

SWAP_BYTES_PER_ELEMENT = 32
"""Bytes of saved activations per hidden-state element and compute-dtype byte, for a
placement given without a plan: Korthikanti et al. count 34 bytes per element in fp16
(17 per dtype byte) for a transformer layer without attention scores; doubled here for
wider MLPs, routers and the attention scores of eager attention (measured 20-32 on the
tests' tiny models in fp32)."""


SWAP_TENSORS = 64
"""Saved tensors per block the budgets pad for (each rounded up to the arena alignment)."""


def swap_budgets(placement: Placement, block_bytes: int, chunk_bytes: int) -> dict[Tier, int]:
    """Bytes each tier needs for the saved activations of ``placement.swapped``, each block
    ``block_bytes`` of them in chunks of ``chunk_bytes``: on the host every swapped block's,
    and on the device the chunks fetched back at once in backward (the one computing, the
    next one, and the one the next block reads first: :data:`SWAP_CHUNKS_IN_FLIGHT`)."""
    need = dict.fromkeys(Tier, 0)
    swapped = placement.swapped or ()
    if not swapped or block_bytes <= 0:
        return need
    pad = SWAP_TENSORS * slot_bytes(0)
    block, chunk = block_bytes * SWAP_MARGIN, min(max(chunk_bytes, 1), block_bytes) * SWAP_MARGIN
    need[Tier.HOST] = len(swapped) * (slot_bytes(int(block)) + pad)
    need[Tier.DEVICE] = SWAP_CHUNKS_IN_FLIGHT * (slot_bytes(int(chunk)) + pad)
    return need


_Packed = tuple[str, Any]
"""What a pack hook leaves in the graph: ("param", (group, j, offset, size, stride)),
("keep", tensor) or ("store", k)."""


class SavedActivations:
    """The tensors autograd saves in one forward of swapped block ``i``, and their way back.

    :meth:`pack` and :meth:`unpack` are the saved-tensor hooks; :meth:`write` stores the
    packed activations after the forward, :meth:`load` fetches them back before the
    backward, :meth:`free` releases their device copies after it.
    """

    def __init__(self, runner: PagedBlocks, i: int, swap: Boundaries | None) -> None:
        self.runner, self.i, self.swap = runner, i, swap
        self._held: list[Tensor] = []
        """Tensors to store, in order (held until :meth:`write`)."""
        self._index: dict[tuple[Any, ...], int] = {}
        """(data pointer, shape, stride, dtype) of each held tensor -> its position."""
        self._spans = self._param_spans()
        self.names: list[str] | None = None
        """Store names of the held tensors once written (None: nothing stored)."""
        self._loaded: list[Tensor] | None = None

    def _param_spans(self) -> list[tuple[int, int, str, int, Tensor]]:
        """(first byte, end byte, group, index, tensor) of the block's bound parameters."""
        pager = self.runner.pager
        out: list[tuple[int, int, str, int, Tensor]] = []
        for group, params in (("params", pager.params[self.i]), ("frozen", pager.frozen[self.i])):
            for j, p in enumerate(params):
                if p.numel():
                    start = p.data_ptr()
                    out.append((start, start + p.numel() * p.element_size(), group, j, p))
        return out

    def pack(self, t: Tensor) -> _Packed:
        """A saved tensor as a reference to a parameter, itself, or its place in the store."""
        found = self._param_of(t)
        if found is not None:
            return "param", found
        if self.swap is None:  # kept where it is: an alias, which outlives the inner leaves
            return "keep", t.detach()
        expanded = any(s == 0 and n > 1 for s, n in zip(t.stride(), t.shape, strict=True))
        if not t.is_floating_point() or not t.numel() or expanded:
            return "keep", t
        # a tensor saved twice is stored once; on the meta device (a dry run) nothing has an
        # address: the same view of the same base is (held, so no id is reused)
        base = t._base if t._base is not None else t
        meta = t.device.type == "meta"
        where = (id(base), t.storage_offset()) if meta else (t.data_ptr(),)
        key = (*where, tuple(t.shape), t.stride(), t.dtype)
        k = self._index.get(key)
        if k is None:
            k = self._index[key] = len(self._held)
            self._held.append(t)
        return "store", k

    def _param_of(self, t: Tensor) -> tuple[str, int, int, tuple[int, ...], tuple[int, ...]] | None:
        """(group, index, element offset, shape, stride) of ``t`` in one of the block's
        parameters it views; None when it views none (on the meta device: ``t`` is the
        parameter or a view of it)."""
        if not t.numel():
            return None
        meta = t.device.type == "meta"
        ptr = t.data_ptr()
        for start, end, group, j, p in self._spans:
            if t.dtype != p.dtype or t.device != p.device:
                continue
            if meta and (t is p or t._base is p):
                offset = int(t.storage_offset()) - int(p.storage_offset())
                return group, j, offset, tuple(t.shape), t.stride()
            if not meta and start <= ptr < end:
                return group, j, (ptr - start) // t.element_size(), tuple(t.shape), t.stride()
        return None

    def unpack(self, packed: _Packed) -> Tensor:
        """A packed tensor back: the parameter bound now, itself, or its fetched copy."""
        kind, what = packed
        if kind == "keep":
            return what  # type: ignore[no-any-return]
        if kind == "param":
            group, j, offset, size, stride = what
            pager = self.runner.pager
            p = (pager.params if group == "params" else pager.frozen)[self.i][j].detach()
            return p.as_strided(size, stride, p.storage_offset() + offset)
        assert self._loaded is not None, "the saved activations are fetched before backward"
        return self._loaded[what]

    def write(self) -> None:
        """Store the held tensors (written from the device while later blocks compute)."""
        held, self._held, self._index = self._held, [], {}
        if held and self.swap is not None:
            self.names = self.swap.save(self.i, [t.detach() for t in held])

    def prefetch(self) -> None:
        """Start fetching the stored tensors back to the device."""
        if self.names is not None and self.swap is not None:
            self.swap.prefetch_names(self.names)

    def load(self) -> None:
        """Fetch the stored tensors back to the device (waiting for their page-in)."""
        if self.names is not None and self.swap is not None and self._loaded is None:
            self._loaded = self.swap.load(self.i, self.names)

    def free(self) -> None:
        """Release the fetched copies (their homes stay for the next forward to overwrite);
        copies not fetched yet are fetched first (a backward that read none of them)."""
        if self.names is not None and self.swap is not None:
            self.load()
            self.swap.free(self.i, self.names)
            self.names = None
        self._loaded = None


def run_swapped(
    runner: PagedBlocks,
    i: int,
    original: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
) -> Any:
    """Block ``i`` (its forward ``original``) on ``args`` / ``kwargs`` through
    :class:`_SwappedBlockFunction`, in the row chunks of ``runner.chunking`` where set (as
    :func:`~bb_lightning.engine.chunked.run_chunked` cuts them); its output as the block
    returns it."""
    per_chunk = runner.chunking.rows if runner.chunking is not None else None
    return run_in_row_chunks(runner, i, original, args, kwargs, per_chunk, _SwappedBlockFunction)


class _Chunk:
    """What row chunk ``[a, b)`` of a swapped block keeps from its forward to its backward:
    its saved activations, the gradient edges of its outputs (not their memory), the rows
    each output has, and its inner leaves (their memory dropped)."""

    def __init__(
        self, a: int, b: int, saved: SavedActivations, made: Sequence[Tensor], wanted: list[Tensor]
    ) -> None:
        self.a, self.b, self.saved, self.wanted = a, b, saved, wanted
        self.edges = [get_gradient_edge(t) if t.requires_grad else None for t in made]
        self.sizes = [t.shape[0] if t.ndim else 0 for t in made]


class _SwappedBlockFunction(torch.autograd.Function):
    """One swapped block (see the module docstring): each chunk's inner graph kept, its
    saved activations in the store."""

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
        wants = [bool(w) for w in ctx.needs_input_grad[5:]]
        ctx.runner, ctx.i, ctx.cut, ctx.chunks = runner, i, [int(rows > 0), *cut], []
        made: list[list[Tensor]] = []
        handed: list[set[int]] = []
        first: Any = None
        captured = CapturedOutputs(None)
        upcoming = runner.enter(i, "forward_grad")
        try:
            for k, (a, b, call) in enumerate(calls):
                h = hidden[a:b] if rows > 0 else hidden
                e = [x[a * c : b * c] if c else x for x, c in zip(extras, cut, strict=True)]
                given = [t.detach().requires_grad_(w) for t, w in zip((h, *e), wants, strict=True)]
                saved = SavedActivations(runner, i, runner.swap)  # the weights bound now
                hooks = torch.autograd.graph.saved_tensors_hooks(saved.pack, saved.unpack)
                with torch.enable_grad(), hooks:
                    if k == 0:
                        captured = CapturedOutputs.since_now()
                        first = call(*given)
                        ctx.layout = captured.layout()
                        made.append([*_outputs(first), *captured.tensors()])
                    else:
                        with recording(ctx.layout) as redo:
                            out = call(*given)
                        made.append([*_outputs(out), *redo.tensors()])
                handed.append(call.passed(exclude=given))
                call.drop_inputs()
                saved.write()
                wanted = [t for t, w in zip(given, wants, strict=True) if w]
                ctx.chunks.append(_Chunk(a, b, saved, made[-1], wanted))
                _drop_leaves(given, made[-1])
        finally:
            runner.leave(i, upcoming)
        holder.extend((first, captured, len(_outputs(first))))
        joined, passive = _joined(made, handed)
        outputs = [t.detach() for t in joined]
        ctx.set_materialize_grads(False)  # an output nothing reads gets None, not zeros
        ctx.mark_non_differentiable(
            *(
                o
                for j, (o, p) in enumerate(zip(outputs, passive, strict=True))
                if p or not o.is_floating_point() or not any(m[j].requires_grad for m in made)
            )
        )
        ctx.shapes = [tuple(t.shape) for t in (hidden, *extras)]
        return tuple(outputs)

    @staticmethod
    def backward(ctx: Any, *grad_outs: Tensor | None) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        runner: PagedBlocks = ctx.runner
        i: int = ctx.i
        chunks: list[_Chunk] = ctx.chunks
        wants = [bool(w) for w in ctx.needs_input_grad[5:]]
        params = runner.pager.params[i]
        summed: list[Tensor | None] = [None] * len(params)
        of_inputs: list[Tensor | None] = [None] * len(wants)
        upcoming = runner.enter(i, "backward")
        try:  # the last chunk first: the one prefetched ahead of the block (its last saved)
            for k in range(len(chunks) - 1, -1, -1):
                if k > 0:
                    chunks[k - 1].saved.prefetch()
                else:
                    runner.prefetch_saved(upcoming)
                _chunk_backward(ctx, k, grad_outs, summed, of_inputs)
        finally:
            runner.leave(i, upcoming)
            for chunk in chunks:
                chunk.saved.free()
            ctx.chunks = None
        runner.backward_ran(i)
        runner.hand_off(i, summed)
        return (None,) * 5 + tuple(g if w else None for g, w in zip(of_inputs, wants, strict=True))


def _chunk_backward(
    ctx: Any,
    k: int,
    grad_outs: Sequence[Tensor | None],
    summed: list[Tensor | None],
    of_inputs: list[Tensor | None],
) -> None:
    """The backward of chunk ``k`` from its saved activations: the weights' gradients added
    into ``summed``, the inputs' into their rows of ``of_inputs`` (summed for inputs passed
    whole); its fetched activations freed."""
    chunks: list[_Chunk] = ctx.chunks
    chunk, chunked = chunks[k], len(chunks) > 1
    read = []
    for j, (edge, g) in enumerate(zip(chunk.edges, grad_outs, strict=True)):
        if g is not None and chunked:
            start = sum(c.sizes[j] for c in chunks[:k])
            g = g[start : start + chunk.sizes[j]]
        if g is not None and edge is not None:
            read.append((edge, g))
    inputs = [*chunk.wanted, *ctx.runner.pager.params[ctx.i]]
    chunk.saved.load()
    grads: Sequence[Tensor | None] = ()
    if read and inputs:
        grads = torch.autograd.grad(
            [e for e, _ in read], inputs, [g for _, g in read], allow_unused=True
        )
    chunk.saved.free()
    if not grads:
        return
    for j, g in enumerate(grads[len(chunk.wanted) :]):
        if g is not None:
            before = summed[j]
            summed[j] = g if before is None else before + g
    got = iter(grads[: len(chunk.wanted)])
    wants = [bool(w) for w in ctx.needs_input_grad[5:]]
    a, b = chunk.a, chunk.b
    for n, (c, w) in enumerate(zip(ctx.cut, wants, strict=True)):
        g = next(got) if w else None
        if g is None:
            continue
        held = of_inputs[n]
        if not c:
            of_inputs[n] = g if held is None else held + g
            continue
        if held is None:
            held = of_inputs[n] = torch.zeros(ctx.shapes[n], dtype=g.dtype, device=g.device)
        held[a * c : b * c].copy_(g)


def _drop_leaves(given: Sequence[Tensor], made: Sequence[Tensor]) -> None:
    """Let the memory of a chunk's inner leaves go (what its backward reads is stored; the
    graph keeps the leaves' shapes): those the block does not return."""
    returned = {id(t) for t in made}
    for t in given:
        if id(t) not in returned:
            t.data = torch.empty(0, dtype=t.dtype, device=t.device)
