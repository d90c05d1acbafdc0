"""Lightning features under balance_beam against plain Lightning; LightningCLI; bad configs."""

from __future__ import annotations

import os
import textwrap
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.cli import LightningCLI
from lightning.pytorch.loggers import CSVLogger

from bb_lightning import BalanceBeamStrategy
from bb_lightning.engine.flat_state import FlatState
from bb_lightning.engine.state_io import EngineStateDict
from bb_lightning.engine.trainer_engine import TrainingEngine
from bb_lightning.module import CausalLMModule
from bb_lightning.placement import Placement
from bb_lightning.planner import PlanOverrides
from storage.store import StoreConfig
from storage.tiers import Tier

from ..tiny import hf_config

D, H, N = Tier.DEVICE, Tier.HOST, Tier.NVME


class _Recorder(pl.Callback):
    """Per-micro-batch training losses and the learning rate each optimizer step used."""

    def __init__(self) -> None:
        self.losses: list[float] = []
        self.lrs: list[float] = []

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, i: int
    ) -> None:
        self.losses.append(float(outputs["loss"]))
        self.lrs.append(float(trainer.optimizers[0].param_groups[0]["lr"]))


def _features_run(strategy: Any, tmp: Path, tiny: SimpleNamespace) -> dict[str, Any]:
    """Two epochs of 4 batches: accumulation 2, norm clipping, warm-up schedule, validation
    (sanity check included), ``self.log`` to a CSV logger, ModelCheckpoint on ``val_loss``."""
    recorder = _Recorder()
    checkpoint = ModelCheckpoint(dirpath=tmp / "ckpts", monitor="val_loss", save_top_k=1)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        strategy=strategy,
        max_epochs=2,
        accumulate_grad_batches=2,
        gradient_clip_val=0.5,
        logger=CSVLogger(tmp, name="logs"),
        log_every_n_steps=1,
        callbacks=[recorder, checkpoint],
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=1,
    )
    module = CausalLMModule(
        tiny.tiny_llama(), learning_rate=1e-3, weight_decay=0.01, warmup_steps=3, seed=0
    )
    trainer.fit(module, tiny.loader(4), tiny.loader(2, seed=9))
    return {
        "losses": recorder.losses,
        "lrs": recorder.lrs,
        "metrics": {k: float(v) for k, v in trainer.callback_metrics.items()},
        "global_step": trainer.global_step,
        "epoch": trainer.current_epoch,
        "sched": trainer.lr_scheduler_configs[0].scheduler.last_epoch,  # type: ignore[union-attr]
        "best": Path(checkpoint.best_model_path),
        "csv": (Path(trainer.logger.log_dir) / "metrics.csv").read_text(),  # type: ignore[union-attr]
    }


@pytest.mark.slow
def test_lightning_features_equal_plain_lightning(tiny: SimpleNamespace, tmp_path: Path) -> None:
    want = _features_run("auto", tmp_path / "plain", tiny)
    placement = Placement(weights=(N, H, D, H), master=(H, N, H, H), prefetch_depth=1)
    strategy = BalanceBeamStrategy(
        placement=placement, compute_dtype="fp32", nvme_path=str(tmp_path / "nvme")
    )
    got = _features_run(strategy, tmp_path / "bb", tiny)
    torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(want["losses"]))
    assert len(got["losses"]) == 8 and got["lrs"] == want["lrs"]
    assert (got["global_step"], got["epoch"], got["sched"]) == (4, 2, 4)
    assert (want["global_step"], want["epoch"], want["sched"]) == (4, 2, 4)
    assert got["metrics"].keys() == want["metrics"].keys() >= {"train_loss", "val_loss"}
    for key, value in want["metrics"].items():
        assert got["metrics"][key] == pytest.approx(value, rel=1e-5), key
    assert "val_loss" in got["csv"].splitlines()[0]
    assert got["best"].name == want["best"].name and (got["best"] / "state.zarr").is_dir()
    strategy.close()


def test_resume_from_save_after_fit_matches_plain_lightning(
    tiny: SimpleNamespace, tmp_path: Path
) -> None:
    """A checkpoint written by ``trainer.save_checkpoint`` after ``fit`` resumes as plain
    Lightning resumes its own: Lightning restores the loops of a finished fit as if a batch
    of the epoch were left (it replays one batch, then starts the next epoch), so both runs
    differ from an uninterrupted one in the same way."""

    def run(strategy: Any, steps: int, ckpt: Path | None, save: Path | None) -> list[float]:
        trainer, recorder = tiny.make_trainer(strategy, steps)
        module = CausalLMModule(
            tiny.tiny_llama(2), learning_rate=1e-3, weight_decay=0.01, warmup_steps=6, seed=0
        )
        trainer.fit(module, tiny.loader(4), ckpt_path=ckpt)
        if save is not None:
            trainer.save_checkpoint(save)
        return list(recorder.losses)

    def ours() -> BalanceBeamStrategy:
        return BalanceBeamStrategy(placement=Placement.uniform(2, weights=H), compute_dtype="fp32")

    plain = run("auto", 4, None, tmp_path / "plain.ckpt")
    plain += run("auto", 7, tmp_path / "plain.ckpt", None)
    first = ours()
    got = run(first, 4, None, tmp_path / "bb.ckpt")
    first.close()
    second = ours()
    got += run(second, 7, tmp_path / "bb.ckpt", None)
    assert second.engine is not None and second.engine.step_count == 7
    second.close()
    assert len(got) == 7
    torch.testing.assert_close(torch.tensor(got), torch.tensor(plain), rtol=1e-6, atol=1e-6)


