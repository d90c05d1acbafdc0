"""bf16 compute with fp32 host masters against a plain-torch loop doing the same.

Plain Lightning ``"bf16-true"`` keeps bf16 weights without fp32 masters, so its
updates round away (lr x update < bf16 spacing) and it is no reference. The
reference here runs the Hugging Face model in bf16 with the host kernels a fit on a CPU
installs (``train_kernels``; each checked against float64 in its own tests), sums each
micro-batch's bf16 gradient into fp32 (as the engine's fp32 accumulators do) and steps fp32
master weights with ``torch.optim.AdamW``. Without clipping both sides then compute the
same: the masters agree to 1e-7 of the reference's movement (seeds 0-7).

With norm clipping the two sum the gradients' norm in other groupings (the engine block by
block), so their clip coefficients can differ in the last bit; a master then lands on the
other side of a bf16 rounding, the next step's bf16 weights differ by one spacing, and the
runs part at bf16 noise. Measured over data seeds 0-7 (AMD EPYC, 2 threads): half the
seeds agree to 1e-6, the others' masters differ by up to 0.56 % of the reference's movement
(the norm of the difference over the norm of ``final - initial``, over all tensors) and up
to 2.05 % for one tensor (the embedding, whose rarely seen rows move least). The wrong
engines these bounds reject (reference variants, seed 0): no step (losses 1.4e-3 off,
masters 100 %), lr x2 or x0.5 (losses 1.1e-3, masters 50 %), a dropped micro-batch gradient
(losses 9.6e-4, masters 90 %), clipping ignored (masters 2.0 % over all) and weight decay
ignored (1.3 % over all, 16 % for one tensor; the tests use weight decay 0.1 so that 3 steps
of it show above bf16 noise). A clip twice as loose (0.76 %, 1.9 %) lies within that noise:
the clip's arithmetic is checked in fp32 against plain Lightning
(``tests/bb_lightning/strategy/test_strategy.py``).
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from bb_lightning import BalanceBeamStrategy
from bb_lightning.engine import host_linear, host_norm, train_kernels
from bb_lightning.module import CausalLMModule
from bb_lightning.placement import Placement
from storage.tiers import Tier

STEPS = 3
WEIGHT_DECAY = 0.1
LOSS_RTOL = 2e-4
"""Relative loss bound: measured 3e-5, a wrong step at least 9.6e-4 (module docstring)."""
MASTERS_RTOL = 1e-2
"""Bound on |masters - reference| / |reference's movement| over all tensors: measured up to
0.56 % (module docstring)."""
TENSOR_RTOL = 4e-2
"""The same bound for each tensor: measured up to 2.05 %."""


def _reference(
    config: dict[str, Any],
    batches: list[dict[str, torch.Tensor]],
    accumulate: int = 1,
    clip: float | None = None,
    compute_dtype: torch.dtype = torch.bfloat16,
    kernels: bool = False,
) -> Any:
    """Per-micro-batch losses (divided by ``accumulate``, as Lightning reports them), initial
    and final fp32 masters of ``compute_dtype`` compute with ``torch.optim.AdamW`` on fp32
    masters; with ``kernels`` the model runs the host kernels a fit on a CPU device installs
    (:func:`~bb_lightning.engine.train_kernels.install`, each checked against float64 in its
    own tests), so that its gradients round as the engine's do."""
    cfg = dict(config)
    with torch.random.fork_rng():
        torch.manual_seed(0)  # CausalLMModule(seed=0) initialises the same way
        master = AutoModelForCausalLM.from_config(
            AutoConfig.for_model(cfg.pop("model_type"), **cfg)
        )
    initial = {k: v.detach().clone() for k, v in master.state_dict().items()}
    compute = copy.deepcopy(master).to(compute_dtype)
    optimizer = torch.optim.AdamW(
        master.parameters(), lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=WEIGHT_DECAY
    )
    losses = []
    restore = train_kernels.install(torch.device("cpu"), compute) if kernels else None
    try:
        _steps(compute, master, optimizer, batches, accumulate, clip, losses)
    finally:
        if restore is not None:
            restore()
    final = {k: v.detach().clone() for k, v in master.state_dict().items()}
    return losses, initial, final


