"""The planning session: the job a Trainer call runs, priced by the planner into a placement."""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from transformers import PreTrainedModel

from bb_lightning.engine.pager import Placement
from bb_lightning.planner import (
    FitJob,
    HardwareProfile,
    ModelProfile,
    PlanError,
    PlanOverrides,
    PredictJob,
    make_plan,
    measure,
    preset,
)
from bb_lightning.planner.calibrate import (
    PredictCompute,
    TrainCompute,
    probe_predict_compute,
    probe_train_compute,
)
from storage.tiers import Tier


class _PlanningMixin:
    """Methods of :class:`~bb_lightning.strategy.BalanceBeamStrategy`."""

    def _plan_predict(self, module: pl.LightningModule, trainer: pl.Trainer) -> Placement:
        """Plan the predict job; the DataLoader runs its own batch size, or the plan's."""
        net = _hf_model(module)
        assert net is not None
        job = self.job if isinstance(self.job, PredictJob) else predict_job(trainer, module)
        dm = getattr(trainer, "datamodule", None)
        batch = getattr(dm, "batch_size", None)
        model, hardware = ModelProfile.from_module(net), self._hardware()
        best = make_plan(model, hardware, job, overrides=self.overrides)
        if self.hardware is None or self.hardware == "measure":
            rows = min(batch if isinstance(batch, int) else best.concurrent_seqs, job.num_prompts)
            hardware = self._probe_predict(net, hardware, job, rows)
            best = make_plan(model, hardware, job, overrides=self.overrides)
        plan = best
        if isinstance(batch, int) and batch != best.concurrent_seqs:
            ov = _replace(self.overrides or PlanOverrides(),
                          concurrent_seqs=min(batch, job.num_prompts))  # fmt: skip
            try:
                plan = make_plan(model, hardware, job, overrides=ov)
            except PlanError as err:  # the plan printed must be the batch that runs
                raise ValueError(
                    f"balance_beam cannot plan batches of {batch} prompts ({err}): use the "
                    f"planner's {best.concurrent_seqs} (data batch_size: null), or pass "
                    "placement= to run unplanned"
                ) from err
        elif batch is None and callable(getattr(dm, "use_planned_batch_size", None)):
            dm.use_planned_batch_size(plan.concurrent_seqs)  # type: ignore[union-attr]
            batch = plan.concurrent_seqs
        rank_zero_info(plan.explain())
        running = "the DataLoader's batches" if batch is None else f"batches of {batch} prompts"
        kv = "device" if plan.kv_cache is None else plan.kv_cache.value
        rank_zero_info(
            f"balance_beam: planner recommends {best.concurrent_seqs} concurrent sequences "
            f"({best.tokens_per_s:.4g} tokens/s); running {running} "
            f"({plan.tokens_per_s:.4g} tokens/s predicted), KV cache on {kv}"
        )
        self._adopt(plan)
        weights = tuple(plan.weights)
        return Placement(weights=weights, master=weights, prefetch_depth=plan.prefetch_depth)

    def _plan(self, module: pl.LightningModule, num_blocks: int, trainer: pl.Trainer) -> Placement:
        fitting = trainer.state.fn == TrainerFn.FITTING
        predicting = trainer.state.fn == TrainerFn.PREDICTING
        if predicting and _hf_model(module) is not None and not isinstance(self.job, FitJob):
            return self._plan_predict(module, trainer)
        if isinstance(self.job, FitJob) or (fitting and _hf_model(module) is not None):
            return self._plan_with_planner(module, trainer)
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
        )

    def _plan_with_planner(self, module: pl.LightningModule, trainer: pl.Trainer) -> Placement:
        net = _hf_model(module)
        if net is None:
            raise ValueError(
                f"{type(module).__name__} holds no Hugging Face model to profile: pass placement="
            )
        job, micro, accum = (self.job if isinstance(self.job, FitJob) else None), 0, 0
        if job is None:
            seq_len, micro = first_batch_shape(trainer)
            accum = int(trainer.accumulate_grad_batches)
            clip = trainer.gradient_clip_val is not None and float(trainer.gradient_clip_val) > 0
            job = FitJob(seq_len=seq_len, global_batch_seqs=micro * accum, grad_clipping=clip)
        model, hardware = ModelProfile.from_module(net), self._hardware()
        if self.hardware is None or self.hardware == "measure":
            hardware = self._probe_compute(net, hardware, job, micro)
        best = make_plan(model, hardware, job, overrides=self.overrides)
        plan = best
        if micro and (best.micro_batch, best.grad_accum) != (micro, accum):
            ov = self.overrides or PlanOverrides()
            forced = _replace(ov, micro_batch=micro, grad_accum=accum)
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
        self._adopt(plan)
        return Placement.from_plan(plan)

    def _probe_compute(
        self, net: PreTrainedModel, hardware: HardwareProfile, job: FitJob, micro: int
    ) -> HardwareProfile:
        """``hardware`` with the compute efficiency the model's own training pass sustains
        on the device (see :mod:`bb_lightning.planner.calibrate`); unchanged when the
        probe does not fit in memory."""
        micro = micro or getattr(self.overrides, "micro_batch", None) or 1
        probe = functools.partial(
            probe_train_compute,
            net.config,
            hardware,
            seq_len=job.seq_len,
            micro_batch=micro,
            dtype=self.resolved_dtype(),
            device=self.root_device,
        )
        return _calibrated(hardware, probe, "compute probe")

    def _probe_predict(
        self, net: PreTrainedModel, hardware: HardwareProfile, job: PredictJob, rows: int
    ) -> HardwareProfile:
        """``hardware`` with the prefill and decode rates the model's own passes sustain
        on the device at ``rows`` concurrent sequences (see
        :func:`~bb_lightning.planner.calibrate.probe_predict_compute`); unchanged when the
        probe does not fit in memory."""
        probe = functools.partial(
            probe_predict_compute,
            net.config,
            hardware,
            prompt_len=job.prompt_len,
            concurrent=max(1, rows),
            cache_len=job.cache_len,
            context=job.mean_context,
            dtype=self.resolved_dtype(),
            device=self.root_device,
        )
        return _calibrated(hardware, probe, "predict compute probe")

    def _hardware(self) -> HardwareProfile:
        spec = self.hardware
        if isinstance(spec, HardwareProfile):
            hardware = spec
        elif spec is None or spec == "measure":
            hardware = measure(nvme_path=self.nvme_path)
        else:
            hardware = preset(spec)
        forced = Tier.NVME in (
            getattr(self.overrides, "weights_tier", None),
            getattr(self.overrides, "master_tier", None),
        )
        if self.nvme_path is None and not forced:
            hardware = hardware.replace(
                nvme_capacity=0, nvme_read_bandwidth=0.0, nvme_write_bandwidth=0.0
            )
        return hardware


