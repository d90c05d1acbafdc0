"""A user's own ``training_step`` and ``configure_optimizers`` that use the model as plain
PyTorch allows, under balance_beam against plain Lightning: two forwards before one
backward (a preference pair), a forward without grad beside the one that trains (a
reference's log-probs), a loss on what transformers captures inside the blocks (attention
weights), with the model's activation checkpointing on; AdamW param groups of their own weight decay, learning rate, betas and eps
(grouped by ``ndim`` as code written for plain PyTorch does, a scheduler on top), an
optimizer given only some of the parameters, torch ``Adam`` without weight decay.

The checkpoint is written with ``save_pretrained`` and loaded by path in the module;
both runs are seeded alike. Blocks paged from NVMe are recomputed in backward, or swapped
(their activations kept while their weights are paged out); blocks on the host run with
ordinary autograd (a CPU uses their memory in place).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader
from transformers import AutoConfig, AutoModelForCausalLM

from bb_lightning import BalanceBeamStrategy
from bb_lightning.engine import host_norm
from bb_lightning.placement import Placement
from storage.tiers import Tier

from .tiny import cpu_profile

STEPS, ACCUM = 2, 2


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory, tiny: SimpleNamespace) -> Path:
    cfg = tiny.tiny_llama(3)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(cfg.pop("model_type"), **cfg))
    path = tmp_path_factory.mktemp("user") / "llama"
    model.save_pretrained(path)
    return path


class Steps(pl.LightningModule):
    """Training steps of the kinds named in the module docstring."""

    def __init__(self, path: Path, kind: str) -> None:
        super().__init__()
        self.kind = kind
        self.net = AutoModelForCausalLM.from_pretrained(
            path, dtype=torch.float32, attn_implementation="eager"
        )
        if kind == "pair_lower_frozen":  # frozen blocks whose input still needs a gradient
            for layer in self.net.model.layers[:2]:
                layer.requires_grad_(False)

    def _logp(self, ids: torch.Tensor) -> torch.Tensor:
        return self.net(input_ids=ids).logits.log_softmax(-1).mean()

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        ids = batch["input_ids"]
        lm = self.net(input_ids=ids, labels=ids, output_attentions=self.kind == "attentions")
        if self.kind in ("pair", "pair_lower_frozen"):
            chosen, rejected = self._logp(ids[:, :8]), self._logp(ids[:, 8:])
            return lm.loss - F.logsigmoid(chosen - 0.5 * rejected)
        if self.kind == "reference_without_grad":
            with torch.no_grad():
                reference = self.net(input_ids=ids).logits.log_softmax(-1)
            logp = lm.logits.log_softmax(-1)
            return lm.loss + F.kl_div(logp, reference, log_target=True, reduction="batchmean")
        assert self.kind == "attentions"
        return lm.loss + lm.attentions[0].square().mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        params = [p for p in self.parameters() if p.requires_grad]
        return torch.optim.AdamW(params, lr=1e-3, weight_decay=0.01)


def _fit(
    strategy: Any, path: Path, kind: str, tiny: SimpleNamespace, cls: type[Steps] | None = None
) -> tuple[list[float], dict[str, torch.Tensor]]:
    torch.manual_seed(0)
    module = (cls or Steps)(path, kind)
    trainer, recorder = tiny.make_trainer(strategy, STEPS, accumulate_grad_batches=ACCUM)
    trainer.fit(module, tiny.loader(STEPS * ACCUM))
    return recorder.losses, {k: v.detach().clone() for k, v in module.state_dict().items()}


@pytest.mark.parametrize("weights", ["nvme", "host", "nvme-swapped"])
@pytest.mark.parametrize(
    "kind", ["pair", "pair_lower_frozen", "reference_without_grad", "attentions"]
)
def test_a_users_training_step_trains_like_plain_lightning(
    kind: str, weights: str, checkpoint: Path, tiny: SimpleNamespace, tmp_path: Path
) -> None:
    """``nvme-swapped``: the NVMe blocks keep their activations (on the CPU where their
    forward made them) while their weights are paged out, instead of recomputing."""
    want_losses, want = _fit("auto", checkpoint, kind, tiny)
    home = Tier(weights.split("-")[0])
    placement = Placement.uniform(3, weights=home, master=Tier.NVME, prefetch_depth=1)
    if weights.endswith("swapped"):
        placement = dataclasses.replace(placement, swapped=(0, 1, 2))
    strategy = BalanceBeamStrategy(
        placement=placement, compute_dtype="fp32", nvme_path=str(tmp_path / "nvme")
    )
    losses, got = _fit(strategy, checkpoint, kind, tiny)
    strategy.close()
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(want_losses))
    assert got.keys() == want.keys()
    for key, value in want.items():
        torch.testing.assert_close(got[key], value, rtol=1e-5, atol=2e-5, msg=key)


def _by_ndim(net: torch.nn.Module) -> tuple[list[torch.nn.Parameter], list[torch.nn.Parameter]]:
    """Matrices (decayed) and vectors (norms: not decayed), as nanoGPT-style code splits them."""
    params = [p for p in net.parameters() if p.requires_grad]
    return [p for p in params if p.dim() >= 2], [p for p in params if p.dim() < 2]


def _optimizer(net: torch.nn.Module, kind: str) -> Any:
    if kind == "groups_by_ndim_scheduled":
        matrices, vectors = _by_ndim(net)
        assert matrices and vectors
        opt = torch.optim.AdamW(
            [{"params": matrices, "weight_decay": 0.1, "lr": 2e-3}, {"params": vectors}],
            lr=1e-3, weight_decay=0.0,
        )  # fmt: skip
        schedule = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0 / (1 + step))
        return {"optimizer": opt, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}
    if kind == "groups_of_their_own_betas_and_eps":
        matrices, vectors = _by_ndim(net)
        return torch.optim.AdamW(
            [{"params": matrices, "betas": (0.8, 0.9)}, {"params": vectors, "eps": 1e-3}],
            lr=1e-3, weight_decay=0.05,
        )  # fmt: skip
    if kind == "attention_and_head_only":  # the other parameters get gradients, no steps
        chosen = [p for n, p in net.named_parameters() if "self_attn" in n or "lm_head" in n]
        return torch.optim.AdamW(chosen, lr=1e-3, weight_decay=0.01)
    assert kind == "adam_without_decay"
    return torch.optim.Adam(net.parameters(), lr=1e-3)


class Optimized(Steps):
    """Plain next-token loss; the optimizer of ``kind``."""

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        ids = batch["input_ids"]
        return self.net(input_ids=ids, labels=ids).loss

    def configure_optimizers(self) -> Any:
        return _optimizer(self.net, self.kind)


@pytest.mark.parametrize("weights", [Tier.NVME, Tier.HOST], ids=lambda t: t.value)
@pytest.mark.parametrize(
    "kind",
    [
        "groups_by_ndim_scheduled",
        "groups_of_their_own_betas_and_eps",
        "attention_and_head_only",
        "adam_without_decay",
    ],
)
def test_a_users_optimizer_trains_like_plain_lightning(
    kind: str,
    weights: Tier,
    checkpoint: Path,
    tiny: SimpleNamespace,
    tmp_path: Path,
    count_host_kernel: Callable[..., list[int]],
) -> None:
    """The blocks are stepped by the one-pass AdamW where it builds (its groups, and the
    parameters the optimizer was not given, cast as they are)."""
    want_losses, want = _fit("auto", checkpoint, kind, tiny, Optimized)
    one_pass = count_host_kernel("adamw")
    strategy = BalanceBeamStrategy(
        placement=Placement.uniform(3, weights=weights, master=Tier.NVME, prefetch_depth=1),
        compute_dtype="fp32",
        nvme_path=str(tmp_path / "nvme"),
    )
    losses, got = _fit(strategy, checkpoint, kind, tiny, Optimized)
    strategy.close()
    kern = host_norm.kernel()
    assert one_pass or kern is None or not kern.adamw_exact
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(want_losses))
    for key, value in want.items():
        torch.testing.assert_close(got[key], value, rtol=1e-5, atol=2e-5, msg=key)


class Refused(Optimized):
    def configure_optimizers(self) -> Any:
        params = self.net.parameters()
        if self.kind == "sgd":
            return torch.optim.SGD(params, lr=1e-2)
        if self.kind == "amsgrad":
            return torch.optim.AdamW(params, lr=1e-3, amsgrad=True)
        return torch.optim.Adam(params, lr=1e-3, weight_decay=0.01)


@pytest.mark.parametrize(
    ("kind", "match"),
    [
        ("sgd", r"returned SGD: return torch.optim.AdamW"),
        ("amsgrad", r"AdamW param group 0 sets amsgrad=True.*drop amsgrad"),
        ("adam_l2", r"Adam param group 0 has weight_decay=0.01 .*Adam with weight_decay=0"),
    ],
)
def test_an_optimizer_the_host_step_cannot_run_is_refused_at_setup(
    kind: str, match: str, checkpoint: Path, tiny: SimpleNamespace, tmp_path: Path
) -> None:
    strategy = BalanceBeamStrategy(
        placement=Placement.uniform(3, weights=Tier.NVME), nvme_path=str(tmp_path / "nvme")
    )
    trainer, _ = tiny.make_trainer(strategy, 1)
    with pytest.raises(ValueError, match=match) as err:
        trainer.fit(Refused(checkpoint, kind), tiny.loader(1))
    assert "\n" not in str(err.value)
    strategy.close()


class Checkpointed(Optimized):
    """The model's activation checkpointing turned on, as fine-tuning scripts habitually do."""

    def __init__(self, path: Path, kind: str) -> None:
        super().__init__(path, kind)
        self.net.gradient_checkpointing_enable()

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.net.parameters(), lr=1e-3, weight_decay=0.01)


