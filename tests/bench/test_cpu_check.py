"""``bench/cpu_check.py``: the benchmarks' figures collected beside their targets."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"


def _module() -> ModuleType:
    sys.path.insert(0, str(BENCH))  # the script imports _common as its neighbour
    try:
        spec = importlib.util.spec_from_file_location("cpu_check", BENCH / "cpu_check.py")
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules["cpu_check"] = module  # its dataclasses look their module up
        spec.loader.exec_module(module)
        return module
    finally:
        sys.path.remove(str(BENCH))


def test_each_target_compares_its_figure_with_its_bound() -> None:
    check = _module()
    figures = {
        "fit-1x4": {
            "ratio_plain": 0.96,
            "step_over_floor": 1.06,
            "measured_over_predicted": 1.25,
            "planned_over_plain": None,  # --skip-recommended
            "over_deepspeed": 2.04,
        },
        "predict": {"floor_share": 0.84, "measured_over_predicted": 0.74, "over_generate": 1.4},
    }
    rows = check.evaluate(figures, "avx512_bf16")
    got = {(r["step"], r["figure"]): r["met"] for r in rows}
    assert got == {
        ("fit-1x4", "ratio_plain"): True,  # >= 0.95
        ("fit-1x4", "step_over_floor"): False,  # <= 1.05
        ("fit-1x4", "measured_over_predicted"): True,  # 0.75-1.25, bounds included
        ("fit-1x4", "planned_over_plain"): None,  # not measured
        ("fit-1x4", "over_deepspeed"): True,  # >= 2
        ("predict", "floor_share"): False,  # >= 0.85
        ("predict", "measured_over_predicted"): False,
    }  # steps not asked for have no rows; the AMX-only predict targets are left out here
    amx = {(r["step"], r["figure"]) for r in check.evaluate(figures, "amx")}
    assert ("predict", "over_generate") in amx and ("predict", "over_accelerate_cold") in amx
    assert check.default_dtype("amx") == check.default_dtype("avx512_bf16") == "bf16"
    assert check.default_dtype("no_bf16") == "fp32"


def test_an_unknown_step_is_named_with_the_known_ones(tmp_path: Path) -> None:
    cmd = [sys.executable, str(BENCH / "cpu_check.py"), str(tmp_path), "--only", "fit-2x2"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 2
    assert "fit-2x2" in done.stderr and "fit-1x4" in done.stderr


def _kind_from_cpuinfo() -> str:
    text = Path("/proc/cpuinfo").read_text(encoding="utf-8")
    flags = set(re.search(r"^flags\s*:(.*)$", text, re.M).group(1).split())  # type: ignore[union-attr]
    if flags & {"amx_bf16", "amx_tile"}:
        return "amx"
    return "avx512_bf16" if "avx512_bf16" in flags else "no_bf16"


def _printed(pattern: str, text: str) -> float:
    match = re.search(pattern, text)
    assert match is not None, f"no line matching {pattern!r} in:\n{text[-3000:]}"
    return float(match.group(1))


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/cpuinfo").exists(), reason="reads the CPU's flags")
def test_a_dry_run_collects_what_each_benchmark_printed(tmp_path: Path) -> None:
    out = tmp_path / "out"
    cmd = [sys.executable, str(BENCH / "cpu_check.py"), str(out), "--dry-run"]
    cmd += ["--only", "fit-busy,predict-busy", "--nvme-dir", str(tmp_path / "nvme")]
    env = dict(os.environ, BB_CACHE_DIR=str(tmp_path / "cache"))
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600, check=False)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    doc = json.loads((out / "cpu-check.json").read_text(encoding="utf-8"))
    kind = _kind_from_cpuinfo()
    assert doc["machine"]["kind"] == kind
    assert doc["dtype"] == ("bf16" if kind != "no_bf16" else "fp32")
    assert set(doc["steps"]) == {"fit-busy", "predict-busy"}

    fit = doc["steps"]["fit-busy"]
    assert fit["exit"] == 0 and "--busy-probe" in fit["command"]
    log = (out / "steps" / "fit-busy.log").read_text(encoding="utf-8")
    figures = fit["figures"]
    # the JSON holds the figures the benchmark printed (printed to 2-3 decimals)
    ratio = _printed(r"ratio balance_beam / plain = ([\d.]+)", log)
    assert figures["ratio_plain"] == pytest.approx(ratio, abs=0.006)
    over = _printed(r"balance_beam step [\d.e-]+ s / floor = ([\d.]+)", log)
    assert figures["step_over_floor"] == pytest.approx(over, abs=0.0006)
    predicted = _printed(r"\[balance_beam\] .*measured / predicted = ([\d.]+)", log)
    assert figures["measured_over_predicted"] == pytest.approx(predicted, abs=0.006)
    assert figures["planned_over_plain"] is None and figures["over_deepspeed"] is None

    gen = doc["steps"]["predict-busy"]
    assert gen["exit"] == 0
    log = (out / "steps" / "predict-busy.log").read_text(encoding="utf-8")
    figures = gen["figures"]
    predicted = _printed(
        r"\(model-shaped probe\): [\d.]+ tokens/s; measured / predicted = ([\d.]+)", log
    )
    assert figures["measured_over_predicted"] == pytest.approx(predicted, abs=0.006)
    reached = _printed(r"ours reaches (\d+)% of it", log)
    assert 100 * figures["floor_share"] == pytest.approx(reached, abs=0.51)
    ratio = _printed(r"ratio ours / hf generate \(best, batch \d+\) = ([\d.]+)", log)
    assert figures["over_generate"] == pytest.approx(ratio, abs=0.006)
    assert figures["identical_share"] == 1.0  # greedy tokens equal generate's

    rows = {(r["step"], r["figure"]): r for r in doc["targets"]}
    assert set(rows) == {
        ("fit-busy", "measured_over_predicted"),
        ("predict-busy", "measured_over_predicted"),
    }
    for (step, _), row in rows.items():
        assert row["value"] == doc["steps"][step]["figures"]["measured_over_predicted"]
        assert row["met"] == (0.75 <= row["value"] <= 1.25)
    assert f"targets met: {doc['met']} of 2" in done.stdout
