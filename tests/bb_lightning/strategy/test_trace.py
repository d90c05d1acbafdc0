"""``--trace``: a Chrome/Perfetto trace of compute and copies from a real offloaded fit."""

from __future__ import annotations

import json
from collections import defaultdict

import lightning.pytorch as pl
import pytest

from bb_lightning import BalanceBeamStrategy
from bb_lightning.data import TextDataModule
from bb_lightning.module import CausalLMModule
from bb_lightning.planner import PlanOverrides
from bb_lightning.strategy.trace import TraceCallback, TraceHandle, TraceRecorder
from storage.tiers import Tier

from ..tiny import tiny_llama_config

TINY = tiny_llama_config(
    3, hidden_size=32, intermediate_size=64, num_attention_heads=2, num_key_value_heads=2,
    vocab_size=264,
)  # fmt: skip


@pytest.fixture(scope="module")
def trace(tmp_path_factory: pytest.TempPathFactory) -> dict:
    root = tmp_path_factory.mktemp("trace")
    (root / "text.txt").write_text("def f(x):\n    return x + 1\n" * 200)
    (root / "nvme").mkdir()
    strategy = BalanceBeamStrategy(
        nvme_path=str(root / "nvme"),
        hardware="a100-80gb",
        overrides=PlanOverrides(weights_tier=Tier.NVME, master_tier=Tier.NVME),
    )
    trainer = pl.Trainer(
        strategy=strategy, accelerator="cpu", max_steps=3, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        limit_val_batches=0, callbacks=[TraceCallback(root / "t.json")],
    )  # fmt: skip
    data = TextDataModule(str(root / "text.txt"), seq_len=32, batch_size=2, val_fraction=0.0)
    trainer.fit(CausalLMModule(TINY), datamodule=data)
    strategy.close()
    return json.loads((root / "t.json").read_text())


def test_trace_is_chrome_json_with_complete_events(trace: dict) -> None:
    events = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert events
    for e in events:
        assert {"name", "ph", "ts", "dur", "pid", "tid"} <= set(e)
        assert e["dur"] >= 0 and e["ts"] >= 0
    names = {e["tid"]: e["args"]["name"] for e in trace["traceEvents"] if e["ph"] == "M"}
    assert set(names.values()) >= {"compute"} and any(n.startswith("copy") for n in names.values())
    assert {e["tid"] for e in events} <= set(names)


def test_trace_holds_compute_per_block_and_copies_per_tensor(trace: dict) -> None:
    events = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    blocks = {e["name"] for e in events if e.get("cat") == "compute"}
    assert blocks == {"block 0", "block 1", "block 2"}
    pages = {e["name"] for e in events if e["name"].startswith("page-in")}
    assert {"page-in block.0.weight", "page-in block.2.weight"} <= pages
    # 3 steps x (forward + backward) visit every block: at least 6 page-ins of block 1.
    assert sum(e["name"] == "page-in block.1.weight" for e in events) >= 6


def test_timestamps_are_monotone_per_track(trace: dict) -> None:
    per_track: dict[int, list[float]] = defaultdict(list)
    for e in trace["traceEvents"]:
        if e["ph"] == "X":
            per_track[e["tid"]].append(e["ts"])
    for ts in per_track.values():
        assert ts == sorted(ts)


def test_handle_removes_its_wrappers() -> None:
    class Pager:
        def acquire(self, i: int) -> int:
            return i

    pager, handle = Pager(), TraceHandle()
    recorder = TraceRecorder()
    handle.patch(pager, "acquire", lambda orig: lambda i: orig(i) + 1)
    assert pager.acquire(1) == 2
    with pytest.raises(ValueError, match="already wrapped"):
        handle.patch(pager, "acquire", lambda orig: orig)
    handle.remove()
    assert pager.acquire(1) == 1 and "acquire" not in vars(pager)
    with recorder.span("x", "compute", cat="compute"):
        pass
    assert recorder.to_json()["traceEvents"][-1]["name"] == "x"