def test_a_model_with_activation_checkpointing_on_is_planned_and_trains_like_plain_lightning(
    checkpoint: Path, tiny: SimpleNamespace, tmp_path: Path
) -> None:
    """balance_beam recomputes the paged blocks itself: the model's own checkpointing is
    off while the strategy plans and trains (its trace refused it), and on again after."""
    want_losses, want = _fit("auto", checkpoint, "", tiny, Checkpointed)
    cpu = cpu_profile(nvme=1 << 30)
    strategy = BalanceBeamStrategy(hardware=cpu, compute_dtype="fp32", nvme_path=str(tmp_path))
    torch.manual_seed(0)
    module = Checkpointed(checkpoint, "")
    trainer, recorder = tiny.make_trainer(strategy, STEPS, accumulate_grad_batches=ACCUM)
    trainer.fit(module, tiny.loader(STEPS * ACCUM))
    strategy.close()
    assert strategy.plan is not None  # planned, not refused by the profile's trace
    assert module.net.is_activation_checkpointing  # the user's setting, back
    torch.testing.assert_close(torch.tensor(recorder.losses), torch.tensor(want_losses))
    for key, value in module.state_dict().items():
        torch.testing.assert_close(value, want[key], rtol=1e-5, atol=2e-5, msg=key)


class ClipsItself(Optimized):
    def configure_gradient_clipping(self, optimizer: Any, *args: Any, **kwargs: Any) -> None:
        torch.nn.utils.clip_grad_norm_(self.parameters(), 0.1)

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.net.parameters(), lr=1e-3)


