"""The trace is an observer of the pager and the store: it reports the events any other
observer of theirs sees, and stops when its handle is removed."""

from __future__ import annotations

import threading
from collections import Counter
from pathlib import Path
from types import SimpleNamespace

import torch
from torch import nn

from bb_lightning.engine.grad_sink import GradSink
from bb_lightning.engine.pager import BlockPager
from bb_lightning.placement import ModelSizes, Placement, weights_manifest
from bb_lightning.strategy.trace import COMPUTE, TraceRecorder, install_trace
from storage import StoreConfig, Tier, TieredStore, TransferKind

MiB = 1 << 20
LABELS = {TransferKind.PAGE_IN: "page-in", TransferKind.WRITE_BACK: "write-back"}


class Seen:
    """Records what the pager and the store tell their observers."""

    def __init__(self) -> None:
        self.blocks: list[tuple[str, int]] = []
        self.copies: list[str] = []
        self._lock = threading.Lock()

    def block_acquiring(self, i: int) -> None:
        self.blocks.append(("acquiring", i))

    def block_acquired(self, i: int) -> None:
        self.blocks.append(("acquired", i))

    def block_released(self, i: int) -> None:
        self.blocks.append(("released", i))

    def transfer_started(self, kind: TransferKind, name: str) -> None:
        pass

    def transfer_finished(self, kind: TransferKind, name: str) -> None:
        with self._lock:
            self.copies.append(f"{LABELS.get(kind, 'copy')} {name}")


def test_trace_reports_the_events_the_observers_see(tmp_path: Path) -> None:
    (tmp_path / "nvme").mkdir()
    config = StoreConfig(device_budget=4 * MiB, host_budget=4 * MiB, device="cpu",
                         nvme_path=str(tmp_path / "nvme"), nvme_budget=16 * MiB)  # fmt: skip
    torch.manual_seed(0)
    blocks = [nn.Linear(16, 16) for _ in range(3)]
    with TieredStore(config) as store:
        placement = Placement.uniform(3, weights=Tier.NVME)  # bf16 weights
        sizes = ModelSizes(blocks=tuple(sum(p.numel() for p in b.parameters()) for b in blocks))
        manifest = {t.name: t for t in weights_manifest(sizes, placement)}
        pager = BlockPager(store, blocks, placement, manifest=manifest,
                           device=torch.device("cpu"), weights_only=True)  # fmt: skip
        grads = GradSink()
        recorder, seen = TraceRecorder(), Seen()
        handle = install_trace(SimpleNamespace(pager=pager, store=store, grads=grads), recorder)
        pager.add_observer(seen)
        store.add_observer(seen)
        pager.prefetch([0, 1])
        for i in range(3):
            views = pager.acquire(i)
            assert torch.equal(views[0], blocks[i].weight.detach().to(torch.bfloat16))
            pager.release(i)
        out = torch.empty(16 * 16 + 16, dtype=torch.bfloat16)
        store.read_async("block.2.weight", out).wait()
        master = torch.zeros(16 * 16 + 16)
        ticket = pager.write_weights(0, master, torch.empty_like(master, dtype=torch.bfloat16))
        assert ticket is not None
        ticket.wait_host()
        handle.remove()
        traced = len(recorder.events)
        pager.acquire(1)  # seen, no longer traced
        pager.release(1)
        grads.close()
        assert torch.equal(store.read("block.0.weight"), master.to(torch.bfloat16))

    events = recorder.events
    assert len(events) == traced
    copies = [e["name"] for e in events if e["cat"] == "copy"]
    want = ["page-in block.0.weight", "page-in block.1.weight", "page-in block.2.weight",
            "copy block.2.weight", "write-back block.0.weight"]  # fmt: skip
    assert Counter(copies) == Counter(want) == Counter(seen.copies[: len(want)])
    assert seen.copies[len(want) :] == ["page-in block.1.weight"]
    steps = [(kind, i) for kind in ("acquiring", "acquired", "released") for i in range(3)]
    assert sorted(seen.blocks[:9]) == sorted(steps)
    assert seen.blocks[9:] == [("acquiring", 1), ("acquired", 1), ("released", 1)]
    # the trace's compute track: a wait while acquire(i) ran, then the hold until release(i)
    per_block = [e["name"] for e in events if e["cat"] in ("wait", "compute")]
    assert per_block == [f"{what} {i}" for i in range(3) for what in ("wait block", "block")]
    tracks = {e["tid"] for e in events if e["cat"] in ("wait", "compute")}
    names = {e["tid"]: e["args"]["name"] for e in recorder.to_json()["traceEvents"]
             if e["ph"] == "M"}  # fmt: skip
    assert {names[t] for t in tracks} == {COMPUTE}
    assert all(names[e["tid"]].startswith("copy: bb-store") for e in events if e["cat"] == "copy")
