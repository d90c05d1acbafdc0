"""What the strategy does at the start and at the end of each ``trainer.*`` call.

At the start (``setup``): the model's own activation checkpointing is turned off while
the engine recomputes paged blocks itself (:func:`checkpointing_off`), and the call gets
its placement (:func:`call_placement`): the one given, in the compute dtype of the call,
else the plan of the job read from the Trainer (:mod:`bb_lightning.strategy.session`). With
several ranks the local rank 0 of each node measures it, every rank times the collectives
on the ranks' group, rank 0 plans, and every rank runs rank 0's placement
(:mod:`bb_lightning.strategy.world`).

In ``fit``, each of Lightning's optimizers steps through the engine (:func:`host_step`).

At the end (``teardown``, :func:`end_call`): the engine's work settles and the module gets
its weights back, or stays hollow and says why
(:meth:`~bb_lightning.strategy.assembly.EngineSlot.hand_back`); with several ranks every rank
decides alike, and after an error on one rank none gathers.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities import rank_zero_info

from bb_lightning.engine.flat import dtype_name
from bb_lightning.engine.hf_quirks import activation_checkpointing_off
from bb_lightning.engine.optimizer_step import adamw_groups_from_optimizer
from bb_lightning.engine.trainer_engine import TrainingEngine
from bb_lightning.placement import Placement
from bb_lightning.planner import FitJob, HardwareProfile, Plan, PlanOverrides, PredictJob
from bb_lightning.strategy import assembly, session, world
from bb_lightning.strategy.handback import budget_room
from bb_lightning.strategy.settings import HandBackConfig

__all__ = ["call_placement", "checkpointing_off", "end_call", "host_step"]


def checkpointing_off(module: torch.nn.Module, call: str) -> list[torch.nn.Module]:
    """Turn off the activation checkpointing of ``module``'s models for the ``trainer.<call>``
    call (paged blocks are recomputed in backward by the engine), saying so on rank zero;
    returns the models to turn it on again for afterwards."""
    turned = activation_checkpointing_off(module)
    if turned:
        rank_zero_info(
            f"balance_beam: the model's activation checkpointing is off during "
            f"trainer.{call} (paged blocks are recomputed in backward by balance_beam "
            "itself) and on again after it"
        )
    return turned


def call_placement(
    module: pl.LightningModule,
    trainer: pl.Trainer,
    num_blocks: int,
    *,
    given: Placement | None,
    overrides: PlanOverrides | None,
    hardware: str | HardwareProfile | None,
    job: FitJob | PredictJob | None,
    nvme_path: str | None,
    dtype: torch.dtype,
    device: torch.device,
    ranks: world.Ranks,
    ranks_per_node: int,
) -> tuple[Placement, Plan | None]:
    """The placement of ``module``'s ``num_blocks`` blocks in this call, and the plan it
    comes from (None when ``given``, or when there was nothing to plan).

    ``given`` is taken as is, computing in ``dtype``. Else the job (``job``, None: read
    from ``trainer``) is planned on ``hardware`` (a preset, a profile, or None /
    ``"measure"``: this machine, and with several ranks the slowest node) with
    ``overrides``, the NVMe tier in ``nvme_path``, probes on ``device`` in ``dtype``; with
    several ``ranks`` (``ranks_per_node`` on each node) rank 0 plans and the others follow
    its plan, or raise its error.
    """
    if given is not None:
        return dataclasses.replace(given, compute_dtype=dtype_name(dtype)), None
    if ranks.world_size > 1 and (hardware is None or hardware == "measure"):
        hardware = world.measured_nodes(ranks, lambda: session.measure_machine(nvme_path))
        hardware = world.measured_collectives(hardware, ranks.world_size, ranks_per_node, device)
        rates = _rates(hardware, ranks.world_size, ranks_per_node)
        rank_zero_info(f"balance_beam: collectives on the ranks' group: {rates} (timed now)")
    planning = session.PlanningSession(
        overrides=overrides, hardware=hardware, nvme_path=nvme_path, dtype=dtype,
        device=device, world_size=ranks.world_size, ranks_per_node=ranks_per_node,
    )  # fmt: skip
    read = session.read_job(trainer, module, job, world_size=ranks.world_size)

    def place() -> tuple[Placement, Plan | None]:
        return planning.place(session.hf_model(module), read, num_blocks)

    if ranks.world_size == 1:
        return place()
    placement, plan = world.on_rank_zero(ranks, place)  # every rank runs rank 0's placement
    if not ranks.is_global_zero:
        session.follow_plan(read, plan)
    return placement, plan


def _rates(hw: HardwareProfile, world_size: int, ranks_per_node: int) -> str:
    """The collective rates of ``hw`` in words, of the levels ``world_size`` ranks,
    ``ranks_per_node`` a node, have."""
    levels = [f"{hw.intra_node_bandwidth / 1e9:.3g} GB/s within a node"] * (ranks_per_node > 1)
    if world_size > ranks_per_node:
        levels.append(f"{hw.inter_node_bandwidth / 1e9:.3g} GB/s between nodes")
    return ", ".join([*levels, f"{hw.collective_latency * 1e3:.3g} ms a ring step"])


def end_call(
    slot: assembly.EngineSlot,
    owner: object,
    trainer: pl.Trainer | None,
    *,
    ranks: world.Ranks,
    ranks_per_node: int,
    dtype: torch.dtype,
    hand_back: HandBackConfig,
    budget_given: bool,
) -> None:
    """The end of ``trainer``'s call: the engine in ``slot`` settles, and ``owner``'s module
    gets its weights back in ``dtype`` or stays hollow (``hand_back``;
    :meth:`~bb_lightning.strategy.assembly.EngineSlot.hand_back`). ``budget_given``: the user's
    ``StoreConfig`` host budget caps the copy too. With several ``ranks``
    (``ranks_per_node`` on this node, each handing a copy back) the decision is every
    rank's; after an error on any rank (:func:`~bb_lightning.strategy.world.stopped_with_error`) the
    weights stay in the store without a collective."""
    calls = slot.calls
    if calls is None:
        return
    stopped = world.stopped_with_error(ranks, trainer)
    if stopped is None:
        calls.settle()
    else:  # a collective still queued may fail now that another rank is gone
        with contextlib.suppress(Exception):
            calls.settle()
    several = ranks.world_size > 1
    room = budget_room(slot.store) if budget_given and slot.store is not None else None
    slot.hand_back(
        owner, dtype, hand_back.gather_on_teardown, hand_back.gather_limit,
        ranks.reduce_boolean_decision if several else None,
        share=max(1, ranks_per_node) if several else 1, stopped=stopped, room=room,
    )  # fmt: skip


def host_step(
    optimizer: torch.optim.Optimizer,
    *,
    engine: Callable[[], TrainingEngine | None],
    trainer: Callable[[], pl.Trainer | None],
    overlap: Callable[[], bool],
    after: Callable[[], None],
) -> Callable[..., Any]:
    """``optimizer``'s ``step`` under the engine: the ``engine()``'s host AdamW with the
    optimizer's groups and the ``trainer()``'s gradient clipping; where ``overlap()``, each
    block steps while the window's last backward (in the closure) still runs, or, with
    global-norm clipping, while the next forward runs. ``after()`` follows each step (the
    adapt controller's measurement)."""

    def step(closure: Callable[[], Any] | None = None) -> Any:
        # Called at the accumulation boundary, before the window's last backward (in
        # the closure); the lr read now is this step's (schedulers step afterwards).
        clip = session.clip_config(trainer())
        adamw = adamw_groups_from_optimizer(optimizer)
        running = engine()
        assert running is not None
        if overlap() and closure is not None:  # value clipping: stepped after backward
            running.begin_overlapped_step(adamw, clip)
        loss = closure() if closure is not None else None
        running.optimizer_step(adamw, clip)
        optimizer._opt_called = True  # type: ignore[attr-defined]  # for LR schedulers
        after()
        return loss

    # torch's LR schedulers take a step marked so as recording ``_opt_called`` (above).
    step._wrapped_by_lr_sched = True  # type: ignore[attr-defined]
    return step
