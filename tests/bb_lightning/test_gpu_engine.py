"""On a CUDA device: the engine against plain training, its memory in backward, host-KV
generation and the page-in timer. Skipped without CUDA; run with ``pytest -m gpu``.

Blocks here are 64 MiB in fp32 (hidden 1024, MLP 4096): tiny blocks copy in
microseconds and hide races between copies and compute.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from bb_lightning import BalanceBeamStrategy
from bb_lightning.engine.generate import GenerationConfig, LayerMajorGenerator
from bb_lightning.placement import Placement
from bb_lightning.planner import cost
from bb_lightning.probe import model_profile_from_config
from storage.tiers import Tier

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

VOCAB, SEQ, BATCH = 256, 32, 2
D, H, N = Tier.DEVICE, Tier.HOST, Tier.NVME


def wide_llama(layers: int) -> dict[str, Any]:
    """A Llama config dict of ``layers`` blocks of 16.8 M parameters (64 MiB in fp32)."""
    return {
        "model_type": "llama",
        "hidden_size": 1024,
        "intermediate_size": 4096,
        "num_hidden_layers": layers,
        "num_attention_heads": 8,
        "num_key_value_heads": 8,
        "vocab_size": VOCAB,
        "max_position_embeddings": 64,
        "tie_word_embeddings": False,
    }


def _batches(n: int) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    return [{"input_ids": torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)} for _ in range(n)]


class _Losses(pl.Callback):
    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer: Any, module: Any, outputs: Any, *args: Any) -> None:
        self.losses.append(float(outputs["loss"]))


def _fit(
    strategy: Any, layers: int, steps: int, precision: str = "32-true", *callbacks: Any
) -> tuple[list[float], dict[str, torch.Tensor]]:
    from bb_lightning.module import CausalLMModule

    module = CausalLMModule(wide_llama(layers), learning_rate=1e-3, weight_decay=0.01, seed=0)
    losses = _Losses()
    trainer = pl.Trainer(
        accelerator="cuda", devices=1, strategy=strategy, precision=precision, max_steps=steps,
        logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, num_sanity_val_steps=0, callbacks=[losses, *callbacks],
    )  # fmt: skip
    loader = torch.utils.data.DataLoader(_batches(steps), batch_size=None, shuffle=False)  # type: ignore[arg-type,var-annotated]
    trainer.fit(module, loader)
    if isinstance(strategy, BalanceBeamStrategy):
        state = {k: v.float().cpu() for k, v in strategy.lightning_module_state_dict().items()}
        strategy.close()
    else:
        state = {k: v.detach().float().cpu() for k, v in module.state_dict().items()}
    return losses.losses, state


@pytest.fixture(scope="module")
def plain_adamw() -> tuple[list[float], dict[str, torch.Tensor]]:
    """Plain Lightning on the GPU: the module's ``torch.optim.AdamW`` over CUDA parameters."""
    return _fit("auto", 4, 3)


@pytest.mark.parametrize("tier", [D, H, N], ids=lambda t: t.value)
def test_engine_equals_torch_adamw_on_the_gpu(
    plain_adamw: tuple[list[float], dict[str, torch.Tensor]], tier: Tier, tmp_path: Path
) -> None:
    placement = Placement.uniform(4, weights=tier, master=tier, prefetch_depth=1)
    strategy = BalanceBeamStrategy(
        placement=placement, compute_dtype="fp32", nvme_path=str(tmp_path / "nvme")
    )
    losses, state = _fit(strategy, 4, 3)
    want_losses, want = plain_adamw
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(want_losses), rtol=1e-5, atol=0)
    assert state.keys() == want.keys()
    # AdamW turns a rounding difference in a gradient far below eps (1e-8) into a step
    # difference of up to lr x |g| / eps: 1e-5 at most, per step, for |g| <= 1e-10
    for key, value in want.items():
        torch.testing.assert_close(state[key], value, rtol=1e-5, atol=2e-5, msg=key)


class _BackwardPeak(pl.Callback):
    """Peak device bytes allocated during each backward, above what was allocated before it."""

    def __init__(self) -> None:
        self.deltas: list[int] = []
        self._base = 0

    def on_before_backward(self, trainer: Any, module: Any, loss: Any) -> None:
        torch.cuda.synchronize()
        self._base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()

    def on_after_backward(self, trainer: Any, module: Any) -> None:
        torch.cuda.synchronize()
        self.deltas.append(torch.cuda.max_memory_allocated() - self._base)


