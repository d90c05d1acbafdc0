"""``trainer.predict`` under balance_beam: layer-major generation streamed to JSONL."""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from torch.utils.data import DataLoader
from transformers import AutoModelForCausalLM

from bb_lightning.data import PromptsDataModule, prompt_digest
from bb_lightning.data.tokenizer import ByteTokenizer
from bb_lightning.data.writer import JsonlPredictionWriter
from bb_lightning.module import CausalLMModule
from bb_lightning.placement import Placement
from bb_lightning.planner import HardwareProfile, PredictJob
from bb_lightning.strategy.core import BalanceBeamStrategy
from bb_lightning.strategy.handback import WeightsInStoreError
from storage.tiers import Tier

from .tiny import cpu_profile, tiny_llama_config

CONFIG = tiny_llama_config(
    3, vocab_size=260, max_position_embeddings=48, bos_token_id=257, eos_token_id=258,
    pad_token_id=256,
)  # fmt: skip
PROMPTS = ["The quick brown", "fox", "y" * 50, "jumps over the", "lazy dog", "a"]


pytestmark = pytest.mark.usefixtures("one_thread")


def _generate(module: CausalLMModule, texts: list[str], new: int) -> dict[int, list[int]]:
    """Hugging Face greedy tokens of each prompt alone (cut before eos), by index."""
    assert module.model is not None
    tok, out = ByteTokenizer(), {}
    for i, text in enumerate(texts):
        ids = torch.tensor([tok.encode(text)])
        if ids.shape[1] >= CONFIG["max_position_embeddings"]:
            continue
        with torch.no_grad():
            want = module.model.generate(
                input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=new,
                do_sample=False, pad_token_id=256, eos_token_id=258,
            )[0, ids.shape[1] :].tolist()  # fmt: skip
        out[i] = want[: want.index(258)] if 258 in want else want
    return out


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
    module = CausalLMModule(CONFIG, seed=4, max_new_tokens=6, tokenizer="byte")
    strategy = BalanceBeamStrategy(
        placement=Placement.uniform(3, weights=Tier.NVME, master=Tier.HOST),
        compute_dtype="fp32",
        nvme_path=str(tmp_path / "nvme"),
    )
    dm = PromptsDataModule(str(_prompts(tmp_path, PROMPTS)), batch_size=3, max_prompt_len=64)
    out = tmp_path / "out.jsonl"
    trainer = _trainer(strategy, out)
    trainer.predict(module, datamodule=dm, return_predictions=False)
    # predict-only: the store holds each block's compute-dtype weights and nothing else
    assert strategy.engine is None and strategy.store is not None
    assert sorted(strategy.store.names()) == [f"block.{i}.weight" for i in range(3)]
    assert strategy.inference is not None
    block = sum(math.prod(shape) for shape in strategy.inference.pager.shapes[0])
    used = strategy.store.usage()
    assert used[Tier.NVME][0] == pytest.approx(3 * 4 * block, abs=3 * 4096)  # fp32 weights
    assert used[Tier.HOST][0] < 3 * 12 * block  # staging only: no masters and moments
    strategy.close()
    # the run's own store: weights written at setup, read back only by this run, with no
    # CRC-32C trailer (no checksum pass on every weight pass)
    for meta in (tmp_path / "nvme").rglob("block.*.weight/zarr.json"):
        assert [c["name"] for c in json.loads(meta.read_text())["codecs"]] == ["bytes"], meta
    assert len(list((tmp_path / "nvme").rglob("block.*.weight/zarr.json"))) == 3
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["id"] for r in records] == [f"p{i}" for i in range(len(PROMPTS))]
    assert records[2] == {
        "id": "p2",
        "error": "prompt has 50 tokens >= the model's context of 48: shorten it below 48 tokens",
        "prompt_digest": prompt_digest(PROMPTS[2]),
    }
    reference = CausalLMModule(CONFIG, seed=4)
    reference.configure_model()
    tok = ByteTokenizer()
    for i, want in _generate(reference, PROMPTS, 6).items():
        assert records[i]["token_ids"] == want, records[i]["id"]
        assert records[i]["text"] == tok.decode(want)


