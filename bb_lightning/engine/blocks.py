"""Run a model's repeated blocks through the pager, with per-block activation checkpointing.

:class:`PagedBlocks` replaces each block's ``forward`` (an instance attribute, so
module hooks still fire and :meth:`PagedBlocks.remove` restores the class
method). With grad enabled the block runs inside :class:`_PagedBlockFunction`:

- forward: page the block in, prefetch the next blocks of the schedule, run it
  under ``no_grad``, keep only its input, release it;
- backward: page it in again (prefetching earlier blocks), recompute it with
  grad from the saved input (same RNG state), take the input and parameter
  gradients with ``torch.autograd.grad``, hand the parameter gradients to the
  gradient sink (fp32 host accumulators), release the block, and tell
  :attr:`PagedBlocks.on_block_backward` (which may start the block's optimizer step).

Blocks listed in :attr:`PagedBlocks.autograd_blocks` (those whose weights are used
where they live: resident on the device, or homed on the host when the device is the
CPU) run with ordinary autograd instead: their activations are kept and nothing is
recomputed. A post-accumulate hook on each of their parameters takes the gradient out
of ``.grad`` as soon as autograd has produced it; once every parameter of the block
has its gradient the block is released and handed on exactly like a recomputed one
(gradient sink or :attr:`PagedBlocks.on_block_grads`, then
:attr:`PagedBlocks.on_block_backward`), so its optimizer step can start while backward
goes on. A block with frozen parameters (LoRA adapters over frozen base weights) can
have all its trainable gradients before autograd is done with its weights (the input
gradient still goes through the frozen ones), so its input passes through an identity
whose backward marks the block's backward as done, and the block is handed on only
then. :meth:`PagedBlocks.take_pending` returns what a backward left incomplete
(parameters that got no gradient).

Without grad (validation, prediction, ``inference_mode``) a block is paged in, run and
released, with the next blocks prefetched cyclically so that the next batch finds block 0
in flight; with :attr:`PagedBlocks.max_tokens` set, a batch of more tokens runs through
the block in chunks of rows while it is paged in (the planner's prefill micro-batch);
groups of sequences run side by side (:mod:`~bb_lightning.engine.groups`) page a block in
once for them all. A recomputed block passes gradient to its hidden states (the first
positional argument, or the keyword) and to every other tensor argument that requires it
(a per-layer input computed from trainable embeddings, as Gemma 3n's); other arguments
pass through. With :attr:`PagedBlocks.chunking` set, a recomputed block runs its
micro-batch in row chunks instead, its boundary inputs kept where the placement says
(:mod:`~bb_lightning.engine.chunked`). A block in :attr:`PagedBlocks.swapped_blocks` runs
with autograd while paged in and keeps its saved activations in the store instead of
recomputing (:mod:`~bb_lightning.engine.swapped`).
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from bb_lightning.engine import host_packed
from bb_lightning.engine.chunked import Boundaries, Chunking, run_chunked
from bb_lightning.engine.flat_state import FlatState
from bb_lightning.engine.grad_sink import GradSink
from bb_lightning.engine.groups import current_step
from bb_lightning.engine.hf_quirks import CACHE_KWARGS, CapturedOutputs, recording
from bb_lightning.engine.pager import BlockPager
from bb_lightning.engine.rows import call_in_row_chunks, chunk_count
from bb_lightning.engine.swapped import run_swapped

__all__ = ["PagedBlocks"]


class PagedBlocks:
    """Installs and removes the paged forward of every block; owns the visit schedule."""

    def __init__(self, blocks: Sequence[nn.Module], pager: BlockPager, grads: GradSink) -> None:
        if len(blocks) != pager.num_blocks:
            raise ValueError(
                f"{len(blocks)} blocks but the pager holds {pager.num_blocks}: "
                "build the pager from the same block list"
            )
        self.blocks = list(blocks)
        self.pager = pager
        self.grads = grads
        self._installed = False
        self._dummy = torch.empty(0, requires_grad=True)
        self.on_block_grads: Callable[[int, Sequence[Tensor | None]], None] | None = None
        """Called with ``i`` and block ``i``'s parameter gradients (device tensors, None for
        unused parameters) in place of adding them to the block's accumulator through
        the gradient sink; the engine sets it to sum and step blocks on its worker."""
        self.autograd_blocks: frozenset[int] = frozenset()
        """Blocks run with ordinary autograd (activations kept, no recompute); only blocks
        whose weights are used in place (DEVICE-home, or HOST-home on a CPU device) may be
        listed: their weights stay bound from forward until their gradients are in."""
        self._pending: dict[int, list[Tensor | None]] = {}
        """Gradients collected so far of autograd blocks whose backward is under way."""
        self._input_pending: dict[int, int] = {}
        """Autograd blocks with frozen weights, and how many of their input gradients (one
        per forward in this micro-batch) are not computed yet."""
        self._runs: dict[int, int] = {}
        """Recomputed blocks: forwards with grad in this micro-batch whose backward has not
        run (a training step may run the model more than once before one backward; an
        autograd block's hooks see the sum of its uses at once)."""
        self._hooks: list[Any] = []
        self.on_block_backward: Callable[[int], None] | None = None
        """Called with ``i`` once block ``i``'s backward has queued its gradients and released
        the block (the engine starts the block's optimizer step from it)."""
        self.chunking: Chunking | None = None
        """Training: recomputed blocks run their micro-batch in row chunks and keep their
        boundary inputs where this says (:mod:`~bb_lightning.engine.chunked`); None: one
        checkpointed call on the device."""
        self.swapped_blocks: frozenset[int] = frozenset()
        """Training: paged blocks run with autograd whose saved activations :attr:`swap`
        keeps in the store instead of recomputing them
        (:mod:`~bb_lightning.engine.swapped`)."""
        self.swap: Boundaries | None = None
        """Where the swapped blocks' saved activations live from forward to backward (None:
        where the forward made them, on a CPU device whose host is its own memory)."""
        self.max_tokens: int | None = None
        """Tokens a forward without grad runs through a block at once: a larger batch runs
        in chunks of rows while the block stays paged in
        (:func:`~bb_lightning.engine.rows.call_in_row_chunks`); None: the whole batch."""

    @property
    def installed(self) -> bool:
        """Whether the paged forwards are in place."""
        return self._installed

    def install(self) -> None:
        """Replace each block's forward with the paged one; a second call does nothing."""
        if self._installed:
            return
        for i, block in enumerate(self.blocks):
            original = type(block).forward.__get__(block)
            block.forward = self._make_forward(i, original)  # type: ignore[method-assign]
            for j, p in enumerate(self.pager.params[i]):
                if p.requires_grad:
                    self._hooks.append(p.register_post_accumulate_grad_hook(self._hook(i, j)))
        self._installed = True

    def remove(self) -> None:
        """Restore the blocks' own forwards and release every paged block."""
        if not self._installed:
            return
        for block in self.blocks:
            del block.forward
        for handle in self._hooks:
            handle.remove()
        self._hooks = []
        self._pending = {}
        self._input_pending = {}
        self.pager.release_all_except(())
        for i in self.autograd_blocks:  # bound since their last forward
            self.pager.release(i)
        self._installed = False

    def _make_forward(self, i: int, original: Callable[..., Any]) -> Callable[..., Any]:
        def paged_forward(*args: Any, **kwargs: Any) -> Any:
            if not torch.is_grad_enabled():
                return self._run_no_grad(i, original, args, kwargs)
            if i in self.autograd_blocks:
                self.enter(i, "forward_grad")  # stays bound until its gradients are in
                self._pending.setdefault(i, [None] * len(self.pager.params[i]))
                if self.pager.frozen[i]:
                    hidden, call = _split(original, args, kwargs)
                    if hidden.requires_grad:
                        self._input_pending[i] = self._input_pending.get(i, 0) + 1
                        return call(_InputDone.apply(self, i, hidden))
                return original(*args, **kwargs)
            if i in self.swapped_blocks:
                return run_swapped(self, i, original, args, kwargs)
            if self.chunking is not None:
                return run_chunked(self, i, original, args, kwargs)
            hidden, call = _split(original, args, kwargs)
            self._runs[i] = self._runs.get(i, 0) + 1
            holder: list[Any] = []
            outputs = _PagedBlockFunction.apply(
                self, i, call, holder, self._dummy, hidden, *call.extras
            )
            out, captured = holder
            made = len(_outputs(out))
            captured.replace(list(outputs[made:]))
            return _repack(out, outputs[:made])

        return paged_forward

    # -- gradients of autograd blocks ---------------------------------------

    def _hook(self, i: int, j: int) -> Callable[[Tensor], None]:
        needed = sum(p.requires_grad for p in self.pager.params[i])

        def take(param: Tensor) -> None:
            pending = self._pending.get(i)
            if pending is None:  # not an autograd pass of this block
                return
            # autograd sums every use of the parameter in this backward before the hook
            pending[j], param.grad = param.grad, None
            self._maybe_done(i, needed)

        return take

    def _maybe_done(self, i: int, needed: int) -> None:
        """Hand block ``i`` on once its ``needed`` gradients and its input gradient are in."""
        pending = self._pending.get(i)
        if pending is None or i in self._input_pending:
            return
        if sum(g is not None for g in pending) == needed:
            del self._pending[i]
            self.hand_off(i, pending)

    def input_done(self, i: int) -> None:
        """Autograd has computed block ``i``'s input gradient: its weights are no longer read."""
        left = self._input_pending.pop(i, 1) - 1
        if left > 0:  # its weights are read by the input gradient of another forward
            self._input_pending[i] = left
            return
        self._maybe_done(i, sum(p.requires_grad for p in self.pager.params[i]))

    def hand_off(self, i: int, grads: Sequence[Tensor | None]) -> None:
        """Release block ``i`` and pass on its parameter gradients (None: no gradient)."""
        self.pager.release(i)  # before its optimizer step may rewrite the weights
        if self.on_block_grads is not None:
            self.on_block_grads(i, grads)
        else:
            state = self.pager.states[i]
            self.grads.process_async(grads, lambda g: _sum_into(state, g))
        if self.on_block_backward is not None:
            self.on_block_backward(i)

    def runs_left(self, i: int) -> int:
        """Backward passes of block ``i`` still to come in this micro-batch (a step that ran
        the model twice hands each block's gradients on twice; the last hand-off holds
        its last part)."""
        return self._runs.get(i, 0)

    def backward_ran(self, i: int) -> None:
        """One backward pass of block ``i`` (recomputed) has computed its gradients."""
        if self._runs.get(i, 0) > 0:
            self._runs[i] -= 1

    def take_pending(self) -> dict[int, list[Tensor | None]]:
        """Autograd blocks whose backward left parameters without a gradient, and what
        they got (``.grad`` read for those the hooks did not see); forgets them, and the
        forwards whose backward did not run (their outputs were not in the loss)."""
        pending, self._pending = self._pending, {}
        self._input_pending = {}
        self._runs = {}
        if self.chunking is not None:
            self.chunking.boundaries.forget()
        if self.swap is not None:
            self.swap.forget()
        for i, grads in pending.items():
            for j, p in enumerate(self.pager.params[i]):
                if grads[j] is None and p.grad is not None:
                    grads[j], p.grad = p.grad, None
        return pending

    def prefetch_saved(self, blocks: Sequence[int]) -> None:
        """Start fetching back what ``blocks`` keep in the store for their backward: the
        boundary inputs of recomputed blocks, the saved activations of swapped ones."""
        if self.chunking is not None and not self.chunking.boundaries.on_device:
            self.chunking.boundaries.prefetch(blocks)
        if self.swap is not None:
            self.swap.prefetch(blocks)

    # -- the visit schedule -------------------------------------------------

    def _upcoming(self, i: int, phase: str) -> list[int]:
        """Blocks visited after block ``i`` in ``phase``, up to the prefetch depth."""
        n, depth = self.pager.num_blocks, self.pager.placement.prefetch_depth
        if phase == "forward_grad":
            order = list(range(i + 1, n)) + list(range(n - 1, -1, -1))
        elif phase == "forward":
            order = [(i + k) % n for k in range(1, n)]
        else:
            order = list(range(i - 1, -1, -1))
        return order[:depth]

    def enter(self, i: int, phase: str) -> list[int]:
        """Page block ``i`` in and prefetch the next ones; the blocks kept after it."""
        upcoming = self._upcoming(i, phase)
        if phase != "backward" and i == 0:  # autograd blocks stay bound for their backward
            self.pager.release_all_except([0, *upcoming, *self._pending])
        self.pager.acquire(i)
        self.pager.prefetch(upcoming)
        return upcoming

    def leave(self, i: int, upcoming: Sequence[int]) -> None:
        """Release block ``i`` unless the schedule visits it again within the window, or
        its backward with ordinary autograd is still to come (a forward without grad ran
        between that block's forward and its backward)."""
        if i not in upcoming and i not in self._pending:
            self.pager.release(i)

    def _enter_shared(self, i: int, visit: int) -> list[int]:
        """Page block ``i`` in for groups of sequences in flight (its ``visit``-th block of
        the step); the blocks kept after it. The blocks after it are prefetched by the
        release of the block before it (:meth:`_leave_shared`), at the first visit here."""
        upcoming = self._upcoming(i, "forward")
        if i == 0:
            self.pager.release_all_except([0, *upcoming, *self._pending])
        self.pager.acquire(i)
        if visit == 0:
            self.pager.prefetch(upcoming)
        return upcoming

    def _leave_shared(self, i: int, upcoming: list[int]) -> None:
        """Release block ``i`` once every group is done with it (:meth:`leave`) and prefetch
        the blocks after the next one into its slot."""
        self.leave(i, upcoming)
        if upcoming:
            self.pager.prefetch(self._upcoming(upcoming[0], "forward"))

    def _run_no_grad(
        self, i: int, original: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Any:
        def run() -> Any:
            if self.max_tokens is None:
                return original(*args, **kwargs)
            if chunk_count(args, kwargs, self.max_tokens) < 2:
                return call_in_row_chunks(original, args, kwargs, self.max_tokens)
            with host_packed.packed_linears(self.blocks[i], self.max_tokens):
                return call_in_row_chunks(original, args, kwargs, self.max_tokens)

        step = current_step()
        if step is not None:  # groups of sequences in flight: one page-in for them all
            return step.block(
                i, lambda visit: self._enter_shared(i, visit), run,
                lambda upcoming: self._leave_shared(i, upcoming),
            )  # fmt: skip
        upcoming = self.enter(i, "forward")
        try:
            return run()
        finally:
            self.leave(i, upcoming)


class _BlockCall:
    """Runs a block on given hidden states, its other arguments bound.

    :attr:`extras` are the other tensor arguments that require gradient (top-level, in a
    tuple, or in ``**kwargs``); a call given new values for them runs on those instead.
    """

    def __init__(self, original: Callable[..., Any], bound: inspect.BoundArguments) -> None:
        self.original, self.bound = original, bound
        params = bound.signature.parameters
        self.first = next(iter(params))
        self._slots: list[tuple[dict[str, Any], str, int | None]] = []
        """Where each extra sits: (dict, key, index in the tuple there or None)."""
        for key, value in bound.arguments.items():
            if key == self.first:
                continue
            if params[key].kind is inspect.Parameter.VAR_KEYWORD:  # a copy (``_split``)
                for k, v in value.items():
                    self._collect(value, k, v)
            else:
                self._collect(bound.arguments, key, value)
        self.extras: list[Tensor] = [d[k] if j is None else d[k][j] for d, k, j in self._slots]

    def _collect(self, where: dict[str, Any], key: str, value: Any) -> None:
        if isinstance(value, Tensor) and value.requires_grad:
            self._slots.append((where, key, None))
        elif isinstance(value, tuple):
            for j, v in enumerate(value):
                if isinstance(v, Tensor) and v.requires_grad:
                    self._slots.append((where, key, j))

    def passed(self, exclude: Sequence[Tensor]) -> set[int]:
        """Ids of the tensors among the bound arguments (top level, in a tuple, in
        ``**kwargs``), those in ``exclude`` left out."""
        params = self.bound.signature.parameters
        found: list[Any] = []
        for key, value in self.bound.arguments.items():
            if params[key].kind is inspect.Parameter.VAR_KEYWORD:
                found.extend(value.values())
            else:
                found.append(value)
        tensors = [t for v in found for t in (v if isinstance(v, tuple) else (v,))]
        skip = {id(t) for t in exclude}
        return {id(t) for t in tensors if isinstance(t, Tensor) and id(t) not in skip}

    def __call__(self, hidden: Tensor, *extras: Tensor) -> Any:
        self._set(hidden, extras)
        return self.original(*self.bound.args, **self.bound.kwargs)

    def drop_inputs(self) -> None:
        """Forget the hidden states and extras of the last call (their memory may go)."""
        self._set(None, (None,) * len(self._slots))

    def _set(self, hidden: Tensor | None, extras: Sequence[Tensor | None]) -> None:
        self.bound.arguments[self.first] = hidden
        for (where, key, j), value in zip(self._slots, extras, strict=False):
            if j is None:
                where[key] = value
            else:
                old = where[key]
                items = list(old)
                items[j] = value
                where[key] = tuple(items) if type(old) is tuple else type(old)(*items)


def _split(
    original: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[Tensor, _BlockCall]:
    """The hidden states (the forward's first parameter) and a call running the block on others.

    Cache arguments, positional or keyword, are set to None and ``use_cache`` to False.
    """
    sig = inspect.signature(original)
    try:
        bound = sig.bind(*args, **kwargs)
    except TypeError as err:
        raise ValueError(
            f"block forward{sig} cannot take the arguments it was given: {err}"
        ) from err
    arguments = bound.arguments
    for key, param in sig.parameters.items():
        if param.kind is inspect.Parameter.VAR_KEYWORD and key in arguments:
            arguments[key] = _without_cache(dict(arguments[key]))
    arguments.update(_without_cache({k: v for k, v in arguments.items() if k in _NO_CACHE}))
    first = next(iter(sig.parameters))
    hidden = arguments.get(first)
    if not isinstance(hidden, Tensor):
        raise ValueError(
            f"block hidden states {first!r} are a {type(hidden).__name__}, not a Tensor: pass "
            "the hidden states as the block's first argument"
        )

    return hidden, _BlockCall(original, bound)


_NO_CACHE = (*CACHE_KWARGS, "use_cache")


def _without_cache(kwargs: dict[str, Any]) -> dict[str, Any]:
    for key in CACHE_KWARGS:
        if key in kwargs:
            kwargs[key] = None
    if "use_cache" in kwargs:
        kwargs["use_cache"] = False
    return kwargs


def _outputs(out: Any) -> list[Tensor]:
    """The tensors a block returns: itself, or those at the top level of its tuple / list."""
    items = list(out) if isinstance(out, (tuple, list)) else [out]
    if not items or not isinstance(items[0], Tensor):
        raise ValueError(f"block returned {type(out).__name__} without a leading Tensor")
    return [t for t in items if isinstance(t, Tensor)]


def _repack(out: Any, outputs: Sequence[Tensor]) -> Any:
    """The block's output structure with its tensors replaced, in order, by ``outputs``."""
    if not isinstance(out, (tuple, list)):
        return outputs[0]
    given = iter(outputs)
    items = [next(given) if isinstance(t, Tensor) else t for t in out]
    return tuple(items) if isinstance(out, tuple) else items


@contextlib.contextmanager
def _rng_restored(state: tuple[Tensor, Tensor | None]) -> Iterator[None]:
    devices = [torch.cuda.current_device()] if state[1] is not None else []
    with torch.random.fork_rng(devices=devices):
        torch.set_rng_state(state[0])
        if state[1] is not None:
            torch.cuda.set_rng_state(state[1])
        yield


def _sum_into(state: FlatState, grads: Sequence[Tensor | None]) -> None:
    state.accumulate(grads, torch.empty(state.numel, dtype=torch.float32))


class _PagedBlockFunction(torch.autograd.Function):
    """One block with per-block checkpointing: only its inputs are saved (the hidden
    states and the other tensor arguments that require gradient).

    Every tensor the block returns is an output, so a second one that a later block reads
    (a router's state handed down the stack) carries its gradient back as the first does;
    so is every tensor transformers' output capture recorded inside it (router logits for
    an MoE's auxiliary loss), recorded again when the block is recomputed.
    """

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
        cuda_state = torch.cuda.get_rng_state() if hidden.is_cuda else None
        ctx.rng = (torch.get_rng_state(), cuda_state)
        ctx.runner, ctx.i, ctx.call = runner, i, call
        upcoming = runner.enter(i, "forward_grad")
        captured = CapturedOutputs.since_now()
        try:
            out = call(hidden, *extras)
        finally:
            runner.leave(i, upcoming)
        holder.extend((out, captured))
        ctx.layout = captured.layout()
        ctx.save_for_backward(hidden, *extras)
        # A tensor the block hands through from its other arguments (a mask, a position
        # table) leaves as an alias outside the graph: returned itself, autograd would
        # give the caller's tensor this node as its grad_fn.
        passed = call.passed(exclude=(hidden, *extras))
        made = [*_outputs(out), *captured.tensors()]
        outputs = [t.detach() if id(t) in passed else t for t in made]
        ctx.set_materialize_grads(False)  # an output nothing reads gets None, not zeros
        ctx.mark_non_differentiable(
            *(
                o
                for o, t in zip(outputs, made, strict=True)
                if o is not t or not o.is_floating_point()
            )
        )
        return tuple(outputs)

    @staticmethod
    def backward(ctx: Any, *grad_outs: Tensor | None) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        saved = ctx.saved_tensors
        runner: PagedBlocks = ctx.runner
        i: int = ctx.i
        wants = [bool(w) for w in ctx.needs_input_grad[5:]]  # hidden, then the extras
        upcoming = runner.enter(i, "backward")
        runner.prefetch_saved(upcoming)
        try:
            params = runner.pager.params[i]
            given = [t.detach().requires_grad_(w) for t, w in zip(saved, wants, strict=True)]
            wanted = [t for t, w in zip(given, wants, strict=True) if w]
            inputs = [*wanted, *params]
            grads: tuple[Tensor | None, ...] = (None,) * len(inputs)
            if inputs:  # else nothing of this block trains and no gradient flows through it
                with torch.enable_grad(), _rng_restored(ctx.rng), recording(ctx.layout) as redone:
                    outputs = [*_outputs(ctx.call(*given)), *redone.tensors()]
                read = [
                    (o, g)
                    for o, g in zip(outputs, grad_outs, strict=True)
                    if g is not None and o.requires_grad
                ]
                if read:
                    grads = torch.autograd.grad(
                        [o for o, _ in read], inputs, [g for _, g in read], allow_unused=True
                    )
        finally:
            runner.leave(i, upcoming)
        runner.backward_ran(i)
        runner.hand_off(i, grads[len(wanted) :])
        of_inputs = iter(grads[: len(wanted)])
        return (None,) * 5 + tuple(next(of_inputs) if w else None for w in wants)


class _InputDone(torch.autograd.Function):
    """Identity on a block's input whose backward tells the runner the block is done."""

    @staticmethod
    def forward(ctx: Any, runner: PagedBlocks, i: int, hidden: Tensor) -> Tensor:  # type: ignore[override]
        ctx.runner, ctx.i = runner, i
        return hidden.clone()

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        ctx.runner.input_done(ctx.i)
        return None, None, grad
