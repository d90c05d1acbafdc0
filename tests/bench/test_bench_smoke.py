"""The training benchmarks run as scripts at tiny sizes and print their ratio lines."""

from __future__ import annotations

import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"
TINY = ["--layers", "2", "--hidden", "64", "--ffn", "128", "--heads", "4", "--vocab", "256"]
TINY += ["--seq", "32", "--steps", "2", "--warmup", "1"]


def _run(script: str, tmp_path: Path, *args: str) -> str:
    env = dict(os.environ, BB_CACHE_DIR=str(tmp_path / "cache"))
    cmd = [sys.executable, str(BENCH / script), *TINY, "--nvme-dir", str(tmp_path / "nvme")]
    done = subprocess.run(
        [*cmd, *args], capture_output=True, text=True, env=env, timeout=300, check=False
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done.stdout


def _number(pattern: str, text: str) -> float:
    match = re.search(pattern, text)
    assert match is not None, f"no line matching {pattern!r} in:\n{text}"
    value = float(match.group(1))
    assert math.isfinite(value) and value > 0, match.group(0)
    return value


@pytest.mark.slow
def test_train_offload_prints_ratios(tmp_path: Path) -> None:
    out = _run(
        "train_offload.py", tmp_path, "--measure-seconds", "1", "--busy-probe", "--repeat", "2"
    )
    assert "machine: CPU" in out and f"NVMe dir: {tmp_path / 'nvme'}" in out
    assert "busy neighbour: a process spins on core" in out
    assert out.index("busy neighbour stopped") < out.index("[plain] micro-batch")
    run = r"micro-batch 1 x accumulation 4 x seq 32: ([\d.]+) tokens/s"
    plains = [float(x) for x in re.findall(rf"\[plain\] {run}", out)]
    bbs = [float(x) for x in re.findall(rf"\[balance_beam\] {run}", out)]
    assert len(plains) == len(bbs) == 2, out  # two alternating pairs
    assert out.index("pair 2 of 2") < out.rindex("[plain] micro-batch")
    ratio = _number(r"ratio balance_beam / plain = ([\d.]+) \(.*fastest of 2", out)
    # each side's fastest run (printed rounded to 0.1 tokens/s)
    assert ratio == pytest.approx(max(bbs) / max(plains), rel=0.01, abs=0.006)
    pairs = re.search(r"of each alternating pair: ([\d.]+), ([\d.]+)", out)
    assert pairs is not None, out
    for k in range(2):
        assert float(pairs.group(k + 1)) == pytest.approx(bbs[k] / plains[k], rel=0.01, abs=0.006)
    floor = _number(r"\[floor\] .*forward \+ backward at .*: ([\d.e-]+) s/step", out)
    step = _number(r"balance_beam step ([\d.e-]+) s / floor", out)
    over = _number(r"balance_beam step [\d.e-]+ s / floor = ([\d.]+)", out)
    assert floor > 0 and over == pytest.approx(step / floor, rel=0.01)
    _number(r"\[balance_beam\] .*measured / predicted = ([\d.]+)", out)
    _number(r"\[planned\] .*measured / predicted = ([\d.]+)", out)
    planned = [
        float(x)
        for x in re.findall(
            r"\[planned\] micro-batch \d+ x accumulation \d+ x seq 32: ([\d.]+)", out
        )
    ]
    assert len(planned) == 2, out  # the planner's batch runs --repeat times too
    over_plain = _number(r"ratio planned / plain = ([\d.]+) \(the fastest of 2 runs each\)", out)
    assert over_plain == pytest.approx(max(planned) / max(plains), rel=0.01, abs=0.006)
    assert "plan: fit llama" in out  # the planner's explanation of the recommended run


@pytest.mark.slow
def test_train_large_reports_peak_memory(tmp_path: Path) -> None:
    out = _run("train_large.py", tmp_path, "--host-budget-gib", "0.5")
    peak = _number(r"ru_maxrss ([\d.]+) GiB", out)
    limit = _number(r"limit host budget \+ 2 GiB = ([\d.]+) GiB", out)
    assert limit == pytest.approx(2.5, abs=0.01)
    verdict = "PASS" if peak <= limit else "FAIL"
    assert re.search(rf"-> {verdict} \(peak / limit = [\d.]+\)", out), out
    _number(r"throughput: ([\d.]+) trained tokens/s", out)
    kinds = r"([\d.]+) GiB \(RssAnon ([\d.]+), RssShmem ([\d.]+), RssFile ([\d.]+)\)"
    for phase in ("setup", "forward", "backward", "optimizer", "teardown", "whole run"):
        match = re.search(rf"^  {phase}: {kinds}$", out, re.MULTILINE)  # RSS by kind
        assert match is not None, f"no RSS line of {phase} in:\n{out}"
        total, *parts = (float(x) for x in match.groups())
        assert parts[0] > 0 and total == pytest.approx(sum(parts), abs=0.02), match.group(0)
    names = ("host arena", "device tier", "resident params", "RssAnon beyond", "heap free")
    account = ", ".join(rf"{name} ([\d.]+)" for name in names)
    for phase in ("setup", "forward", "backward", "optimizer", "teardown", "whole run"):
        match = re.search(rf"^  {phase}: {account}$", out, re.MULTILINE)  # the store's own
        assert match is not None, f"no accounting line of {phase} in:\n{out}"
    assert "after fit: the module holds its trained weights" in out  # tiny: they fit
    assert "FITS in RAM" in out  # the tiny model says it is not a large-model test
    assert "wrote a random bf16 checkpoint" in out


@pytest.mark.slow
def test_train_large_runs_the_plans_row_chunks_and_prices_its_step(tmp_path: Path) -> None:
    """``--plan --chunk-rows 1``: the strategy plans the user's micro-batch of 3 in chunks of
    one row, runs that plan, and prints its predicted step beside the measured one."""
    out = _run(
        "train_large.py", tmp_path, "--host-budget-gib", "0.5", "--plan", "--chunk-rows", "1",
        "--micro-batch", "3", "--measure-seconds", "0.5", "--probe-micro-batch", "1",
    )  # fmt: skip
    assert "plan: fit llama" in out and "in 3 chunk(s) of 1 sequence(s)" in out
    assert "plan in force: recomputed blocks run 1 rows per chunk" in out
    step = _number(r"measured ([\d.e-]+) s/step, predicted", out)
    predicted = _number(r"predicted ([\d.e-]+) s/step", out)
    ratio = _number(r"measured / predicted = ([\d.]+) \(target", out)
    assert ratio == pytest.approx(step / predicted, rel=0.02, abs=0.006)


@pytest.mark.slow
def test_train_large_runs_whole_micro_batches_with_chunk_rows_0(tmp_path: Path) -> None:
    out = _run(
        "train_large.py", tmp_path, "--host-budget-gib", "0.5", "--plan", "--chunk-rows", "0",
        "--micro-batch", "2", "--measure-seconds", "0.5", "--probe-micro-batch", "1",
    )  # fmt: skip
    assert "each micro-batch in one piece through every block" in out
    _number(r"measured / predicted = ([\d.]+) \(target", out)


@pytest.mark.slow
def test_train_large_rejects_a_host_budget_below_the_store_need(tmp_path: Path) -> None:
    env = dict(os.environ, BB_CACHE_DIR=str(tmp_path / "cache"))
    cmd = [sys.executable, str(BENCH / "train_large.py"), *TINY, "--host-budget-gib", "0.00001"]
    done = subprocess.run(
        [*cmd, "--nvme-dir", str(tmp_path / "nvme")],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
        check=False,
    )
    assert done.returncode != 0
    assert "ValueError" in done.stderr and "raise the budget" in done.stderr


def test_grad_hold_prints_the_ratio_and_equal_weights(tmp_path: Path) -> None:
    tiny = ["--layers", "2", "--hidden", "64", "--ffn", "128", "--heads", "4", "--vocab", "256"]
    cmd = [sys.executable, str(BENCH / "grad_hold.py"), *tiny, "--seq", "32", "--repeat", "2"]
    cmd += ["--dtype", "float32", "--nvme-dir", str(tmp_path / "nvme")]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    out = done.stdout
    assert "machine: CPU" in out
    assert len(re.findall(r"hold_grads=(?:True |False): step \d: [\d.]+ s", out)) == 4
    _number(r"held / accumulated step time = ([\d.]+)", out)
    # the same sums in the same order: the two ways train the same weights, bit for bit
    assert re.search(r"largest weight difference between the two 0(\.0)?$", out, re.M), out


def test_io_beside_compute_prints_the_compute_lost_per_gb(tmp_path: Path) -> None:
    cmd = [sys.executable, str(BENCH / "io_beside_compute.py"), "--gib", "0.25"]
    cmd += ["--seconds", "0.3", "--repeat", "2", "--nvme-dir", str(tmp_path / "nvme")]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    out = done.stdout
    assert "machine: CPU" in out
    rounds = re.findall(r"round \d: alone ([\d.]+) s .*reads ([\d.]+) s \(([\d.]+) GB", out)
    assert len(rounds) == 2, out
    alone = min(float(r[0]) for r in rounds)
    reads = min(float(r[1]) for r in rounds)
    ratio = _number(r"beside reads: [\d.]+ s = ([\d.]+) x alone", out)
    # the per-loop seconds are printed to 1 ms, the ratio to 0.001
    low, high = (reads - 5e-4) / (alone + 5e-4), (reads + 5e-4) / (alone - 5e-4)
    assert low - 5e-4 <= ratio <= high + 5e-4, out
    assert re.search(r"beside writes: .* compute lost -?[\d.]+ s per GB; steal [\d.]+", out), out
    assert not list((tmp_path / "nvme").glob("bb-io-beside-*"))  # its files are gone