FAMILIES: dict[str, dict[str, Any]] = {
    "mistral": {
        "model_type": "mistral",
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 1,
        "vocab_size": 256,
        "max_position_embeddings": 64,
    },
    "qwen2": {
        "model_type": "qwen2",
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": 256,
        "max_position_embeddings": 64,
        "tie_word_embeddings": True,
    },
    "opt": {
        "model_type": "opt",
        "hidden_size": 64,
        "ffn_dim": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "vocab_size": 256,
        "max_position_embeddings": 64,
        "word_embed_proj_dim": 32,
        "dropout": 0.0,
        "attention_dropout": 0.0,
        "layerdrop": 0.0,
    },
    "gpt_neox": {
        "model_type": "gpt_neox",
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "vocab_size": 256,
        "max_position_embeddings": 64,
        "hidden_dropout": 0.0,
        "attention_dropout": 0.0,
    },
}
BLOCKS = {
    "mistral": "model.layers",
    "qwen2": "model.layers",
    "opt": "model.decoder.layers",
    "gpt_neox": "gpt_neox.layers",
}


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_families_train_like_plain_lightning(
    family: str, tiny: SimpleNamespace, tmp_path: Path, reference_run: Any
) -> None:
    config = FAMILIES[family]
    placement = Placement(weights=(N, H), master=(H, N), prefetch_depth=1)
    strategy = BalanceBeamStrategy(
        placement=placement, compute_dtype="fp32", nvme_path=str(tmp_path)
    )
    module = tiny.make_module(config)
    trainer, recorder = tiny.make_trainer(strategy, 2)
    trainer.fit(module, tiny.loader(2))
    engine = strategy.engine
    assert engine is not None and module.model is not None
    assert engine.paged.blocks == list(module.model.get_submodule(BLOCKS[family]))
    losses, state = reference_run(config, 2)
    torch.testing.assert_close(torch.tensor(recorder.losses), torch.tensor(losses))
    got = dict(strategy.lightning_module_state_dict())
    assert got.keys() == state.keys()
    for key, value in state.items():
        # as for GPT-2: elements with a gradient far below AdamW's eps move by rounding noise
        torch.testing.assert_close(got[key], value, rtol=1e-5, atol=2e-5, msg=key)
    strategy.close()


def test_lightning_cli_class_path_builds_and_fits(tiny: SimpleNamespace, tmp_path: Path) -> None:
    hf_config(tiny.tiny_llama(2)).save_pretrained(tmp_path / "model")
    (tmp_path / "nvme").mkdir()
    yaml = textwrap.dedent(
        f"""
        trainer:
          accelerator: cpu
          devices: 1
          max_steps: 2
          logger: false
          enable_checkpointing: false
          enable_progress_bar: false
          strategy:
            class_path: bb_lightning.BalanceBeamStrategy
            init_args:
              compute_dtype: fp32
              nvme_path: {tmp_path / "nvme"}
              hardware: a100-80gb
              warmup_steps: 2
              adapt_tolerance: null
              overrides:
                weights_tier: NVME
                master_tier: HOST
                prefetch_depth: 2
        model:
          model: {tmp_path / "model"}
          learning_rate: 0.001
        """
    )
    (tmp_path / "config.yaml").write_text(yaml)
    cli = LightningCLI(
        CausalLMModule,
        run=False,
        args=["--config", str(tmp_path / "config.yaml")],
        save_config_callback=None,
    )
    strategy = cli.trainer.strategy
    assert isinstance(strategy, BalanceBeamStrategy)
    assert (strategy.compute_dtype, strategy.nvme_path) == ("fp32", str(tmp_path / "nvme"))
    assert strategy.overrides == PlanOverrides(weights_tier=N, master_tier=H, prefetch_depth=2)
    cli.trainer.fit(cli.model, tiny.loader(2))
    assert strategy.engine is not None and strategy.engine.step_count == 2
    placement = strategy.engine.pager.placement
    assert placement.weights == (N, N) and placement.prefetch_depth == 2
    strategy.close()


def _bad_fit(tiny: SimpleNamespace, strategy: BalanceBeamStrategy, match: str) -> list[float]:
    trainer, recorder = tiny.make_trainer(strategy, 2)
    with pytest.raises(ValueError, match=match):
        trainer.fit(tiny.make_module(tiny.tiny_llama(2)), tiny.loader(2))
    assert strategy.engine is None and strategy.store is None
    return list(recorder.losses)


