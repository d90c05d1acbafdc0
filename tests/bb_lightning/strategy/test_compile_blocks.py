"""``compile_blocks``: a strategy whose blocks run compiled trains as plain Lightning does,
compiling the block forward once per way it is called, not per block; an unknown backend
is refused before anything is built."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch._dynamo
from torch._dynamo.utils import counters

from bb_lightning import BalanceBeamStrategy
from bb_lightning.placement import Placement
from storage.tiers import Tier

H, N = Tier.HOST, Tier.NVME
STEPS = 3


@pytest.fixture
def clean_dynamo() -> Iterator[None]:
    torch._dynamo.reset()
    counters.clear()
    with torch._dynamo.config.patch(recompile_limit=3, fail_on_recompile_limit_hit=True):
        yield
    torch._dynamo.reset()


def test_compiled_blocks_train_as_plain_lightning(
    tiny: SimpleNamespace, tmp_path: Path, reference_run: Any, clean_dynamo: None
) -> None:
    placement = Placement(weights=(N, H, H, N), master=(H, N, H, H), prefetch_depth=1)
    strategy = BalanceBeamStrategy(
        nvme_path=str(tmp_path / "nvme"), placement=placement, compute_dtype="fp32",
        adapt_tolerance=None, gather_on_teardown=True, compile_blocks="aot_eager",
    )  # fmt: skip
    module = tiny.make_module(tiny.tiny_llama())
    trainer, recorder = tiny.make_trainer(strategy, STEPS)
    trainer.fit(module, tiny.loader(STEPS))
    assert 1 <= counters["stats"]["unique_graphs"] <= 3  # compiled, not once per block
    losses, state = reference_run(tiny.tiny_llama(), STEPS)
    torch.testing.assert_close(torch.tensor(recorder.losses), torch.tensor(losses))
    got = module.state_dict()
    for key, value in state.items():
        torch.testing.assert_close(got[key], value, rtol=1e-5, atol=1e-6, msg=key)


def test_an_unknown_compile_backend_is_refused_naming_it() -> None:
    with pytest.raises(ValueError, match=r"compile_blocks='inductr' is not a torch\.compile"):
        BalanceBeamStrategy(compile_blocks="inductr")
