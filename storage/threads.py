"""Background threads that stay out of the compute's way on a CPU device.

torch runs an operation's elementwise and matrix work on an OpenMP team formed by
the thread that calls it. On a CPU device the training or generating thread's team
already takes every core; a copy or gradient thread that forms a team of its own
beside it leaves both teams waiting at their barriers: with copy threads that formed
teams of their own the cores sat idle for part of each training step, which took longer
than with single-threaded copy threads.

:func:`single_threaded` is a ``ThreadPoolExecutor`` initializer that gives the
new thread one intra-op thread and leaves every other thread's count as it was.

On a CUDA device the training thread launches kernels and needs a core of its own; a
worker with the whole intra-op pool (every core of the machine, in every rank of the
node) competes with it, and with 8 ranks per node forms 8 teams of all the cores.
:func:`worker_threads` gives such a worker this rank's share of the cores less one.
"""

from __future__ import annotations

import os
import threading

import torch

__all__ = ["LOCAL_RANKS_ENV", "limit_torch_threads", "single_threaded", "worker_threads"]

LOCAL_RANKS_ENV = "LOCAL_WORLD_SIZE"
"""Environment variable giving the ranks on this node (torchrun sets it)."""

_default_lock = threading.Lock()
"""Held while a thread has the process default changed: a pool starting several threads
at once must not let one read another's temporary default as the one to restore."""


def limit_torch_threads(threads: int) -> None:
    """Give the calling thread (one that has not run a parallel torch op yet)
    ``threads`` intra-op threads; every other thread keeps its count.

    ``torch.set_num_threads`` sets the calling thread's count and also the default that
    threads take when they first run an op. This thread reads its own count right away
    (so it keeps it), and a short-lived thread then sets the default back.
    """
    if threads < 1:
        raise ValueError(f"threads={threads} must be >= 1")
    with _default_lock:
        default = torch.get_num_threads()  # a new thread's count: the process default
        torch.set_num_threads(threads)
        torch.get_num_threads()  # read now: this thread keeps ``threads``
        if default != threads:
            restore = threading.Thread(target=torch.set_num_threads, args=(default,))
            restore.start()
            restore.join()


def single_threaded() -> None:
    """``ThreadPoolExecutor`` initializer: the pool's threads run torch ops on one thread."""
    limit_torch_threads(1)


def worker_threads(
    device_type: str, *, cores: int | None = None, ranks_per_node: int | None = None
) -> int:
    """Intra-op threads for a worker thread beside the compute of a ``device_type`` device.

    ``"cpu"``: 1 (the compute's team holds every core). ``"cuda"``: this rank's share of
    ``cores`` (None: the cores this process may run on) over ``ranks_per_node`` (None:
    :data:`LOCAL_RANKS_ENV`, else 1), less one for the thread launching kernels; at least 1.
    """
    if device_type != "cuda":
        return 1
    if cores is None:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 1
    if ranks_per_node is None:
        text = os.environ.get(LOCAL_RANKS_ENV, "").strip()
        ranks_per_node = int(text) if text.isdigit() and int(text) > 0 else 1
    if cores < 1 or ranks_per_node < 1:
        raise ValueError(
            f"cores={cores} and ranks_per_node={ranks_per_node} must be >= 1: pass counts"
        )
    return max(1, cores // ranks_per_node - 1)
