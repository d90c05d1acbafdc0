"""The module after ``trainer.fit`` under balance_beam against the same module after plain
Lightning: ``state_dict()``, ``save_pretrained`` -> ``from_pretrained`` logits, forwards,
the too-large-for-host case, and Lightning's gradient-clipping settings."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from torch.profiler import ProfilerActivity, profile
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedModel

from bb_lightning import BalanceBeamStrategy
from bb_lightning.engine.budgets import param_counts, required_budgets
from bb_lightning.engine.trainer_engine import TrainingEngine
from bb_lightning.hf.structure import find_block_list
from bb_lightning.module import CausalLMModule
from bb_lightning.placement import Placement
from bb_lightning.strategy.handback import WeightsInStoreError, param_bytes
from storage.store import StoreConfig
from storage.tiers import Tier

H, N, D = Tier.HOST, Tier.NVME, Tier.DEVICE
STEPS = 2


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory, tiny: SimpleNamespace) -> Path:
    """A tiny Llama written with ``save_pretrained``, loaded by path as a user does."""
    cfg = tiny.tiny_llama(3)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(cfg.pop("model_type"), **cfg))
    path = tmp_path_factory.mktemp("tiny") / "llama"
    model.save_pretrained(path)
    return path


class UserModule(pl.LightningModule):
    """A user's own LightningModule holding a Hugging Face model (not CausalLMModule)."""

    def __init__(self, path: Path) -> None:
        super().__init__()
        self.net = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        return self.net(input_ids=batch["input_ids"], labels=batch["input_ids"]).loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3, weight_decay=0.01)


def _net(module: pl.LightningModule) -> PreTrainedModel:
    return module.net if isinstance(module, UserModule) else module.model  # type: ignore[return-value]


def _make(kind: str, path: Path) -> pl.LightningModule:
    if kind == "user":
        return UserModule(path)
    return CausalLMModule(str(path), learning_rate=1e-3, weight_decay=0.01)


def _ours(**kwargs: Any) -> BalanceBeamStrategy:
    placement = Placement(weights=(N, H, D), master=(H, N, H))
    return BalanceBeamStrategy(placement=placement, compute_dtype="fp32", **kwargs)


def _fit(strategy: Any, module: pl.LightningModule, tiny: SimpleNamespace, **kw: Any) -> pl.Trainer:
    trainer, _ = tiny.make_trainer(strategy, STEPS, **kw)
    trainer.fit(module, tiny.loader(STEPS * kw.get("accumulate_grad_batches", 1)))
    return trainer


def _logits(net: torch.nn.Module, tiny: SimpleNamespace) -> torch.Tensor:
    with torch.no_grad():
        return net(input_ids=tiny.batches(1, seed=5)[0]["input_ids"]).logits


@pytest.fixture(scope="module")
def plain() -> dict[str, pl.LightningModule]:
    """Modules trained by plain Lightning, per kind (filled on first use)."""
    return {}


def _plain(kind: str, path: Path, tiny: SimpleNamespace, cache: dict[str, Any]) -> Any:
    if kind not in cache:
        module = _make(kind, path)
        _fit("auto", module, tiny)
        cache[kind] = module
    return cache[kind]


@pytest.mark.parametrize("kind", ["causal_lm", "user"])
def test_module_after_fit_is_the_trained_model(
    kind: str, checkpoint: Path, tiny: SimpleNamespace, tmp_path: Path, plain: dict[str, Any]
) -> None:
    want = _plain(kind, checkpoint, tiny, plain)
    module = _make(kind, checkpoint)
    strategy = _ours(nvme_path=str(tmp_path / "nvme"))
    trainer = _fit(strategy, module, tiny)
    got, ref = module.state_dict(), want.state_dict()
    assert got.keys() == ref.keys()
    for key, value in ref.items():
        torch.testing.assert_close(got[key], value, rtol=1e-5, atol=1e-6, msg=key)
    logits = _logits(_net(module), tiny)  # forwards run on the module itself
    torch.testing.assert_close(logits, _logits(_net(want), tiny), rtol=1e-5, atol=1e-5)
    _net(module).save_pretrained(tmp_path / "out")
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.float32)
    torch.testing.assert_close(_logits(loaded, tiny), logits, rtol=0, atol=0)
    # The next call pages the module's current values: plain's weights validate as plain's.
    module.load_state_dict(ref)
    batch = tiny.loader(1, seed=9)
    if kind == "causal_lm":
        (metrics,) = trainer.validate(module, batch, verbose=False)
        (expected,) = tiny.make_trainer("auto", STEPS)[0].validate(want, batch, verbose=False)
        assert metrics["val_loss"] == pytest.approx(expected["val_loss"], rel=1e-5)
    strategy.close()
    torch.testing.assert_close(_logits(_net(module), tiny), _logits(_net(want), tiny))


