"""The devices-and-ranks side of Lightning's ``ParallelStrategy`` contract.

:class:`RankedStrategy` is one device per process, with ``devices=G, num_nodes=M`` ranks
over G x M processes: this rank's device, the ranks' numbering, Lightning's script
launcher, the world process group and its collectives (``barrier``, ``broadcast``,
``reduce``; Lightning's ``all_gather`` and ``reduce_boolean_decision`` go through them),
and the engine's own collectives (:class:`~bb_lightning.engine.shard.ShardComm`), with
the helpers it calls: joining the world group (:func:`join_world`), destroying it before
the interpreter is torn down (:func:`destroy_group_at_exit`), only ``start_method="popen"``
(:func:`check_start_method`). :class:`~bb_lightning.strategy.BalanceBeamStrategy`
subclasses it; what the ranks do together (planning on rank 0, saving a checkpoint) is in
:mod:`bb_lightning.strategy.world`.
"""

from __future__ import annotations

import atexit
import contextlib
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any, Literal

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.fabric.plugins import ClusterEnvironment
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.utilities.distributed import (
    _distributed_is_initialized,
    _init_dist_connection,
    _sync_ddp_if_available,
)
from lightning.fabric.utilities.distributed import group as _group
from lightning.fabric.utilities.seed import reset_seed
from lightning.pytorch.strategies import ParallelStrategy
from lightning.pytorch.strategies.launchers.subprocess_script import _SubprocessScriptLauncher
from lightning.pytorch.utilities.rank_zero import rank_zero_only
from lightning_utilities.core.rank_zero import rank_zero_only as utils_rank_zero_only
from typing_extensions import override

from bb_lightning.engine.shard import ShardComm
from bb_lightning.strategy import world

__all__ = [
    "RankedStrategy",
    "broadcast_object",
    "check_start_method",
    "default_backend",
    "destroy_group_at_exit",
    "join_world",
    "max_over_ranks",
    "rank_device",
    "wait_for_ranks",
]


class RankedStrategy(ParallelStrategy):
    """A ``ParallelStrategy`` of one device per process, its ranks and their collectives.

    Args:
        accelerator, checkpoint_io, precision_plugin: Lightning's (None: the Trainer's).
        parallel_devices: the devices of this node's ranks; None: the Trainer's.
        cluster_environment: where ranks come from; None: Lightning's detection.
        process_group_backend: backend of the world process group; None: by device
            (:func:`default_backend`).
        timeout: of the process groups' collectives.
        start_method: ``"popen"`` only (:func:`check_start_method`).
    """

    def __init__(
        self,
        *,
        accelerator: pl.accelerators.Accelerator | None = None,
        checkpoint_io: Any | None = None,
        precision_plugin: Any | None = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: ClusterEnvironment | None = None,
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
        start_method: Literal["popen"] = "popen",
    ) -> None:
        check_start_method(start_method)
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
        )
        self._root_device = (
            torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
        )
        """The device outside a Trainer (no ``parallel_devices``): CUDA device 0 when visible."""
        self._num_nodes = 1
        self._process_group_backend = process_group_backend
        self._timeout = timeout
        self.start_method = start_method
        self._comm: ShardComm | None = None
        """The engine's collectives (world size > 1), made once after the world group."""

    @property
    @override
    def root_device(self) -> torch.device:
        """This rank's device: the Trainer's devices at the local rank (``accelerator="cpu"``
        -> cpu, ``devices=[i]`` -> cuda:i); CUDA device 0 when visible outside a Trainer."""
        return rank_device(self.parallel_devices, self.local_rank, self._root_device)

    @property
    def num_nodes(self) -> int:
        """Nodes of the run (the Trainer's ``num_nodes``)."""
        return self._num_nodes

    @num_nodes.setter
    def num_nodes(self, num_nodes: int) -> None:
        self._num_nodes = num_nodes

    @property
    def num_processes(self) -> int:
        """Processes (ranks, one device each) per node: the Trainer's devices."""
        return len(self.parallel_devices) if self.parallel_devices is not None else 0

    @property
    def is_distributed(self) -> bool:
        """Whether there are several ranks (then Lightning shards the data among them)."""
        return self.world_size > 1

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, int]:
        """Lightning's distributed samplers: every rank of every node, this one's rank."""
        return {"num_replicas": self.num_nodes * self.num_processes, "rank": self.global_rank}

    @property
    def process_group_backend(self) -> str:
        """Backend of the world process group (the constructor's, else by device)."""
        return self._process_group_backend or default_backend(self.root_device)

    @override
    def _configure_launcher(self) -> None:
        """Lightning's script launcher for several ranks it starts itself (not torchrun/srun)."""
        assert self.cluster_environment is not None
        ranks = self.num_nodes * self.num_processes
        if ranks > 1 and not self.cluster_environment.creates_processes_externally:
            self._launcher = _SubprocessScriptLauncher(
                self.cluster_environment, self.num_processes, self.num_nodes
            )

    @override
    def setup_environment(self) -> None:
        """Set the device up; with several ranks, join the world process group."""
        super().setup_environment()
        if self.num_nodes * self.num_processes <= 1:
            return
        reset_seed()
        self.set_world_ranks()
        assert self.cluster_environment is not None
        join_world(
            self.cluster_environment, self.process_group_backend, self._timeout, self.root_device
        )

    def set_world_ranks(self) -> None:
        """Global rank = node rank x processes per node + local rank; world = nodes x processes."""
        if self.cluster_environment is not None:
            self.cluster_environment.set_global_rank(
                self.node_rank * self.num_processes + self.local_rank
            )
            self.cluster_environment.set_world_size(self.num_nodes * self.num_processes)
        # Lightning's rank-zero helpers (logging, warnings) read the rank from these
        rank_zero_only.rank = utils_rank_zero_only.rank = self.global_rank  # type: ignore[attr-defined]

    @override
    def barrier(self, name: str | None = None) -> None:
        """Wait for every rank (nothing with one process)."""
        wait_for_ranks(self.root_device)

    @override
    def broadcast(self, obj: Any, src: int = 0) -> Any:
        """Rank ``src``'s ``obj`` (pickled) on every rank (``obj`` itself with one process)."""
        return broadcast_object(obj, src)

    @override
    def reduce(
        self, tensor: torch.Tensor | Any, group: Any | None = None, reduce_op: Any | None = "mean"
    ) -> torch.Tensor | Any:
        """``tensor`` reduced over the ranks (``"mean"``, ``"sum"``, ``"max"``... or a
        ``ReduceOp``), in place; anything but a tensor is returned as is."""
        if isinstance(tensor, torch.Tensor):
            return _sync_ddp_if_available(tensor, group, reduce_op=reduce_op)
        return tensor

    def max_reducer(self) -> world.Reducer | None:
        """The maximum of a host tensor over the ranks (:func:`max_over_ranks`); None with one rank (nothing to reduce)."""
        if self.world_size == 1:
            return None
        return max_over_ranks(self.reduce, self.root_device)

    def shard_comm(self) -> ShardComm:
        """The engine's collectives on a process group of their own (made once, on every
        rank, after the world process group: several ranks only)."""
        if self._comm is None:
            self._comm = ShardComm.from_world(timeout=self._timeout)
        return self._comm

    def teardown_ranks(self) -> None:
        """End the cluster environment's part of a run of several ranks (nothing with one)."""
        if self.cluster_environment is not None and self.world_size > 1:
            self.cluster_environment.teardown()


