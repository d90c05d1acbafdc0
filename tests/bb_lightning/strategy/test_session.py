"""The planning session without a Trainer run: the job read once from the data, then planned."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.trainer.states import TrainerFn
from torch.utils.data import DataLoader
from transformers import AutoModelForCausalLM

from bb_lightning.data import PromptsDataModule
from bb_lightning.module import CausalLMModule
from bb_lightning.planner import FitJob, PlanOverrides, PredictJob, make_plan, preset
from bb_lightning.planner.models import builtin_config
from bb_lightning.probe import model_profile_from_module
from bb_lightning.strategy.session import (
    PlanningSession,
    PromptShape,
    TrainerJob,
    TrainShape,
    hf_model,
    read_job,
)
from storage.tiers import Tier

from ..tiny import cpu_profile, hf_config, tiny_llama_config

CONFIG = tiny_llama_config(2, vocab_size=260, bos_token_id=257, eos_token_id=258, pad_token_id=256)
CPU = cpu_profile()


def _rows(n: int, width: int) -> list[dict[str, torch.Tensor]]:
    return [{"input_ids": torch.full((width,), 65 + i)} for i in range(n)]


class StatedShape(pl.LightningDataModule):
    """A training datamodule that states its shape; drawing a batch would fail."""

    seq_len = 24
    batch_size = 3

    def train_dataloader(self) -> Any:
        raise AssertionError("the shape is stated: no batch is drawn")


class PlainTrain(pl.LightningDataModule):
    """A user's datamodule that says nothing: the first batch tells the shape."""

    def train_dataloader(self) -> DataLoader[Any]:
        return DataLoader(_rows(8, 16), batch_size=2)  # type: ignore[arg-type]


class PlainPredict(pl.LightningDataModule):
    """A user's predict datamodule with a batch size and no prompt statistics."""

    batch_size = 2

    def predict_dataloader(self) -> DataLoader[Any]:
        return DataLoader(_rows(5, 7), batch_size=self.batch_size)  # type: ignore[arg-type]


def _trainer(fn: TrainerFn, module: pl.LightningModule, dm: Any, **kwargs: Any) -> pl.Trainer:
    """A Trainer as it stands when the strategy is set up: its state and data attached."""
    trainer = pl.Trainer(accelerator="cpu", logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, **kwargs)  # fmt: skip
    trainer.state.fn = fn
    trainer._data_connector.attach_data(module, datamodule=dm)
    return trainer


@pytest.fixture(scope="module")
def module() -> CausalLMModule:
    module = CausalLMModule(CONFIG, seed=0, max_new_tokens=4)
    module.configure_model()  # as the Trainer does before the strategy's setup
    return module


def test_fit_job_from_a_datamodule_that_states_its_shape(module: CausalLMModule) -> None:
    dm = StatedShape()
    assert isinstance(dm, TrainShape)
    job = read_job(_trainer(TrainerFn.FITTING, module, dm, accumulate_grad_batches=2), module)
    chunk = module.loss_chunk_tokens  # the module's loss runs in chunks of this many
    assert job.job == FitJob(seq_len=24, global_batch_seqs=3 * 2, loss_chunk_tokens=chunk)
    assert (job.micro_batch, job.grad_accum) == (3, 2)


def test_fit_job_from_the_first_batch_of_a_plain_datamodule(module: CausalLMModule) -> None:
    dm = PlainTrain()
    assert not isinstance(dm, TrainShape)
    trainer = _trainer(TrainerFn.FITTING, module, dm, accumulate_grad_batches=3,
                       gradient_clip_val=1.0)  # fmt: skip
    job = read_job(trainer, module)
    chunk = module.loss_chunk_tokens
    want = FitJob(seq_len=16, global_batch_seqs=2 * 3, grad_clipping=True, loss_chunk_tokens=chunk)
    assert job.job == want
    assert (job.micro_batch, job.grad_accum) == (2, 3)
    given = FitJob(seq_len=8, global_batch_seqs=1)
    assert read_job(trainer, module, given).job is given  # a given job reads no batch
    by_value = _trainer(TrainerFn.FITTING, module, dm, accumulate_grad_batches=3,
                        gradient_clip_val=0.5, gradient_clip_algorithm="value")  # fmt: skip
    job = read_job(by_value, module).job
    assert isinstance(job, FitJob) and job.grad_clipping
    assert job.grad_clip_algorithm == "value"  # priced as a step after backward


