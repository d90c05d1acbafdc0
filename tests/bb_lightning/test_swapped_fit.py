"""Swapped blocks in training against plain Lightning, over a few model families.

Each run gives ``BalanceBeamStrategy(placement=Placement(..., swapped=...))``: the swapped
blocks run their forward once, with autograd, keeping their saved weights as references
re-bound in backward and their other saved activations, under the CPU double of CUDA's
copies, as store tensors on the host (``swap.<i>.<n>.<k>``), or on the CPU device itself
where its forward made them (no store tensor); the other blocks recompute (some in row
chunks). Losses and final weights (fp32) must equal plain Lightning's on the same
``save_pretrained`` directory, with gradient accumulation and norm clipping, and a swapped
block's forward must run once per micro-batch (no recompute).
"""

from __future__ import annotations

import functools
from collections import Counter
from pathlib import Path
from types import SimpleNamespace
from typing import Any
from unittest import mock

import pytest
import torch
from torch.utils.data import DataLoader
from transformers import AutoConfig, AutoModelForCausalLM

from bb_lightning import BalanceBeamStrategy
from bb_lightning.engine.chunked import row_spans
from bb_lightning.hf.lora import LoraOptions
from bb_lightning.hf.structure import find_block_list
from bb_lightning.module import CausalLMModule
from bb_lightning.placement import Placement
from bb_lightning.planner import FitJob, PlanOverrides, make_plan, preset
from bb_lightning.planner.models import builtin_config
from bb_lightning.probe import model_profile_from_config, model_profile_from_module
from bb_lightning.strategy.dryrun import dry_fit, meta_model
from storage.deferred import DOUBLE_ENV, double_requested
from storage.tiers import PRICED_LINKS, Tier

from .test_chunked_fit import ACCUM, ROWS, SEQ, STEPS, _fit, _OwnModule, _TwoForwards
from .test_families import JAMBA
from .tiny import VOCAB, cpu_profile, saved

H, N = Tier.HOST, Tier.NVME

pytestmark = pytest.mark.usefixtures("one_thread")


def _counted(module: Any) -> tuple[Counter[int], Any]:
    """A patch of the blocks' class forward counting calls per block (by its index)."""
    blocks = _blocks(module)
    cls = type(blocks[0])
    forward = cls.forward
    calls: Counter[int] = Counter()
    index = {id(b): i for i, b in enumerate(blocks)}

    @functools.wraps(forward)  # the engine reads the signature for the hidden states
    def counting(self: Any, *args: Any, **kwargs: Any) -> Any:
        if "forward" in vars(self):  # run by the engine, not the strategy's tracing pass
            calls[index.get(id(self), -1)] += 1
        return forward(self, *args, **kwargs)

    return calls, mock.patch.object(cls, "forward", counting)


def _blocks(module: Any) -> list[Any]:
    if isinstance(module, CausalLMModule):
        module.configure_model()
        module = module.model
    return list(find_block_list(module)[1])


def _same_as_plain(
    tiny: SimpleNamespace,
    make: Any,
    placement: Placement,
    *,
    count: bool = True,
    forwards: int = 1,
) -> BalanceBeamStrategy:
    """Fit ``make()`` under plain Lightning and under ``placement``: both agree, the swapped
    blocks kept their saved activations in the store on the host under the double (on the
    CPU device itself without it: no store tensor), and (``count``) each swapped block ran
    forward once per micro-batch, each recomputed one twice."""
    want_losses, want = _fit(tiny, "auto", make())
    strategy = BalanceBeamStrategy(placement=placement, compute_dtype="fp32")
    module = make()
    calls, patch = _counted(module)
    with patch:
        losses, got = _fit(tiny, strategy, module)
    store = strategy.store
    assert store is not None
    swapped = placement.swapped or ()
    names = [n for n in store.names() if n.startswith("swap.")]
    to_host = set(swapped) if double_requested(None) else set()
    assert {int(n.split(".")[1]) for n in names} == to_host
    assert all(store.home(n) is H for n in names)
    if count:
        chunks = len(row_spans(ROWS, placement.chunk_rows))
        for i in range(placement.num_blocks):
            runs = STEPS * ACCUM * forwards * chunks
            assert calls[i] == runs * (1 if i in swapped else 2), (i, calls)
    assert len(losses) == STEPS * ACCUM
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(want_losses), rtol=1e-5, atol=0)
    assert got.keys() == want.keys()
    for key, value in want.items():
        torch.testing.assert_close(
            got[key], value, rtol=1e-5, atol=5e-5, msg=lambda m, k=key: f"{k}: {m}"
        )
    return strategy


