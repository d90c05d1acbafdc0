"""The planning session: the job of a Trainer call, priced by the planner into a placement.

:func:`read_job` reads what a ``trainer.fit`` / ``predict`` call runs, once, from the
Trainer, its datamodule and the module, into a :class:`TrainerJob`; a
:class:`PlanningSession` (the strategy's planning settings) turns it into the
:class:`~bb_lightning.planner.Plan` and the
:class:`~bb_lightning.placement.Placement` the engine executes
(:meth:`PlanningSession.place`).

Fit: the session profiles the model (on the meta device when it was built there), takes
the hardware profile (``measure()``, cached per machine, or a preset), derives a
:class:`~bb_lightning.planner.FitJob` from the Trainer (sequence length from a
:class:`TrainShape` datamodule's ``seq_len`` or the first batch, global batch =
micro-batch x ``accumulate_grad_batches``) and plans the batch shape the DataLoader
actually runs, printing the plan and the planner's recommended micro-batch beside it.

Predict: it plans a :class:`~bb_lightning.planner.PredictJob` (:func:`predict_job`) and
prints the plan; a :class:`PromptShape` datamodule whose ``batch_size`` is None takes the
plan's ``concurrent_seqs``. On a measured machine (``hardware`` None or ``"measure"``)
the plan is priced with the rates the model's own prefill and decode passes sustain on
the device (:func:`~bb_lightning.probe.calibrate.probe_predict_compute`, a few seconds
on a CPU), as ``fit`` is with its training pass.

A datamodule need not know any of this: one without the protocols' members is read
through its first batch.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import lightning.pytorch as pl
import torch
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from torch import nn
from transformers import PreTrainedModel
from typing_extensions import Protocol, runtime_checkable

from bb_lightning.engine.attention import uses_sdpa
from bb_lightning.engine.flat import dtype_name
from bb_lightning.placement import Placement
from bb_lightning.planner import (
    FitJob,
    HardwareProfile,
    Plan,
    PlanError,
    PlanOverrides,
    PredictJob,
    make_plan,
    preset,
)
from bb_lightning.probe import measure, model_profile_from_module
from bb_lightning.probe.calibrate import (
    PredictCompute,
    TrainCompute,
    fp32_advice,
    probe_predict_compute,
    probe_train_compute,
)
from bb_lightning.strategy import world
from bb_lightning.strategy.checks import (
    ComputeDtype,
    check_clipping,
    check_settings,
    clip_config,
    compute_dtype,
    compute_dtype_check,
)
from storage.tiers import Tier

__all__ = [
    "ComputeDtype",
    "PlanningSession",
    "PromptShape",
    "SizedBatches",
    "TrainShape",
    "TrainerJob",
    "attention_overrides",
    "boundary_numel",
    "check_clipping",
    "check_settings",
    "clip_config",
    "compute_dtype",
    "compute_dtype_check",
    "first_batch_shape",
    "follow_plan",
    "hf_model",
    "measure_machine",
    "predict_job",
    "read_job",
]


@runtime_checkable
class SizedBatches(Protocol):
    """A datamodule that states its batch size (most do)."""

    @property
    def batch_size(self) -> int | None:
        """Sequences (fit) or prompts (predict) per batch; None: the plan's."""
        ...


@runtime_checkable
class ChunkedLoss(Protocol):
    """A module whose training loss holds the logits of a few tokens at a time
    (:class:`~bb_lightning.module.CausalLMModule`)."""

    @property
    def loss_chunk_tokens(self) -> int | None:
        """Tokens whose logits the loss holds at once; None: the whole pass's."""
        ...


@runtime_checkable
class TrainShape(Protocol):
    """A training datamodule that states its batches' shape
    (:class:`~bb_lightning.data.TextDataModule`)."""

    @property
    def seq_len(self) -> int:
        """Tokens per training sequence."""
        ...

    @property
    def batch_size(self) -> int:
        """Sequences per micro-batch."""
        ...


