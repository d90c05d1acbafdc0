"""What each rank keeps apart and what the ranks agree on, without a process group: the
collectives are played by hand for the rank under test."""

from __future__ import annotations

import os
import socket
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from bb_lightning.planner import FitJob, MeasuredTimes, PredictJob, adapt, make_plan, preset
from bb_lightning.probe import model_profile_from_config
from bb_lightning.strategy import world
from bb_lightning.strategy.adapt import AdaptController
from bb_lightning.strategy.session import PlanningSession, TrainerJob, follow_plan
from storage.store import StoreConfig

from ..tiny import tiny_llama_config

CONFIG = tiny_llama_config(4, vocab_size=260, max_position_embeddings=128)


def test_each_rank_gets_its_own_nvme_directory_and_one_process_keeps_the_path(
    tmp_path: Path,
) -> None:
    base = str(tmp_path)
    assert world.rank_nvme_path(base, 3, 4) == os.path.join(base, "rank3")
    assert world.rank_nvme_path(base, 0, 1) == base
    assert world.rank_nvme_path(None, 1, 2) is None  # a temporary directory per process
    with pytest.raises(ValueError, match=r"global_rank=2 outside 0\.\.1"):
        world.rank_nvme_path(base, 2, 2)
    store = StoreConfig(device_budget=1 << 20, host_budget=1 << 20, nvme_path=base,
                        nvme_budget=1 << 20, device="cpu")  # fmt: skip
    ranked = world.rank_store_config(store, 1, 2)
    assert ranked is not None and ranked.nvme_path == os.path.join(base, "rank1")
    assert ranked.host_budget == store.host_budget
    assert world.rank_store_config(store, 0, 1) is store


def test_the_profile_takes_the_layout_and_network_defaults_only_where_missing() -> None:
    assert world.with_world(preset("h100"), 8, 8).intra_node_bandwidth == 0.8 * 450e9  # NVLink
    node = preset("h100").replace(intra_node_bandwidth=0.0, inter_node_bandwidth=0.0)
    assert world.with_world(node, 1, 1) is node
    one_node = world.with_world(node, 8, 8)
    assert (one_node.world_size, one_node.ranks_per_node, one_node.num_nodes) == (8, 8, 1)
    assert one_node.intra_node_bandwidth == world.DEFAULT_INTRA_NODE_BANDWIDTH
    assert one_node.inter_node_bandwidth == 0.0  # not needed on one node
    given = node.replace(intra_node_bandwidth=1e11, inter_node_bandwidth=2.5e10)
    two_nodes = world.with_world(given, 16, 8)
    assert (two_nodes.intra_node_bandwidth, two_nodes.inter_node_bandwidth) == (1e11, 2.5e10)
    assert world.with_world(node, 4, 2).inter_node_bandwidth == world.DEFAULT_INTER_NODE_BANDWIDTH


def test_the_planning_session_plans_one_rank_of_the_world() -> None:
    model = model_profile_from_config(CONFIG)
    job = FitJob(seq_len=64, global_batch_seqs=8)
    session = PlanningSession(hardware="h100", world_size=2, ranks_per_node=2)
    hardware = session._hardware()
    assert (hardware.world_size, hardware.ranks_per_node) == (2, 2)
    plan = make_plan(model, hardware, job)
    want = make_plan(model, world.with_world(preset("h100", gpus=2), 2, 2).replace(
        nvme_capacity=0, nvme_read_bandwidth=0.0, nvme_write_bandwidth=0.0), job)  # fmt: skip
    assert plan == want
    assert plan.micro_batch * plan.grad_accum == 4  # each rank runs half the global batch
    alone = PlanningSession(hardware="h100")._hardware()
    assert alone.world_size == 1 and alone == preset("h100").replace(
        nvme_capacity=0, nvme_read_bandwidth=0.0, nvme_write_bandwidth=0.0
    )


class _Prompts:
    """A predict datamodule that takes the planned batch size (PromptShape)."""

    def __init__(self) -> None:
        self.batch_size: int | None = None
        self.longest_prompt = 8
        self.num_prompts = 7

    def use_planned_batch_size(self, concurrent_seqs: int) -> None:
        self.batch_size = concurrent_seqs