def _placement(blocks: int, swapped: tuple[int, ...], chunk_rows: int | None = None) -> Placement:
    return Placement(
        weights=(H,) * blocks, master=(H,) * blocks, recompute_resident=True,
        swapped=swapped, chunk_rows=chunk_rows, boundaries=H if chunk_rows else None,
    )  # fmt: skip


@pytest.fixture
def double(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every store under the CPU double of CUDA's copies: swapped activations go to the
    store's host tier and back, as beside a GPU."""
    monkeypatch.setenv(DOUBLE_ENV, "1")


RUNS = [  # family, blocks swapped of 2, rows per chunk (of 5: 1, 2 + 2 + 1 uneven, 3 + 2),
    # under the double (the store's host tier) or on the CPU device itself
    ("llama", (1,), None, True),
    ("llama", (0, 1), 1, True),
    ("llama", (0, 1), None, False),
    ("qwen2_tied", (0,), 2, True),
    ("qwen2_tied", (0, 1), 2, False),
    ("mixtral_aux_loss", (0, 1), None, True),  # the routers' logits recorded once, not redone
    ("mixtral_aux_loss", (1,), 3, True),  # ... and joined by rows over the chunks
    ("mixtral_aux_loss", (1,), 3, False),
]


@pytest.mark.parametrize(("family", "swapped", "chunk_rows", "to_store"), RUNS)
def test_swapped_blocks_fit_like_plain_lightning(
    family: str,
    swapped: tuple[int, ...],
    chunk_rows: int | None,
    to_store: bool,
    tiny: SimpleNamespace,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv(DOUBLE_ENV, "1" if to_store else "0")
    path = saved(family, tmp_path / "ckpt")
    strategy = _same_as_plain(
        tiny,
        lambda: CausalLMModule(str(path), learning_rate=1e-3, weight_decay=0.01),
        _placement(2, swapped, chunk_rows),
    )
    strategy.close()


@pytest.mark.usefixtures("double")
def test_a_hybrid_recurrent_model_fits_with_swapped_blocks_like_plain_lightning(
    tiny: SimpleNamespace, tmp_path: Path
) -> None:
    """Jamba's mamba and attention layers (two classes: forwards not counted)."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model("jamba", **JAMBA))
    model.save_pretrained(tmp_path / "ckpt")
    path = tmp_path / "ckpt"
    strategy = _same_as_plain(
        tiny,
        lambda: CausalLMModule(str(path), learning_rate=1e-3, weight_decay=0.01),
        _placement(2, (0,), 2),
        count=False,
    )
    strategy.close()


@pytest.mark.usefixtures("double")
def test_lora_adapters_fit_with_swapped_blocks_like_plain_lightning(
    tiny: SimpleNamespace, tmp_path: Path
) -> None:
    """The frozen base weights saved by reference, re-bound when paged in for backward."""
    path = saved("llama", tmp_path / "ckpt")
    lora = {"rank": 4, "alpha": 8.0, "target_modules": ["q_proj", "v_proj", "up_proj"]}
    strategy = _same_as_plain(
        tiny,
        lambda: CausalLMModule(str(path), learning_rate=1e-2, lora=lora, seed=3),
        _placement(2, (0, 1), 3),
    )
    strategy.close()


def test_a_users_own_module_fits_with_swapped_blocks_in_row_chunks(tiny: SimpleNamespace) -> None:
    """A per-row input's gradients joined by rows over the chunks, a whole gate's summed."""
    strategy = _same_as_plain(tiny, _OwnModule, _placement(3, (0, 2), 2))
    strategy.close()


@pytest.mark.usefixtures("double")
def test_two_forwards_before_one_backward_keep_two_sets_of_saved_activations(
    tiny: SimpleNamespace, tmp_path: Path
) -> None:
    path = saved("llama", tmp_path / "ckpt")
    strategy = _same_as_plain(tiny, lambda: _TwoForwards(path), _placement(2, (0, 1)), forwards=2)
    assert strategy.store is not None and "swap.0.1.0" in strategy.store.names()
    strategy.close()


def test_a_cpu_plan_keeps_the_activations_of_nvme_homed_blocks_and_fits_like_plain_lightning(
    tiny: SimpleNamespace, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Planned for a CPU with the blocks' weights on NVMe (paged in by copy): every block
    swaps instead of recomputing, its saved activations left where its forward made them
    (no store tensor) and its weights paged in again for its backward (re-bound to the
    copy paged in then); each block's forward runs once per micro-batch and the fit equals
    plain Lightning's."""
    monkeypatch.setenv(DOUBLE_ENV, "0")
    path = saved("qwen2_tied", tmp_path / "ckpt")
    job = FitJob(seq_len=SEQ, global_batch_seqs=ROWS * ACCUM)
    overrides = PlanOverrides(weights_tier=N, micro_batch=ROWS, grad_accum=ACCUM)
    make = lambda: CausalLMModule(str(path), learning_rate=1e-3, weight_decay=0.01)  # noqa: E731
    want_losses, want = _fit(tiny, "auto", make())
    strategy = BalanceBeamStrategy(
        job=job, hardware=cpu_profile(nvme=8 << 30), overrides=overrides,
        nvme_path=str(tmp_path / "nvme"), compute_dtype="fp32",
    )  # fmt: skip
    module = make()
    calls, patch = _counted(module)
    with patch:
        losses, got = _fit(tiny, strategy, module)
    plan, store = strategy.plan, strategy.store
    assert plan is not None and store is not None
    assert plan.weights == (N, N) and plan.placement.swapped == (0, 1)
    assert plan.recomputed_blocks() == () and "blocks 0-1 swap" in plan.explain()
    assert not [n for n in store.names() if n.startswith("swap.")]
    assert store.home("block.0.weight") is N
    assert calls == Counter({0: STEPS * ACCUM, 1: STEPS * ACCUM})
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(want_losses), rtol=1e-5, atol=0)
    for key, value in want.items():
        torch.testing.assert_close(got[key], value, rtol=1e-5, atol=5e-5)
    strategy.close()


@pytest.mark.usefixtures("double")
def test_a_plan_that_swaps_runs_end_to_end(tiny: SimpleNamespace, tmp_path: Path) -> None:
    """A plan priced with ``swap_activations`` for a GPU whose links have headroom over
    its compute swaps block 1 and recomputes block 0; the strategy runs that plan on the
    CPU (the store sized for the swapped activations by the plan) as plain Lightning trains."""
    path = saved("llama", tmp_path / "ckpt")
    hw = preset("a100-80gb").replace(device_flops=1e12, device_memory=int(1.3 * (1 << 30)))
    job = FitJob(seq_len=SEQ, global_batch_seqs=ROWS * ACCUM)
    overrides = PlanOverrides(
        swap_activations=True, weights_tier=H, micro_batch=ROWS, grad_accum=ACCUM
    )
    make = lambda: CausalLMModule(str(path), learning_rate=1e-3, weight_decay=0.01)  # noqa: E731
    want_losses, want = _fit(tiny, "auto", make())
    strategy = BalanceBeamStrategy(job=job, hardware=hw, overrides=overrides, compute_dtype="fp32")
    losses, got = _fit(tiny, strategy, make())
    plan, store = strategy.plan, strategy.store
    assert plan is not None and store is not None
    assert (plan.placement.swapped, plan.placement.recomputed) == ((1,), (0,))
    assert "block 0 recompute, block 1 swap" in plan.explain()
    names = [n for n in store.names() if n.startswith("swap.")]
    assert names and {n.split(".")[1] for n in names} == {"1"}
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(want_losses), rtol=1e-5, atol=0)
    for key, value in want.items():
        torch.testing.assert_close(got[key], value, rtol=1e-5, atol=5e-5)
    strategy.close()


