"""Groups of a generation batch's sequences in flight at once, one thread each.

With decode attention on the host (the plan's ``decode_attention``, beside a GPU) a
decode step alternates between the device's work of each block (its projections, MLP
or experts) and the host's attention over the KV cache: with the whole batch as one group
one of the two always waits for the other. :func:`run_groups` runs one model forward per
group of sequences, each on a thread of its own (the first on the caller's), each group
with its own KV cache, so that while the host attends for one group the device computes
for another (FlexGen's zig-zag schedule in spirit). torch releases the GIL inside its
operations, and a group's thread waits for the device only where its host attention
copies the query rows to the host. :func:`host_turn` lets one group at a time run the
host's attention (on all the host's cores): the first group's attention ends first, and
its device work runs beside the next group's attention, instead of every group's
attention ending together at the end of a shared, slower one.

Paged blocks meet at each block (:meth:`GroupStep.block`): the block is paged in once,
when every group has reached it (the last to arrive pages it in and prefetches the next),
each group runs its own call of it, and the block is released once every group is done
with it, so a block's weights cross the link once per step whatever the groups. A model
whose blocks are not paged runs its groups' forwards side by side without meeting.

Every group computes what it would alone: its rows, its cache, its mask and positions;
a token depends only on its own sequence. An error in one group breaks the others'
meeting (they stop) and is raised to the caller.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from contextvars import ContextVar
from typing import Any, TypeVar

import torch

__all__ = ["GroupStep", "current_step", "group_spans", "host_turn", "run_groups"]

T = TypeVar("T")

_STEP: ContextVar[GroupStep | None] = ContextVar("bb_group_step", default=None)
"""The step whose group the current thread runs (None: no groups in flight)."""


class GroupStep:
    """One forward pass of ``parties`` groups, each on its own thread."""

    def __init__(self, parties: int) -> None:
        if parties < 1:
            raise ValueError(f"parties={parties} must be >= 1 groups in flight")
        self.parties = parties
        self._barrier = threading.Barrier(parties, action=self._act)
        self._pending: Callable[[], None] = lambda: None
        """What the last group to reach a meeting runs before every group goes on."""
        self._upcoming: list[int] = []
        """The blocks the last page-in kept paged in after its block (its ``enter``)."""
        self.host = threading.Lock()
        """Held while a group's host attention computes (one group at a time)."""

    def _act(self) -> None:
        self._pending()

    def _meet(self, action: Callable[[], None]) -> None:
        self._pending = action  # every group sets the same action before its last one meets
        self._barrier.wait()

    def block(
        self,
        enter: Callable[[], list[int]],
        run: Callable[[], T],
        leave: Callable[[list[int]], None],
    ) -> T:
        """``run()`` (this group's call of a block) between one ``enter()`` (the block's
        page-in, returning the blocks kept after it) when every group has reached the block
        and one ``leave(kept)`` when every group is done with it."""

        def entered() -> None:
            self._upcoming = enter()

        self._meet(entered)
        try:
            out = run()
        except BaseException:
            self.abort()
            raise
        self._meet(lambda: leave(self._upcoming))
        return out

    def abort(self) -> None:
        """Break the meetings: every group waiting at one (or reaching one) stops."""
        self._barrier.abort()


def current_step() -> GroupStep | None:
    """The grouped forward the calling thread runs a group of (None: none)."""
    return _STEP.get()


@contextlib.contextmanager
def host_turn() -> Iterator[None]:
    """Hold the host's attention for the calling group (a no-op outside a grouped step)."""
    step = _STEP.get()
    if step is None or step.parties == 1:
        yield
        return
    with step.host:
        yield


def group_spans(rows: int, groups: int) -> list[tuple[int, int]]:
    """``[start, end)`` of each of ``groups`` groups of ``rows`` rows, as even as can be
    (the first ones one row longer); fewer groups where there are fewer rows."""
    if rows < 1 or groups < 1:
        raise ValueError(f"rows={rows} and groups={groups} must both be >= 1")
    n = min(rows, groups)
    sizes = [rows // n + (g < rows % n) for g in range(n)]
    starts = [sum(sizes[:g]) for g in range(n)]
    return [(a, a + s) for a, s in zip(starts, sizes, strict=True)]


def run_groups(calls: Sequence[Callable[[], T]], pool: ThreadPoolExecutor | None) -> list[T]:
    """Each of ``calls`` (one group's forward) on a thread of its own, the first on the
    caller's and the others on ``pool``'s (at least ``len(calls) - 1`` workers that nothing
    else uses meanwhile), under the caller's grad / inference mode and CUDA stream; their
    results in order. One call runs alone on the caller's thread, as without groups."""
    if len(calls) == 1:
        return [calls[0]()]
    if pool is None:
        raise ValueError(f"{len(calls)} groups need a pool of {len(calls) - 1} threads")
    step = GroupStep(len(calls))
    modes = (torch.is_inference_mode_enabled(), torch.is_grad_enabled())
    cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
    stream = torch.cuda.current_stream() if cuda else None

    def one(call: Callable[[], T]) -> T:
        token = _STEP.set(step)
        try:
            with torch.inference_mode(modes[0]), torch.set_grad_enabled(modes[1]):
                with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
                    return call()
        except BaseException:
            step.abort()
            raise
        finally:
            _STEP.reset(token)

    futures: list[Future[T]] = [pool.submit(one, c) for c in calls[1:]]
    results: list[Any] = []
    errors: list[BaseException] = []
    try:
        results.append(one(calls[0]))
    except BaseException as err:
        errors.append(err)
    for f in futures:
        try:
            results.append(f.result())
        except BaseException as err:
            errors.append(err)
    if errors:  # the group that failed, not one that only saw the meeting broken
        broken = threading.BrokenBarrierError
        raise next((e for e in errors if not isinstance(e, broken)), errors[0])
    return results
