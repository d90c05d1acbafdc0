"""Groups of sequences in flight (bb_lightning.engine.groups): how a batch splits, how the
groups' threads meet at each paged block, how an error in one group reaches the caller,
and how many groups the generator runs where."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

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
    """Three groups through two blocks: each block is entered once before any group runs
    it and left once after every group has; each group on a thread of its own, under the
    caller's inference mode."""
    events: list[tuple[str, int, int | None]] = []
    lock = threading.Lock()

    def record(*event: object) -> None:
        with lock:
            events.append(event)  # type: ignore[arg-type]

    def forward(group: int) -> tuple[int, bool]:
        step = current_step()
        assert step is not None and step.parties == 3
        for i in range(2):
            step.block(
                lambda i=i: (record("enter", i, None), [i + 1])[1],
                lambda i=i: record("run", i, group),
                lambda kept, i=i: record("leave", i, kept[0]),
            )
        return threading.get_ident(), torch.is_inference_mode_enabled()

    with torch.inference_mode():
        out = run_groups([lambda g=g: forward(g) for g in range(3)], pool)
    assert len({thread for thread, _ in out}) == 3 and out[0][0] == threading.get_ident()
    assert all(inference for _, inference in out)
    assert current_step() is None
    for i in range(2):
        block = events[5 * i : 5 * i + 5]
        assert block[0] == ("enter", i, None)
        assert sorted(e[2] for e in block[1:4]) == [0, 1, 2]  # type: ignore[type-var]
        assert block[4] == ("leave", i, i + 1)  # the blocks the page-in kept
    assert len(events) == 10


def test_an_error_in_one_group_stops_the_others_and_reaches_the_caller(
    pool: ThreadPoolExecutor,
) -> None:
    """The second group fails before its first block while the first waits there: the
    first stops (its meeting broken) and the caller gets the second group's error."""
    ran: list[int] = []

    def waits() -> None:
        step = current_step()
        assert step is not None
        step.block(lambda: [], lambda: ran.append(0), lambda kept: None)

    def fails() -> None:
        raise KeyError("the second group's error")

    with pytest.raises(KeyError, match="the second group's error"):
        run_groups([waits, fails], pool)
    assert ran == []
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
