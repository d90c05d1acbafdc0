"""The strategy's side of data parallelism: what each rank keeps apart and what the ranks agree on.

Helpers of :class:`~bb_lightning.strategy.BalanceBeamStrategy` for ``world_size``
N > 1 (``Trainer(devices=G, num_nodes=M)``, N = G x M); with N = 1 each returns its input.
Those that take :class:`Ranks` (the strategy) are collectives: every rank calls them.

- Each rank's NVMe tier in ``<nvme_path>/rank<global_rank>`` (:func:`rank_nvme_path`): the
  tier locks its directory, so two ranks cannot share one; ``nvme_path`` itself is marked
  as scratch and holds only those (:func:`make_shared_nvme_dir`).
- The planner's hardware profile carries the layout (:func:`with_world`); measured on
  each node by its local rank 0, the slowest node's figures plan every rank
  (:func:`slowest_node`), with the collective rates timed on the ranks' own group
  (:func:`measured_collectives`).
- The measured phase times of the re-plan decision are the slowest rank's
  (:func:`slowest_times`), so every rank re-plans, or not, at the same step.
- A checkpoint directory must be one every rank sees (:func:`check_shared_directory`).
- Rank 0 plans and every rank takes its result, or its error (:func:`on_rank_zero`); the
  local rank 0 of each node measures it (:func:`measured_nodes`); rank 0 writes a
  checkpoint while the others take part in its gathers (:func:`save_on_ranks`); a call
  that ended in an error on some rank gathers nothing (:func:`stopped_with_error`).

The world process group, each rank's device and the collectives of the strategy itself
are in :mod:`bb_lightning.strategy.ranks`. Importing this module imports no Lightning
(``bb-lightning plan --devices N`` lays a profile out with :func:`with_world`).
"""

from __future__ import annotations

import dataclasses
import os
import pickle
import re
import secrets
import socket
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, TypeVar, cast

import torch
import torch.distributed as dist

from bb_lightning.planner import HardwareProfile, MeasuredTimes
from bb_lightning.probe.collectives import probe_collectives
from storage import scratch
from storage.store import StoreConfig

if TYPE_CHECKING:
    import lightning.pytorch as pl

__all__ = [
    "DEFAULT_INTER_NODE_BANDWIDTH",
    "DEFAULT_INTRA_NODE_BANDWIDTH",
    "Ranks",
    "check_shared_directory",
    "make_shared_nvme_dir",
    "measured_collectives",
    "measured_nodes",
    "on_rank_zero",
    "prepare_nvme_dir",
    "rank_nvme_path",
    "rank_store_config",
    "rank_stores",
    "run_leftover",
    "save_on_ranks",
    "slowest_node",
    "slowest_times",
    "stopped_with_error",
    "with_world",
]

DEFAULT_INTRA_NODE_BANDWIDTH = 2.0e9
"""Bytes/s one rank sends another of its node when the profile gives none and none was
timed (:func:`measured_collectives` times them where the machine is measured): gloo over
host memory (loopback TCP), as CPU ranks run their collectives, a few GB/s."""
DEFAULT_INTER_NODE_BANDWIDTH = 1.25e9
"""Bytes/s one rank sends a rank of another node when the profile gives none (10 Gbit/s
Ethernet); give ``HardwareProfile.inter_node_bandwidth`` for a faster network."""

PROBE_PREFIX = "bb-measure-"
"""Name prefix of the temporary directory the machine probe writes in ``nvme_path``
(:func:`bb_lightning.probe.measure.measure`)."""
_RANK_DIR = re.compile(r"rank[0-9]+")

MARKER_PREFIX = ".bb-shared-"
"""Name prefix of the marker file :func:`check_shared_directory` writes."""


def rank_nvme_path(nvme_path: str | None, global_rank: int, world_size: int) -> str | None:
    """The NVMe directory of rank ``global_rank``: ``<nvme_path>/rank<global_rank>`` when
    ``world_size`` > 1, ``nvme_path`` itself for one process (None stays None: a temporary
    directory, its own per process)."""
    if nvme_path is None or world_size == 1:
        return nvme_path
    if not 0 <= global_rank < world_size:
        raise ValueError(f"global_rank={global_rank} outside 0..{world_size - 1} (world_size)")
    return os.path.join(nvme_path, f"rank{global_rank}")


