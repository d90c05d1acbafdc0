"""``trainer.predict`` under balance_beam: layer-major generation streamed to JSONL."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch

from bb_lightning.data import PromptsDataModule
from bb_lightning.engine.pager import Placement
from bb_lightning.module import CausalLMModule
from bb_lightning.strategy import BalanceBeamStrategy
from bb_lightning.tokenizer import ByteTokenizer
from bb_lightning.writer import JsonlPredictionWriter
from storage.tiers import Tier

CONFIG: dict[str, Any] = {
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 260,
    "max_position_embeddings": 48,
    "bos_token_id": 257,
    "eos_token_id": 258,
    "pad_token_id": 256,
}
PROMPTS = ["The quick brown", "fox", "y" * 50, "jumps over the", "lazy dog", "a"]


def _trainer(strategy: Any, out: Path) -> pl.Trainer:
    return pl.Trainer(
        accelerator="cpu",
        devices=1,
        strategy=strategy,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[JsonlPredictionWriter(out)],
    )


def _prompts(tmp_path: Path, texts: list[str]) -> Path:
    path = tmp_path / "prompts.jsonl"
    path.write_text(
        "".join(json.dumps({"id": f"p{i}", "prompt": t}) + "\n" for i, t in enumerate(texts))
    )
    return path


def test_predict_pages_from_nvme_and_equals_generate(tmp_path: Path) -> None:
    module = CausalLMModule(CONFIG, seed=4, max_new_tokens=8, tokenizer="byte")
    strategy = BalanceBeamStrategy(
        placement=Placement.uniform(3, weights=Tier.NVME, master=Tier.HOST),
        compute_dtype="fp32",
        nvme_path=str(tmp_path / "nvme"),
    )
    dm = PromptsDataModule(str(_prompts(tmp_path, PROMPTS)), batch_size=3, max_prompt_len=64)
    out = tmp_path / "out.jsonl"
    trainer = _trainer(strategy, out)
    trainer.predict(module, datamodule=dm, return_predictions=False)
    strategy.close()
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["id"] for r in records] == [f"p{i}" for i in range(len(PROMPTS))]
    assert records[2] == {
        "id": "p2",
        "error": "prompt has 50 tokens >= the model's context of 48: shorten it below 48 tokens",
    }

    reference = CausalLMModule(CONFIG, seed=4)
    reference.configure_model()
    assert reference.model is not None
    tok = ByteTokenizer()
    for i, text in enumerate(PROMPTS):
        if i == 2:
            continue
        ids = torch.tensor([tok.encode(text)])
        with torch.no_grad():
            want = reference.model.generate(
                input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=8,
                do_sample=False, pad_token_id=256, eos_token_id=258,
            )[0, ids.shape[1] :].tolist()  # fmt: skip
        want = want[: want.index(258)] if 258 in want else want
        assert records[i]["token_ids"] == want, records[i]["id"]
        assert records[i]["text"] == tok.decode(want)


def test_empty_prompt_file_is_a_clear_error(tmp_path: Path) -> None:
    module = CausalLMModule(CONFIG, seed=4, max_new_tokens=2)
    dm = PromptsDataModule(str(_prompts(tmp_path, [])))
    with pytest.raises(ValueError, match="holds no prompt"):
        _trainer("balance_beam", tmp_path / "out.jsonl").predict(module, datamodule=dm)