def test_unusable_nvme_paths_fail_before_training(tiny: SimpleNamespace, tmp_path: Path) -> None:
    placement = Placement.uniform(2, weights=N, master=H)
    (tmp_path / "file").write_text("x")
    bad = BalanceBeamStrategy(
        placement=placement, compute_dtype="fp32", nvme_path=str(tmp_path / "file" / "nvme")
    )
    assert _bad_fit(tiny, bad, r"file.*not a directory: pick a directory") == []
    assert sorted(os.listdir(tmp_path)) == ["file"]
    proc = Path("/proc/self")
    if proc.is_dir() and not os.access(proc, os.W_OK):  # not writable even by root
        bad = BalanceBeamStrategy(
            placement=placement, compute_dtype="fp32", nvme_path=str(proc / "nvme")
        )
        assert _bad_fit(tiny, bad, r"not writable: fix its permissions") == []


@pytest.mark.parametrize(
    ("budgets", "match"),
    [
        ({"host_budget": 64 << 10}, r"host budget 65536 bytes < \d+ bytes needed"),
        ({"device_budget": 16 << 10}, r"device budget 16384 bytes < \d+ bytes needed"),
        ({"nvme_budget": 4096}, r"nvme budget 4096 bytes < \d+ bytes needed"),
    ],
)
def test_budgets_too_small_fail_before_writing(
    tiny: SimpleNamespace, tmp_path: Path, budgets: dict[str, int], match: str
) -> None:
    nvme = tmp_path / "nvme"
    nvme.mkdir()
    config = {"device_budget": 8 << 20, "host_budget": 8 << 20, "nvme_budget": 8 << 20, **budgets}
    store = StoreConfig(nvme_path=str(nvme), **config)
    placement = Placement(weights=(N, H), master=(N, H), prefetch_depth=1)
    strategy = BalanceBeamStrategy(store=store, placement=placement, compute_dtype="fp32")
    assert _bad_fit(tiny, strategy, match + ".*raise those budgets in StoreConfig") == []
    assert os.listdir(nvme) == []
    # the same budgets raised fit and train
    good = StoreConfig(nvme_path=str(nvme), **{**config, **dict.fromkeys(budgets, 8 << 20)})
    strategy = BalanceBeamStrategy(store=good, placement=placement, compute_dtype="fp32")
    trainer, recorder = tiny.make_trainer(strategy, 1)
    trainer.fit(tiny.make_module(tiny.tiny_llama(2)), tiny.loader(1))
    assert len(recorder.losses) == 1
    strategy.close()


def test_state_dict_is_lazy_and_checkpoints_never_gather(
    tiny: SimpleNamespace, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    strategy = BalanceBeamStrategy(
        placement=Placement(weights=(N, H, D, H), master=(H, N, H, H)),
        compute_dtype="fp32",
        nvme_path=str(tmp_path / "nvme"),
    )
    trainer, _ = tiny.make_trainer(strategy, 1)
    trainer.fit(tiny.make_module(tiny.tiny_llama()), tiny.loader(1))
    engine = strategy.engine
    assert engine is not None
    want = engine.state_dict()
    reads: list[str] = []
    read_master = FlatState.read_master

    def counting(self: FlatState, out: torch.Tensor | None = None) -> torch.Tensor:
        reads.append(self.name)
        return read_master(self, out)

    def refuse(self: TrainingEngine) -> dict[str, torch.Tensor]:
        raise AssertionError("the whole model was gathered on the host")

    monkeypatch.setattr(FlatState, "read_master", counting)
    monkeypatch.setattr(TrainingEngine, "state_dict", refuse)
    lazy = strategy.lightning_module_state_dict()
    assert isinstance(lazy, EngineStateDict) and reads == []
    assert list(lazy) == list(want) and "model.model.norm.weight" in lazy and reads == []
    key = "model.model.layers.2.mlp.up_proj.weight"
    torch.testing.assert_close(lazy[key], want[key], rtol=0, atol=0)
    assert reads == ["block.2"]
    for k, v in lazy.items():  # one read each time the flat state changes
        torch.testing.assert_close(v, want[k], rtol=0, atol=0, msg=k)
    blocks = [f"block.{i}" for i in range(4)]
    assert reads[1:] == ["resident", *blocks, "resident"]
    trainer.save_checkpoint(tmp_path / "ck")  # streams masters; never gathers the model
    assert (tmp_path / "ck" / "state.zarr" / "master").is_dir()
    strategy.close()


def test_nvme_path_given_twice_must_agree(tmp_path: Path) -> None:
    store = StoreConfig(
        device_budget=1 << 20,
        host_budget=1 << 20,
        nvme_path=str(tmp_path / "a"),
        nvme_budget=1 << 20,
    )
    with pytest.raises(ValueError, match="disagree"):
        BalanceBeamStrategy(store=store, nvme_path=str(tmp_path / "b"))
    BalanceBeamStrategy(store=store, nvme_path=str(tmp_path / "a"))