def test_a_placement_refuses_a_block_both_recomputed_and_swapped() -> None:
    with pytest.raises(ValueError, match=r"blocks \[1\] are both recomputed and swapped"):
        Placement(weights=(H, H), master=(H, H), recomputed=(0, 1), swapped=(1,))
    with pytest.raises(ValueError, match=r"swapped blocks \[0\] are resident"):
        Placement(weights=(Tier.DEVICE, H), master=(H, H), swapped=(0,))
    with pytest.raises(ValueError, match=r"swapped blocks \[2\] are out of range for 2"):
        Placement(weights=(H, H), master=(H, H), swapped=(2,))
    p = Placement(weights=(H, H), master=(H, H), recomputed=(0,), swapped=(1,))
    assert Placement.from_dict(p.to_dict()) == p
    assert p.recomputed_blocks(frozenset((Tier.DEVICE,))) == (0,)


@pytest.mark.usefixtures("double")
def test_a_given_placement_sizes_the_store_for_its_swapped_activations(
    tiny: SimpleNamespace, tmp_path: Path
) -> None:
    """Saved activations far larger than the store's slack: the strategy reads the first
    batch's shape and the model's width and sizes the host tier for them."""
    path = saved("llama", tmp_path / "ckpt")
    rows, seq = 48, 64  # about 12 MiB of fp32 saved activations per block
    strategy = BalanceBeamStrategy(placement=_placement(2, (0, 1)), compute_dtype="fp32")
    trainer, recorder = tiny.make_trainer(strategy, 1)
    ids = torch.randint(0, VOCAB, (rows, seq), generator=torch.Generator().manual_seed(0))
    module = CausalLMModule(str(path), learning_rate=1e-3)
    trainer.fit(module, DataLoader([{"input_ids": ids}], batch_size=None))  # type: ignore[arg-type]
    store = strategy.store
    assert store is not None and len(recorder.losses) == 1
    held = sum(store.spec(n).nbytes for n in store.names() if n.startswith("swap."))
    assert held > 4 << 20  # beyond the slack
    assert store.config.host_budget >= held
    strategy.close()


