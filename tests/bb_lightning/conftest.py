"""Tiny models, fixed data and a plain-Lightning reference run for the strategy tests."""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from torch.utils.data import DataLoader

from bb_lightning.engine import host_norm
from bb_lightning.module import CausalLMModule

from .tiny import LLAMA_VOCAB, tiny_gpt2_config, tiny_llama_config

VOCAB = LLAMA_VOCAB
SEQ = 32
BATCH = 2


def batches(n: int, seed: int = 0) -> list[dict[str, torch.Tensor]]:
    """``n`` batches of random tokens (batch 2, seq 32), the same for a given seed."""
    g = torch.Generator().manual_seed(seed)
    return [{"input_ids": torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)} for _ in range(n)]


def loader(n: int, seed: int = 0) -> DataLoader[Any]:
    """A loader over :func:`batches` in a fixed order."""
    return DataLoader(batches(n, seed), batch_size=None, shuffle=False)  # type: ignore[arg-type]


class LossRecorder(pl.Callback):
    """Records the loss of every training micro-batch."""

    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_train_batch_end(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
    ) -> None:
        self.losses.append(float(outputs["loss"]))


def make_trainer(strategy: Any, steps: int, **kwargs: Any) -> tuple[pl.Trainer, LossRecorder]:
    """A quiet CPU trainer running ``steps`` optimizer steps, with a loss recorder."""
    recorder = LossRecorder()
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        strategy=strategy,
        max_steps=steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        callbacks=[recorder],
        **kwargs,
    )
    return trainer, recorder


def make_module(config: dict[str, Any]) -> CausalLMModule:
    """The module under test: seeded weights, lr high enough that steps move weights."""
    return CausalLMModule(config, learning_rate=1e-3, weight_decay=0.01, seed=0)


RunFn = Callable[..., tuple[list[float], dict[str, torch.Tensor]]]


@pytest.fixture(scope="session")
def reference_run() -> RunFn:
    """Plain Lightning CPU training: (per-micro-batch losses, final fp32 state dict); cached."""
    cache: dict[tuple[Any, ...], tuple[list[float], dict[str, torch.Tensor]]] = {}

    def run(config: dict[str, Any], steps: int, **kwargs: Any) -> Any:
        key = (repr(sorted(config.items())), steps, repr(sorted(kwargs.items())))
        if key not in cache:
            module = make_module(config)
            accum = kwargs.get("accumulate_grad_batches", 1)
            trainer, recorder = make_trainer("auto", steps, **kwargs)
            trainer.fit(module, loader(steps * accum))
            state = {k: v.detach().clone() for k, v in module.state_dict().items()}
            cache[key] = (recorder.losses, state)
        return cache[key]

    return run


def predict(checkpoint: Path, batch: dict[str, Any], strategy: Any, new_tokens: int) -> Any:
    """``trainer.predict`` of a ``CausalLMModule`` of ``checkpoint`` on one ``batch`` under
    ``strategy`` (closed after); the module handed back runs its own ``forward``
    everywhere."""
    module = CausalLMModule(str(checkpoint), max_new_tokens=new_tokens)
    trainer, _ = make_trainer(strategy, 1)
    records = trainer.predict(module, DataLoader([batch], batch_size=None))
    strategy.close()
    assert [m for m in module.modules() if "forward" in vars(m)] == []
    return records


@pytest.fixture(scope="session")
def tiny() -> SimpleNamespace:
    """The helpers above, for test modules (a conftest is not importable by name)."""
    return SimpleNamespace(
        tiny_llama=tiny_llama_config,
        tiny_gpt2=tiny_gpt2_config,
        batches=batches,
        loader=loader,
        make_trainer=make_trainer,
        make_module=make_module,
        predict=predict,
    )


@pytest.fixture
def one_thread() -> Iterator[None]:
    """One intra-op thread for the test: tiny matrices gain nothing from threads, and on a
    busy machine they only wait for them (``pytestmark = pytest.mark.usefixtures(...)``)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def host_kernel() -> host_norm._Kernel:
    """The compiled RMS norm and rotary embedding (``host_ops.c``), which must build where the
    machine has a C compiler; the test is skipped elsewhere (the model's own operations run)."""
    if shutil.which(os.environ.get("CC", "cc")) is None:
        pytest.skip("no C compiler on PATH: norms and rotary embeddings run torch's operations")
    built = host_norm.kernel()
    assert built is not None, "the C kernel did not build (see the warning)"
    return built


@pytest.fixture
def count_host_kernel(monkeypatch: pytest.MonkeyPatch) -> Callable[..., list[int]]:
    """``count(method, kind=host_norm._Kernel)`` wraps the compiled kernel class ``kind``'s
    ``method`` ("__call__": the norm, "rope", "sum_into": gradient sums; ``host_linear._Kernel``'s
    "__call__": the product) and returns the list each of its calls appends to."""

    def count(method: str, kind: type = host_norm._Kernel) -> list[int]:
        calls: list[int] = []
        real = getattr(kind, method)
        monkeypatch.setattr(kind, method,
                            lambda self, *a, **k: calls.append(1) or real(self, *a, **k))  # fmt: skip
        return calls

    return count
