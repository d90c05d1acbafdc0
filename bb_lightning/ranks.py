"""The devices-and-ranks side of Lightning's ``ParallelStrategy`` contract.

:class:`RankedStrategy` is one device per process, with ``devices=G, num_nodes=M`` ranks
over G x M processes: this rank's device, the ranks' numbering, Lightning's script
launcher, the world process group and its collectives (``barrier``, ``broadcast``,
``reduce``; Lightning's ``all_gather`` and ``reduce_boolean_decision`` go through them),
and the engine's own collectives (:class:`~bb_lightning.engine.shard.ShardComm`).
:class:`~bb_lightning.strategy.BalanceBeamStrategy` subclasses it; the helpers it calls
are in :mod:`bb_lightning.world`.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any, Literal

import lightning.pytorch as pl
import torch
from lightning.fabric.plugins import ClusterEnvironment
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.utilities.distributed import _sync_ddp_if_available
from lightning.fabric.utilities.seed import reset_seed
from lightning.pytorch.strategies import ParallelStrategy
from lightning.pytorch.strategies.launchers.subprocess_script import _SubprocessScriptLauncher
from lightning.pytorch.utilities.rank_zero import rank_zero_only
from lightning_utilities.core.rank_zero import rank_zero_only as utils_rank_zero_only
from typing_extensions import override

from bb_lightning import world
from bb_lightning.engine.shard import ShardComm

__all__ = ["RankedStrategy"]


class RankedStrategy(ParallelStrategy):
    """A ``ParallelStrategy`` of one device per process, its ranks and their collectives.

    Args:
        accelerator, checkpoint_io, precision_plugin: Lightning's (None: the Trainer's).
        parallel_devices: the devices of this node's ranks; None: the Trainer's.
        cluster_environment: where ranks come from; None: Lightning's detection.
        process_group_backend: backend of the world process group; None: by device
            (:func:`bb_lightning.world.default_backend`).
        timeout: of the process groups' collectives.
        start_method: ``"popen"`` only (:func:`bb_lightning.world.check_start_method`).
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
        world.check_start_method(start_method)
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
        return world.rank_device(self.parallel_devices, self.local_rank, self._root_device)

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
        return self._process_group_backend or world.default_backend(self.root_device)

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
        world.join_world(
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
        world.wait_for_ranks(self.root_device)

    @override
    def broadcast(self, obj: Any, src: int = 0) -> Any:
        """Rank ``src``'s ``obj`` (pickled) on every rank (``obj`` itself with one process)."""
        return world.broadcast_object(obj, src)

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
        """The maximum of a host tensor over the ranks (:func:`bb_lightning.world.
        max_over_ranks`); None with one rank (nothing to reduce)."""
        if self.world_size == 1:
            return None
        return world.max_over_ranks(self.reduce, self.root_device)

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
