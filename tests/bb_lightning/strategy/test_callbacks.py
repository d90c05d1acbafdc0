"""ThroughputCallback: FLOPs against torch's FLOP counter, metrics from a real offloaded fit."""

from __future__ import annotations

import csv
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.loggers import CSVLogger
from torch.utils.flop_counter import FlopCounterMode
from transformers import AutoConfig, AutoModelForCausalLM

from bb_lightning import BalanceBeamStrategy
from bb_lightning.data import TextDataModule
from bb_lightning.module import CausalLMModule
from bb_lightning.planner import PlanOverrides
from bb_lightning.planner.cost import model_flops_per_token
from bb_lightning.probe import model_profile_from_config
from bb_lightning.strategy.callbacks import ThroughputCallback, phase_summary
from storage.tiers import Tier

from ..tiny import tiny_llama_config

TINY = tiny_llama_config(2, num_key_value_heads=4, vocab_size=264)


@pytest.mark.parametrize("training", [False, True])
def test_model_flops_match_torch_flop_counter(training: bool) -> None:
    values = dict(TINY)
    config = AutoConfig.for_model(values.pop("model_type"), **values)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    seq = 2  # attention over 2 tokens is < 1% of the FLOPs: the formula's context rounding
    ids = torch.randint(0, 264, (1, seq))
    with FlopCounterMode(display=False) as counter:
        loss = model(input_ids=ids, labels=ids).loss
        if training:
            loss.backward()
    task = "fit" if training else "predict"
    expected = model_flops_per_token(model_profile_from_config(config), task, seq)
    assert counter.get_total_flops() / seq == pytest.approx(expected, rel=0.02)


def test_bad_peak_is_rejected() -> None:
    with pytest.raises(ValueError, match="peak_flops"):
        ThroughputCallback(peak_flops=0.0)


def test_callback_logs_throughput_and_link_rates(tmp_path: Path) -> None:
    (tmp_path / "text.txt").write_text("import os\nprint(os.getcwd())\n" * 300)
    (tmp_path / "nvme").mkdir()
    strategy = BalanceBeamStrategy(
        nvme_path=str(tmp_path / "nvme"),
        hardware="a100-80gb",
        overrides=PlanOverrides(weights_tier=Tier.NVME, master_tier=Tier.HOST),
    )
    callback = ThroughputCallback()
    trainer = pl.Trainer(
        strategy=strategy, accelerator="cpu", max_steps=3, log_every_n_steps=1,
        logger=CSVLogger(tmp_path), enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, limit_val_batches=0, callbacks=[callback],
    )  # fmt: skip
    data = TextDataModule(str(tmp_path / "text.txt"), seq_len=32, batch_size=2, val_fraction=0.0)
    trainer.fit(CausalLMModule(TINY), datamodule=data)
    lines = phase_summary(strategy)
    strategy.close()
    rows = list(csv.DictReader(next(tmp_path.rglob("metrics.csv")).open()))
    logged = [r for r in rows if r.get("tokens/s")]
    assert len(logged) == 3
    profile = model_profile_from_config(CausalLMModule(TINY).model_config())
    per_token = model_flops_per_token(profile, "fit", 32)
    for r in logged:  # FLOP/s and tokens/s come from the same tokens and seconds
        assert float(r["GFLOP/s"]) * 1e9 / float(r["tokens/s"]) == pytest.approx(per_token)
    # Weights live on NVMe: every step pages them in through an NVMe link.
    nvme = [k for k in rows[0] if k.startswith("nvme_read") and k.endswith("MB/s")]
    assert nvme and all(any(r.get(k) for k in nvme) for r in logged)
    assert callback.totals["tokens"] == 3 * 2 * 32
    assert lines and "measured" in lines[1]
