"""A worker thread beside CUDA compute takes this rank's share of the cores, less one.

With the process's whole intra-op pool, the gradient worker competed with the thread
launching kernels and, at 8 ranks per node, formed 8 teams of every core.
"""

from __future__ import annotations

import threading

import pytest
import torch

from storage.threads import LOCAL_RANKS_ENV, limit_torch_threads, worker_threads


def test_cuda_workers_share_the_cores_of_the_node(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(LOCAL_RANKS_ENV, raising=False)
    assert worker_threads("cpu", cores=64) == 1  # beside the compute's own team
    assert worker_threads("cuda", cores=16) == 15  # one rank: every core but the launcher's
    assert worker_threads("cuda", cores=64, ranks_per_node=8) == 7
    assert worker_threads("cuda", cores=16, ranks_per_node=8) == 1
    assert worker_threads("cuda", cores=4, ranks_per_node=8) == 1  # at least one
    monkeypatch.setenv(LOCAL_RANKS_ENV, "4")  # torchrun's count of the node's ranks
    assert worker_threads("cuda", cores=32) == 7
    monkeypatch.setenv(LOCAL_RANKS_ENV, "")
    assert worker_threads("cuda", cores=32) == 31
    with pytest.raises(ValueError, match=r"cores=0 and ranks_per_node=1 must be >= 1"):
        worker_threads("cuda", cores=0, ranks_per_node=1)


def test_a_worker_keeps_its_count_and_the_process_keeps_its_own() -> None:
    """The count reaches the worker's ops (as the gradient sink's initializer sets it) and
    no other thread's."""
    before = torch.get_num_threads()
    want = worker_threads("cuda", cores=3 * before + 3, ranks_per_node=1)
    seen: list[int] = []

    def run() -> None:
        limit_torch_threads(want)
        seen.append(torch.get_num_threads())

    worker = threading.Thread(target=run)
    worker.start()
    worker.join()
    assert seen == [want] and torch.get_num_threads() == before
