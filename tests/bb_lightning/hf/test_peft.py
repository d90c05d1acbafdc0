"""LoRA (peft) under balance_beam: same losses and adapters as plain Lightning, frozen
weights paged read-only without optimizer state, the adapter saved and reloaded."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from peft import LoraConfig, PeftModel, get_peft_model, get_peft_model_state_dict
from transformers import AutoModelForCausalLM, LlamaConfig

from bb_lightning import BalanceBeamStrategy
from bb_lightning.engine.checkpoint import read_trainer_state
from bb_lightning.hf.export import export_hf
from bb_lightning.hf.lora import LoraOptions, lora_profile
from bb_lightning.module import CausalLMModule
from bb_lightning.placement import Placement
from bb_lightning.probe import model_profile_from_module
from storage.tiers import Tier

from ..tiny import save_tiny, tiny_llama_config

D, H, N = Tier.DEVICE, Tier.HOST, Tier.NVME
LAYERS, VOCAB, SEQ, BATCH, STEPS = 3, 128, 16, 2, 3
TARGETS = ["q_proj", "v_proj", "o_proj", "gate_proj", "down_proj"]


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Llama written with ``save_pretrained``, as a user's checkpoint."""
    return save_tiny(
        tmp_path_factory.mktemp("tiny-llama"), tiny_llama_config(LAYERS, vocab_size=VOCAB)
    )


class LoraLM(pl.LightningModule):
    """A user's module: the checkpoint wrapped with peft, AdamW over the adapters."""

    def __init__(self, path: Path, config: LoraConfig | None = None) -> None:
        super().__init__()
        base = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        torch.manual_seed(1)
        config = config or LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=TARGETS)
        self.model = get_peft_model(base, config)
        # B starts at zero (no first-step gradient for A): start it random so both move.
        for name, p in self.model.named_parameters():
            if "lora_B" in name:
                torch.nn.init.normal_(p, std=0.02)

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        ids = batch["input_ids"]
        loss: torch.Tensor = self.model(input_ids=ids, labels=ids).loss
        self.log("loss", loss, batch_size=ids.shape[0])
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        trainable = [p for p in self.model.parameters() if p.requires_grad]
        return torch.optim.AdamW(trainable, lr=1e-2, weight_decay=0.01)


def _data(n: int) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    return [{"input_ids": torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)} for _ in range(n)]


class _Losses(pl.Callback):
    def __init__(self) -> None:
        self.losses: list[float] = []
        self.stats: dict[str, Any] = {}

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        store = getattr(trainer.strategy, "store", None)
        if store is not None:  # link traffic from here on is the training's
            self.stats = {k: v.bytes for k, v in store.stats().items()}

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        self.losses.append(float(args[1]["loss"]))


def _fit(
    module: pl.LightningModule,
    strategy: Any,
    accum: int = 1,
    ckpt_path: Path | None = None,
    **kw: Any,
) -> _Losses:
    rec = _Losses()
    trainer = pl.Trainer(
        accelerator="cpu", devices=1, strategy=strategy, precision="32-true",
        max_steps=STEPS, accumulate_grad_batches=accum, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        callbacks=[rec], **kw,
    )  # fmt: skip
    loader = torch.utils.data.DataLoader(_data(STEPS * accum), batch_size=None)  # type: ignore[arg-type]
    trainer.fit(module, loader, ckpt_path=ckpt_path)
    return rec


_REFERENCE: dict[tuple[int, float | None], tuple[list[float], dict[str, torch.Tensor]]] = {}


def _reference(base_dir: Path, accum: int, clip: float | None) -> Any:
    """Plain Lightning training of the same peft model: losses and adapter weights."""
    key = (accum, clip)
    if key not in _REFERENCE:
        module = LoraLM(base_dir)
        rec = _fit(module, "auto", accum, gradient_clip_val=clip)
        adapters = {k: v.clone() for k, v in get_peft_model_state_dict(module.model).items()}
        _REFERENCE[key] = (rec.losses, adapters)
    return _REFERENCE[key]