def _steps(
    compute: torch.nn.Module,
    master: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    batches: list[dict[str, torch.Tensor]],
    accumulate: int,
    clip: float | None,
    losses: list[float],
) -> None:
    """:func:`_reference`'s steps: ``losses`` gets each micro-batch's."""
    for k, batch in enumerate(batches):
        if k % accumulate == 0:
            with torch.no_grad():
                for p, m in zip(compute.parameters(), master.parameters(), strict=True):
                    p.copy_(m)
        loss = compute(input_ids=batch["input_ids"], labels=batch["input_ids"]).loss / accumulate
        loss.backward()
        losses.append(float(loss))
        for p, m in zip(compute.parameters(), master.parameters(), strict=True):
            if p.grad is not None:  # fp32 sum of the micro-batches' bf16 gradients
                m.grad = p.grad.float() if m.grad is None else m.grad + p.grad.float()
            p.grad = None
        if (k + 1) % accumulate:
            continue
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(master.parameters(), clip)
        optimizer.step()
        optimizer.zero_grad()


def _module(config: dict[str, Any]) -> CausalLMModule:
    """The module under test with the reference's weight decay, fp32 initial weights."""
    module = CausalLMModule(config, learning_rate=1e-3, weight_decay=WEIGHT_DECAY, seed=0)
    module.configure_model()  # fp32 initial weights whatever the precision plugin's default
    return module


def _assert_masters_moved_as_reference(
    state: dict[str, torch.Tensor],
    initial: dict[str, torch.Tensor],
    final_ref: dict[str, torch.Tensor],
) -> None:
    """The engine's fp32 masters end where the reference's did, relative to how far
    the reference's moved: over all tensors and for each one."""
    off = moved = 0.0
    for key, want in final_ref.items():
        got = state[f"model.{key}"].float()
        key_off, key_moved = float((got - want).norm()), float((want - initial[key]).norm())
        assert key_off <= TENSOR_RTOL * key_moved, (key, key_off / key_moved)
        off, moved = off + key_off**2, moved + key_moved**2
    assert off**0.5 <= MASTERS_RTOL * moved**0.5, (off / moved) ** 0.5


@pytest.mark.parametrize("precision", ["bf16-mixed", "bf16-true"])
def test_bf16_blocks_with_fp32_masters_match_reference(
    tiny: SimpleNamespace, precision: str
) -> None:
    config = tiny.tiny_llama()
    losses_ref, initial, final_ref = _reference(config, tiny.batches(STEPS), kernels=True)
    module = _module(config)
    placement = Placement.uniform(4, weights=Tier.HOST, master=Tier.HOST, prefetch_depth=1)
    strategy = BalanceBeamStrategy(placement=placement)
    trainer, recorder = tiny.make_trainer(strategy, STEPS, precision=precision)
    trainer.fit(module, tiny.loader(STEPS))
    assert strategy.engine is not None and strategy.engine.compute_dtype == torch.bfloat16
    assert strategy.engine.store.host_view("block.0.weight").dtype == torch.bfloat16  # paged
    layer = module.model.model.layers[0] if module.model is not None else None
    # after fit the module holds the masters in the dtype plain Lightning leaves: fp32 under
    # bf16-mixed, bf16 under bf16-true (the fp32 masters stay in the store, read below)
    handed = torch.bfloat16 if precision == "bf16-true" else torch.float32
    assert layer is not None and layer.self_attn.q_proj.weight.dtype == handed
    torch.testing.assert_close(
        torch.tensor(recorder.losses), torch.tensor(losses_ref), rtol=LOSS_RTOL, atol=0
    )
    state = dict(strategy.lightning_module_state_dict())
    assert all(v.dtype == torch.float32 for k, v in state.items() if k.endswith("weight"))
    _assert_masters_moved_as_reference(state, initial, final_ref)
    strategy.close()


