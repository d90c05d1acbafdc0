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

Paged blocks meet at each block (:meth:`GroupStep.block`): the first group to reach a
block pages it in, each group runs its own call of it, and the last group done with it
releases it, so a block's weights cross the link once per step whatever the groups. A
group may run ahead into the next block while another is still in this one (the device
computes the first group's next projections while the host attends for the second: the
pipeline fills once per step, not once per block), but no further: with two blocks in use,
the next block's page-in starts when the block before them is released, so the device
holds as many blocks as without groups (``prefetch_depth + 1``). A model whose blocks are
not paged runs its groups' forwards side by side without meeting.

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
    """One forward pass of ``parties`` groups, each on its own thread, meeting at the paged
    blocks they visit in the same order (see the module docstring)."""

    def __init__(self, parties: int) -> None:
        if parties < 1:
            raise ValueError(f"parties={parties} must be >= 1 groups in flight")
        self.parties = parties
        self.host = threading.Lock()
        """Held while a group's host attention computes (one group at a time)."""
        self._cv = threading.Condition()
        self._pager = threading.Lock()
        """Held while a block is paged in or released (one at a time)."""
        self._visits: dict[int, int] = {}
        """Blocks each group's thread has visited so far."""
        self._block: dict[int, int] = {}
        """The block of each visit begun (visits are numbered in order, the same for all)."""
        self._kept: dict[int, list[int]] = {}
        """What each visit's page-in returned (the blocks kept after it)."""
        self._left: dict[int, int] = {}
        """Groups done with each visit."""
        self._released: set[int] = set()
        """Visits every group is done with, their block released."""
        self._broken = False

    def block(
        self,
        i: int,
        enter: Callable[[int], list[int]],
        run: Callable[[], T],
        leave: Callable[[list[int]], None],
    ) -> T:
        """``run()``, this group's call of block ``i`` at its ``k``-th visit of a block.

        The first group to reach visit ``k`` runs ``enter(k)`` (the block's page-in,
        returning the blocks kept after it) before any group runs it, and the last group
        done with it runs ``leave(kept)`` (its release, and the next page-ins). A group
        begins visit ``k`` once visit ``k - 2`` and every earlier visit of block ``i`` are
        released: the groups are at most one block apart, so at most two blocks are in
        use at once, and the next page-in starts as the block two visits back is released.
        """
        me = threading.get_ident()
        k = self._visits.get(me, 0)
        self._visits[me] = k + 1
        with self._cv:
            self._wait(lambda: (k < 2 or k - 2 in self._released) and all(
                v in self._released for v, b in self._block.items() if b == i and v < k
            ))  # fmt: skip
            first = k not in self._block
            self._block[k] = i
        if first:
            with self._guard(), self._pager:
                kept = enter(k)
            with self._cv:
                self._kept[k] = kept
                self._cv.notify_all()
        else:
            with self._cv:
                self._wait(lambda: k in self._kept)
        with self._guard():
            out = run()
        with self._cv:
            self._left[k] = self._left.get(k, 0) + 1
            last = self._left[k] == self.parties
        if last:
            with self._guard(), self._pager:
                leave(self._kept[k])
            with self._cv:
                self._released.add(k)
                self._cv.notify_all()
        return out

    def abort(self) -> None:
        """Stop every group waiting at a block (or reaching one): it raises
        ``threading.BrokenBarrierError``."""
        with self._cv:
            self._broken = True
            self._cv.notify_all()

    def _wait(self, ready: Callable[[], bool]) -> None:
        """Wait (holding ``self._cv``) until ``ready()``, unless the step is aborted."""
        self._cv.wait_for(lambda: self._broken or ready())
        if self._broken:
            raise threading.BrokenBarrierError

    @contextlib.contextmanager
    def _guard(self) -> Iterator[None]:
        """Abort the step when the body raises (the other groups stop instead of waiting)."""
        try:
            yield
        except BaseException:
            self.abort()
            raise


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