@runtime_checkable
class PromptShape(Protocol):
    """A predict datamodule that states its prompts and takes the planned batch size
    (:class:`~bb_lightning.data.PromptsDataModule`)."""

    @property
    def batch_size(self) -> int | None:
        """Prompts per batch; None: the plan's, set by :meth:`use_planned_batch_size`."""
        ...

    @property
    def longest_prompt(self) -> int:
        """Tokens of the longest prompt to run."""
        ...

    @property
    def num_prompts(self) -> int:
        """Prompts to run."""
        ...

    def use_planned_batch_size(self, concurrent_seqs: int) -> None:
        """Run batches of ``concurrent_seqs`` prompts (when ``batch_size`` is None)."""
        ...


@dataclass(frozen=True, kw_only=True)
class TrainerJob:
    """What one ``trainer.*`` call runs, as the Trainer and its data say (:func:`read_job`)."""

    job: FitJob | PredictJob | None
    """What the planner plans; None: nothing to plan (no Hugging Face model and no job
    given): the blocks are placed from the overrides."""
    micro_batch: int = 0
    """Sequences per micro-batch the training DataLoader runs; 0: not read (job given)."""
    grad_accum: int = 0
    """The Trainer's ``accumulate_grad_batches``; 0: not read (job given)."""
    batch_size: int | None = None
    """Prompts per predict batch the datamodule runs; None: the plan's (or the DataLoader's)."""
    data: PromptShape | None = field(default=None, compare=False)
    """The predict datamodule that takes the planned batch size when ``batch_size`` is None."""


def hf_model(module: torch.nn.Module) -> PreTrainedModel | None:
    """The first Hugging Face model inside ``module`` (None when it holds none)."""
    return next((m for m in module.modules() if isinstance(m, PreTrainedModel)), None)


def read_job(
    trainer: pl.Trainer,
    module: pl.LightningModule,
    given: FitJob | PredictJob | None = None,
    *,
    world_size: int = 1,
) -> TrainerJob:
    """The job of the Trainer's current call, read once.

    ``predict`` of a Hugging Face model plans a :class:`PredictJob` (``given``, else
    :func:`predict_job`); ``fit`` of one, or any call with a given :class:`FitJob`, plans a
    :class:`FitJob` (``given``, else from :func:`first_batch_shape` and the Trainer's
    accumulation and clipping: the global batch is micro-batch x accumulation x
    ``world_size`` ranks); anything else plans nothing. Raises ``ValueError`` for a
    given ``FitJob`` and a module without a Hugging Face model.
    """
    net, fn = hf_model(module), trainer.state.fn
    if fn == TrainerFn.PREDICTING and net is not None and not isinstance(given, FitJob):
        dm = getattr(trainer, "datamodule", None)
        job = given if isinstance(given, PredictJob) else predict_job(trainer, module)
        batch = dm.batch_size if isinstance(dm, SizedBatches) else None
        return TrainerJob(
            job=job,
            batch_size=batch if isinstance(batch, int) else None,
            data=dm if isinstance(dm, PromptShape) else None,
        )
    if not isinstance(given, FitJob) and (fn != TrainerFn.FITTING or net is None):
        return TrainerJob(job=None)
    if net is None:
        raise ValueError(
            f"{type(module).__name__} holds no Hugging Face model to profile: pass placement="
        )
    if isinstance(given, FitJob):
        return TrainerJob(job=given)
    seq_len, micro = first_batch_shape(trainer)
    accum = int(trainer.accumulate_grad_batches)
    clip = clip_config(trainer)
    chunk = module.loss_chunk_tokens if isinstance(module, ChunkedLoss) else None
    fit = FitJob(
        seq_len=seq_len,
        global_batch_seqs=micro * accum * world_size,
        grad_clipping=clip.value is not None,
        grad_clip_algorithm=clip.algorithm,
        loss_chunk_tokens=chunk,
    )
    return TrainerJob(job=fit, micro_batch=micro, grad_accum=accum)


