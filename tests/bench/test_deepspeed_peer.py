"""The DeepSpeed peer of bench/train_offload.py: skipped with a reason where DeepSpeed cannot
import, and the ZeRO-3 config that DeepSpeed 0.19 needs to keep parameters on NVMe."""

from __future__ import annotations

import importlib
import os
import subprocess
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


PEER_RUN = """
import sys, tempfile, torch
from pathlib import Path
sys.path.insert(0, {bench!r})
import _deepspeed
why = _deepspeed.unavailable()
if why is not None:
    print("UNAVAILABLE", why)
    raise SystemExit(0)
seen = set()
def hook(module, args, out):
    if isinstance(out, torch.Tensor) and out.is_floating_point():
        seen.add(str(out.dtype))
torch.nn.modules.module.register_module_forward_hook(hook)
config = dict(model_type="llama", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=4, vocab_size=128,
              max_position_embeddings=64, tie_word_embeddings=False)
batches = [torch.randint(0, 128, (2, 16)) for _ in range(4)]
with tempfile.TemporaryDirectory() as d:
    seconds, _ = _deepspeed.train_deepspeed(
        config, batches, micro_batch=2, accumulate=2, warmup=1, nvme_dir=Path(d),
        weights_on_nvme=False, dtype=torch.float32)
print("STEPS", len(seconds), "DTYPES", sorted(seen))
"""


def test_the_fp32_peer_runs_in_fp32_where_deepspeed_runs(tmp_path: Path) -> None:
    """DeepSpeed 0.19's ``zero.Init`` turns a requested fp32 into bf16 on a CPU accelerator;
    the peer of ``--dtype fp32`` must compute every module's output in fp32 (run in a child
    process: DeepSpeed starts a process group)."""
    pytest.importorskip("deepspeed")
    done = subprocess.run(
        [sys.executable, "-c", PEER_RUN.format(bench=str(BENCH))],
        capture_output=True,
        text=True,
        timeout=900,
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    if "UNAVAILABLE" in done.stdout:
        pytest.skip(done.stdout.split("UNAVAILABLE", 1)[1].strip())
    last = done.stdout.strip().splitlines()[-1]
    assert last == "STEPS 1 DTYPES ['torch.float32']", done.stdout[-2000:]