def test_predict_takes_the_planned_batch_size_of_a_prompts_datamodule(
    module: CausalLMModule, tmp_path: Path
) -> None:
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps({"prompt": t}) + "\n" for t in ["ab", "abcdef", "a"]))
    dm = PromptsDataModule(str(path), batch_size=None)
    dm.setup("predict")
    assert isinstance(dm, PromptShape)
    job = read_job(_trainer(TrainerFn.PREDICTING, module, dm), module)
    assert job.job == PredictJob(prompt_len=6, new_tokens=4, num_prompts=3)
    assert job.batch_size is None and job.data is dm
    net = hf_model(module)
    placement, plan = PlanningSession(hardware=CPU).place(net, job, 2)
    assert net is not None and plan is not None
    want = make_plan(model_profile_from_module(net), CPU, job.job)
    assert plan.concurrent_seqs == want.concurrent_seqs and plan.weights == want.weights
    assert dm.planned_batch_size == plan.concurrent_seqs
    assert placement is plan.placement and placement.weights == tuple(plan.weights)


def test_predict_plans_the_batch_size_of_a_plain_datamodule(module: CausalLMModule) -> None:
    dm = PlainPredict()
    assert not isinstance(dm, PromptShape)
    job = read_job(_trainer(TrainerFn.PREDICTING, module, dm), module)
    assert job.job == PredictJob(prompt_len=7, new_tokens=4, num_prompts=5)
    assert job.batch_size == 2 and job.data is None
    net = hf_model(module)
    assert net is not None
    _, plan = PlanningSession(hardware=CPU).place(net, job, 2)
    ov = PlanOverrides(concurrent_seqs=2)
    want = make_plan(model_profile_from_module(net), CPU, job.job, overrides=ov)
    assert plan is not None and plan.concurrent_seqs == 2
    assert plan.tokens_per_s == pytest.approx(want.tokens_per_s)


def test_a_module_without_a_hugging_face_model_is_placed_from_the_overrides() -> None:
    plain = pl.LightningModule()
    trainer = _trainer(TrainerFn.FITTING, plain, PlainTrain())
    job = read_job(trainer, plain)
    assert job.job is None
    session = PlanningSession(overrides=PlanOverrides(weights_tier=Tier.DEVICE, prefetch_depth=2))
    placement, plan = session.place(None, job, 3)
    assert plan is None and placement.weights == (Tier.DEVICE,) * 3
    assert placement.master == (Tier.HOST,) * 3 and placement.prefetch_depth == 2
    with pytest.raises(ValueError, match="LightningModule holds no Hugging Face model"):
        read_job(trainer, plain, FitJob(seq_len=8, global_batch_seqs=1))


@pytest.mark.parametrize("impl", ["sdpa", "eager"])
def test_predict_plans_host_attention_only_for_a_model_running_sdpa(impl: str) -> None:
    """Four blocks of OPT-30B on FlexGen's T4: the default plan attends on the host's cores
    where the model runs ``sdpa`` (what the engine's host attention serves) and on the
    device where it runs ``eager``, as the plan forced there prices it; an ``eager`` model
    asked for the host's attention is refused before anything runs."""
    config = hf_config({**builtin_config("opt-30b"), "num_hidden_layers": 4})
    with torch.device("meta"):
        net = AutoModelForCausalLM.from_config(config, attn_implementation=impl)
    job = TrainerJob(job=PredictJob(prompt_len=512, new_tokens=32, num_prompts=4096))
    t4 = preset("t4").replace(host_memory=208 << 30)
    _, plan = PlanningSession(hardware=t4).place(net, job, 4)
    assert plan is not None and isinstance(job.job, PredictJob)
    if impl == "sdpa":
        assert plan.placement.decode_attention is Tier.HOST and plan.kv_cache is Tier.HOST
        return
    assert plan.placement.decode_attention is None
    on_device = PlanOverrides(decode_attention=Tier.DEVICE)
    profile, planned = (
        model_profile_from_module(net),
        dataclasses.replace(job.job, compute_dtype="float32"),
    )
    want = make_plan(profile, t4, planned, overrides=on_device)
    assert plan.tokens_per_s == pytest.approx(want.tokens_per_s, rel=1e-12)
    asked = PlanningSession(hardware=t4, overrides=PlanOverrides(decode_attention=Tier.HOST))
    with pytest.raises(ValueError, match=r"attn_implementation='eager': .*'sdpa'"):
        asked.place(net, job, 4)
