"""A store written by ``bb-lightning convert`` is a model source: predict and fit read it,
never write it, and a store the run cannot use is refused in one line."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import lightning.pytorch as pl
import pytest
import safetensors
import torch
from transformers import AutoModelForCausalLM, PreTrainedModel

import bb_lightning.module as module_mod
from bb_lightning import BalanceBeamStrategy
from bb_lightning.cli import main
from bb_lightning.data import PromptsDataModule
from bb_lightning.data.tokenizer import ByteTokenizer
from bb_lightning.data.writer import JsonlPredictionWriter
from bb_lightning.hf.hf_load import HFCheckpoint
from bb_lightning.module import CausalLMModule
from bb_lightning.placement import Placement
from storage.tiers import Tier

from ..tiny import tiny_llama_config, tiny_model

pytestmark = pytest.mark.usefixtures("one_thread")

PROMPTS = ["The quick brown", "fox", "jumps over the", "a"]
NEW = 6


def _model(dtype: torch.dtype = torch.float32) -> PreTrainedModel:
    """A 3-block Llama with strong weights (initializer_range 0.2: greedy has no ties)."""
    cfg = tiny_llama_config(
        3, vocab_size=260, initializer_range=0.2, bos_token_id=257, eos_token_id=258,
        pad_token_id=256,
    )  # fmt: skip
    return tiny_model(cfg, seed=5).to(dtype)  # type: ignore[return-value]


def _converted(tmp_path: Path, dtype: str = "fp32") -> tuple[PreTrainedModel, Path, Path]:
    """The model, its save_pretrained directory and the store ``bb-lightning convert`` made."""
    model = _model()
    model.save_pretrained(tmp_path / "hf")
    store = tmp_path / "store"
    assert main(["convert", str(tmp_path / "hf"), str(store), "--dtype", dtype,
                 "--no-progress"]) == 0  # fmt: skip
    return model, tmp_path / "hf", store


def _digests(root: Path) -> dict[str, str]:
    """sha256 of every file under ``root`` by relative path (the set of files with them)."""
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


def _prompts(tmp_path: Path) -> Path:
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps({"id": f"p{i}", "prompt": t}) + "\n"
                            for i, t in enumerate(PROMPTS)))  # fmt: skip
    return path


def _predict(module: CausalLMModule, strategy: Any, tmp_path: Path) -> list[dict[str, Any]]:
    out = tmp_path / "out.jsonl"
    trainer = pl.Trainer(
        accelerator="cpu", devices=1, strategy=strategy, logger=False,
        enable_progress_bar=False, enable_model_summary=False,
        callbacks=[JsonlPredictionWriter(out)],
    )  # fmt: skip
    dm = PromptsDataModule(str(_prompts(tmp_path)), batch_size=2)
    trainer.predict(module, datamodule=dm, return_predictions=False)
    return [json.loads(line) for line in out.read_text().splitlines()]


def _generate(model: Any) -> list[list[int]]:
    """Hugging Face greedy tokens of each prompt alone, cut before eos."""
    tok, out = ByteTokenizer(), []
    for text in PROMPTS:
        ids = torch.tensor([tok.encode(text)])
        with torch.no_grad():
            new = model.generate(
                input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW,
                do_sample=False, pad_token_id=256, eos_token_id=258,
            )[0, ids.shape[1] :].tolist()  # fmt: skip
        out.append(new[: new.index(258)] if 258 in new else new)
    return out


def test_predict_from_a_converted_store_equals_generate_and_leaves_it_unchanged(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model, _, store = _converted(tmp_path)
    before = _digests(store)

    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("the weights were read from safetensors, not from the store")

    monkeypatch.setattr(HFCheckpoint, "get", refuse)
    monkeypatch.setattr(module_mod.AutoModelForCausalLM, "from_pretrained", refuse)
    monkeypatch.setattr(safetensors, "safe_open", refuse)
    module = CausalLMModule(str(store), max_new_tokens=NEW)
    strategy = BalanceBeamStrategy(
        placement=Placement.uniform(3, weights=Tier.HOST), compute_dtype="fp32", gather_limit=0
    )
    records = _predict(module, strategy, tmp_path)
    strategy.close()
    assert [r["id"] for r in records] == [f"p{i}" for i in range(len(PROMPTS))]
    assert [r["token_ids"] for r in records] == _generate(model)
    assert _digests(store) == before  # no byte changed, no file added or removed


def test_predict_pages_nvme_blocks_straight_from_the_converted_store(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Blocks homed on NVMe are read from the store's chunk files in place: the run's
    scratch directory holds no byte of their weights, and the store is never written."""
    model, _, store = _converted(tmp_path)
    before = _digests(store)

    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("the weights were read from safetensors, not from the store")

    monkeypatch.setattr(HFCheckpoint, "get", refuse)
    monkeypatch.setattr(safetensors, "safe_open", refuse)
    scratch = tmp_path / "scratch"
    placement = Placement(weights=(Tier.NVME, Tier.HOST, Tier.NVME), master=(Tier.HOST,) * 3)
    strategy = BalanceBeamStrategy(placement=placement, compute_dtype="fp32", gather_limit=0,
                                   nvme_path=str(scratch))  # fmt: skip
    records = _predict(CausalLMModule(str(store), max_new_tokens=NEW), strategy, tmp_path)
    strategy.close()
    assert [r["token_ids"] for r in records] == _generate(model)
    assert _digests(store) == before  # no byte changed, no file added or removed
    weights = (
        sum(p.stat().st_size for p in scratch.rglob("*") if p.is_file()) if scratch.exists() else 0
    )
    assert weights < 4096  # a block's fp32 weights are 213 KiB: none was copied there