def test_backward_holds_no_more_than_the_planned_gradients_in_flight() -> None:
    layers = 8  # gradients of all blocks (8 x 32 MiB in bf16) would exceed the bound
    placement = Placement.uniform(layers, weights=H, master=H, prefetch_depth=1)
    strategy = BalanceBeamStrategy(placement=placement, compute_dtype="bf16")
    peak = _BackwardPeak()
    _fit(strategy, layers, 2, "bf16-true", peak)
    profile = model_profile_from_config(wide_llama(layers))
    tokens = BATCH * SEQ
    # the planner reserves two blocks' gradients in flight (one computed, one copied);
    # one more may be computed while the oldest is copied; plus one block's recomputed
    # activations, the logits and their gradient, the resident parameters' gradients and
    # allocator rounding. The last backward is read: the first also allocates the
    # autograd thread's cuBLAS workspace.
    bound = (
        cost.grad_bytes_in_flight(profile) * 3 // 2
        + tokens * profile.act_bytes_per_token_full
        + 2 * cost.logits_bytes(profile, tokens)
        + (32 << 20)
    )
    assert len(peak.deltas) == 2 and peak.deltas[-1] <= bound, (peak.deltas, bound)


def test_fit_stays_within_its_planned_device_budget(tmp_path: Path) -> None:
    """A plan for a device whose budget holds one block's weights besides the activations,
    logits and gradients in flight: the run's peak allocation stays within that budget
    (the store's arena, allocated whole, with everything the plan prices beside it).
    The arena once took the whole budget: out of device memory on an H200."""
    from bb_lightning.module import CausalLMModule
    from bb_lightning.planner import FitJob, PlanOverrides, preset

    layers, seqs, seq = 8, 16, 64
    config = wide_llama(layers)
    profile = model_profile_from_config(config)
    budget = (
        layers * profile.block_params  # half the blocks' bf16 weights
        + cost.activation_bytes(profile, seqs, seq, True)
        + cost.logits_bytes(profile, seqs * seq)
        + 2 * cost.grad_bytes_in_flight(profile)
        + 2 * (profile.embed_params + profile.head_params)
    )
    hw = preset("h100").replace(device_memory=int((budget + cost.DEVICE_MARGIN_BYTES) / 0.9))
    strategy = BalanceBeamStrategy(
        job=FitJob(seq_len=seq, global_batch_seqs=seqs), hardware=hw,
        overrides=PlanOverrides(micro_batch=seqs, grad_accum=1), nvme_path=str(tmp_path / "nvme"),
    )  # fmt: skip
    module = CausalLMModule(config, learning_rate=1e-3, seed=0)
    g = torch.Generator().manual_seed(0)
    data = [{"input_ids": torch.randint(0, VOCAB, (seqs, seq), generator=g)} for _ in range(2)]
    trainer = pl.Trainer(
        accelerator="cuda", devices=1, strategy=strategy, precision="bf16-true", max_steps=2,
        logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, num_sanity_val_steps=0,
    )  # fmt: skip
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    trainer.fit(module, torch.utils.data.DataLoader(data, batch_size=None))  # type: ignore[arg-type,var-annotated]
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - before
    plan = strategy.plan
    strategy.close()
    assert plan is not None and set(plan.weights) != {D}  # some blocks are paged
    device = next(m for m in plan.memory if m.tier is D)
    # cuBLAS workspaces of the compute and autograd threads come on top
    assert peak <= device.budget + (64 << 20), (peak, device)


def _tokens(
    gen: LayerMajorGenerator, ids: torch.Tensor, mask: torch.Tensor, eos: tuple[int, ...]
) -> list[Any]:
    return gen.generate(ids, mask, GenerationConfig(max_new_tokens=12, eos_token_ids=eos))


def _mid_eos(rows: list[list[int]], most: int) -> tuple[int, ...]:
    """Tokens emitted mid-way, most common first, until ``most`` rows emit one of them."""
    counts = Counter(t for r in rows for t in set(r[1:-1]))
    chosen: list[int] = []
    for token, _ in counts.most_common():
        chosen.append(token)
        if sum(any(t in chosen for t in r[1:-1]) for r in rows) >= most:
            break
    return tuple(chosen)