@pytest.mark.slow
def test_bf16_accumulation_and_clipping_on_every_tier_match_reference(
    tiny: SimpleNamespace, tmp_path: Path, count_host_kernel: Callable[..., list[int]]
) -> None:
    """bf16 with accumulation 2 and norm clipping, blocks on NVMe, host and device; the
    gradients summed, and the blocks stepped in one pass, by the compiled kernel where it
    builds."""
    sums, one_pass = count_host_kernel("sum_into"), count_host_kernel("adamw")
    config, accumulate, clip = tiny.tiny_llama(), 2, 0.5
    batches = tiny.batches(STEPS * accumulate)
    losses_ref, initial, final_ref = _reference(config, batches, accumulate, clip, kernels=True)
    module = _module(config)
    placement = Placement(
        weights=(Tier.NVME, Tier.HOST, Tier.DEVICE, Tier.HOST),
        master=(Tier.HOST, Tier.NVME, Tier.HOST, Tier.DEVICE),
        prefetch_depth=1,
    )
    strategy = BalanceBeamStrategy(placement=placement, nvme_path=str(tmp_path))
    trainer, recorder = tiny.make_trainer(
        strategy,
        STEPS,
        precision="bf16-true",
        accumulate_grad_batches=accumulate,
        gradient_clip_val=clip,
    )
    trainer.fit(module, tiny.loader(STEPS * accumulate))
    assert strategy.engine is not None and strategy.engine.step_count == STEPS
    kern = host_norm.kernel()
    assert sums or kern is None
    assert one_pass or kern is None or not kern.adamw_exact
    torch.testing.assert_close(
        torch.tensor(recorder.losses), torch.tensor(losses_ref), rtol=LOSS_RTOL, atol=0
    )
    state = dict(strategy.lightning_module_state_dict())
    _assert_masters_moved_as_reference(state, initial, final_ref)
    strategy.close()


def _distance(state: dict[str, torch.Tensor], to: dict[str, torch.Tensor],
              initial: dict[str, torch.Tensor]) -> float:  # fmt: skip
    """|state - to| / |to - initial| over all tensors (``state`` keys prefixed ``model.``
    where the module's are)."""
    off = moved = 0.0
    for key, want in to.items():
        got = state.get(f"model.{key}", state.get(key))
        assert got is not None, key
        off += float((got.float() - want).norm()) ** 2
        moved += float((want - initial[key]).norm()) ** 2
    return (off / moved) ** 0.5


@pytest.mark.parametrize("precision", ["bf16-mixed", "bf16-true"])
def test_attention_backward_on_the_tiles_trains_like_reference(
    tiny: SimpleNamespace, tmp_path: Path, count_host_kernel: Callable[..., list[int]],
    precision: str,
) -> None:  # fmt: skip
    """Heads of 32 (GQA 4:2), blocks paged from NVMe (recomputed in backward) and on the
    host: the attention's backward runs on the CPU's matrix tiles where they exist, and the
    run ends as close to the fp32-compute reference as the bf16 reference with torch's
    attention does (its gradients round differently, and AdamW scales what is noise in the
    smallest ones alike, so the per-tensor bound of the tests above does not apply); after
    fit, transformers' ``sdpa`` is its own again. The RMS norms' backward runs through the
    host kernel (``train_norm``) too.

    Measured: the engine 1.0 x the bf16 reference's distance (0.0669 against 0.0672); with a
    kernel that drops the softmax gradient's row sums 6.4 x, without the scores' scale in
    the gradient it fails too."""
    grads = count_host_kernel("attention_backward", host_linear._Kernel)
    norms = count_host_kernel("norm_backward")
    config = tiny.tiny_llama(
        hidden_size=128, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2,
        head_dim=32,
    )  # fmt: skip
    losses_ref, initial, final_ref = _reference(config, tiny.batches(STEPS))
    _, _, final_fp32 = _reference(config, tiny.batches(STEPS), compute_dtype=torch.float32)
    module = _module(config)
    placement = Placement(
        weights=(Tier.NVME, Tier.HOST, Tier.NVME, Tier.HOST),
        master=(Tier.HOST,) * 4,
        prefetch_depth=1,
    )
    strategy = BalanceBeamStrategy(placement=placement, nvme_path=str(tmp_path))
    trainer, recorder = tiny.make_trainer(strategy, STEPS, precision=precision)
    trainer.fit(module, tiny.loader(STEPS))
    # four blocks' backwards a step, the NVMe ones' after their recomputed forward
    assert len(grads) == 4 * STEPS or host_linear.attention_kernel() is None
    # the RMS norms' backward through the host kernel: two a block and the final norm's
    assert len(norms) == (2 * 4 + 1) * STEPS or host_norm.kernel() is None
    assert ALL_ATTENTION_FUNCTIONS["sdpa"] is sdpa_attention_forward
    torch.testing.assert_close(
        torch.tensor(recorder.losses), torch.tensor(losses_ref), rtol=LOSS_RTOL, atol=0
    )
    state = dict(strategy.lightning_module_state_dict())
    ours, bf16 = _distance(state, final_fp32, initial), _distance(final_ref, final_fp32, initial)
    assert ours <= 1.5 * bf16, (ours, bf16)
    strategy.close()


