"""Groups of sequences in flight (bb_lightning.engine.groups): how a batch splits, how the
groups' threads meet at each paged block, how an error in one group reaches the caller,
and how many groups the generator runs where."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from typing import Any

import pytest
import torch

from bb_lightning.engine.generate import LayerMajorGenerator
from bb_lightning.engine.groups import current_step, group_spans, run_groups
from bb_lightning.placement import DECODE_GROUPS
from storage.tiers import Tier

from ..tiny import FAMILIES, tiny_model


@pytest.fixture
def pool() -> Iterator[ThreadPoolExecutor]:
    workers = ThreadPoolExecutor(2)
    yield workers
    workers.shutdown()


def test_a_batch_splits_into_groups_as_even_as_can_be() -> None:
    assert group_spans(4, 1) == [(0, 4)]
    assert group_spans(4, 2) == [(0, 2), (2, 4)]
    assert group_spans(4, 3) == [(0, 2), (2, 3), (3, 4)]
    assert group_spans(7, 2) == [(0, 4), (4, 7)]
    assert group_spans(1, 2) == [(0, 1)]  # fewer rows than groups: one group per row
    with pytest.raises(ValueError, match=r"rows=0 and groups=2 must both be >= 1"):
        group_spans(0, 2)


def test_groups_meet_at_each_block_once(pool: ThreadPoolExecutor) -> None:
    """Three groups through three blocks: each block is paged in once before any group runs
    it and released once after every group has; each group on a thread of its own, under
    the caller's inference mode."""
    events: list[tuple[str, int, int | None]] = []
    lock = threading.Lock()

    def record(*event: Any) -> None:
        with lock:
            events.append(event)  # type: ignore[arg-type]

    def enter(i: int, visit: int) -> list[int]:
        assert visit == i
        record("enter", i, None)
        return [i + 1]

    def forward(group: int) -> tuple[int, bool]:
        step = current_step()
        assert step is not None and step.parties == 3
        for i in range(3):
            step.block(
                i, partial(enter, i), partial(record, "run", i, group),
                partial(lambda i, kept: record("leave", i, kept[0]), i),
            )  # fmt: skip
        return threading.get_ident(), torch.is_inference_mode_enabled()

    with torch.inference_mode():
        out = run_groups([partial(forward, g) for g in range(3)], pool)
    assert len({thread for thread, _ in out}) == 3 and out[0][0] == threading.get_ident()
    assert all(inference for _, inference in out)
    assert current_step() is None
    assert len(events) == 3 * 5
    for i in range(3):
        at = [n for n, e in enumerate(events) if e[1] == i]
        kinds = [events[n][0] for n in at]
        assert kinds == ["enter", "run", "run", "run", "leave"], kinds
        assert sorted(events[n][2] for n in at[1:4]) == [0, 1, 2]  # type: ignore[type-var]
        assert events[at[-1]] == ("leave", i, i + 1)  # the blocks its page-in kept


def test_a_group_runs_ahead_one_block_and_no_further(pool: ThreadPoolExecutor) -> None:
    """The first group runs block 1 while the second is still in block 0 (it waits there
    for the first to reach block 1: a schedule meeting at the end of each block never gets
    there), and pages block 2 in only after block 0 is released (two blocks in use)."""
    events: list[tuple[str, int]] = []
    ahead = threading.Event()

    def run(i: int, group: int) -> None:
        if (i, group) == (1, 0):
            ahead.set()
        if (i, group) == (0, 1):
            assert ahead.wait(timeout=60), "the first group did not run ahead into block 1"
        events.append(("run", i))

    def forward(group: int) -> None:
        step = current_step()
        assert step is not None
        for i in range(3):
            step.block(
                i, lambda visit, i=i: (events.append(("enter", i)), [])[1],
                partial(run, i, group), lambda kept, i=i: events.append(("leave", i)),
            )  # fmt: skip

    run_groups([partial(forward, g) for g in range(2)], pool)
    assert events.index(("enter", 1)) < events.index(("leave", 0))  # ran ahead
    assert events.index(("leave", 0)) < events.index(("enter", 2))  # no further
    assert sorted(events) == sorted(
        [(kind, i) for i in range(3) for kind in ("enter", "run", "run", "leave")]
    )


def test_an_error_in_one_group_stops_the_others_and_reaches_the_caller(
    pool: ThreadPoolExecutor,
) -> None:
    """The second group fails before its first block; the first runs blocks 0 and 1 and
    then waits for block 0's release, which the second never gives: it stops (its wait
    broken) and the caller gets the second group's error."""
    ran: list[int] = []

    def waits() -> None:
        step = current_step()
        assert step is not None
        for i in range(3):
            step.block(i, lambda visit: [], partial(ran.append, i), lambda kept: None)

    def fails() -> None:
        raise KeyError("the second group's error")

    with pytest.raises(KeyError, match="the second group's error"):
        run_groups([waits, fails], pool)
    assert ran in ([], [0], [0, 1])  # never block 2
    with pytest.raises(ValueError, match=r"2 groups need a pool of 1 threads"):
        run_groups([waits, fails], None)


def test_the_generator_runs_groups_only_beside_host_attention() -> None:
    model = tiny_model(FAMILIES["llama"]).eval()
    host = LayerMajorGenerator(model, kv_tier=Tier.HOST, attention_tier=Tier.HOST)
    assert host._groups(torch.device("cpu")) == 1  # the host is the device: nothing to overlap
    assert host._groups(torch.device("cuda")) == DECODE_GROUPS == 2
    assert host._groups(torch.device("meta")) == DECODE_GROUPS
    three = LayerMajorGenerator(
        model, kv_tier=Tier.HOST, attention_tier=Tier.HOST, attention_groups=3
    )
    assert three._groups(torch.device("cpu")) == 3
    device = LayerMajorGenerator(model, kv_tier=Tier.HOST)
    assert device._groups(torch.device("cuda")) == 1
    with pytest.raises(ValueError, match=r"attention_groups=2 with attention_tier=None.*"):
        LayerMajorGenerator(model, kv_tier=Tier.HOST, attention_groups=2)
    with pytest.raises(ValueError, match=r"attention_groups=0 .*\(>= 1\)"):
        LayerMajorGenerator(model, kv_tier=Tier.HOST, attention_tier=Tier.HOST,
                            attention_groups=0)  # fmt: skip
