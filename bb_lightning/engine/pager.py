"""Page blocks' weights in and out of the device through a :class:`storage.store.TieredStore`.

The pager owns the mapping from a block to the names of its tensors in the
store. The store owns residency (RESIDENT / IN_FLIGHT / RELEASED); the pager
only keeps the tickets of page-ins it has issued and asks the store for state.

Per block ``i`` the store holds, each as one flat 1-D tensor:

- ``<prefix>.<i>.weight``: the block's parameters in the compute dtype, laid end
  to end (home: ``Placement.weights[i]``; DEVICE means resident);
- ``<prefix>.<i>.master``, ``.exp_avg``, ``.exp_avg_sq``: fp32 master weights and
  AdamW moments (home: ``Placement.master[i]``), see :class:`FlatState`.

The fp32 gradient accumulators are plain host tensors owned by
:class:`FlatState`: they never page, so they have no residency.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from bb_lightning.engine.timing import PhaseTimer
from storage.store import Ticket, TieredStore
from storage.tiers import Residency, Tier

__all__ = [
    "BlockLoader",
    "BlockPager",
    "FlatState",
    "GradSink",
    "Placement",
    "block_params",
    "flatten_fp32",
    "set_data",
]

BlockLoader = Callable[[int], Tensor]
"""Block index -> the block's parameters as one flat fp32 CPU tensor, laid out like its
:class:`FlatState` (used to fill the store from a checkpoint one block at a time)."""


@dataclass(frozen=True, kw_only=True)
class Placement:
    """Where each block's tensors live, and how far ahead page-ins run."""

    weights: tuple[Tier, ...]
    """Home tier of each block's compute-dtype weights (DEVICE = resident)."""
    master: tuple[Tier, ...]
    """Home tier of each block's fp32 master weights and AdamW moments."""
    prefetch_depth: int = 1
    """Blocks paged in ahead of the one computing (>= 1); the device holds depth + 1 blocks."""

    def __post_init__(self) -> None:
        if len(self.weights) != len(self.master):
            raise ValueError(
                f"placement has {len(self.weights)} weight tiers but {len(self.master)} master "
                "tiers: give one of each per block"
            )
        if self.prefetch_depth < 1:
            raise ValueError(f"prefetch_depth={self.prefetch_depth} must be >= 1: pass 1 or more")

    @classmethod
    def uniform(
        cls, num_blocks: int, *, weights: Tier, master: Tier = Tier.HOST, prefetch_depth: int = 1
    ) -> Placement:
        """Every block's weights on ``weights`` and optimizer state on ``master``."""
        return cls(
            weights=(weights,) * num_blocks,
            master=(master,) * num_blocks,
            prefetch_depth=prefetch_depth,
        )