def test_predict_is_planned_and_takes_the_planned_batch(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    texts = [t for t in PROMPTS if len(t) < 40]
    module = CausalLMModule(CONFIG, seed=4, max_new_tokens=5)
    strategy = BalanceBeamStrategy(hardware=cpu_profile(), compute_dtype="fp32")
    dm = PromptsDataModule(str(_prompts(tmp_path, texts)), batch_size=None)
    with caplog.at_level(logging.INFO):
        _trainer(strategy, tmp_path / "out.jsonl").predict(module, datamodule=dm)
    plan = strategy.plan
    assert plan is not None and plan.task == "predict"
    longest = max(len(ByteTokenizer().encode(t)) for t in texts)
    assert (plan.job.prompt_len, plan.job.new_tokens) == (longest, 5)  # type: ignore[union-attr]
    assert plan.job.num_prompts == len(texts)  # type: ignore[union-attr]
    assert dm.planned_batch_size == plan.concurrent_seqs
    assert module.kv_cache_tier is plan.kv_cache
    assert strategy.inference is not None
    assert strategy.inference.pager.placement.weights == plan.weights
    # prefill runs through each block in the plan's micro-batches of prompts
    assert strategy.inference.paged.max_tokens == plan.micro_batch * longest
    assert "plan: predict" in caplog.text
    assert f"recommends {plan.concurrent_seqs} concurrent sequences" in caplog.text
    records = [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    strategy.close()
    reference = CausalLMModule(CONFIG, seed=4)
    reference.configure_model()
    assert [r["token_ids"] for r in records] == list(_generate(reference, texts, 5).values())


def test_predict_on_a_measured_machine_plans_with_the_probed_rates(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    import bb_lightning.strategy.session as session_module
    from bb_lightning.planner import PlanOverrides, make_plan
    from bb_lightning.probe.calibrate import PredictCompute

    probed: list[dict[str, Any]] = []

    def fake_probe(config: Any, hw: HardwareProfile, **kw: Any) -> PredictCompute:
        probed.append(kw)
        return PredictCompute(
            prefill_block_s=1.0, prefill_rest_s=0.0, prefill_rows=1, prefill_s=1.0,
            decode_block_s=1.0, decode_rest_s=0.0, decode_rows=1, decode_s=1.0,
            efficiency=0.5, decode_efficiency=0.25,
        )  # fmt: skip

    monkeypatch.setattr(session_module, "measure", lambda **_: cpu_profile())
    monkeypatch.setattr(session_module, "probe_predict_compute", fake_probe)
    module = CausalLMModule(CONFIG, seed=4, max_new_tokens=5)
    strategy = BalanceBeamStrategy(compute_dtype="fp32")
    dm = PromptsDataModule(str(_prompts(tmp_path, PROMPTS[:2])), batch_size=2)
    with caplog.at_level(logging.INFO):
        _trainer(strategy, tmp_path / "out.jsonl").predict(module, datamodule=dm)
    plan = strategy.plan
    assert plan is not None and isinstance(plan.job, PredictJob)
    job = plan.job
    # probed at the batch in use, over the generator's cache (15 + 5 tokens rounded up to 32)
    assert probed == [
        {"prompt_len": job.prompt_len, "concurrent": 2, "cache_len": 32,
         "context": job.prompt_len + 2.5, "dtype": torch.float32,
         "device": torch.device("cpu")}
    ]  # fmt: skip
    hw = plan.hardware
    assert (hw.compute_efficiency, hw.decode_efficiency) == (0.5, 0.25)
    ov = PlanOverrides(concurrent_seqs=2)
    again = make_plan(plan.model, hw, job, overrides=ov)
    assert plan.tokens_per_s == pytest.approx(again.tokens_per_s)
    assert again.tokens_per_s < make_plan(plan.model, cpu_profile(), job, overrides=ov).tokens_per_s
    assert "model-shaped predict probe" in caplog.text
    strategy.close()


def test_a_failing_probe_leaves_the_matrix_product_rate(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import bb_lightning.strategy.session as session_module

    def broken(*args: Any, **kw: Any) -> None:
        raise RuntimeError("probe out of order")

    monkeypatch.setattr(session_module, "measure", lambda **_: cpu_profile())
    monkeypatch.setattr(session_module, "probe_predict_compute", broken)
    module = CausalLMModule(CONFIG, seed=4, max_new_tokens=3)
    strategy = BalanceBeamStrategy(compute_dtype="fp32")
    dm = PromptsDataModule(str(_prompts(tmp_path, PROMPTS[:2])), batch_size=2)
    with pytest.warns(UserWarning, match="probe failed .RuntimeError: probe out of order"):
        _trainer(strategy, tmp_path / "out.jsonl").predict(module, datamodule=dm)
    assert strategy.plan is not None and strategy.plan.hardware == cpu_profile()
    assert len((tmp_path / "out.jsonl").read_text().splitlines()) == 2
    strategy.close()


def test_predict_after_fit_reuses_the_trained_weights(tmp_path: Path) -> None:
    module = CausalLMModule(CONFIG, seed=4, max_new_tokens=4, learning_rate=1e-2)
    strategy = BalanceBeamStrategy(
        placement=Placement.uniform(3, weights=Tier.HOST, master=Tier.HOST), compute_dtype="fp32"
    )
    trainer = pl.Trainer(
        accelerator="cpu", devices=1, strategy=strategy, max_steps=1, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        callbacks=[JsonlPredictionWriter(tmp_path / "out.jsonl")],
    )  # fmt: skip
    data = [{"input_ids": torch.randint(0, 256, (2, 16), generator=torch.Generator())}]
    trainer.fit(module, DataLoader(data, batch_size=None))  # type: ignore[arg-type]
    engine = strategy.engine
    assert engine is not None
    trained = engine.state_dict()
    dm = PromptsDataModule(str(_prompts(tmp_path, PROMPTS[:2])), batch_size=2)
    trainer.predict(module, datamodule=dm, return_predictions=False)
    assert strategy.engine is engine and strategy.inference is None
    records = [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    strategy.close()
    reference = CausalLMModule(CONFIG, seed=4)
    reference.configure_model()
    assert reference.model is not None
    reference.load_state_dict(trained)
    assert [r["token_ids"] for r in records] == list(_generate(reference, PROMPTS[:2], 4).values())


def test_validate_without_fit_then_fit(tmp_path: Path) -> None:
    module = CausalLMModule(CONFIG, seed=4)
    reference = CausalLMModule(CONFIG, seed=4)
    reference.configure_model()
    batch = {"input_ids": torch.randint(0, 256, (2, 16), generator=torch.Generator())}
    with torch.no_grad():
        want = float(reference(batch))
    # planned on the tests' CPU profile: the engines, not the probes (the recipe's end-to-end
    # test plans on this machine measured)
    strategy = BalanceBeamStrategy(hardware=cpu_profile(), compute_dtype="fp32")
    trainer = pl.Trainer(
        accelerator="cpu", devices=1, strategy=strategy, max_steps=1, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    loader = DataLoader([batch], batch_size=None)  # type: ignore[arg-type]
    (metrics,) = trainer.validate(module, loader)
    assert strategy.inference is not None and strategy.engine is None
    assert metrics["val_loss"] == pytest.approx(want, rel=1e-5)
    assert not any(".master" in n or ".exp_avg" in n for n in strategy.store.names())  # type: ignore[union-attr]
    trainer.fit(module, loader)  # the fit engine starts from the same weights
    assert strategy.inference is None and strategy.engine is not None
    state = strategy.engine.state_dict()
    strategy.close()
    assert all(torch.isfinite(v).all() for v in state.values())
    moved = max(float((state[k] - v).abs().max()) for k, v in reference.state_dict().items())
    assert 0 < moved < 0.1  # one AdamW step of lr 1e-4 away from the initial weights


def test_empty_prompt_file_is_a_clear_error(tmp_path: Path) -> None:
    module = CausalLMModule(CONFIG, seed=4, max_new_tokens=2)
    dm = PromptsDataModule(str(_prompts(tmp_path, [])))
    with pytest.raises(ValueError, match="holds no prompt"):
        _trainer("balance_beam", tmp_path / "out.jsonl").predict(module, datamodule=dm)


def test_predict_streams_a_safetensors_checkpoint(tmp_path: Path) -> None:
    reference = CausalLMModule(CONFIG, seed=7)
    reference.configure_model()
    assert reference.model is not None
    reference.model.save_pretrained(tmp_path / "ckpt", safe_serialization=True)
    module = CausalLMModule(str(tmp_path / "ckpt"), max_new_tokens=4)
    strategy = BalanceBeamStrategy(  # gather_limit 0: too large for the host, stays streamed
        placement=Placement.uniform(3, weights=Tier.HOST), compute_dtype="fp32", gather_limit=0
    )
    dm = PromptsDataModule(str(_prompts(tmp_path, PROMPTS[:2])), batch_size=2)
    _trainer(strategy, tmp_path / "out.jsonl").predict(module, datamodule=dm)
    assert module.model is not None and all(  # streamed: never materialised in the module
        p.numel() == 0 for p in module.model.model.layers.parameters()
    )
    with pytest.raises(WeightsInStoreError, match="bb-lightning export"):
        module.state_dict()
    module.model.save_pretrained(tmp_path / "out")  # streamed from the weights-only store
    saved = AutoModelForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.float32)
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        torch.testing.assert_close(saved(ids).logits, reference.model(ids).logits)
    strategy.close()  # back on the meta device: a later engine reads the checkpoint again
    assert all(p.is_meta for p in module.model.parameters())
    records = [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert [r["token_ids"] for r in records] == list(_generate(reference, PROMPTS[:2], 4).values())


def test_predict_job_from_a_plain_dataloader(tmp_path: Path) -> None:
    rows = [
        {"id": str(i), "input_ids": torch.full((7,), 65 + i), "attention_mask": torch.ones(7)}
        for i in range(5)
    ]
    loader = DataLoader(rows, batch_size=2)  # type: ignore[arg-type]
    module = CausalLMModule(CONFIG, seed=4, max_new_tokens=3)
    strategy = BalanceBeamStrategy(hardware=cpu_profile(), compute_dtype="fp32")
    out = _trainer(strategy, tmp_path / "out.jsonl").predict(module, dataloaders=loader)
    strategy.close()
    assert strategy.plan is not None
    assert strategy.plan.job == PredictJob(
        prompt_len=7, new_tokens=3, num_prompts=5, compute_dtype="float32"
    )
    assert out is not None and sum(len(b) for b in out) == 5  # type: ignore[arg-type]