def test_a_rank_that_receives_a_predict_plan_runs_its_batch_size() -> None:
    model = model_profile_from_config(CONFIG)
    hardware = world.with_world(preset("h100"), 2, 2)
    plan = make_plan(model, hardware, PredictJob(prompt_len=8, new_tokens=4, num_prompts=7))
    data = _Prompts()
    job = TrainerJob(job=PredictJob(prompt_len=8, new_tokens=4, num_prompts=7), data=data)
    follow_plan(job, plan)
    assert data.batch_size == plan.concurrent_seqs
    given = _Prompts()
    follow_plan(TrainerJob(job=job.job, batch_size=2, data=given), plan)
    assert given.batch_size is None  # the datamodule's own batch size stays
    follow_plan(job, None)  # nothing planned: nothing to follow


def _elementwise_max_with(other: MeasuredTimes, seen: list[torch.Tensor]) -> Any:
    """The all-reduce MAX of this rank's packed times with another rank's."""
    other_packed = torch.tensor(
        [-1.0 if v is None else v for v in other.__dict__.values()], dtype=torch.float64
    )

    def reduce_max(t: torch.Tensor) -> torch.Tensor:
        seen.append(t.clone())
        return torch.maximum(t, other_packed)

    return reduce_max


def test_slowest_times_take_each_phase_from_the_slowest_rank() -> None:
    mine = MeasuredTimes(compute_s=1.0, h2d_s=0.5, optimizer_s=0.2, step_s=1.5)
    theirs = MeasuredTimes(compute_s=0.8, h2d_s=0.9, optimizer_s=0.1, step_s=1.6)
    seen: list[torch.Tensor] = []
    got = world.slowest_times(mine, _elementwise_max_with(theirs, seen))
    assert got == MeasuredTimes(compute_s=1.0, h2d_s=0.9, optimizer_s=0.2, step_s=1.6)
    assert got.nvme_read_s is None and got.d2h_s is None  # measured by no rank
    assert len(seen) == 1 and seen[0].dtype == torch.float64


def test_every_rank_replans_when_one_rank_is_slow(monkeypatch: pytest.MonkeyPatch) -> None:
    model = model_profile_from_config(CONFIG)
    hardware = world.with_world(preset("h100"), 2, 2)
    plan = make_plan(model, hardware, FitJob(seq_len=64, global_batch_seqs=8))
    p = plan.predicted
    fast = MeasuredTimes(compute_s=p.compute, h2d_s=p.h2d, optimizer_s=p.optimizer,
                         step_s=p.total)  # fmt: skip
    slow = MeasuredTimes(compute_s=p.compute + 0.05, h2d_s=p.h2d, optimizer_s=p.optimizer,
                         step_s=p.total + 0.05)  # fmt: skip  # 50 ms more compute
    applied: list[Any] = []
    monkeypatch.setattr(
        "bb_lightning.strategy.adapt.apply_plan", lambda e, new: applied.append(new)
    )
    engine = SimpleNamespace(timer=SimpleNamespace(end_step=lambda: None, steps=[0, 0, 0]))

    def controller() -> AdaptController:
        c = AdaptController(warmup_steps=3, tolerance=0.25)
        c.measured = lambda engine: fast  # type: ignore[method-assign]  # this rank: as planned
        return c

    assert controller().end_step(engine, plan) is None  # alone it would keep the plan
    seen: list[torch.Tensor] = []
    new = controller().end_step(engine, plan, reduce_max=_elementwise_max_with(slow, seen))
    assert new is not None and new == adapt(plan, slow)  # the slow rank's decision
    assert applied == [new] and len(seen) == 1


def _collectives(rank: int, marker: list[str], *, everyone: bool = True) -> dict[str, Any]:
    """Rank ``rank``'s view of the collectives of one check; ``marker`` is rank 0's name."""

    def broadcast(obj: str) -> str:
        if rank == 0:
            marker.append(obj)
        return marker[-1]

    return {
        "global_rank": rank,
        "barrier": lambda: None,
        "broadcast": broadcast,
        "all_true": lambda seen: seen and everyone,
    }


def test_rank_zero_writes_the_marker_and_removes_it(tmp_path: Path) -> None:
    marker: list[str] = []
    folder = tmp_path / "ckpts" / "run"  # made by rank 0
    seen_during: list[bool] = []
    calls = _collectives(0, marker)
    calls["barrier"] = lambda: seen_during.append(os.path.exists(marker[-1]))
    world.check_shared_directory(folder, **calls)
    assert seen_during == [True] and Path(marker[0]).parent == folder.absolute()
    assert Path(marker[0]).name.startswith(world.MARKER_PREFIX)
    assert list(folder.iterdir()) == []  # removed again


