"""The planner prices the training loss as the module computes it: one chunk's logits for
``CausalLMModule`` (its ``loss_chunk_tokens``), the whole pass's for a module that calls the
model with ``labels``; a dry run of the chunked plan stays within the plan's device bytes."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from types import SimpleNamespace

import pytest
from lightning.pytorch.trainer.states import TrainerFn

from bb_lightning.cli import main
from bb_lightning.module import CausalLMModule
from bb_lightning.planner import FitJob, make_plan, preset
from bb_lightning.planner.cost import logits_bytes, loss_chunk_tokens
from bb_lightning.probe import model_profile_from_config
from bb_lightning.strategy.dryrun import dry_fit
from bb_lightning.strategy.session import read_job
from storage.tiers import Tier

VOCAB = 128_256
CONFIG = {
    "model_type": "llama", "hidden_size": 512, "num_hidden_layers": 4,
    "num_attention_heads": 8, "num_key_value_heads": 8, "intermediate_size": 1024,
    "vocab_size": VOCAB, "max_position_embeddings": 4096,
}  # fmt: skip
"""A 4-block Llama with a Llama-3-sized vocabulary: its loss, not its blocks, fills a 6 GiB
device."""


def test_a_chunked_loss_is_priced_per_chunk_and_its_dry_run_fits_the_plan() -> None:
    model = model_profile_from_config(CONFIG)
    hw = preset("h100").replace(device_memory=6 << 30)
    whole = make_plan(model, hw, FitJob(seq_len=2048, global_batch_seqs=64))
    chunk = loss_chunk_tokens(VOCAB)
    chunked = make_plan(
        model, hw, FitJob(seq_len=2048, global_batch_seqs=64, loss_chunk_tokens=chunk)
    )
    # the whole pass's logits (12 bytes per token per entry) cap the pass at one sequence
    assert (whole.micro_batch, whole.limited_by) == (1, "memory")
    # priced per chunk, the pass carries many more tokens, and is faster for it
    assert chunked.micro_batch >= 16 and chunked.tokens_per_s > 2 * whole.tokens_per_s
    device = {m.tier: m for m in chunked.memory}[Tier.DEVICE]
    assert logits_bytes(model, chunked.tokens_per_pass) > device.budget  # whole, it won't fit
    said = "loss: head and cross-entropy over chunks of 697 tokens, each recomputed in backward"
    assert said in chunked.explain() and "loss: head" not in whole.explain()
    # the dry run computes the loss in the job's chunks; with the device budget cut to the
    # plan's figure the store's arena takes no headroom (room for re-plans) beside it
    exact = dataclasses.replace(
        chunked,
        memory=tuple(
            dataclasses.replace(m, budget=device.used) if m.tier is Tier.DEVICE else m
            for m in chunked.memory
        ),
    )
    report = dry_fit(exact, CONFIG)
    assert report.over == [], report.peaks[Tier.DEVICE]
    assert report.peaks[Tier.DEVICE].bytes <= device.used


def test_a_loss_chunk_out_of_range_is_refused() -> None:
    with pytest.raises(ValueError, match=r"FitJob.loss_chunk_tokens = 0 must be a positive"):
        FitJob(seq_len=8, global_batch_seqs=1, loss_chunk_tokens=0)


@pytest.mark.parametrize(("chunk", "want"), [(None, loss_chunk_tokens(256)), (5, 5), (0, None)])
def test_the_fit_job_takes_the_modules_loss_chunk(chunk: int | None, want: int | None) -> None:
    config = {**{k: v for k, v in CONFIG.items() if k != "vocab_size"}, "vocab_size": 256}
    module = CausalLMModule({**config, "hidden_size": 32, "intermediate_size": 64,
                             "num_attention_heads": 4, "num_key_value_heads": 4},
                            loss_chunk_tokens=chunk)  # fmt: skip
    module.configure_model()
    trainer = SimpleNamespace(
        state=SimpleNamespace(fn=TrainerFn.FITTING),
        datamodule=SimpleNamespace(seq_len=16, batch_size=2),
        accumulate_grad_batches=3,
        gradient_clip_val=None,
    )
    job = read_job(trainer, module).job  # type: ignore[arg-type]
    assert job == FitJob(seq_len=16, global_batch_seqs=6, loss_chunk_tokens=want)


def test_plan_prices_the_loss_chunk_it_is_given(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # a Llama-3-8B shape (128k vocabulary) on a 24 GiB card: the whole loss caps the pass
    config = {**CONFIG, "hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32,
              "intermediate_size": 14336, "num_key_value_heads": 8}  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(config))
    argv = ["plan", "--model", str(tmp_path / "config.json"), "--hardware", "rtx4090",
            "--host-memory", "256GiB", "--seq-len", "1024", "--global-batch", "32s", "--json"]  # fmt: skip
    assert main(argv) == 0  # priced as CausalLMModule runs it: its default chunk
    chunked = json.loads(capsys.readouterr().out)
    assert main([*argv, "--loss-chunk-tokens", "0"]) == 0  # a module's own whole loss
    whole = json.loads(capsys.readouterr().out)
    assert main([*argv, "--loss-chunk-tokens", "300"]) == 0
    given = json.loads(capsys.readouterr().out)
    chunks = (chunked["job"]["loss_chunk_tokens"], whole["job"]["loss_chunk_tokens"],
              given["job"]["loss_chunk_tokens"])  # fmt: skip
    assert chunks == (loss_chunk_tokens(VOCAB), None, 300) == (697, None, 300)
    assert chunked["micro_batch"] > whole["micro_batch"]


def test_plan_refuses_a_negative_loss_chunk(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(["plan", "--hardware", "t4", "--loss-chunk-tokens", "-5"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err.strip()
    assert "--loss-chunk-tokens: '-5' is not an integer >= 0" in err
