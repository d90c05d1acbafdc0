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

Nothing of the block runs twice: the compute of a recompute is traded for the saved
activations' copies to the host and back.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from bb_lightning.engine.chunked import Boundaries
from bb_lightning.engine.hf_quirks import CapturedOutputs
from bb_lightning.placement import Placement
from storage.device import slot_bytes
from storage.tiers import Tier

if TYPE_CHECKING:
    from bb_lightning.engine.blocks import PagedBlocks, _BlockCall

__all__ = ["SWAP_BYTES_PER_ELEMENT", "SavedActivations", "run_swapped", "swap_budgets"]

SWAP_BYTES_PER_ELEMENT = 32
"""Bytes of saved activations per hidden-state element and compute-dtype byte, for a
placement given without a plan: Korthikanti et al. count 34 bytes per element in fp16
(17 per dtype byte) for a transformer layer without attention scores; doubled here for
wider MLPs, routers and the attention scores of eager attention (measured 20-32 on the
tests' tiny models in fp32)."""

SWAP_TENSORS = 64
"""Saved tensors per block the budgets pad for (each rounded up to the arena alignment)."""


def swap_budgets(placement: Placement, block_bytes: int) -> dict[Tier, int]:
    """Bytes each tier needs for the saved activations of ``placement.swapped``, each block
    ``block_bytes`` of them: on the host every swapped block's, and on the device those
    fetched back at once in backward (the block's own and ``prefetch_depth`` ahead)."""
    need = dict.fromkeys(Tier, 0)
    swapped = placement.swapped or ()
    if not swapped or block_bytes <= 0:
        return need
    per_block = slot_bytes(block_bytes) + SWAP_TENSORS * slot_bytes(0)
    need[Tier.HOST] = len(swapped) * per_block
    need[Tier.DEVICE] = min(len(swapped), placement.prefetch_depth + 1) * per_block
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

    def __init__(self, runner: PagedBlocks, i: int, swap: Boundaries) -> None:
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
        out = []
        for group, params in (("params", pager.params[self.i]), ("frozen", pager.frozen[self.i])):
            for j, p in enumerate(params):
                if p.numel():
                    start = p.data_ptr()
                    out.append((start, start + p.numel() * p.element_size(), group, j, p))
        return out

    def pack(self, t: Tensor) -> _Packed:
        """A saved tensor as a reference to a parameter, itself, or its place in the store."""
        ptr = t.data_ptr()
        if t.numel():
            for start, end, group, j, p in self._spans:
                if start <= ptr < end and t.dtype == p.dtype and t.device == p.device:
                    offset = (ptr - start) // t.element_size()
                    return "param", (group, j, offset, tuple(t.shape), t.stride())
        expanded = any(s == 0 and n > 1 for s, n in zip(t.stride(), t.shape, strict=True))
        if not t.is_floating_point() or not t.numel() or expanded:
            return "keep", t
        key = (ptr, tuple(t.shape), t.stride(), t.dtype)
        k = self._index.get(key)
        if k is None:
            k = self._index[key] = len(self._held)
            self._held.append(t.detach())
        return "store", k

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
        if held:
            self.names = self.swap.save(self.i, held)

    def load(self) -> None:
        """Fetch the stored tensors back to the device (waiting for their page-in)."""
        if self.names is not None:
            self._loaded = self.swap.load(self.i, self.names)

    def free(self) -> None:
        """Release the fetched copies (their homes stay for the next forward to overwrite)."""
        self._loaded = None
        if self.names is not None:
            self.swap.free(self.i, self.names)
            self.names = None


def run_swapped(
    runner: PagedBlocks,
    i: int,
    original: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
) -> Any:
    """Block ``i`` (its forward ``original``) on ``args`` / ``kwargs`` through
    :class:`_SwappedBlockFunction`; its output as the block returns it."""
    from bb_lightning.engine.blocks import _outputs, _repack, _split

    hidden, call = _split(original, args, kwargs)
    runner._runs[i] = runner._runs.get(i, 0) + 1
    holder: list[Any] = []
    outputs = _SwappedBlockFunction.apply(
        runner, i, call, holder, runner._dummy, hidden, *call.extras
    )
    out, captured = holder
    made = len(_outputs(out))
    captured.replace(list(outputs[made:]))
    return _repack(out, outputs[:made])


class _SwappedBlockFunction(torch.autograd.Function):
    """One swapped block (see the module docstring): its inner graph kept, its saved
    activations in the store."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        runner: PagedBlocks,
        i: int,
        call: _BlockCall,
        holder: list[Any],
        dummy: Tensor,
        hidden: Tensor,
        *extras: Tensor,
    ) -> tuple[Tensor, ...]:
        from bb_lightning.engine.blocks import _outputs

        assert runner.swap is not None
        wants = [bool(w) for w in ctx.needs_input_grad[5:]]
        given = [
            t.detach().requires_grad_(w) for t, w in zip((hidden, *extras), wants, strict=True)
        ]
        upcoming = runner.enter(i, "forward_grad")
        saved = SavedActivations(runner, i, runner.swap)  # the weights bound now
        try:
            captured = CapturedOutputs.since_now()
            hooks = torch.autograd.graph.saved_tensors_hooks(saved.pack, saved.unpack)
            with torch.enable_grad(), hooks:
                out = call(*given)
            made = [*_outputs(out), *captured.tensors()]
            passed = call.passed(exclude=given)
            call.drop_inputs()
            saved.write()
        finally:
            runner.leave(i, upcoming)
        holder.extend((out, captured))
        returned = {id(t) for t in made}
        for t in given:  # the inner leaves keep no memory: what backward reads is stored
            if id(t) not in returned:
                t.data = torch.empty(0, dtype=t.dtype, device=t.device)
        ctx.runner, ctx.i, ctx.saved, ctx.inner = runner, i, saved, made
        ctx.wanted = [t for t, w in zip(given, wants, strict=True) if w]
        outputs = [t.detach() for t in made]
        ctx.set_materialize_grads(False)  # an output nothing reads gets None, not zeros
        ctx.mark_non_differentiable(
            *(
                o
                for o, t in zip(outputs, made, strict=True)
                if id(t) in passed or not t.requires_grad or not o.is_floating_point()
            )
        )
        return tuple(outputs)

    @staticmethod
    def backward(ctx: Any, *grad_outs: Tensor | None) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        runner: PagedBlocks = ctx.runner
        i: int = ctx.i
        saved: SavedActivations = ctx.saved
        wants = [bool(w) for w in ctx.needs_input_grad[5:]]
        wanted: list[Tensor] = ctx.wanted
        upcoming = runner.enter(i, "backward")
        try:
            saved.load()
            runner.prefetch_saved(upcoming)
            inputs = [*wanted, *runner.pager.params[i]]
            grads: Sequence[Tensor | None] = (None,) * len(inputs)
            read = [
                (o, g)
                for o, g in zip(ctx.inner, grad_outs, strict=True)
                if g is not None and o.requires_grad
            ]
            if read and inputs:
                grads = torch.autograd.grad(
                    [o for o, _ in read], inputs, [g for _, g in read], allow_unused=True
                )
        finally:
            runner.leave(i, upcoming)
            saved.free()
            ctx.inner = ctx.wanted = ctx.saved = None
        runner.backward_ran(i)
        runner.hand_off(i, grads[len(wanted) :])
        of_inputs = iter(grads[: len(wanted)])
        return (None,) * 5 + tuple(next(of_inputs) if w else None for w in wants)