def run_leftover(name: str) -> bool:
    """Whether top-level entry ``name`` of an ``nvme_path`` is a run's own: a rank's NVMe
    directory (``rank<r>``, itself a scratch directory its tier checks) or the machine
    probe's temporary directory (:data:`PROBE_PREFIX`)."""
    return _RANK_DIR.fullmatch(name) is not None or name.startswith(PROBE_PREFIX)


def prepare_nvme_dir(nvme_path: str | None) -> None:
    """Check ``nvme_path`` before anything is written in it (the machine probe's file, a
    rank's directory): created when missing and its parent exists; ``ValueError`` (one
    line) for a file, a missing parent, or a directory holding a user's data
    (:func:`storage.scratch.prepare_dir`). None: nothing to check."""
    if nvme_path is not None:
        scratch.prepare_dir(nvme_path, key="nvme_path", owned=run_leftover)


def make_shared_nvme_dir(nvme_path: str | None, world_size: int) -> None:
    """Prepare ``nvme_path`` (:func:`prepare_nvme_dir`), the directory the ranks' own
    directories go in, and mark it as scratch, when several ranks run (every rank calls
    it; each rank's tier then claims ``<nvme_path>/rank<r>``). One process's tier claims
    ``nvme_path`` itself."""
    if nvme_path is None or world_size == 1:
        return
    prepare_nvme_dir(nvme_path)
    scratch.write_marker(nvme_path, {"world_size": world_size, "ranks": "rank<global rank>"})


def rank_store_config(
    store: StoreConfig | None, global_rank: int, world_size: int
) -> StoreConfig | None:
    """``store`` with its NVMe directory made the rank's (:func:`rank_nvme_path`)."""
    if store is None or store.nvme_path is None or world_size == 1:
        return store
    path = rank_nvme_path(store.nvme_path, global_rank, world_size)
    return dataclasses.replace(store, nvme_path=path)


def rank_stores(
    nvme_path: str | None, store: StoreConfig | None, global_rank: int, world_size: int
) -> tuple[str | None, StoreConfig | None]:
    """This rank's NVMe directory and store config (:func:`rank_nvme_path`,
    :func:`rank_store_config`), the directories the ranks share prepared and marked first
    (:func:`make_shared_nvme_dir`)."""
    make_shared_nvme_dir(nvme_path, world_size)
    if store is not None:
        make_shared_nvme_dir(store.nvme_path, world_size)
    return (
        rank_nvme_path(nvme_path, global_rank, world_size),
        rank_store_config(store, global_rank, world_size),
    )


def with_world(hardware: HardwareProfile, world_size: int, ranks_per_node: int) -> HardwareProfile:
    """``hardware`` (one node's profile) with the Trainer's layout: ``world_size`` ranks,
    ``ranks_per_node`` on each node. A network bandwidth the layout needs and the profile
    leaves at 0 takes :data:`DEFAULT_INTRA_NODE_BANDWIDTH` /
    :data:`DEFAULT_INTER_NODE_BANDWIDTH`. One rank returns ``hardware`` unchanged."""
    if world_size == 1:
        return hardware
    changes: dict[str, Any] = {"world_size": world_size, "ranks_per_node": ranks_per_node}
    if ranks_per_node > 1 and hardware.intra_node_bandwidth <= 0:
        changes["intra_node_bandwidth"] = DEFAULT_INTRA_NODE_BANDWIDTH
    if world_size > ranks_per_node and hardware.inter_node_bandwidth <= 0:
        changes["inter_node_bandwidth"] = DEFAULT_INTER_NODE_BANDWIDTH
    return hardware.replace(**changes)


Reducer = Callable[[torch.Tensor], torch.Tensor]
"""An all-reduce with MAX over the ranks of a float64 CPU tensor (returns the result)."""


def slowest_times(measured: MeasuredTimes, reduce_max: Reducer) -> MeasuredTimes:
    """``measured`` with each field the largest over the ranks (``reduce_max``); a field
    no rank measured stays None."""
    names = [f.name for f in dataclasses.fields(measured)]
    values = [getattr(measured, n) for n in names]
    packed = torch.tensor([-1.0 if v is None else float(v) for v in values], dtype=torch.float64)
    reduced = reduce_max(packed).tolist()
    return MeasuredTimes(**{n: (None if v < 0 else v) for n, v in zip(names, reduced, strict=True)})