def test_a_rank_that_cannot_see_the_marker_raises_naming_path_rank_and_host(
    tmp_path: Path,
) -> None:
    elsewhere = tmp_path / "node0-local"  # rank 0's local disk, not here
    marker = [str(elsewhere / f"{world.MARKER_PREFIX}0123")]
    host = socket.gethostname()
    with pytest.raises(ValueError, match=rf"not visible from rank 1 on host {host}: .*shares"):
        world.check_shared_directory(elsewhere, **_collectives(1, marker))
    folder = tmp_path / "shared"
    with pytest.raises(ValueError, match=r"not visible from every rank"):
        world.check_shared_directory(folder, **_collectives(0, [], everyone=False))
    assert list(folder.iterdir()) == []  # rank 0 removed its marker before raising


def test_the_fit_job_of_several_ranks_is_their_global_batch(tiny: SimpleNamespace) -> None:
    from lightning.pytorch.trainer.states import TrainerFn

    from bb_lightning.strategy.session import read_job

    data = SimpleNamespace(seq_len=32, batch_size=2)
    trainer = SimpleNamespace(
        state=SimpleNamespace(fn=TrainerFn.FITTING), datamodule=data,
        accumulate_grad_batches=3, gradient_clip_val=None,
    )  # fmt: skip
    module = tiny.make_module(tiny.tiny_llama(2))
    module.configure_model()
    one = read_job(trainer, module)  # type: ignore[arg-type]
    four = read_job(trainer, module, world_size=4)  # type: ignore[arg-type]
    chunk = module.loss_chunk_tokens  # CausalLMModule's loss runs in chunks of this many
    assert one.job == FitJob(seq_len=32, global_batch_seqs=6, loss_chunk_tokens=chunk)
    assert four.job == FitJob(seq_len=32, global_batch_seqs=24, loss_chunk_tokens=chunk)
    assert (four.micro_batch, four.grad_accum) == (2, 3)  # what each rank's loader runs


def test_every_rank_plans_for_the_slowest_node() -> None:
    fast = preset("a100-80gb")
    slow = fast.replace(
        host_memory=fast.host_memory // 2,
        nvme_read_bandwidth=fast.nvme_read_bandwidth / 3,
        collective_latency=fast.collective_latency + 1e-4,
    )
    got = world.slowest_node([fast, None, slow, None])  # local ranks 1 measured nothing
    assert got.host_memory == slow.host_memory
    assert got.nvme_read_bandwidth == slow.nvme_read_bandwidth
    assert got.collective_latency == slow.collective_latency  # the longer one
    assert got.device_flops == fast.device_flops == slow.device_flops
    assert got.h2d_bandwidth == min(fast.h2d_bandwidth, slow.h2d_bandwidth)
    with pytest.raises(ValueError, match="local rank 0 of each node measures"):
        world.slowest_node([None, None])


def test_the_directory_of_the_ranks_directories_is_made_when_its_parent_exists(
    tmp_path: Path,
) -> None:
    world.make_shared_nvme_dir(str(tmp_path / "nvme"), 2)
    assert (tmp_path / "nvme").is_dir()
    world.make_shared_nvme_dir(str(tmp_path / "one"), 1)  # one process: the tier makes it
    with pytest.raises(ValueError, match=r"parent directory '.*/no' does not exist either"):
        world.make_shared_nvme_dir(str(tmp_path / "no" / "nvme"), 2)
    assert not (tmp_path / "one").exists() and not (tmp_path / "no").exists()


def test_the_default_hand_back_limit_is_shared_by_the_ranks_of_a_node() -> None:
    from bb_lightning.strategy.handback import fits_host

    _, one = fits_host(0, None)
    _, each = fits_host(0, None, share=4)
    assert each <= one // 4 + (one // 100)  # each of 4 ranks gets about a quarter
    assert fits_host(10, 10, share=4) == (True, 10)  # an explicit limit is each rank's own
    with pytest.raises(ValueError, match="share=0"):
        fits_host(0, None, share=0)
