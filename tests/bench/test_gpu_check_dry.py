"""scripts/gpu-check.sh --dry-run: every step's Python runs on the CPU and lands in the JSON."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_dry_run_records_every_step(tmp_path: Path) -> None:
    env = dict(os.environ, PYTHON=sys.executable, BB_CACHE_DIR=str(tmp_path / "cache"))
    env.pop("BB_NVME_DIR", None)
    out = tmp_path / "out"
    done = subprocess.run(
        ["bash", str(REPO / "scripts" / "gpu-check.sh"), str(out), "--dry-run"],
        capture_output=True, text=True, env=env, timeout=600, check=False,
    )  # fmt: skip
    log = (out / "gpu-check.log").read_text()
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:] + log[-4000:]
    listed = subprocess.run(
        [sys.executable, str(REPO / "bench" / "gpu_check.py"), "--list"],
        capture_output=True, text=True, check=True, env=env,
    ).stdout.split()  # fmt: skip
    names = listed[::2]
    assert sum(int(s) for s in listed[1::2]) <= 600  # the whole run fits in 10 minutes
    report = json.loads((out / "gpu-check.json").read_text())
    assert report["dry_run"] is True and report["failed"] == []
    assert list(report["steps"]) == names
    assert {"versions", "pytest", "page_in", "nvme_read", "measure", "finetune", "predict"} <= set(
        names
    )
    for name, step in report["steps"].items():
        assert step["pass"] is None, name  # a dry run judges nothing
        assert "error" not in step["figures"], (name, step["figures"]["error"], log[-4000:])
        assert f"== {name} exit 0" in log
    steps = {k: v["figures"] for k, v in report["steps"].items()}
    assert steps["pytest"]["returncode"] == 0
    assert steps["page_in"]["bytes_equal"] and steps["nvme_read"]["bytes_equal"]
    assert report["steps"]["nvme_read"]["skipped"].startswith("kvikio not run")
    assert steps["measure"]["profile"]["device_type"] == "cpu"
    runs = steps["finetune"]["runs"]
    assert (
        "tokens_per_s" in runs["balance_beam"] and "plan: fit llama" in runs["balance_beam"]["plan"]
    )
    assert runs["fsdp_cpu_offload"] == {"skipped": "needs CUDA (dry run)"}
    # fp32 on the CPU: our layer-major generation gives Accelerate's (Hugging Face's) tokens
    assert steps["predict"]["same_tokens"] == 1.0