def check_shared_directory(
    directory: str | os.PathLike[str],
    *,
    global_rank: int,
    barrier: Callable[[], None],
    broadcast: Callable[[str], str],
    all_true: Callable[[bool], bool],
) -> None:
    """Check that every rank sees ``directory`` (collective: every rank calls it).

    Rank 0 creates the directory and writes a marker file ``.bb-shared-<random>`` in it
    (its name ``broadcast`` to the others); after a ``barrier`` every rank looks for it;
    the ranks agree (``all_true``, a collective that is also the second barrier); rank 0
    removes it. When any rank cannot see it every rank raises ``ValueError``: that rank
    naming the directory, its rank and host, so that no rank is left waiting in a save.
    """
    folder = Path(directory).absolute()
    marker = ""
    failed: OSError | None = None
    if global_rank == 0:
        try:
            folder.mkdir(parents=True, exist_ok=True)
            marker = str(folder / f"{MARKER_PREFIX}{secrets.token_hex(8)}")
            Path(marker).write_text(f"{socket.gethostname()} {os.getpid()}\n")
        except OSError as exc:  # the other ranks learn it from the empty name, none waits
            failed, marker = exc, ""
    marker = broadcast(marker)
    if not marker:
        raise ValueError(
            f"checkpoint directory {str(folder)!r} cannot be created or written on rank 0"
            f"{f' ({failed})' if failed else ' (see its error)'}: pass a directory every rank "
            "can write"
        ) from failed
    barrier()
    seen = os.path.exists(marker)
    everyone = all_true(seen)
    if global_rank == 0:
        Path(marker).unlink(missing_ok=True)
    if not seen:
        raise ValueError(
            f"checkpoint directory {str(folder)!r} is not visible from rank {global_rank} on "
            f"host {socket.gethostname()}: put checkpoints on a filesystem every node shares"
        )
    if not everyone:
        raise ValueError(
            f"checkpoint directory {str(folder)!r} is not visible from every rank (see the "
            "other ranks' errors): put checkpoints on a filesystem every node shares"
        )


_LAYOUT_FIELDS = frozenset({"world_size", "ranks_per_node"})
_HIGHER_IS_WORSE = frozenset({"collective_latency"})


def slowest_node(profiles: Sequence[HardwareProfile | None]) -> HardwareProfile:
    """One profile for every node: the worst figure of each resource among ``profiles``
    (one per node that measured; None for the ranks that did not): the least memory,
    bandwidth, FLOP/s, cores and efficiency, the longest collective latency. Every
    rank runs the same placement, so it must fit and keep pace on the slowest node."""
    measured = [p for p in profiles if p is not None]
    if not measured:
        raise ValueError("no rank measured its node: the local rank 0 of each node measures")
    first = measured[0]
    changes: dict[str, Any] = {}
    for f in dataclasses.fields(first):
        value = getattr(first, f.name)
        if (
            f.name in _LAYOUT_FIELDS
            or isinstance(value, bool)
            or not isinstance(value, (int, float))
        ):
            continue
        values = [getattr(p, f.name) for p in measured]
        changes[f.name] = max(values) if f.name in _HIGHER_IS_WORSE else min(values)
    return first.replace(**changes)


# -- what the ranks do together ----------------------------------------------------------


class Ranks(Protocol):
    """This rank and the collectives of the world (the strategy's)."""

    @property
    def global_rank(self) -> int:
        """This rank among all (0 .. world_size - 1)."""
        ...

    @property
    def local_rank(self) -> int:
        """This rank among its node's."""
        ...

    @property
    def world_size(self) -> int:
        """Ranks of the run."""
        ...

    @property
    def is_global_zero(self) -> bool:
        """Whether this is rank 0."""
        ...

    def barrier(self, name: str | None = None) -> None:
        """Wait for every rank."""
        ...

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        """Rank ``src``'s ``obj`` on every rank."""
        ...

    def reduce_boolean_decision(self, decision: bool, all: bool = True) -> bool:
        """Whether ``decision`` holds on every rank (``all``) or on any."""
        ...