def attention_overrides(net: nn.Module, overrides: PlanOverrides | None) -> PlanOverrides | None:
    """``overrides`` for planning generation with ``net``: decode attention kept on the
    device (``decode_attention`` DEVICE) where ``net`` does not run transformers' ``sdpa``
    attention, which the engine's host attention serves only (an ``eager``-only model:
    Gemma 2, Bloom, MPT, GPT-Neo, Mamba); asking for the host's then is a ValueError."""
    if uses_sdpa(net):
        return overrides
    asked = None if overrides is None else overrides.decode_attention
    if asked is Tier.HOST:
        impl = getattr(getattr(net, "config", None), "_attn_implementation", None)
        raise ValueError(
            f"decode_attention=host with attn_implementation={impl!r}: host attention serves "
            "models running 'sdpa'; load the model with attn_implementation='sdpa' or drop "
            "PlanOverrides.decode_attention"
        )
    if asked is Tier.DEVICE:
        return overrides
    return dataclasses.replace(overrides or PlanOverrides(), decode_attention=Tier.DEVICE)


@dataclass(frozen=True, kw_only=True)
class PlanningSession:
    """The strategy's planning settings; :meth:`place` plans one :class:`TrainerJob`."""

    overrides: PlanOverrides | None = None
    """Choices forced on the planner (see :class:`~bb_lightning.planner.PlanOverrides`)."""
    hardware: str | HardwareProfile | None = None
    """A preset name, a profile, or ``"measure"`` / None (measure this machine, cached)."""
    nvme_path: str | None = None
    """Directory of the NVMe tier; None plans without NVMe unless overrides force it."""
    dtype: torch.dtype = torch.float32
    """Compute dtype of the probes."""
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    """Device the probes run on."""
    world_size: int = 1
    """Data-parallel ranks of the run (1: one process; the hardware profile as given)."""
    ranks_per_node: int = 1
    """Ranks on each node (the Trainer's devices); they share one node's profile."""

    def place(
        self, net: PreTrainedModel | None, job: TrainerJob, num_blocks: int
    ) -> tuple[Placement, Plan | None]:
        """The placement of ``num_blocks`` blocks for ``job``, and the plan it comes from
        (None when there was nothing to plan: homes from the overrides, else the host)."""
        if job.job is None:
            return self.uniform(num_blocks), None
        if net is None:
            raise ValueError("balance_beam plans Hugging Face models only: pass placement=")
        planned = dataclasses.replace(job.job, compute_dtype=dtype_name(self.dtype))
        if isinstance(planned, PredictJob):
            plan = self.plan_predict(net, planned, job)
        else:
            plan = self.plan_fit(net, planned, job)
        return plan.placement, plan

    def uniform(self, num_blocks: int) -> Placement:
        """Every block's home from the overrides' tiers (the host when none is given)."""
        tiers = [getattr(self.overrides, k, None) for k in ("weights_tier", "master_tier")]
        depth = getattr(self.overrides, "prefetch_depth", None) or 1
        if tiers[0] is None:
            rank_zero_info(
                "balance_beam: no placement given; paging every block from host memory "
                "(pass placement= or overrides=PlanOverrides(weights_tier=...))"
            )
        return Placement.uniform(
            num_blocks,
            weights=Tier(tiers[0] or Tier.HOST),
            master=Tier(tiers[1] or Tier.HOST),
            prefetch_depth=depth,
            compute_dtype=dtype_name(self.dtype),
        )

    @property
    def measured(self) -> bool:
        """Whether the hardware is this machine, measured (then the probes calibrate it)."""
        return self.hardware is None or self.hardware == "measure"

    def plan_predict(self, net: PreTrainedModel, job: PredictJob, run: TrainerJob) -> Plan:
        """Plan the predict job; the DataLoader runs its own batch size, or the plan's."""
        batch = run.batch_size
        model, hardware = model_profile_from_module(net), self._hardware()
        overrides = attention_overrides(net, self.overrides)
        best = make_plan(model, hardware, job, overrides=overrides)
        if self.measured:
            rows = min(batch if batch is not None else best.concurrent_seqs, job.num_prompts)
            hardware = self._probe_predict(net, hardware, job, rows)
            best = make_plan(model, hardware, job, overrides=overrides)
        plan = best
        if batch is not None and batch != best.concurrent_seqs:
            ov = dataclasses.replace(overrides or PlanOverrides(),
                          concurrent_seqs=min(batch, job.num_prompts))  # fmt: skip
            try:
                plan = make_plan(model, hardware, job, overrides=ov)
            except PlanError as err:  # the plan printed must be the batch that runs
                raise ValueError(
                    f"balance_beam cannot plan batches of {batch} prompts ({err}): use the "
                    f"planner's {best.concurrent_seqs} (data batch_size: null), or pass "
                    "placement= to run unplanned"
                ) from err
        elif batch is None and run.data is not None:
            run.data.use_planned_batch_size(plan.concurrent_seqs)
            batch = plan.concurrent_seqs
        rank_zero_info(plan.explain())
        running = "the DataLoader's batches" if batch is None else f"batches of {batch} prompts"
        kv = "device" if plan.kv_cache is None else plan.kv_cache.value
        rank_zero_info(
            f"balance_beam: planner recommends {best.concurrent_seqs} concurrent sequences "
            f"({best.tokens_per_s:.4g} tokens/s); running {running} "
            f"({plan.tokens_per_s:.4g} tokens/s predicted), KV cache on {kv}"
        )
        return plan

    def plan_fit(self, net: PreTrainedModel, job: FitJob, run: TrainerJob) -> Plan:
        """Plan the fit job at the micro-batch and accumulation the Trainer runs."""
        micro, accum = run.micro_batch, run.grad_accum
        model, hardware = model_profile_from_module(net), self._hardware()
        if self.measured:
            hardware = self._probe_compute(net, hardware, job, micro)
        best = make_plan(model, hardware, job, overrides=self.overrides)
        plan = best
        if micro and (best.micro_batch, best.grad_accum) != (micro, accum):
            ov = self.overrides or PlanOverrides()
            forced = dataclasses.replace(ov, micro_batch=micro, grad_accum=accum)
            try:
                plan = make_plan(model, hardware, job, overrides=forced)
            except PlanError as err:  # the plan printed must be the batch that runs
                raise ValueError(
                    f"balance_beam cannot plan the batch in use, micro-batch {micro} x "
                    f"accumulate_grad_batches {accum} ({err}): run the planner's micro-batch "
                    f"{best.micro_batch} x {best.grad_accum}, or pass placement= to run "
                    "unplanned"
                ) from err
        rank_zero_info(plan.explain())
        if micro:
            rank_zero_info(
                f"balance_beam: planner recommends micro-batch {best.micro_batch} x "
                f"accumulation {best.grad_accum} ({best.tokens_per_s:.4g} tokens/s); running "
                f"micro-batch {micro} x accumulate_grad_batches {accum} "
                f"({plan.tokens_per_s:.4g} tokens/s predicted)"
            )
        return plan

    def _probe_compute(
        self, net: PreTrainedModel, hardware: HardwareProfile, job: FitJob, micro: int
    ) -> HardwareProfile:
        """``hardware`` with the compute efficiency the model's own training pass sustains
        on the device (see :mod:`bb_lightning.probe.calibrate`); unchanged when the
        probe does not fit in memory."""
        micro = micro or getattr(self.overrides, "micro_batch", None) or 1
        self._advise_dtype()
        probe = functools.partial(
            probe_train_compute,
            net.config,
            hardware,
            seq_len=job.seq_len,
            micro_batch=micro,
            dtype=self.dtype,
            device=self.device,
        )
        return _calibrated(hardware, probe, "compute probe")

    def _probe_predict(
        self, net: PreTrainedModel, hardware: HardwareProfile, job: PredictJob, rows: int
    ) -> HardwareProfile:
        """``hardware`` with the prefill and decode rates the model's own passes sustain
        on the device at ``rows`` concurrent sequences (see
        :func:`~bb_lightning.probe.calibrate.probe_predict_compute`); unchanged when the
        probe does not fit in memory."""
        self._advise_dtype()
        probe = functools.partial(
            probe_predict_compute,
            net.config,
            hardware,
            prompt_len=job.prompt_len,
            concurrent=max(1, rows),
            cache_len=job.cache_len,
            context=job.mean_context,
            dtype=self.dtype,
            device=self.device,
        )
        return _calibrated(hardware, probe, "predict compute probe")

    def _advise_dtype(self) -> None:
        """Warn a bf16 job on a CPU that multiplies fp32 much faster (see
        :func:`~bb_lightning.probe.calibrate.fp32_advice`)."""
        if self.dtype == torch.bfloat16:
            advice = fp32_advice(self.device)
            if advice is not None:
                rank_zero_warn(advice)

    def _hardware(self) -> HardwareProfile:
        spec = self.hardware
        if isinstance(spec, HardwareProfile):
            hardware = spec
        elif spec is None or spec == "measure":
            hardware = measure_machine(self.nvme_path)
        else:
            hardware = preset(spec, gpus=self.ranks_per_node)
        forced = Tier.NVME in (
            getattr(self.overrides, "weights_tier", None),
            getattr(self.overrides, "master_tier", None),
        )
        if self.nvme_path is None and not forced:
            hardware = hardware.replace(
                nvme_capacity=0, nvme_read_bandwidth=0.0, nvme_write_bandwidth=0.0
            )
        return world.with_world(hardware, self.world_size, self.ranks_per_node)