def _strategy(placement: Placement, tmp_path: Path, gather: bool = True) -> BalanceBeamStrategy:
    return BalanceBeamStrategy(
        placement=placement, compute_dtype="fp32", nvme_path=str(tmp_path / "nvme"),
        gather_on_teardown=gather, adapt_tolerance=None,
    )  # fmt: skip


CASES = {
    # weights used in place on the CPU (ordinary autograd), state on the host
    "host": (Placement.uniform(LAYERS, weights=H, master=H), 1, None),
    # paged from NVMe and recomputed, state read ahead from NVMe, accumulation
    "nvme": (Placement.uniform(LAYERS, weights=N, master=N, prefetch_depth=2), 2, None),
    # every tier, clipping (the step after backward)
    "mixed": (Placement(weights=(D, N, H), master=(D, H, N), prefetch_depth=1), 1, 0.5),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_lora_trains_like_plain_lightning(base_dir: Path, tmp_path: Path, case: str) -> None:
    placement, accum, clip = CASES[case]
    want_losses, want_adapters = _reference(base_dir, accum, clip)
    module = LoraLM(base_dir)
    frozen0 = {k: v.clone() for k, v in module.model.named_parameters() if not v.requires_grad}
    rec = _fit(module, _strategy(placement, tmp_path), accum, gradient_clip_val=clip)

    torch.testing.assert_close(torch.tensor(rec.losses), torch.tensor(want_losses), rtol=1e-5,
                               atol=1e-6)  # fmt: skip
    got = get_peft_model_state_dict(module.model)
    assert got.keys() == want_adapters.keys() and len(got) == 2 * LAYERS * len(TARGETS)
    for key, value in want_adapters.items():
        torch.testing.assert_close(got[key], value, rtol=1e-5, atol=2e-5, msg=key)
        assert not torch.equal(value, LoraLM(base_dir).model.state_dict()[_full_key(key)])
    for key, p in module.model.named_parameters():  # the base stayed as it was
        if key in frozen0:
            assert torch.equal(p.detach(), frozen0[key]), key


@pytest.mark.slow
def test_blocks_without_adapters_and_a_trained_head(base_dir: Path, tmp_path: Path) -> None:
    """Adapters in one block only (the others train nothing) and the head trained whole
    (``modules_to_save``): still the losses and weights of plain Lightning."""

    def config() -> LoraConfig:
        return LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "down_proj"],
                          layers_to_transform=[1], modules_to_save=["lm_head"])  # fmt: skip

    ref, module = LoraLM(base_dir, config()), LoraLM(base_dir, config())
    want = _fit(ref, "auto")
    placement = Placement(weights=(N, H, N), master=(N, H, H))
    got = _fit(module, _strategy(placement, tmp_path))
    torch.testing.assert_close(torch.tensor(got.losses), torch.tensor(want.losses), rtol=1e-5,
                               atol=1e-6)  # fmt: skip
    want_sd, got_sd = get_peft_model_state_dict(ref.model), get_peft_model_state_dict(module.model)
    assert got_sd.keys() == want_sd.keys() and any("lm_head" in k for k in want_sd)
    for key, value in want_sd.items():
        torch.testing.assert_close(got_sd[key], value, rtol=1e-5, atol=2e-5, msg=key)


def _full_key(adapter_key: str) -> str:
    """The model's own key of a ``get_peft_model_state_dict`` key (adapter name ``default``)."""
    return adapter_key.replace(".lora_A.weight", ".lora_A.default.weight").replace(
        ".lora_B.weight", ".lora_B.default.weight"
    )


