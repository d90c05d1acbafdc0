"""Crash safety: a writer killed with SIGKILL leaves a complete old or new version, never a mix."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from storage.io import IOConfig, aligned_empty, open_backend
from storage.nvme import CorruptTensorError, NvmeTier

N = 16 << 20  # int32 elements: a 64 MiB tensor

WRITER = f"""
import sys, torch
from storage.io import IOConfig, aligned_empty, open_backend
from storage.nvme import NvmeTier
N = {N}
tier = NvmeTier(sys.argv[1], capacity=1 << 30, backend=open_backend(IOConfig(backend="posix")))
if not tier.contains("w"):
    tier.create("w", (N,), torch.int32)
patterns = [aligned_empty(4 * N), aligned_empty(4 * N)]
patterns[0].view(torch.int32)[:N] = torch.arange(N, dtype=torch.int32)
patterns[1].view(torch.int32)[:N] = -torch.arange(N, dtype=torch.int32) - 1
sys.stdin.readline()  # start writing when the parent is ready to watch
for i in range(1000):
    print("start", i % 2, flush=True)
    tier.write_async("w", patterns[i % 2]).wait()
    print("done", i % 2, flush=True)
"""


def expected(pattern: int) -> torch.Tensor:
    ramp = torch.arange(N, dtype=torch.int32)
    return ramp if pattern == 0 else -ramp - 1


def read_back(path: Path) -> torch.Tensor:
    with (
        open_backend(IOConfig(backend="posix")) as backend,
        NvmeTier(path, capacity=1 << 30, backend=backend) as tier,
    ):
        assert not list(path.rglob("*.partial-*")), "stale partial files survive reopening"
        dst = aligned_empty(4 * N)
        tier.read_async("w", dst).wait()
        return dst.view(torch.int32)[:N].clone()


@pytest.mark.slow
def test_sigkill_mid_write_leaves_a_whole_version(tmp_path: Path) -> None:
    # (completed writes before the kill, seconds to wait after the next write starts)
    trials = [(0, 0.0), (1, 0.0), (1, 0.02), (2, 0.05)]
    children = []
    for k, _ in enumerate(trials):
        children.append(
            subprocess.Popen(
                [sys.executable, "-c", WRITER, str(tmp_path / f"s{k}")],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                text=True,
            )
        )
    interrupted = 0
    for k, ((completed, delay), child) in enumerate(zip(trials, children, strict=True)):
        assert child.stdin is not None and child.stdout is not None
        child.stdin.write("go\n")
        child.stdin.flush()
        done = 0
        while True:
            line = child.stdout.readline().split()
            assert line, f"writer {k} ended early with code {child.wait()}"
            if line[0] == "done":
                done += 1
            elif done == completed:
                break  # a write is starting after the wanted number of completed ones
        time.sleep(delay)
        child.send_signal(signal.SIGKILL)
        child.wait()
        store = tmp_path / f"s{k}"
        interrupted += bool(list(store.rglob("*.partial-*")))
        if completed == 0:
            try:
                got = read_back(store)
            except CorruptTensorError as exc:
                assert "incomplete" in str(exc)
                continue
            assert torch.equal(got, expected(0))
        else:
            got = read_back(store)
            assert torch.equal(got, expected(0)) or torch.equal(got, expected(1))
    print(f"{interrupted} of {len(trials)} writers were killed with a partial file on disk")
