"""CausalLMModule against plain torch training and Hugging Face generate."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from torch.utils.data import DataLoader
from transformers import AutoConfig, AutoModelForCausalLM

from bb_lightning.data import PromptsDataModule, TextDataModule
from bb_lightning.data.tokenizer import ByteTokenizer
from bb_lightning.engine.optim import AdamWConfig
from bb_lightning.module import CausalLMModule, resolve_model_config
from bb_lightning.planner.models import builtin_config

from .tiny import tiny_llama_config

TINY = tiny_llama_config(
    2, vocab_size=320, max_position_embeddings=128, pad_token_id=ByteTokenizer.pad_token_id,
    bos_token_id=ByteTokenizer.bos_token_id, eos_token_id=ByteTokenizer.eos_token_id,
)  # fmt: skip
HPARAMS: dict[str, Any] = {"learning_rate": 3e-3, "weight_decay": 0.1, "betas": (0.9, 0.95)}


def _trainer(**kwargs: Any) -> pl.Trainer:
    return pl.Trainer(
        accelerator="cpu",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        **kwargs,
    )


def _batches(n: int, batch: int = 2, seq: int = 16) -> list[dict[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(7)
    # Random tokens from 16 of the 320 ids: learnable (the unigram law) yet different per batch.
    return [{"input_ids": torch.randint(0, 16, (batch, seq), generator=gen)} for _ in range(n)]


class _Losses(pl.Callback):
    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer: pl.Trainer, module: Any, outputs: Any, *_: Any) -> None:
        self.losses.append(float(outputs["loss"]))


@pytest.mark.parametrize("warmup_steps", [0, 3])
def test_fit_equals_plain_torch_loop(warmup_steps: int) -> None:
    steps = 5
    data = _batches(steps)
    module = CausalLMModule(TINY, seed=11, warmup_steps=warmup_steps, **HPARAMS)
    losses = _Losses()
    trainer = _trainer(max_steps=steps, callbacks=[losses])
    trainer.fit(module, train_dataloaders=DataLoader(data, batch_size=None))

    # Reference: the same model, seed, data and optimizer in a hand-written loop.
    torch.manual_seed(11)
    ref = AutoModelForCausalLM.from_config(AutoConfig.for_model(**TINY))
    opt = torch.optim.AdamW(ref.parameters(), lr=3e-3, weight_decay=0.1, betas=(0.9, 0.95))
    sched = None
    if warmup_steps:
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda i: min(1.0, (i + 1) / warmup_steps))
    want = []
    for batch in data:
        loss = ref(input_ids=batch["input_ids"], labels=batch["input_ids"]).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        if sched is not None:
            sched.step()
        want.append(loss.item())

    assert losses.losses == pytest.approx(want, rel=1e-5)
    assert want[-1] < want[0] - 0.05, want  # it learns
    assert module.model is not None
    for (name, got), (_, exp) in zip(
        module.model.state_dict().items(), ref.state_dict().items(), strict=True
    ):
        torch.testing.assert_close(got, exp, rtol=1e-5, atol=1e-6, msg=name)


def test_configure_model_is_idempotent_and_seeded() -> None:
    module = CausalLMModule(TINY, seed=3)
    module.configure_model()
    first = module.model
    module.configure_model()
    assert module.model is first
    state = torch.random.get_rng_state()
    other = CausalLMModule(TINY, seed=3)
    other.configure_model()
    assert torch.equal(torch.random.get_rng_state(), state)  # global random state untouched
    assert other.model is not None and first is not None
    for a, b in zip(first.parameters(), other.parameters(), strict=True):
        assert torch.equal(a, b)
    third = CausalLMModule(TINY, seed=4)
    third.configure_model()
    assert third.model is not None
    assert not torch.equal(next(third.model.parameters()), next(first.parameters()))


def test_seed_gives_the_same_weights_inside_an_init_context_of_another_device() -> None:
    # plain Lightning on a GPU calls configure_model inside torch.device("cuda"), whose
    # generator draws other numbers than the CPU's from one seed; the meta device stands
    # in for it here: the weights are still real, on the host, and equal to a plain build
    plain = CausalLMModule(TINY, seed=3)
    plain.configure_model()
    inside = CausalLMModule(TINY, seed=3)
    with torch.device("meta"):
        inside.configure_model()
    assert plain.model is not None and inside.model is not None
    for (name, a), b in zip(plain.model.named_parameters(), inside.model.parameters(), strict=True):
        assert b.device.type == "cpu", name
        assert torch.equal(a, b), name


def test_load_local_checkpoint_and_config_sources(tmp_path: Path) -> None:
    torch.manual_seed(5)
    hf = AutoModelForCausalLM.from_config(AutoConfig.for_model(**TINY))
    hf.save_pretrained(tmp_path / "ckpt")
    assert (tmp_path / "ckpt" / "model.safetensors").is_file()
    module = CausalLMModule(str(tmp_path / "ckpt"))
    assert module.checkpoint_dir == tmp_path / "ckpt"
    module.configure_model()
    assert module.model is not None
    got, want = module.model.state_dict(), hf.state_dict()
    assert got.keys() == want.keys()
    for name in want:
        assert torch.equal(got[name], want[name]), name

    # config.json alone, a dict and a PretrainedConfig describe the same network.
    (tmp_path / "cfg.json").write_text(json.dumps(TINY))
    for source in (str(tmp_path / "cfg.json"), TINY, hf.config):
        config, weights = resolve_model_config(source)
        assert weights is None
        assert (config.hidden_size, config.num_hidden_layers) == (64, 2)
    default, _ = resolve_model_config(None)
    table = builtin_config("tiny-llama")
    assert (default.model_type, default.hidden_size) == (table["model_type"], table["hidden_size"])
    named, _ = resolve_model_config("llama-370m")
    assert named.num_hidden_layers == builtin_config("llama-370m")["num_hidden_layers"]
    with pytest.raises(ValueError, match="no 'model_type'"):
        resolve_model_config({"hidden_size": 64})
    with pytest.raises(ValueError, match="does not exist"):
        resolve_model_config(str(tmp_path / "missing.json"))


class _Modes(pl.Callback):
    def __init__(self) -> None:
        self.eval_modules: list[int] = []
        self.rng: list[torch.Tensor] = []

    def on_train_batch_start(self, trainer: pl.Trainer, module: Any, *_: Any) -> None:
        self.eval_modules.append(sum(not m.training for m in module.modules()))
        self.rng.append(torch.get_rng_state())


def test_a_loaded_checkpoint_trains_with_its_dropout(tmp_path: Path) -> None:
    """``from_pretrained`` gives the network in eval mode and Lightning's fit keeps the modes
    it finds: the module trains a loaded checkpoint in train mode, as one built from a
    config, and its training losses are those of the network in train mode."""
    config = AutoConfig.for_model(**{**TINY, "attention_dropout": 0.5})
    torch.manual_seed(5)
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "ckpt")
    module = CausalLMModule(str(tmp_path / "ckpt"), **HPARAMS)
    modes, losses = _Modes(), _Losses()
    trainer = _trainer(max_steps=2, callbacks=[modes, losses])
    batches = _batches(2)
    trainer.fit(module, DataLoader(batches, batch_size=None))  # type: ignore[arg-type]
    assert modes.eval_modules == [0, 0]
    # the first step's loss: the checkpoint's network with dropout on, same random state
    reference = AutoModelForCausalLM.from_pretrained(tmp_path / "ckpt")
    ids = batches[0]["input_ids"]
    with torch.no_grad():
        torch.set_rng_state(modes.rng[0])
        dropped = reference.train()(input_ids=ids, labels=ids).loss
        kept = reference.eval()(input_ids=ids, labels=ids).loss
    assert losses.losses[0] == pytest.approx(float(dropped), rel=1e-6)
    assert not torch.isclose(dropped, kept)


def test_optimizer_hyperparameters() -> None:
    module = CausalLMModule(TINY, eps=1e-7, **HPARAMS)
    assert module.adamw_config() == AdamWConfig(
        lr=3e-3, betas=(0.9, 0.95), eps=1e-7, weight_decay=0.1
    )
    module.configure_model()
    opt = module.configure_optimizers()
    assert isinstance(opt, torch.optim.AdamW)
    group = opt.param_groups[0]
    assert (group["lr"], group["weight_decay"], group["eps"]) == (3e-3, 0.1, 1e-7)
    with pytest.raises(ValueError, match="top_p=0"):
        CausalLMModule(TINY, top_p=0.0)


def _prompts(tmp_path: Path) -> PromptsDataModule:
    rows = [
        {"id": "a", "prompt": "The quick brown"},
        {"id": "b", "prompt": "fox"},
        {"id": "c", "prompt": "x" * 40},
        {"id": "d", "prompt": "jumps over the"},
    ]
    path = tmp_path / "prompts.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows))
    return PromptsDataModule(str(path), batch_size=2, max_prompt_len=32)


def test_predict_greedy_equals_generate(tmp_path: Path) -> None:
    module = CausalLMModule(TINY, seed=2, max_new_tokens=6, tokenizer="byte")
    dm = _prompts(tmp_path)
    out = _trainer().predict(module, datamodule=dm)
    assert out is not None
    records = [r for batch in out for r in batch]  # type: ignore[union-attr]
    assert [r["id"] for r in records] == ["a", "b", "c", "d"]
    assert records[2] == {"id": "c", "error": "prompt has 40 tokens > max_prompt_len=32"}

    assert module.model is not None
    model = module.model.eval()
    tok = ByteTokenizer()
    for batch in dm.predict_dataloader():
        keep = [i for i, e in enumerate(batch["error"]) if e is None]
        ids, mask = batch["input_ids"][keep], batch["attention_mask"][keep]
        with torch.no_grad():
            ref = model.generate(
                input_ids=ids, attention_mask=mask, max_new_tokens=6, do_sample=False,
                pad_token_id=tok.pad_token_id,
            )  # fmt: skip
        for i, row in zip(keep, ref[:, ids.shape[1] :].tolist(), strict=True):
            got = next(r for r in records if r["id"] == batch["id"][i])
            cut = row.index(tok.eos_token_id) if tok.eos_token_id in row else len(row)
            assert got["token_ids"] == row[:cut]
            assert got["text"] == tok.decode(row[:cut])
            assert len(row) == 6


def test_predict_sampling_is_seeded(tmp_path: Path) -> None:
    def run(seed: int) -> list[Any]:
        module = CausalLMModule(TINY, seed=2, max_new_tokens=8, temperature=1.5, top_k=50)
        module.configure_model()
        module.hparams["seed"] = seed  # same weights, different sampling seed
        out = _trainer().predict(module, datamodule=_prompts(tmp_path))
        assert out is not None
        return [r.get("token_ids") for batch in out for r in batch]  # type: ignore[union-attr]

    assert run(0) == run(0)
    assert run(0) != run(1)


def test_validate_on_text_data_equals_mean_loss() -> None:
    """TextDataModule batches drive the module; val_loss is the row-weighted mean loss."""
    pattern = os.path.join(os.path.dirname(os.__file__), "*.py")
    dm = TextDataModule(pattern, seq_len=32, batch_size=2, max_files=2, max_tokens=2048)
    module = CausalLMModule(TINY, seed=1)
    result = _trainer().validate(module, datamodule=dm)
    assert module.model is not None
    total, rows = 0.0, 0
    with torch.no_grad():
        for b in dm.val_dataloader():
            ids = b["input_ids"]
            total += float(module.model(input_ids=ids, labels=ids).loss) * len(ids)
            rows += len(ids)
    assert rows == 3  # 64 rows, 5% held out: batches of 2 and 1
    assert result[0]["val_loss"] == pytest.approx(total / rows, rel=1e-5)