@pytest.mark.slow  # a full-size Llama-7B dry run on the meta device: about 10 s on 2 cores
def test_a_swapping_plan_moves_on_each_link_what_it_prices_in_a_dry_run() -> None:
    """The ``llama-7b-24gb`` recipe's job on ``rtx4090`` with 128 GiB of host memory, where
    swapping the last blocks is cheaper than recomputing them: the engine, run on meta
    tensors, holds the swapped blocks' chunks fetched back within the plan's device budget
    and moves on each link what the plan prices, within the 5 % the recipes are held to."""
    config = {
        "model_type": "llama", "hidden_size": 4096, "num_hidden_layers": 32,
        "num_attention_heads": 32, "num_key_value_heads": 32, "intermediate_size": 11008,
        "vocab_size": 32000, "max_position_embeddings": 4096,
    }  # fmt: skip
    job = FitJob(seq_len=2048, global_batch_seqs=128)
    forced = PlanOverrides(micro_batch=1, grad_accum=128)
    hw = preset("rtx4090").replace(host_memory=128 << 30)
    plan = make_plan(model_profile_from_config(config), hw, job, overrides=forced)
    assert plan.placement.swapped
    report = dry_fit(plan, config)
    assert Tier.DEVICE not in report.over  # the chunks fetched back are in the device budget
    for link in PRICED_LINKS:
        assert report.links[link] == pytest.approx(report.planned_links[link], rel=0.05), link


@pytest.mark.slow  # a 370M Llama's LoRA dry run on the meta device: about 15 s on 2 cores
def test_a_lora_plan_that_swaps_holds_and_moves_what_it_prices_in_a_dry_run() -> None:
    """LoRA adapters over a frozen 370M Llama, planned with swapping on a 6 GiB device: a
    frozen matrix saves no input for its weight gradient, so the blocks' saved
    activations are priced from a trace of what the module trains; the engine, run on
    meta tensors, moves on each link what the plan prices (within the 5 % the recipes are
    held to), and its device peak, the store's slots for the chunks fetched back
    included, stays within the plan's budget."""
    config = builtin_config("llama-370m")
    lora = LoraOptions.from_value(
        {"rank": 16, "dropout": 0.05, "target_modules": ["q_proj", "v_proj", "up_proj"]}
    )
    profile = model_profile_from_module(meta_model(config, torch.bfloat16, lora=lora))
    hw = preset("rtx4090").replace(device_memory=6 << 30)
    job = FitJob(seq_len=2048, global_batch_seqs=8)
    forced = PlanOverrides(micro_batch=4, grad_accum=2)
    plan = make_plan(profile, hw, job, overrides=forced)
    assert plan.placement.swapped and plan.placement.recomputed
    report = dry_fit(plan, config, lora=lora)
    assert report.over == []
    for link in PRICED_LINKS:
        assert report.links[link] == pytest.approx(report.planned_links[link], rel=0.05), link