def test_host_kv_generation_equals_device_kv_with_compaction(tmp_path: Path) -> None:
    config = AutoConfig.for_model(
        "llama", vocab_size=VOCAB, bos_token_id=1, eos_token_id=2, pad_token_id=0,
        hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64,
    )  # fmt: skip
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "m")
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "m").cuda().eval()
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(3, VOCAB, (8, 9), generator=g)
    mask = torch.ones_like(ids)
    for row, n in enumerate((9, 4, 7, 4, 9, 5, 8, 6)):
        mask[row, : 9 - n], ids[row, : 9 - n] = 0, 0
    device_kv = LayerMajorGenerator(model)
    free = [r.token_ids for r in _tokens(device_kv, ids, mask, ())]
    eos = _mid_eos(free, 5)
    want = _tokens(device_kv, ids, mask, eos)
    assert sum(r.finish_reason == "eos" for r in want) >= 4  # the batch is compacted
    host_kv = LayerMajorGenerator(model, kv_tier=Tier.HOST)
    got = _tokens(host_kv, ids, mask, eos)
    assert host_kv._kv is not None and host_kv._kv.cache.offloading
    assert [r.token_ids for r in got] == [r.token_ids for r in want]
    assert [r.finish_reason for r in got] == [r.finish_reason for r in want]


def test_a_host_kv_cache_in_the_store_pins_nothing_per_step(tmp_path: Path) -> None:
    """The cache on the host paged through the store: tokens as with the cache on the device
    (compaction included), the cache in the store's host tier, and no pinned memory from
    PyTorch's host allocator per step, where transformers' offloading cache takes some."""
    import dataclasses

    from bb_lightning.engine.kv_paged import kv_budgets
    from bb_lightning.shapes import cache_length
    from storage.store import StoreConfig, TieredStore

    config = AutoConfig.for_model(
        "llama", vocab_size=VOCAB, bos_token_id=1, eos_token_id=2, pad_token_id=0,
        hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64,
    )  # fmt: skip
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "m")
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "m").cuda().eval()
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(3, VOCAB, (8, 9), generator=g)
    mask = torch.ones_like(ids)
    for row, n in enumerate((9, 4, 7, 4, 9, 5, 8, 6)):
        mask[row, : 9 - n], ids[row, : 9 - n] = 0, 0
    device_kv = LayerMajorGenerator(model)
    free = [r.token_ids for r in _tokens(device_kv, ids, mask, ())]
    eos = _mid_eos(free, 5)
    want = _tokens(device_kv, ids, mask, eos)
    placement = dataclasses.replace(
        Placement.uniform(3, weights=H, compute_dtype="float32"), kv_cache=H
    )
    per_token = model_profile_from_config(config).kv_bytes_per_token
    kv = kv_budgets(placement, 8, cache_length(9 + 12), per_token, 3)
    assert kv is not None
    store = TieredStore(
        StoreConfig(device_budget=kv[D] + (1 << 20), host_budget=kv[H] + (1 << 20), device="cuda")
    )

    def pinned_requests() -> int:
        torch.cuda.synchronize()
        return int(torch.cuda.host_memory_stats().get("active_requests.allocated", 0))

    offloading = LayerMajorGenerator(model, kv_tier=H)
    before = pinned_requests()
    _tokens(offloading, ids, mask, eos)
    assert pinned_requests() > before  # transformers' copies to the host, per layer and step
    paged = LayerMajorGenerator(model, kv_tier=H, kv_store=store)
    before = pinned_requests()
    got = _tokens(paged, ids, mask, eos)
    assert pinned_requests() == before
    assert [r.token_ids for r in got] == [r.token_ids for r in want]
    assert [r.finish_reason for r in got] == [r.finish_reason for r in want]
    assert store.usage()[H][0] == kv[H]  # every layer's keys and values, in the store
    paged.close()
    store.close()


def test_page_in_waits_are_timed_on_the_device() -> None:
    from bb_lightning.engine.budgets import required_budgets
    from bb_lightning.engine.trainer_engine import TrainingEngine
    from storage.store import StoreConfig, TieredStore

    config = AutoConfig.for_model(**wide_llama(3))
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    placement = Placement.uniform(3, weights=H, master=H, compute_dtype="float32")
    numels = [sum(p.numel() for p in b.parameters()) for b in model.model.layers]
    rest = sum(p.numel() for p in model.parameters()) - sum(numels)
    need = required_budgets(numels, rest, placement)
    store = TieredStore(StoreConfig(device_budget=need[D] + (1 << 20),
                                    host_budget=need[H] + (1 << 20), device="cuda"))  # fmt: skip
    engine = TrainingEngine(
        model, model.model.layers, store, placement,
        device=torch.device("cuda", torch.cuda.current_device()),
    )  # fmt: skip
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), device="cuda")
    engine.timer.begin_step()
    with torch.no_grad():
        engine.model(input_ids=ids)
    assert engine.timer._pending, "the waits were timed by device events"
    times = engine.timer.end_step()
    # the first block's page-in is exposed (nothing computes while it copies): the stream
    # stalled for it, which the host clock around a non-blocking wait does not see
    assert times is not None and times.wait_page_in > 0.0
    engine.close()
    store.close()