def test_fit_from_a_converted_store_equals_fit_from_the_checkpoint(
    tiny: SimpleNamespace, tmp_path: Path
) -> None:
    _, hf, store = _converted(tmp_path)
    before = _digests(store)
    runs = []
    for source in (store, hf):
        module = CausalLMModule(str(source), learning_rate=1e-3)
        strategy = BalanceBeamStrategy(
            placement=Placement.uniform(3, weights=Tier.HOST, master=Tier.HOST),
            compute_dtype="fp32",
        )
        trainer, recorder = tiny.make_trainer(strategy, 3)
        trainer.fit(module, tiny.loader(3))
        runs.append((recorder.losses, {k: v.clone() for k, v in module.state_dict().items()}))
        strategy.close()
    (losses, weights), (want_losses, want_weights) = runs
    assert len(losses) == 3 and losses == want_losses
    assert weights.keys() == want_weights.keys()
    for key, value in want_weights.items():
        torch.testing.assert_close(weights[key], value, rtol=0, atol=0, msg=key)
    start = _model().state_dict()
    moved = sum(float((weights[f"model.{k}"] - v).abs().sum()) for k, v in start.items())
    assert moved > 1.0  # the fit trained the weights it started from the store
    assert _digests(store) == before


def test_plain_lightning_loads_a_converted_store_as_from_pretrained(tmp_path: Path) -> None:
    _, hf, store = _converted(tmp_path, dtype="keep")
    module = CausalLMModule(str(store))
    module.configure_model()
    loaded = AutoModelForCausalLM.from_pretrained(hf)
    assert module.model is not None
    got = module.model.state_dict()
    for key, value in loaded.state_dict().items():
        assert got[key].dtype == value.dtype, key
        torch.testing.assert_close(got[key], value, rtol=0, atol=0, msg=key)


def _one_line(err: pytest.ExceptionInfo[ValueError]) -> str:
    message = str(err.value)
    assert "\n" not in message
    return message


def test_a_store_of_another_dtype_is_refused_for_predict(tmp_path: Path) -> None:
    _, _, store = _converted(tmp_path, dtype="bf16")
    before = _digests(store)
    module = CausalLMModule(str(store), max_new_tokens=NEW)
    strategy = BalanceBeamStrategy(
        placement=Placement.uniform(3, weights=Tier.HOST), compute_dtype="fp32"
    )
    with pytest.raises(ValueError) as err:
        _predict(module, strategy, tmp_path)
    message = _one_line(err)
    assert str(store) in message and "bfloat16" in message and "float32" in message, message
    assert "--dtype fp32" in message, message
    strategy.close()
    assert _digests(store) == before


def test_a_store_of_another_model_is_refused(tmp_path: Path) -> None:
    _, _, store = _converted(tmp_path)
    group = store / "zarr.json"
    doc = json.loads(group.read_text())
    doc["attributes"]["hf_config"]["intermediate_size"] = 96  # tensors of another model
    group.write_text(json.dumps(doc))
    before = _digests(store)
    module = CausalLMModule(str(store))
    strategy = BalanceBeamStrategy(
        placement=Placement.uniform(3, weights=Tier.HOST), compute_dtype="fp32"
    )
    with pytest.raises(ValueError) as err:
        _predict(module, strategy, tmp_path)
    message = _one_line(err)
    assert str(store) in message and "(128, 64) (model (96, 64))" in message, message
    strategy.close()
    assert _digests(store) == before


@pytest.mark.parametrize("version", [2, None])
def test_a_store_of_another_format_version_is_refused(tmp_path: Path, version: int | None) -> None:
    _, _, store = _converted(tmp_path)
    group = store / "zarr.json"
    doc = json.loads(group.read_text())
    if version is None:  # written before stores were model sources
        del doc["attributes"]["balance_beam_converted"]
    else:
        doc["attributes"]["balance_beam_converted"]["format_version"] = version
    group.write_text(json.dumps(doc))
    with pytest.raises(ValueError) as err:
        CausalLMModule(str(store))
    message = _one_line(err)
    assert f"format version {version!r}" in message and str(store) in message, message
    assert "bb-lightning convert" in message, message


def test_a_store_with_an_unreadable_group_is_refused_not_built_at_random(tmp_path: Path) -> None:
    _, _, store = _converted(tmp_path)
    (store / "zarr.json").write_text('{"zarr_format": 3, "node_ty')  # torn; config.json beside
    with pytest.raises(ValueError) as err:
        CausalLMModule(str(store))
    message = _one_line(err)
    assert str(store) in message and "not readable JSON" in message, message