def test_frozen_weights_have_no_optimizer_state(base_dir: Path, tmp_path: Path) -> None:
    module = LoraLM(base_dir)
    trainable, total = module.model.get_nb_trainable_parameters()
    strategy = _strategy(Placement.uniform(LAYERS, weights=N, master=H), tmp_path, gather=False)
    rec = _fit(module, strategy)
    engine = strategy.engine
    assert engine is not None
    store = engine.store
    # Bytes per kind of tensor, from the store's own listing.
    fp32_state = sum(store.spec(n).nbytes for n in store.names()
                     if n.rsplit(".", 1)[-1] in ("master", "exp_avg", "exp_avg_sq", "grad")
                     and not n.startswith("engine.scratch"))  # fmt: skip
    assert fp32_state == 16 * trainable  # master + two moments + accumulator, 4 bytes each
    blocks = [n for n in store.names() if n.startswith("block.")]
    weights = sum(store.spec(n).nbytes for n in blocks if n.endswith((".weight", ".frozen")))
    outside = sum(p.numel() for k, p in module.model.named_parameters() if ".layers." not in k)
    assert weights == 4 * (total - outside)  # fp32 compute dtype: every block weight once
    frozen = sum(store.spec(n).nbytes for n in blocks if n.endswith(".frozen"))
    assert frozen == 4 * (total - trainable - outside)
    assert all(store.home(n) is N for n in blocks if n.endswith((".weight", ".frozen")))
    # Written back to NVMe during training: the trainable weights each step, nothing frozen.
    engine.state_dict()  # waits for the last write-backs
    stats = store.stats()
    written = sum(stats[k].bytes - rec.stats[k] for k in ("nvme_write", "nvme_write_direct"))
    trained_weights = sum(store.spec(n).nbytes for n in blocks if n.endswith(".weight"))
    assert written == STEPS * trained_weights
    with pytest.raises(ValueError, match="save_pretrained"):  # not a full model to export
        export_hf(strategy, tmp_path / "hf")
    strategy.close()


def test_saved_adapter_reloads_with_equal_logits(base_dir: Path, tmp_path: Path) -> None:
    module = LoraLM(base_dir)
    _fit(module, _strategy(Placement.uniform(LAYERS, weights=H, master=N), tmp_path))
    module.model.save_pretrained(tmp_path / "adapter")
    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    loaded = PeftModel.from_pretrained(base, tmp_path / "adapter")
    ids = _data(1)[0]["input_ids"]
    with torch.no_grad():
        want = module.model(input_ids=ids).logits
        got = loaded(input_ids=ids).logits
        untrained = LoraLM(base_dir).model(input_ids=ids).logits
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(got, untrained, atol=1e-3)  # training moved the adapters


@pytest.mark.slow
def test_module_lora_option_trains_like_plain_lightning(base_dir: Path, tmp_path: Path) -> None:
    lora = {"rank": 4, "alpha": 8.0, "target_modules": ["q_proj", "k_proj", "up_proj"]}
    runs = []
    for strategy in ("auto", _strategy(Placement.uniform(LAYERS, weights=N, master=H), tmp_path)):
        module = CausalLMModule(base_dir, learning_rate=1e-2, lora=lora, seed=3)
        rec = _fit(module, strategy)
        net = module.model
        assert net is not None
        runs.append((rec.losses, get_peft_model_state_dict(net)))
    (got_losses, got), (want_losses, want) = runs[1], runs[0]
    torch.testing.assert_close(torch.tensor(got_losses), torch.tensor(want_losses), rtol=1e-5,
                               atol=1e-6)  # fmt: skip
    assert len(want) == 2 * LAYERS * 3
    for key, value in want.items():
        torch.testing.assert_close(got[key], value, rtol=1e-5, atol=2e-5, msg=key)


def test_profile_counts_trained_params(base_dir: Path) -> None:
    net = LoraLM(base_dir).model
    trainable, total = net.get_nb_trainable_parameters()
    profile = model_profile_from_module(net.get_base_model())
    assert (profile.trainable_params, profile.total_params) == (trainable, total)
    assert profile.block_train * LAYERS == trainable and not profile.full_fine_tune
    options = LoraOptions(rank=4, alpha=8.0, target_modules=tuple(TARGETS))
    planned = lora_profile(net.config.to_dict(), options)  # from the config, on meta
    assert (planned.trainable_params, planned.total_params) == (trainable, total)


def test_missing_peft_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "peft", None)  # import peft now raises ImportError
    module = CausalLMModule({**LlamaConfig(num_hidden_layers=1).to_dict()}, lora={"rank": 4})
    with pytest.raises(ImportError, match=r"pip install 'balance-beam\[peft\]'"):
        module.configure_model()