def block_params(module: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """Named parameters of ``module`` in registration order, shared ones once."""
    return list(module.named_parameters(remove_duplicate=True))


class FlatState:
    """fp32 master weights, AdamW moments (in the store) and a host gradient accumulator.

    ``params`` are laid end to end in one flat buffer of ``numel`` elements.
    The master weights are initialised from ``initial`` (flat fp32) when given,
    else from the parameters' current values (which may then not be on the meta device).
    """

    def __init__(
        self,
        store: TieredStore,
        name: str,
        params: Sequence[Tensor],
        *,
        home: Tier,
        initial: Tensor | None = None,
    ) -> None:
        self.store = store
        self.name = name
        self.shapes = [tuple(p.shape) for p in params]
        self.numel = sum(math.prod(s) for s in self.shapes)
        master = initial if initial is not None else flatten_fp32(params)
        if master.shape != (self.numel,) or master.dtype != torch.float32:
            raise ValueError(
                f"initial values of {name!r} have shape {tuple(master.shape)} and {master.dtype}; "
                f"expected ({self.numel},) and torch.float32: lay the parameters end to end"
            )
        zeros = torch.zeros(self.numel, dtype=torch.float32)
        store.register(self.master_name, master, home=home)
        store.register(f"{name}.exp_avg", zeros, home=home)
        store.register(f"{name}.exp_avg_sq", zeros, home=home)
        pin = torch.cuda.is_available()
        self.grad = torch.zeros(self.numel, dtype=torch.float32, pin_memory=pin)
        """fp32 gradient accumulator on the host, zeroed after each optimizer step."""
        self.grad_views = _views(self.grad, self.shapes)

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

    def master_views(self, flat: Tensor) -> list[Tensor]:
        """Per-parameter views of a flat buffer laid out like this state."""
        return _views(flat, self.shapes)

    def move(self, home: Tier) -> None:
        """Change the home tier of the master weights and moments (they must be released)."""
        for name in self.state_names:
            self.store.move(name, home)


def set_data(param: Tensor, value: Tensor) -> None:
    """``param.data = value``, also for a parameter on the meta device (swapped in place,
    so the parameter object and every reference to it stay the same)."""
    if param.is_meta and not value.is_meta:
        new = nn.Parameter(value, requires_grad=param.requires_grad)
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
    return torch.cat([p.detach().reshape(-1).to("cpu", torch.float32) for p in params])


def _views(flat: Tensor, shapes: Sequence[tuple[int, ...]]) -> list[Tensor]:
    views = []
    offset = 0
    for shape in shapes:
        size = math.prod(shape)
        views.append(flat[offset : offset + size].view(shape))
        offset += size
    return views


class GradSink:
    """Moves gradients off the device into fp32 host accumulators on one worker thread.

    On CUDA the copy runs on a side stream ordered after the producing stream;
    on CPU the worker adds into the accumulator. :meth:`wait` is the one sync
    point of a backward pass.
    """

    def __init__(self, timer: PhaseTimer | None = None) -> None:
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="bb-grads")
        self._futures: list[Future[None]] = []
        self._stream = torch.cuda.Stream() if torch.cuda.is_available() else None
        self.timer = timer
        """Times :meth:`wait` as phase ``wait_grads`` when set."""

    def add_async(self, dst: Sequence[Tensor], grads: Sequence[Tensor | None]) -> None:
        """Add each gradient (any dtype, device) into the matching host fp32 view, later."""
        if self._stream is not None and any(g is not None and g.is_cuda for g in grads):
            event = torch.cuda.Event()
            event.record()
            for g in grads:
                if g is not None:
                    g.record_stream(self._stream)
            self._futures.append(self._pool.submit(self._add_cuda, dst, grads, event))
        else:
            self._futures.append(self._pool.submit(_add_all, dst, grads))

    def _add_cuda(
        self, dst: Sequence[Tensor], grads: Sequence[Tensor | None], event: torch.cuda.Event
    ) -> None:
        assert self._stream is not None
        with torch.cuda.stream(self._stream):
            self._stream.wait_event(event)
            host = [None if g is None else g.to("cpu", torch.float32) for g in grads]
        _add_all(dst, host)

    def submit(self, work: Callable[[], None]) -> None:
        """Run ``work`` on the worker after every addition queued so far (FIFO order)."""
        self._futures.append(self._pool.submit(work))

    def wait(self, phase: str | None = "wait_grads") -> None:
        """Block until every queued task is done; re-raises a worker's exception.

        The wait is timed as ``phase`` when a timer is set (None: not timed).
        """
        futures, self._futures = self._futures, []
        with _timed(None if phase is None else self.timer, phase or ""):
            for future in futures:
                future.result()

    def close(self) -> None:
        """Finish queued work and stop the worker."""
        self.wait()
        self._pool.shutdown(wait=True)


def _timed(timer: PhaseTimer | None, phase: str) -> contextlib.AbstractContextManager[None]:
    return contextlib.nullcontext() if timer is None else timer.phase(phase)


def _add_all(dst: Sequence[Tensor], grads: Sequence[Tensor | None]) -> None:
    for view, g in zip(dst, grads, strict=True):
        if g is not None:
            view.add_(g.to(view.device))


