"""A user's own ``training_step`` that uses the model as plain PyTorch allows, under
balance_beam against plain Lightning: two forwards before one backward (a preference
pair), a forward without grad beside the one that trains (a reference's log-probs), and
a loss on what transformers captures inside the blocks (attention weights).

The checkpoint is written with ``save_pretrained`` and loaded by path in the module;
both runs are seeded alike. Blocks paged from NVMe are recomputed in backward; blocks
on the host run with ordinary autograd (a CPU uses their memory in place).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from transformers import AutoConfig, AutoModelForCausalLM

from bb_lightning import BalanceBeamStrategy
from bb_lightning.engine.pager import Placement
from storage.tiers import Tier

STEPS, ACCUM = 2, 2


@pytest.fixture(autouse=True)
def _one_thread() -> Iterator[None]:
    """Tiny matrices gain nothing from threads; on a busy machine they only wait for them."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


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
    strategy: Any, path: Path, kind: str, tiny: SimpleNamespace
) -> tuple[list[float], dict[str, torch.Tensor]]:
    torch.manual_seed(0)
    module = Steps(path, kind)
    trainer, recorder = tiny.make_trainer(strategy, STEPS, accumulate_grad_batches=ACCUM)
    trainer.fit(module, tiny.loader(STEPS * ACCUM))
    return recorder.losses, {k: v.detach().clone() for k, v in module.state_dict().items()}


@pytest.mark.parametrize("weights", [Tier.NVME, Tier.HOST], ids=lambda t: t.value)
@pytest.mark.parametrize(
    "kind", ["pair", "pair_lower_frozen", "reference_without_grad", "attentions"]
)
def test_a_users_training_step_trains_like_plain_lightning(
    kind: str, weights: Tier, checkpoint: Path, tiny: SimpleNamespace, tmp_path: Path
) -> None:
    want_losses, want = _fit("auto", checkpoint, kind, tiny)
    strategy = BalanceBeamStrategy(
        placement=Placement.uniform(3, weights=weights, master=Tier.NVME, prefetch_depth=1),
        compute_dtype="fp32",
        nvme_path=str(tmp_path / "nvme"),
    )
    losses, got = _fit(strategy, checkpoint, kind, tiny)
    strategy.close()
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(want_losses))
    assert got.keys() == want.keys()
    for key, value in want.items():
        torch.testing.assert_close(got[key], value, rtol=1e-5, atol=2e-5, msg=key)
