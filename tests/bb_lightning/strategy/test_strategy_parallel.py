"""The strategy as a Lightning ParallelStrategy, in one process: ranks, devices, launcher,
the world's share of the planning, and ``devices=1`` left as it was (no process group)."""

from __future__ import annotations

from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.fabric.plugins.environments import LightningEnvironment
from lightning.pytorch.strategies.launchers.subprocess_script import _SubprocessScriptLauncher
from lightning.pytorch.utilities.rank_zero import rank_zero_only
from lightning_utilities.core.rank_zero import rank_zero_only as utils_rank_zero_only

from bb_lightning import BalanceBeamStrategy
from bb_lightning.placement import Placement
from bb_lightning.strategy import world
from bb_lightning.strategy.ranks import check_start_method
from storage.tiers import Tier


@pytest.fixture(autouse=True)
def _rank_zero_restored() -> Iterator[None]:
    """``set_world_ranks`` sets Lightning's rank-zero rank: later tests must log again."""
    saved = rank_zero_only.rank, utils_rank_zero_only.rank  # type: ignore[attr-defined]
    yield
    rank_zero_only.rank, utils_rank_zero_only.rank = saved  # type: ignore[attr-defined]


def _ranked(
    monkeypatch: pytest.MonkeyPatch,
    *,
    devices: list[torch.device],
    nodes: int = 1,
    local_rank: int | None = None,
    node_rank: int = 0,
) -> BalanceBeamStrategy:
    """A strategy as Lightning sets one up on a node, for the process of ``local_rank``
    (None: the process that launches the others)."""
    if local_rank is None:
        monkeypatch.delenv("LOCAL_RANK", raising=False)
    else:
        monkeypatch.setenv("LOCAL_RANK", str(local_rank))
    monkeypatch.setenv("NODE_RANK", str(node_rank))
    strategy = BalanceBeamStrategy(
        parallel_devices=devices, cluster_environment=LightningEnvironment()
    )
    strategy.num_nodes = nodes
    strategy.set_world_ranks()
    strategy._configure_launcher()
    return strategy


@pytest.mark.parametrize("method", ["spawn", "fork", "forkserver"])
def test_spawn_and_fork_are_refused_naming_popen(method: str) -> None:
    with pytest.raises(ValueError, match=rf"start_method='{method}'.*state_dict.*popen.*torchrun"):
        BalanceBeamStrategy(start_method=method)  # type: ignore[arg-type]
    check_start_method("popen")
    assert BalanceBeamStrategy().start_method == "popen"