@pytest.mark.parametrize("kind", ["causal_lm", "user"])
def test_too_large_for_host_streams_or_names_the_export(
    kind: str,
    checkpoint: Path,
    tiny: SimpleNamespace,
    tmp_path: Path,
    plain: dict[str, Any],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    want = _plain(kind, checkpoint, tiny, plain)
    module = _make(kind, checkpoint)
    strategy = _ours(nvme_path=str(tmp_path / "nvme"), gather_limit=0)  # nothing fits the host
    _fit(strategy, module, tiny)
    for owner in (module, _net(module)):
        with pytest.raises(WeightsInStoreError, match="bb-lightning export"):
            owner.state_dict()
    # A failure while streaming leaves no file behind.
    iter_state = TrainingEngine.iter_state

    def failing(self: TrainingEngine, *args: Any) -> Iterator[Any]:
        items = iter_state(self, *args)
        yield next(items)
        yield next(items)
        raise OSError("disk full")

    monkeypatch.setattr(TrainingEngine, "iter_state", failing)
    with pytest.raises(OSError, match="disk full"):
        _net(module).save_pretrained(tmp_path / "broken", max_shard_size="20KB")
    assert [p.name for p in (tmp_path / "broken").iterdir()] == []
    monkeypatch.undo()
    _net(module).save_pretrained(tmp_path / "out", max_shard_size="200KB")  # streams
    assert len(list((tmp_path / "out").glob("model-*.safetensors"))) > 1
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.float32)
    torch.testing.assert_close(_logits(loaded, tiny), _logits(_net(want), tiny))
    strategy.close()
    with pytest.raises(WeightsInStoreError, match=r"strategy\.close\(\) has closed"):
        _net(module).save_pretrained(tmp_path / "late")
    assert not (tmp_path / "late").exists()


def test_gather_on_teardown_false_keeps_the_weights_in_the_store(
    checkpoint: Path, tiny: SimpleNamespace, tmp_path: Path
) -> None:
    module = _make("causal_lm", checkpoint)
    strategy = _ours(gather_on_teardown=False)
    _fit(strategy, module, tiny)
    with pytest.raises(WeightsInStoreError, match="gather_on_teardown=False"):
        module.state_dict()
    state = dict(strategy.lightning_module_state_dict())  # lazy reads still work
    module = strategy.gather_full_model()
    assert strategy.store is None
    for key, value in module.state_dict().items():
        torch.testing.assert_close(value, state[key], rtol=0, atol=0, msg=key)