Result = TypeVar("Result")


def on_rank_zero(ranks: Ranks, work: Callable[[], Result], *, what: str = "plan") -> Result:
    """``work()`` run on rank 0, its result, or its error, broadcast to every rank: a rank
    never waits for a result that will not come. An error that does not pickle reaches the
    other ranks as ``RuntimeError("rank 0 cannot <what>: ...")``."""
    outcome: Result | BaseException | None = None
    failed: Exception | None = None
    if ranks.is_global_zero:
        try:
            outcome = work()
        except Exception as err:  # the other ranks raise it too
            failed = err
            outcome = err if _picklable(err) else RuntimeError(f"rank 0 cannot {what}: {err}")
    outcome = ranks.broadcast(outcome)
    if failed is not None:
        raise failed
    if isinstance(outcome, BaseException):
        raise outcome
    return cast(Result, outcome)


def _picklable(obj: object) -> bool:
    try:
        pickle.dumps(obj)
    except Exception:
        return False
    return True


def measured_nodes(ranks: Ranks, measure: Callable[[], HardwareProfile]) -> HardwareProfile:
    """The local rank 0 of each node runs ``measure`` (cached per machine) while its other
    ranks wait; every rank gets the slowest node's figures (:func:`slowest_node`). A rank
    whose measurement fails makes every rank raise ``RuntimeError``, none waits."""
    mine: HardwareProfile | str | None = None
    if ranks.local_rank == 0:
        try:
            mine = measure()
        except Exception as err:
            mine = f"rank {ranks.global_rank} cannot measure its node: {err}"
    gathered: list[Any] = [None] * ranks.world_size
    dist.all_gather_object(gathered, mine)
    failed = [g for g in gathered if isinstance(g, str)]
    if failed:
        raise RuntimeError("; ".join(failed))
    return slowest_node(gathered)


def measured_collectives(
    hardware: HardwareProfile, world_size: int, ranks_per_node: int, device: torch.device
) -> HardwareProfile:
    """``hardware`` with the bytes/s within a node and across the nodes, and the latency a
    ring step, that all-gathers and reduce-scatters of ``device`` tensors sustain now on the
    world's group of ``world_size`` ranks, ``ranks_per_node`` a node (the slowest rank's:
    :func:`bb_lightning.probe.collectives.probe_collectives`; every rank calls it). A level
    the layout lacks keeps the profile's figure; one rank returns ``hardware``."""
    if world_size == 1:
        return hardware
    rates = probe_collectives(world_size=world_size, ranks_per_node=ranks_per_node, device=device)
    return rates.apply(hardware)


def save_on_ranks(
    ranks: Ranks,
    filepath: str | os.PathLike[str],
    save: Callable[[str], object],
    follow: Callable[[], object],
) -> None:
    """Rank 0 ``save``s at its ``filepath`` (broadcast: every rank's path is rank 0's) once
    every rank sees the directory it goes in (:func:`check_shared_directory`); the other
    ranks ``follow`` (they take part in the state's gathers)."""
    path = ranks.broadcast(str(filepath))
    check_shared_directory(
        os.path.dirname(os.path.abspath(path)),
        global_rank=ranks.global_rank, barrier=ranks.barrier, broadcast=ranks.broadcast,
        all_true=ranks.reduce_boolean_decision,
    )  # fmt: skip
    if ranks.is_global_zero:
        save(path)
    else:
        follow()


def stopped_with_error(ranks: Ranks, trainer: pl.Trainer | None) -> str | None:
    """Why the weights stay in the store when ``trainer``'s call of several ranks ended in
    an error (None otherwise): the other ranks may have stopped, and giving the weights
    back takes collectives with every rank."""
    if ranks.world_size == 1 or trainer is None:
        return None
    from lightning.pytorch.trainer.states import TrainerStatus  # a Trainer ran: imported

    if trainer.state.status != TrainerStatus.INTERRUPTED:
        return None
    return (
        f"the call stopped with an error on rank {ranks.global_rank} of {ranks.world_size}, "
        "so no rank gathers the weights"
    )