def measure_machine(nvme_path: str | None) -> HardwareProfile:
    """This machine's measured profile (cached per machine; the NVMe probe writes a
    temporary file in ``nvme_path``, checked first: created when missing, refused in one
    line when it is a file or holds a user's data, :func:`world.prepare_nvme_dir`)."""
    world.prepare_nvme_dir(nvme_path)
    return measure(nvme_path=nvme_path)


def follow_plan(job: TrainerJob, plan: Plan | None) -> None:
    """On a rank that received ``plan`` from the rank that planned ``job``: what
    :meth:`PlanningSession.place` does besides planning (a :class:`PromptShape` datamodule
    whose ``batch_size`` is None takes the plan's ``concurrent_seqs``)."""
    if plan is None or not isinstance(job.job, PredictJob):
        return
    if job.batch_size is None and job.data is not None:
        job.data.use_planned_batch_size(plan.concurrent_seqs)


def first_batch_shape(trainer: pl.Trainer) -> tuple[int, int]:
    """(sequence length in tokens, sequences per micro-batch) of the training data.

    Read from a :class:`TrainShape` datamodule's ``seq_len`` and ``batch_size``, else
    from the first batch of the training DataLoader (its ``input_ids``, or its first
    2-D tensor).
    """
    dm = getattr(trainer, "datamodule", None)
    if (
        isinstance(dm, TrainShape)
        and isinstance(dm.seq_len, int)
        and isinstance(dm.batch_size, int)
    ):
        return dm.seq_len, dm.batch_size
    source = trainer.fit_loop._data_source
    first = next(iter(source.dataloader()), None) if source.is_defined() else None
    if isinstance(first, Mapping):
        first = first.get("input_ids", next(iter(first.values()), None))
    elif isinstance(first, (list, tuple)):
        first = next((t for t in first if isinstance(t, torch.Tensor) and t.dim() == 2), None)
    if not isinstance(first, torch.Tensor) or first.dim() != 2:
        raise ValueError(
            f"balance_beam cannot tell the sequence length from the first training batch "
            f"({type(first).__name__}): pass job=FitJob(seq_len=..., global_batch_seqs=...) or "
            "placement="
        )
    return int(first.shape[1]), int(first.shape[0])