def _hf_model(module: torch.nn.Module) -> PreTrainedModel | None:
    """The first Hugging Face model inside ``module`` (None when it holds none)."""
    return next((m for m in module.modules() if isinstance(m, PreTrainedModel)), None)


def _replace(overrides: PlanOverrides, **changes: Any) -> PlanOverrides:
    return PlanOverrides(**{**overrides.__dict__, **changes})


def first_batch_shape(trainer: pl.Trainer) -> tuple[int, int]:
    """(sequence length in tokens, sequences per micro-batch) of the training data.

    Read from the datamodule's ``seq_len`` and ``batch_size`` when it has them, else
    from the first batch of the training DataLoader (its ``input_ids``, or its first
    2-D tensor).
    """
    dm = getattr(trainer, "datamodule", None)
    seq_len, batch = getattr(dm, "seq_len", None), getattr(dm, "batch_size", None)
    if isinstance(seq_len, int) and isinstance(batch, int):
        return seq_len, batch
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

    Prompt length (tokens) and number of prompts come from the datamodule's
    ``longest_prompt`` and ``num_prompts`` when it has them (``PromptsDataModule``),
    else from the first batch of the predict DataLoader (its ``input_ids`` width and
    the dataset's length); new tokens from the module's ``max_new_tokens``
    hyperparameter.
    """
    new = getattr(module, "hparams", {}).get("max_new_tokens")
    if not isinstance(new, int):
        raise ValueError(
            f"{type(module).__name__} has no max_new_tokens hyperparameter (got {new!r}): pass "
            "job=PredictJob(prompt_len=..., new_tokens=..., num_prompts=...) or placement="
        )
    dm = getattr(trainer, "datamodule", None)
    plen, count = getattr(dm, "longest_prompt", None), getattr(dm, "num_prompts", None)
    if isinstance(plen, int) and isinstance(count, int):
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