# -- the world process group ------------------------------------------------------------


_EXIT_HOOK: list[Callable[[], None]] = []


def destroy_group_at_exit() -> None:
    """Destroy the default process group when the script ends, while Python is still whole.

    A script that ends without ``torch.distributed.destroy_process_group()`` (as Lightning
    scripts do) leaves gloo's worker threads holding finished work, tensors included;
    freeing them while the interpreter is torn down can abort the process ("terminate
    called without an active exception"), and Lightning's launcher then stops the other
    ranks with exit code 1 after a run that succeeded. Registered once per process, by the
    strategy that created the group; a group already destroyed is left alone.
    """
    if _EXIT_HOOK:
        return

    def destroy() -> None:
        if dist.is_available() and dist.is_initialized():
            with contextlib.suppress(Exception):
                dist.destroy_process_group()

    _EXIT_HOOK.append(destroy)
    atexit.register(destroy)


def check_start_method(start_method: str) -> None:
    """Refuse a start method other than ``"popen"`` (the script launcher, torchrun, srun)."""
    if start_method != "popen":
        raise ValueError(
            f"start_method={start_method!r}: balance_beam cannot run under {start_method}: "
            "that launcher returns the module's state_dict to the parent process, and paged "
            "weights are not in the module; use start_method='popen' (the default), torchrun "
            "or srun"
        )


def default_backend(device: torch.device) -> str:
    """The world group's backend for ranks computing on ``device``: ``"gloo"`` on the CPU,
    ``"cpu:gloo,cuda:nccl"`` on CUDA (host tensors on gloo, device tensors on NCCL)."""
    return "gloo" if device.type == "cpu" else "cpu:gloo,cuda:nccl"


def join_world(
    environment: ClusterEnvironment, backend: str, timeout: timedelta | None, device: torch.device
) -> None:
    """Join the world process group (``environment`` holds this rank and the world size);
    a group this call creates is destroyed at exit (:func:`destroy_group_at_exit`)."""
    kwargs: dict[str, Any] = {"timeout": timeout}
    if device.type != "cpu":
        kwargs["device_id"] = device
    created = not dist.is_initialized()
    _init_dist_connection(environment, backend, **kwargs)
    if created:
        destroy_group_at_exit()


def rank_device(
    devices: Sequence[torch.device] | None, local_rank: int, fallback: torch.device
) -> torch.device:
    """The device of the rank ``local_rank`` among its node's ``devices`` (the Trainer's);
    ``fallback`` when there are none (outside a Trainer). ``ValueError`` when the node has
    fewer devices than ranks."""
    if not devices:
        return fallback
    if local_rank >= len(devices):
        raise ValueError(
            f"local rank {local_rank} has no device among {list(devices)}: give the Trainer "
            "as many devices as processes per node (devices=...)"
        )
    return torch.device(devices[local_rank])


def max_over_ranks(reduce: Callable[..., Any], device: torch.device) -> world.Reducer:
    """A :data:`Reducer` on the world group through the strategy's ``reduce``: the host
    tensor goes to ``device`` first (an NCCL-only world reduces no host tensors) and the
    result comes back to the host."""

    def reduce_max(tensor: torch.Tensor) -> torch.Tensor:
        result: torch.Tensor = reduce(tensor.to(device), reduce_op="max")
        return result.cpu()

    return reduce_max


def wait_for_ranks(device: torch.device) -> None:
    """Wait for every rank of the world group (nothing without one); an NCCL group waits
    on ``device``."""
    if not _distributed_is_initialized():
        return
    if dist.get_backend() == "nccl":
        dist.barrier(device_ids=[device.index])
    else:
        dist.barrier()


def broadcast_object(obj: Any, src: int) -> Any:
    """Rank ``src``'s ``obj`` (pickled) on every rank (``obj`` itself without a group)."""
    if not _distributed_is_initialized():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src, group=_group.WORLD)
    return box[0]