class _UsersModule(pl.LightningModule):
    """A user's own module around a ``save_pretrained`` checkpoint (``sdpa``, fp32 weights)."""

    def __init__(self, path: Path) -> None:
        super().__init__()
        self.net = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        return self.net(input_ids=batch["input_ids"], labels=batch["input_ids"]).loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(
            self.parameters(), lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=WEIGHT_DECAY
        )


def test_a_users_module_trains_through_the_tiles_attention_backward(
    tiny: SimpleNamespace, tmp_path: Path, count_host_kernel: Callable[..., list[int]]
) -> None:
    """The user's own LightningModule loading a ``save_pretrained`` Llama with heads of 32 by
    path, ``bf16-mixed``: the attention's backward runs on the tiles where they exist, the RMS
    norms' and the gated MLPs' through the host kernels, and the
    module after ``fit`` holds masters as close to the fp32-compute run as the bf16 reference's
    (the bound of the test above)."""
    grads = count_host_kernel("attention_backward", host_linear._Kernel)
    norms = count_host_kernel("norm_backward")
    mlps = count_host_kernel("silu_mul_backward")
    config = tiny.tiny_llama(
        hidden_size=128, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2,
        head_dim=32,
    )  # fmt: skip
    losses_ref, initial, final_ref = _reference(config, tiny.batches(STEPS))
    _, _, final_fp32 = _reference(config, tiny.batches(STEPS), compute_dtype=torch.float32)
    cfg = dict(config)
    with torch.random.fork_rng():
        torch.manual_seed(0)  # the reference's initial weights
        AutoModelForCausalLM.from_config(
            AutoConfig.for_model(cfg.pop("model_type"), **cfg)
        ).save_pretrained(tmp_path / "llama")
    module = _UsersModule(tmp_path / "llama")
    placement = Placement(
        weights=(Tier.NVME, Tier.HOST, Tier.NVME, Tier.HOST), master=(Tier.HOST,) * 4,
        prefetch_depth=1,
    )  # fmt: skip
    strategy = BalanceBeamStrategy(placement=placement, nvme_path=str(tmp_path / "nvme"))
    trainer, recorder = tiny.make_trainer(strategy, STEPS, precision="bf16-mixed")
    trainer.fit(module, tiny.loader(STEPS))
    assert len(grads) == 4 * STEPS or host_linear.attention_kernel() is None
    assert len(norms) == (2 * 4 + 1) * STEPS or host_norm.kernel() is None
    assert len(mlps) == 4 * STEPS or host_norm.kernel() is None  # each block's MLP backward
    assert not any("forward" in vars(m) for m in module.modules())  # the class's forwards again
    torch.testing.assert_close(
        torch.tensor(recorder.losses), torch.tensor(losses_ref), rtol=LOSS_RTOL, atol=0
    )
    after = {k: v.detach().float() for k, v in module.net.state_dict().items()}
    ours, bf16 = _distance(after, final_fp32, initial), _distance(final_ref, final_fp32, initial)
    assert ours <= 1.5 * bf16, (ours, bf16)
    strategy.close()