class BlockPager:
    """Binds each block's parameters to paged device views of its flat weights.

    Released parameters point at one shared empty tensor, so a block costs no
    device memory until it is paged in.
    """

    def __init__(
        self,
        store: TieredStore,
        blocks: Sequence[nn.Module],
        placement: Placement,
        *,
        compute_dtype: torch.dtype,
        device: torch.device,
        prefix: str = "block",
        loader: BlockLoader | None = None,
        timer: PhaseTimer | None = None,
    ) -> None:
        """Register every block's tensors in ``store`` and unbind its parameters.

        Args:
            loader: block values when the parameters are on the meta device (streamed
                from a checkpoint); None reads the parameters themselves.
            timer: times waits on page-ins as phase ``wait_page_in`` when set.
        """
        if len(placement.weights) != len(blocks):
            raise ValueError(
                f"placement covers {len(placement.weights)} blocks but the model has "
                f"{len(blocks)}: build the placement for this model"
            )
        self.store = store
        self.placement = placement
        self.compute_dtype = compute_dtype
        self.timer = timer
        self.params = [[p for _, p in block_params(b)] for b in blocks]
        self.names = [f"{prefix}.{i}.weight" for i in range(len(blocks))]
        self.states: list[FlatState] = []
        self._tickets: dict[int, Ticket] = {}
        for i, params in enumerate(self.params):
            master = loader(i) if loader is not None else flatten_fp32(params)
            store.register(self.names[i], master.to(compute_dtype), home=placement.weights[i])
            state = FlatState(
                store, f"{prefix}.{i}", params, home=placement.master[i], initial=master
            )
            self.states.append(state)
            del master
        self._empty = torch.empty(0, dtype=compute_dtype, device=device)
        for i in range(len(blocks)):
            self._unbind(i)

    @property
    def num_blocks(self) -> int:
        """Number of paged blocks."""
        return len(self.names)

    def _paged(self, i: int) -> bool:
        return self.store.home(self.names[i]) is not Tier.DEVICE

    def prefetch(self, indices: Sequence[int]) -> None:
        """Start page-ins of the given blocks that are neither resident nor in flight."""
        for i in indices:
            if i in self._tickets or not self._paged(i):
                continue
            if self.store.state(self.names[i]) is Residency.RELEASED:
                self._tickets[i] = self.store.prefetch_async([self.names[i]])

    def acquire(self, i: int) -> list[Tensor]:
        """Page block ``i`` in (waiting for its prefetch) and bind its parameters; the views."""
        name = self.names[i]
        ticket = self._tickets.pop(i, None)
        if ticket is None and self.store.state(name) is Residency.RELEASED:
            ticket = self.store.prefetch_async([name])
        if ticket is not None:
            with _timed(self.timer, "wait_page_in"):
                flat = ticket.wait()[name]
        else:
            flat = self.store.get(name)
        views = _views(flat, [tuple(s) for s in self.states[i].shapes])
        for p, v in zip(self.params[i], views, strict=True):
            p.data = v
        return views

    def release(self, i: int) -> None:
        """Unbind block ``i`` and give its device slot back (resident blocks stay)."""
        self._unbind(i)
        ticket = self._tickets.pop(i, None)
        if ticket is not None:
            ticket.wait()
        if self._paged(i) and self.store.state(self.names[i]) is Residency.RESIDENT:
            self.store.release([self.names[i]])

    def release_all_except(self, keep: Sequence[int] = ()) -> None:
        """Release every paged-in or in-flight block not in ``keep``."""
        for i in range(self.num_blocks):
            if i not in keep and (i in self._tickets or self._paged(i)):
                self.release(i)

    def _unbind(self, i: int) -> None:
        for p in self.params[i]:
            set_data(p, self._empty)

    def write_weights(self, i: int, master: Tensor, scratch: Tensor) -> None:
        """Cast fp32 ``master`` into ``scratch`` (compute dtype) and store it as block ``i``'s weights."""
        assert not self._paged(i) or self.store.state(self.names[i]) is Residency.RELEASED, (
            f"block {i} must be released before its weights are rewritten"
        )
        out = scratch[: master.numel()]
        out.copy_(master)
        self.store.write(self.names[i], out)

    def apply(self, placement: Placement) -> None:
        """Re-home every block's tensors as ``placement`` says (moves through the store).

        Every block is released first; the store checks each destination's budget
        and raises ``ValueError`` when one does not fit (blocks moved before stay moved).
        """
        if len(placement.weights) != self.num_blocks:
            raise ValueError(
                f"placement covers {len(placement.weights)} blocks but the pager holds "
                f"{self.num_blocks}: build the placement for this model"
            )
        self.release_all_except(())
        # Free a tier before filling it: moves off a tier go first.
        order = sorted(range(self.num_blocks), key=lambda i: placement.weights[i] is Tier.DEVICE)
        for i in order:
            self.store.move(self.names[i], placement.weights[i])
        for i, state in enumerate(self.states):
            state.move(placement.master[i])
        self.placement = placement

    def device_bytes(self) -> int:
        """Bytes of compute-dtype weights one block occupies (the largest block)."""
        elem = torch.empty(0, dtype=self.compute_dtype).element_size()
        return max(s.numel for s in self.states) * elem
