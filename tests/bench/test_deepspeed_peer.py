"""The DeepSpeed peer of bench/train_offload.py: skipped with a reason where DeepSpeed cannot
import, and the ZeRO-3 config that DeepSpeed 0.19 needs to keep parameters on NVMe."""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"


@pytest.fixture(autouse=True)
def environment() -> Iterator[None]:
    """The peer sets DeepSpeed's process-group variables; put the environment back."""
    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)


def peer(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    monkeypatch.syspath_prepend(str(BENCH))
    return importlib.import_module("_deepspeed")


def test_without_deepspeed_the_peer_says_how_to_install_it(monkeypatch: pytest.MonkeyPatch) -> None:
    module = peer(monkeypatch)
    monkeypatch.setitem(sys.modules, "deepspeed", None)  # import deepspeed raises ImportError
    why = module.unavailable()
    assert why is not None and "DeepSpeed does not import" in why and "[bench]" in why


def test_parameters_on_nvme_need_no_cpu_copy_and_no_prefetch(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    module = peer(monkeypatch)
    cfg = module.ds_config(
        micro_batch=2, accumulate=4, nvme_dir=tmp_path, weights_on_nvme=True, max_param=3 << 20
    )
    zero = cfg["zero_optimization"]
    assert zero["stage"] == 3 and zero["offload_param"]["device"] == "nvme"
    assert zero["offload_param"]["max_in_cpu"] == 0
    assert zero["offload_param"]["buffer_size"] >= 3 << 20
    assert zero["stage3_prefetch_bucket_size"] == 0
    assert zero["stage3_max_live_parameters"] == zero["stage3_max_reuse_distance"] == 0
    assert zero["offload_optimizer"]["device"] == "nvme"
    assert (cfg["train_micro_batch_size_per_gpu"], cfg["gradient_accumulation_steps"]) == (2, 4)
    on_cpu = module.ds_config(
        micro_batch=1, accumulate=1, nvme_dir=tmp_path, weights_on_nvme=False, max_param=1
    )
    assert on_cpu["zero_optimization"]["offload_param"]["device"] == "cpu"
    assert on_cpu["zero_optimization"]["offload_optimizer"]["nvme_path"] == str(tmp_path)


def test_the_peer_computes_in_the_benchmarks_dtype(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """``--dtype fp32`` (a CPU without bf16 matrix instructions) turns DeepSpeed's bf16 off."""
    module = peer(monkeypatch)
    common = dict(micro_batch=1, accumulate=1, nvme_dir=tmp_path, weights_on_nvme=False)
    assert module.ds_config(**common, max_param=1)["bf16"]["enabled"] is True
    assert module.ds_config(**common, max_param=1, bf16=False)["bf16"]["enabled"] is False