def test_ranks_devices_and_sampler_of_a_rank_on_the_second_node(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    cuda = [torch.device("cuda", 0), torch.device("cuda", 1)]
    strategy = _ranked(monkeypatch, devices=cuda, nodes=2, local_rank=1, node_rank=1)
    assert (strategy.num_processes, strategy.num_nodes) == (2, 2)
    assert (strategy.global_rank, strategy.world_size, strategy.local_rank) == (3, 4, 1)
    assert strategy.root_device == torch.device("cuda", 1)  # its local rank's device
    assert strategy.is_distributed and not strategy.is_global_zero
    assert strategy.distributed_sampler_kwargs == {"num_replicas": 4, "rank": 3}
    assert rank_zero_only.rank == 3  # type: ignore[attr-defined]  # rank-zero logging off here
    assert strategy.launcher is None  # started by the launcher of local rank 0
    assert strategy.process_group_backend == "cpu:gloo,cuda:nccl"


def test_the_launching_process_gets_the_script_launcher_on_cpu(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    strategy = _ranked(monkeypatch, devices=[torch.device("cpu")] * 2)
    launcher = strategy.launcher
    assert isinstance(launcher, _SubprocessScriptLauncher)
    assert (launcher.num_processes, launcher.num_nodes) == (2, 1)
    assert strategy.root_device == torch.device("cpu") and strategy.global_rank == 0
    assert strategy.process_group_backend == "gloo"
    given = BalanceBeamStrategy(process_group_backend="mpi")
    assert given.process_group_backend == "mpi"


def test_one_device_has_no_launcher_and_is_not_distributed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    strategy = _ranked(monkeypatch, devices=[torch.device("cuda", 1)])
    assert strategy.launcher is None and not strategy.is_distributed
    assert strategy.root_device == torch.device("cuda", 1)
    assert strategy.distributed_sampler_kwargs == {"num_replicas": 1, "rank": 0}


def test_a_local_rank_without_a_device_raises_naming_devices(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    strategy = _ranked(monkeypatch, devices=[torch.device("cpu")], local_rank=1)
    with pytest.raises(ValueError, match=r"local rank 1 has no device.*devices="):
        _ = strategy.root_device


def test_outside_a_trainer_the_fallback_device_and_single_process_collectives() -> None:
    strategy = BalanceBeamStrategy()
    want = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    assert strategy.parallel_devices is None and strategy.root_device == want
    assert strategy.world_size == 1 and not strategy.is_distributed
    t = torch.tensor([1.0, 5.0])
    assert strategy.reduce(t, reduce_op="max") is t  # no process group: as is
    assert strategy.broadcast({"a": 1}) == {"a": 1}
    strategy.barrier()


def _trainer(devices: int) -> pl.Trainer:
    return pl.Trainer(
        accelerator="cpu",
        devices=devices,
        strategy=BalanceBeamStrategy(),
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
    )


def test_trainer_with_two_cpu_devices_sets_up_two_ranks_without_launching() -> None:
    trainer = _trainer(2)
    strategy = trainer.strategy
    assert isinstance(strategy, BalanceBeamStrategy)
    assert isinstance(strategy.launcher, _SubprocessScriptLauncher)
    assert trainer.world_size == 2 and trainer.num_devices == 2
    assert trainer.distributed_sampler_kwargs == {"num_replicas": 2, "rank": 0}
    assert trainer._accelerator_connector.is_distributed  # Lightning shards the data
    assert not torch.distributed.is_initialized()  # the group is made in setup_environment


def test_devices_one_fit_makes_no_process_group_and_no_launcher(tiny: SimpleNamespace) -> None:
    strategy = BalanceBeamStrategy(
        compute_dtype="fp32", placement=Placement.uniform(4, weights=Tier.HOST, master=Tier.HOST)
    )
    trainer, recorder = tiny.make_trainer(strategy, 1)
    assert strategy.launcher is None and not trainer._accelerator_connector.is_distributed
    trainer.fit(tiny.make_module(tiny.tiny_llama()), tiny.loader(1))
    assert len(recorder.losses) == 1
    assert not torch.distributed.is_initialized() and strategy._comm is None
    strategy.close()


def _planning_rank(rank: int, sent: list[Any]) -> BalanceBeamStrategy:
    """A strategy that believes it is rank ``rank`` of 2, broadcasting through ``sent``."""
    strategy = BalanceBeamStrategy()
    env = LightningEnvironment()
    env.set_world_size(2)
    env.set_global_rank(rank)
    strategy.cluster_environment = env

    def broadcast(obj: Any, src: int = 0) -> Any:
        if rank == src:
            sent.append(obj)
        return sent[-1]

    strategy.broadcast = broadcast  # type: ignore[method-assign]
    return strategy


def test_rank_zero_plans_and_the_others_take_its_result() -> None:
    sent: list[Any] = []
    placement = Placement.uniform(2, weights=Tier.HOST, master=Tier.HOST)
    zero, one = _planning_rank(0, sent), _planning_rank(1, sent)
    calls: list[int] = []

    def place(rank: int) -> Any:
        calls.append(rank)
        return placement, None

    assert world.on_rank_zero(zero, lambda: place(0)) == (placement, None)
    assert world.on_rank_zero(one, lambda: place(1)) == (placement, None)
    assert calls == [0]  # rank 1 never plans


def test_a_planning_error_on_rank_zero_is_raised_on_every_rank() -> None:
    sent: list[Any] = []
    zero, one = _planning_rank(0, sent), _planning_rank(1, sent)

    def fails() -> Any:
        raise ValueError("cannot plan the batch in use")

    with pytest.raises(ValueError, match="cannot plan the batch in use"):
        world.on_rank_zero(zero, fails)
    with pytest.raises(ValueError, match="cannot plan the batch in use"):
        world.on_rank_zero(one, fails)  # raised from rank 0's broadcast, not run here


class _Unpicklable(ValueError):
    def __init__(self) -> None:
        super().__init__("model too large")
        self.hook = lambda: None  # a lambda does not pickle


def test_an_unpicklable_planning_error_still_reaches_the_other_ranks() -> None:
    sent: list[Any] = []
    zero, one = _planning_rank(0, sent), _planning_rank(1, sent)

    def fails() -> Any:
        raise _Unpicklable

    with pytest.raises(_Unpicklable):
        world.on_rank_zero(zero, fails)  # rank 0 raises its own error
    with pytest.raises(RuntimeError, match="rank 0 cannot plan: model too large"):
        world.on_rank_zero(one, fails)


class _SecondRankJoins(pl.Callback):
    """At the end of training the world becomes two ranks, the other short of host memory."""

    def __init__(self, strategy: BalanceBeamStrategy) -> None:
        self.strategy = strategy
        self.asked: list[bool] = []

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        def all_ranks(decision: bool, all: bool = True) -> bool:
            self.asked.append(decision)
            return False  # the other rank's weights do not fit

        self.strategy.reduce_boolean_decision = all_ranks  # type: ignore[method-assign]
        env = self.strategy.cluster_environment
        assert env is not None
        env.set_world_size(2)


def test_hand_back_is_decided_for_every_rank_by_the_rank_with_least_memory(
    tiny: SimpleNamespace,
) -> None:
    from bb_lightning.strategy.handback import WeightsInStoreError

    strategy = BalanceBeamStrategy(
        compute_dtype="fp32", placement=Placement.uniform(4, weights=Tier.HOST, master=Tier.HOST)
    )
    joins = _SecondRankJoins(strategy)
    trainer, _ = tiny.make_trainer(strategy, 1)
    trainer.callbacks.append(joins)  # type: ignore[attr-defined]
    module = tiny.make_module(tiny.tiny_llama())
    trainer.fit(module, tiny.loader(1))
    assert joins.asked == [True]  # this rank had room ...
    with pytest.raises(WeightsInStoreError, match="another rank's host limit"):
        module.state_dict()  # ... but every rank keeps them in the store
    env = strategy.cluster_environment
    assert env is not None
    env.set_world_size(1)
    strategy.close()
