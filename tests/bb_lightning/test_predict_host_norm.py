"""``trainer.predict`` under balance_beam on a CPU device runs the Llama family's RMS norms
through the compiled kernel (``engine.host_norm``) and predicts Hugging Face greedy
``generate``'s tokens (fp32) from a ``save_pretrained`` directory; other norms keep their
class ``forward``, and the module's norms get theirs back when the engine closes."""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from torch.utils.data import DataLoader

from bb_lightning import BalanceBeamStrategy
from bb_lightning.engine import host_norm
from bb_lightning.module import CausalLMModule
from bb_lightning.placement import Placement
from storage.tiers import Tier

from .tiny import FAMILIES, VOCAB, check_like_generate, save_tiny

NEW = 6

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize(("family", "served"), [("llama", True), ("gemma_tied", False)])
def test_predict_norms_through_the_kernel_and_generates_like_hf(
    family: str, served: bool, tiny: SimpleNamespace, tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    if shutil.which(os.environ.get("CC", "cc")) is None:
        pytest.skip("no C compiler on PATH: RMS norms run torch's operations")
    calls: list[int] = []
    call = host_norm._Kernel.__call__
    monkeypatch.setattr(host_norm._Kernel, "__call__",
                        lambda self, *a: calls.append(1) or call(self, *a))  # fmt: skip
    path = save_tiny(tmp_path / "ckpt", {**FAMILIES[family], "initializer_range": 0.2})
    module = CausalLMModule(str(path), max_new_tokens=NEW)
    strategy = BalanceBeamStrategy(
        placement=Placement.uniform(2, weights=Tier.HOST), compute_dtype="fp32",
        nvme_path=str(tmp_path / "nvme"),
    )  # fmt: skip
    trainer, _ = tiny.make_trainer(strategy, 1)
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(3, VOCAB, (3, 7), generator=g)
    mask = torch.ones_like(ids)
    ids[0, :2] = mask[0, :2] = 0  # a shorter prompt, padded on the left
    batch = {"id": ["a", "b", "c"], "input_ids": ids, "attention_mask": mask}
    records = trainer.predict(module, DataLoader([batch], batch_size=None))
    assert records is not None
    first = len(calls)
    # every block's two norms and the final one, at the prefill and each decode step
    steps = max(len(r["token_ids"]) for r in records[0])  # type: ignore[union-attr]
    assert (steps >= 1 and first >= 5 * steps) if served else not calls
    # the module handed back runs its own norms; paged again, the kernel's
    assert [type(m).__name__ for m in module.modules() if "forward" in vars(m)] == []
    again = trainer.predict(module, DataLoader([batch], batch_size=None))
    assert again == records and len(calls) == 2 * first
    strategy.close()
    assert [type(m).__name__ for m in module.modules() if "forward" in vars(m)] == []
    check_like_generate(path, module, [batch], records, NEW)