class ReadsGradients(ClipsItself):
    configure_gradient_clipping = pl.LightningModule.configure_gradient_clipping

    def on_before_optimizer_step(self, optimizer: Any) -> None:
        torch.nn.utils.clip_grad_norm_(self.parameters(), 0.1)


def test_hooks_that_clip_parameter_gradients_are_refused_or_warned(
    checkpoint: Path, tiny: SimpleNamespace, tmp_path: Path
) -> None:
    """The parameters hold no ``.grad`` under balance_beam: a clipping override is refused
    before anything is built, a hook that reads gradients is warned about."""
    strategy = BalanceBeamStrategy(
        placement=Placement.uniform(3, weights=Tier.NVME), nvme_path=str(tmp_path / "nvme")
    )
    trainer, _ = tiny.make_trainer(strategy, 1)
    with pytest.raises(ValueError, match=r"overrides configure_gradient_clipping") as err:
        trainer.fit(ClipsItself(checkpoint, ""), tiny.loader(1))
    assert "\n" not in str(err.value) and strategy.store is None
    strategy.close()
    strategy = BalanceBeamStrategy(
        placement=Placement.uniform(3, weights=Tier.NVME), nvme_path=str(tmp_path / "nvme")
    )
    trainer, _ = tiny.make_trainer(strategy, 1)
    with pytest.warns(UserWarning, match=r"on_before_optimizer_step: .* no \.grad there"):
        trainer.fit(ReadsGradients(checkpoint, ""), tiny.loader(1))
    strategy.close()


def test_a_dataloader_with_forked_workers_trains_like_plain_lightning(
    checkpoint: Path, tiny: SimpleNamespace, tmp_path: Path
) -> None:
    """The user's DataLoader forks two workers after the store opened its arenas (which
    forked children do not inherit): the batches arrive as without workers, and the run
    equals plain Lightning's."""
    want_losses, want = _fit("auto", checkpoint, "reference_without_grad", tiny)
    strategy = BalanceBeamStrategy(
        placement=Placement.uniform(3, weights=Tier.NVME, master=Tier.HOST, prefetch_depth=1),
        compute_dtype="fp32", nvme_path=str(tmp_path / "nvme"),
    )  # fmt: skip
    torch.manual_seed(0)
    module = Steps(checkpoint, "reference_without_grad")
    trainer, recorder = tiny.make_trainer(strategy, STEPS, accumulate_grad_batches=ACCUM)
    loader = DataLoader(
        tiny.batches(STEPS * ACCUM), batch_size=None, num_workers=2,
        multiprocessing_context="fork",
    )  # fmt: skip
    trainer.fit(module, loader)
    strategy.close()
    torch.testing.assert_close(torch.tensor(recorder.losses), torch.tensor(want_losses))
    for key, value in want.items():
        got = module.state_dict()[key]
        torch.testing.assert_close(got, value, rtol=1e-5, atol=2e-5, msg=key)
