"""The device memory measure() gives the device tier on CUDA (CUDA functions stood in for)."""

from __future__ import annotations

import importlib
import json
from pathlib import Path

import pytest
import torch

from bb_lightning.planner.profile import HardwareProfile

m = importlib.import_module("bb_lightning.probe.measure")  # the package exports the function

GIB = 1 << 30


@pytest.fixture
def fake_cuda(monkeypatch: pytest.MonkeyPatch) -> dict[str, float]:
    """An 80 GiB device with 70 GiB free; the allocator caches 6 GiB, of which it holds
    2 GiB after ``empty_cache``; the process may use ``fraction`` of the device."""
    state = {"reserved": 6 * GIB, "free": 70 * GIB, "fraction": 1.0, "emptied": 0}

    def empty_cache() -> None:
        state["free"] += state["reserved"] - 2 * GIB
        state["reserved"] = 2 * GIB
        state["emptied"] += 1

    monkeypatch.setattr(torch.cuda, "empty_cache", empty_cache)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (state["free"], 80 * GIB))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: state["reserved"])
    monkeypatch.setattr(
        torch.cuda, "get_per_process_memory_fraction", lambda device=None: state["fraction"]
    )
    return state


def test_free_memory_is_read_after_emptying_the_cache(fake_cuda: dict[str, float]) -> None:
    got = m.cuda_device_memory(torch.device("cuda", 0))
    assert fake_cuda["emptied"] == 1
    assert got == 74 * GIB  # 70 free + 4 handed back by the cache


def test_a_per_process_fraction_caps_the_device_memory(fake_cuda: dict[str, float]) -> None:
    fake_cuda["fraction"] = 0.3  # 24 GiB of 80, of which the allocator holds 2
    assert m.cuda_device_memory(torch.device("cuda", 0)) == int(0.3 * 80 * GIB) - 2 * GIB
    fake_cuda["fraction"] = 0.01  # less than the allocator already holds
    assert m.cuda_device_memory(torch.device("cuda", 0)) == 0


def test_a_cached_cuda_profile_gets_the_device_memory_of_now(
    fake_cuda: dict[str, float], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv(m.CACHE_ENV, str(tmp_path))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Fake GPU")
    identity = m.machine_identity(None)
    cached = HardwareProfile(
        name="measured: Fake GPU", device_type="cuda", device_memory=70 * GIB,
        device_flops=1e15, h2d_bandwidth=5e10, d2h_bandwidth=5e10, host_memory=100 * GIB,
        nvme_read_bandwidth=0.0, nvme_write_bandwidth=0.0, nvme_capacity=0,
        host_adam_params_per_s=1e9, cores=16,
    )  # fmt: skip
    path = m.cache_path(identity)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"identity": identity, "profile": cached.to_dict()}))
    fake_cuda["fraction"] = 0.3
    got = m.measure()
    assert got.replace(device_memory=cached.device_memory) == cached
    assert got.device_memory == int((int(0.3 * 80 * GIB) - 2 * GIB) * m.CUDA_DEVICE_SHARE)


def test_the_model_shaped_probe_runs_only_within_the_process_share(
    fake_cuda: dict[str, float],
) -> None:
    # the probe's copies of a 1.26 B Llama at 4 x 2048 tokens need about 12 GiB: room on
    # the whole device, none within a tenth of it (set_per_process_memory_fraction)
    from bb_lightning.probe import calibrate, model_profile_from_config

    config = {"model_type": "llama", "hidden_size": 2048, "intermediate_size": 5632,
              "num_hidden_layers": 22, "num_attention_heads": 32, "num_key_value_heads": 32,
              "vocab_size": 32000, "tie_word_embeddings": False}  # fmt: skip
    model = model_profile_from_config(config)
    cuda = torch.device("cuda", 0)
    assert calibrate._fits(model, 2048, 4, cuda, span=7)
    fake_cuda["fraction"] = 0.1
    assert not calibrate._fits(model, 2048, 4, cuda, span=7)