def _calibrated(
    hardware: HardwareProfile,
    probe: Callable[[], TrainCompute | PredictCompute | None],
    what: str,
) -> HardwareProfile:
    """``hardware`` with the rates ``probe()`` measures, said in the log; unchanged (and
    said) when the model is too large for it or it fails: the plan is then priced at the
    matrix-product rate, and the job goes on."""
    try:
        result = probe()
    except Exception as err:  # a calibration must not stop the job it calibrates
        rank_zero_warn(f"balance_beam: the {what} failed ({type(err).__name__}: {err}); "
                       "planning with the matrix-product rate")  # fmt: skip
        return hardware
    if result is None:
        rank_zero_info(f"balance_beam: model too large for the {what}; planning with the "
                       "matrix-product rate")  # fmt: skip
        return hardware
    rank_zero_info(f"balance_beam {result.describe(hardware)}")
    return result.applied_to(hardware)


def predict_job(trainer: pl.Trainer, module: pl.LightningModule) -> PredictJob:
    """The predict job of a Trainer: prompt length, new tokens and number of prompts.

    Prompt length (tokens) and number of prompts come from a :class:`PromptShape`
    datamodule's ``longest_prompt`` and ``num_prompts`` (``PromptsDataModule``), else
    from the first batch of the predict DataLoader (its ``input_ids`` width and the
    dataset's length); new tokens from the module's ``max_new_tokens`` hyperparameter.
    """
    new = getattr(module, "hparams", {}).get("max_new_tokens")
    if not isinstance(new, int):
        raise ValueError(
            f"{type(module).__name__} has no max_new_tokens hyperparameter (got {new!r}): pass "
            "job=PredictJob(prompt_len=..., new_tokens=..., num_prompts=...) or placement="
        )
    dm = getattr(trainer, "datamodule", None)
    if isinstance(dm, PromptShape):
        plen, count = dm.longest_prompt, dm.num_prompts
        return PredictJob(prompt_len=plen, new_tokens=new, num_prompts=max(1, count))
    source = trainer.predict_loop._data_source
    loader = source.dataloader() if source.is_defined() else None
    first = next(iter(loader), None) if loader is not None else None  # type: ignore[call-overload]
    ids = first.get("input_ids") if isinstance(first, Mapping) else first
    if not isinstance(ids, torch.Tensor) or ids.dim() != 2:
        raise ValueError(
            f"balance_beam cannot tell the prompt length from the first predict batch "
            f"({type(first).__name__}): pass job=PredictJob(...) or placement="
        )
    dataset = getattr(loader, "dataset", None)
    count = len(dataset) if hasattr(dataset, "__len__") else int(ids.shape[0])  # type: ignore[arg-type]
    return PredictJob(prompt_len=int(ids.shape[1]), new_tokens=new, num_prompts=max(1, count))


def boundary_numel(
    module: pl.LightningModule,
    trainer: pl.Trainer,
    placement: Placement,
    plan: Plan | None,
    training: bool,
) -> int:
    """Elements of one block's hidden states in a micro-batch (rows x tokens x width) for
    the store to hold the boundary inputs a given placement keeps off the device and its
    swapped blocks' saved activations; 0 when a plan sizes them, when they stay on the
    device, or when the width or the batch cannot be read (a module of the user's own: the
    store's slack holds them, else its budgets)."""
    on_device = placement.boundaries in (None, Tier.DEVICE) and not placement.swapped
    if not training or plan is not None or on_device:
        return 0
    config = getattr(hf_model(module), "config", None)
    get_text = getattr(config, "get_text_config", None)
    width = getattr(get_text() if callable(get_text) else config, "hidden_size", None)
    if not isinstance(width, int):
        return 0
    try:
        seq_len, rows = first_batch_shape(trainer)
    except ValueError:
        return 0
    return rows * seq_len * width