def _peak_allocated(fn: Callable[[], object]) -> int:
    """Most bytes torch's CPU allocator held at once for ``fn`` beyond what it held before,
    from the profiler's allocation and free records in time order."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = sorted(
        (e.time_range.start, e.self_cpu_memory_usage)
        for e in prof.events()
        if e.self_cpu_memory_usage
    )
    live = peak = 0
    for _, change in events:
        live += change
        peak = max(peak, live)
    return peak


def test_hand_back_reads_one_block_at_a_time(
    checkpoint: Path, tiny: SimpleNamespace, tmp_path: Path
) -> None:
    """Handing back bf16 weights takes the model in bf16 (2 bytes a parameter), not a
    whole fp32 copy first (4 more): the values are the fp32 masters rounded once."""
    module = _make("causal_lm", checkpoint)
    strategy = _ours(nvme_path=str(tmp_path / "nvme"), gather_on_teardown=False)
    _fit(strategy, module, tiny)
    masters = dict(strategy.lightning_module_state_dict())
    engine = strategy._slot.engine
    assert isinstance(engine, TrainingEngine)
    numel = param_bytes(engine) // 4
    largest = max(s.numel for s in engine.states[:-1])  # a block's flat fp32 state
    peak = _peak_allocated(lambda: strategy._slot.gather(torch.bfloat16))
    # the model in bf16, and at most one block's fp32 values beside it; a whole fp32
    # copy first would take 6 bytes a parameter
    assert 2 * numel <= peak <= 2 * numel + 4 * largest + (64 << 10), (peak, numel)
    got = module.state_dict()
    for key, value in masters.items():
        assert got[key].dtype == torch.bfloat16, key
        torch.testing.assert_close(got[key], value.to(torch.bfloat16), rtol=0, atol=0, msg=key)
    strategy.close()


def test_a_given_host_budget_caps_the_weights_handed_back(
    checkpoint: Path, tiny: SimpleNamespace, tmp_path: Path
) -> None:
    """With a StoreConfig given, the weights are handed back only into the room its host
    budget leaves beside the store's host arena (the store's own accounting); else the
    module stays hollow, naming that budget."""
    placement = Placement(weights=(N, H, D), master=(H, N, H), compute_dtype="float32")
    model = AutoModelForCausalLM.from_pretrained(checkpoint)
    numels, rest, _ = param_counts(model, list(find_block_list(model)[1]))
    need = required_budgets(numels, rest, placement)
    fp32 = 4 * (sum(numels) + rest)
    for extra, hollow in ((fp32 // 2, True), (fp32 + (1 << 20), False)):
        module = _make("causal_lm", checkpoint)
        store = StoreConfig(
            device_budget=need[D] + (1 << 20),
            host_budget=need[H] + extra,
            nvme_path=str(tmp_path / "nvme"),
            nvme_budget=need[N] + (1 << 20),
            device="cpu",
        )
        strategy = BalanceBeamStrategy(store=store, placement=placement, compute_dtype="fp32")
        _fit(strategy, module, tiny)
        assert strategy.store is not None
        used, capacity = strategy.store.usage()[H]  # the arena holds what the manifest priced
        assert (used, capacity) == (need[H], (need[H] + extra) // 4096 * 4096)
        if hollow:
            with pytest.raises(WeightsInStoreError, match=r"StoreConfig\.host_budget"):
                module.state_dict()
        else:
            got = {key: value.shape for key, value in module.state_dict().items()}
            assert got == {f"model.{key}": value.shape for key, value in model.state_dict().items()}
        strategy.close()


def test_clip_zero_is_no_clipping(tiny: SimpleNamespace, reference_run: Any) -> None:
    config = tiny.tiny_llama(2)
    strategy = BalanceBeamStrategy(placement=Placement.uniform(2, weights=H), compute_dtype="fp32")
    module = tiny.make_module(config)
    trainer, recorder = tiny.make_trainer(strategy, STEPS, gradient_clip_val=0)
    trainer.fit(module, tiny.loader(STEPS))
    losses, state = reference_run(config, STEPS)  # plain Lightning without clipping
    torch.testing.assert_close(torch.tensor(recorder.losses), torch.tensor(losses))
    for key, value in module.state_dict().items():
        torch.testing.assert_close(value, state[key], rtol=1e-5, atol=1e-6, msg=key)
    strategy.close()


def test_value_clipping_equals_plain_lightning(tiny: SimpleNamespace, reference_run: Any) -> None:
    config = tiny.tiny_llama(2)
    kwargs = {"gradient_clip_val": 2e-3, "gradient_clip_algorithm": "value"}
    placement = Placement(weights=(N, H), master=(H, N))
    strategy = BalanceBeamStrategy(placement=placement, compute_dtype="fp32")
    module = tiny.make_module(config)
    trainer, recorder = tiny.make_trainer(strategy, STEPS, accumulate_grad_batches=2, **kwargs)
    trainer.fit(module, tiny.loader(2 * STEPS))
    losses, state = reference_run(config, STEPS, accumulate_grad_batches=2, **kwargs)
    _, unclipped = reference_run(config, STEPS, accumulate_grad_batches=2)
    torch.testing.assert_close(torch.tensor(recorder.losses), torch.tensor(losses))
    got = module.state_dict()
    for key, value in state.items():
        torch.testing.assert_close(got[key], value, rtol=1e-5, atol=1e-6, msg=key)
    assert any(not torch.allclose(state[k], unclipped[k]) for k in state)  # clipping bites
    strategy.close()


def test_negative_clip_value_fails_before_training(tiny: SimpleNamespace) -> None:
    strategy = BalanceBeamStrategy(placement=Placement.uniform(2, weights=H), compute_dtype="fp32")
    trainer, recorder = tiny.make_trainer(strategy, 1, gradient_clip_val=-1.0)
    with pytest.raises(ValueError, match=r"gradient_clip_val=-1\.0 must be >= 0"):
        trainer.fit(tiny.make_module(tiny.tiny_llama(2)), tiny.loader(1))
    assert recorder.losses == [] and strategy.engine is None


def test_the_host_limit_counts_the_dtype_the_weights_come_back_in(
    checkpoint: Path, tiny: SimpleNamespace, tmp_path: Path
) -> None:
    """Under bf16-true the module takes its weights back in bf16 (2 bytes a parameter):
    a gather_limit between their bf16 and their fp32 size gives them back; one below the
    bf16 size leaves the module hollow, naming the bf16 bytes."""
    numel = sum(p.numel() for p in AutoModelForCausalLM.from_pretrained(checkpoint).parameters())
    for limit, back in ((3 * numel, True), (2 * numel - 1, False)):
        module = _make("causal_lm", checkpoint)
        placement = Placement(weights=(N, H, D), master=(H, N, H))
        strategy = BalanceBeamStrategy(
            placement=placement, nvme_path=str(tmp_path / f"nvme{limit}"), gather_limit=limit
        )
        _fit(strategy, module, tiny, precision="bf16-true")
        if back:
            assert all(v.dtype == torch.bfloat16 for v in module.state_dict().values())
        else:
            with pytest.raises(WeightsInStoreError, match=r"GiB of bfloat16 weights > host limit"):
                module.state_dict()
        strategy.close()