def test_bad_lora_options_are_named() -> None:
    with pytest.raises(ValueError, match="rank=0"):
        CausalLMModule("tiny-llama", lora={"rank": 0})
    with pytest.raises(ValueError, match="unknown LoRA option"):
        CausalLMModule("tiny-llama", lora={"r": 4})


def test_no_module_imports_peft_at_import_time() -> None:
    """peft is optional: the package's modules import it only inside functions."""
    import ast

    import bb_lightning

    root = Path(bb_lightning.__file__).parent
    top_level = []
    for path in root.rglob("*.py"):
        for node in ast.parse(path.read_text()).body:  # module-level statements only
            names = (
                [a.name for a in node.names] if isinstance(node, ast.Import)
                else [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            )  # fmt: skip
            top_level += [f"{path.name}: {n}" for n in names if n.split(".")[0] == "peft"]
    assert len(list(root.rglob("*.py"))) > 10 and top_level == []


@pytest.mark.slow
def test_checkpoint_holds_the_adapters_and_restores(base_dir: Path, tmp_path: Path) -> None:
    """A Lightning checkpoint of a LoRA run restores the adapters (the base comes from the
    model itself), and no frozen weight is written into it."""
    placement = Placement.uniform(LAYERS, weights=H, master=H)
    module = LoraLM(base_dir)
    trainer = pl.Trainer(
        accelerator="cpu", devices=1, strategy=_strategy(placement, tmp_path, gather=False),
        precision="32-true", max_steps=STEPS, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    trainer.fit(module, torch.utils.data.DataLoader(_data(STEPS), batch_size=None))  # type: ignore[arg-type]
    trainer.save_checkpoint(tmp_path / "last.ckpt")
    trained = {k: v.clone() for k, v in trainer.strategy.lightning_module_state_dict().items()}
    trainer.strategy.close()  # type: ignore[attr-defined]
    saved = read_trainer_state(tmp_path / "last.ckpt")
    assert not any("base_layer" in k for k in saved["buffers"])

    fresh = LoraLM(base_dir)
    rec = _fit(fresh, _strategy(placement, tmp_path / "again"), ckpt_path=tmp_path / "last.ckpt")
    assert rec.losses == []  # max_steps already reached: restored, nothing trained
    for key, value in fresh.model.state_dict().items():
        torch.testing.assert_close(value, trained[f"model.{key}"], msg=key)


@pytest.mark.slow
def test_validate_and_predict_after_lora_fit_equal_hugging_face(
    base_dir: Path, tmp_path: Path
) -> None:
    """The same strategy validates and generates with the trained adapters (paged base)."""
    module = CausalLMModule(base_dir, learning_rate=1e-2, lora={"rank": 4}, max_new_tokens=4)
    strategy = _strategy(Placement.uniform(LAYERS, weights=N, master=H), tmp_path, gather=False)
    trainer = pl.Trainer(
        accelerator="cpu", devices=1, strategy=strategy, precision="32-true",
        max_steps=STEPS, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False,
    )  # fmt: skip
    data = _data(STEPS)
    trainer.fit(module, torch.utils.data.DataLoader(data, batch_size=None))  # type: ignore[arg-type]
    val = torch.utils.data.DataLoader(data[:1], batch_size=None)  # type: ignore[arg-type]
    got_loss = trainer.validate(module, val, verbose=False)[0]["val_loss"]
    ids, mask = data[0]["input_ids"][:, :8], torch.ones(BATCH, 8, dtype=torch.long)
    prompts = [{"id": ["a", "b"], "input_ids": ids, "attention_mask": mask}]
    got = trainer.predict(module, torch.utils.data.DataLoader(prompts, batch_size=None))  # type: ignore[arg-type]
    strategy.gather_full_model()
    net = module.model
    assert net is not None
    with torch.no_grad():
        want = net.generate(input_ids=ids, attention_mask=mask, max_new_tokens=4, do_sample=False)
        want_loss = net(input_ids=data[0]["input_ids"], labels=data[0]["input_ids"]).loss
    assert [r["token_ids"] for r in got[0]] == want[:, 8:].tolist()  # type: ignore[index]
    assert got_loss == pytest.approx(float(want_loss), rel=1e-5)
