"""scripts/gpu-check.sh: the dry run's steps on the CPU land in the JSON; bad arguments are
refused with a usage line before anything in OUTDIR is deleted."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "gpu-check.sh"


def _env(tmp_path: Path) -> dict[str, str]:
    env = dict(os.environ, PYTHON=sys.executable, BB_CACHE_DIR=str(tmp_path / "cache"))
    env.pop("BB_NVME_DIR", None)
    env["TMPDIR"] = str(tmp_path / "tmp")  # where the NVMe scratch goes, to see it removed
    # no wheels carried: the preflight installs nothing, and never into the repository
    env["BB_DEVICE_WHEELS"] = str(tmp_path / "no-wheels")
    env["BB_DEVICE_SITE"] = str(tmp_path / "site")
    (tmp_path / "tmp").mkdir()
    return env


def _run(
    args: list[str], env: dict[str, str], cwd: Path = REPO
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True,
                          env=env, cwd=cwd, timeout=600, check=False)  # fmt: skip


def _tree(root: Path) -> dict[str, tuple[bytes, int]]:
    """Every file under ``root``: its bytes and modification time."""
    return {str(p.relative_to(root)): (p.read_bytes(), p.stat().st_mtime_ns)
            for p in sorted(root.rglob("*")) if p.is_file()}  # fmt: skip


def _earlier_results(folder: Path) -> None:
    """What an earlier check left in ``folder`` (which a rerun replaces)."""
    (folder / "steps").mkdir(parents=True)
    (folder / "steps" / "finetune.json").write_text('{"step": "finetune"}')
    (folder / "gpu-check.json").write_text("{}")
    (folder / "gpu-check.log").write_text("the first run's log\n")


@pytest.mark.slow
def test_dry_run_records_every_step(tmp_path: Path) -> None:
    env = _env(tmp_path)
    out = tmp_path / "out"
    done = _run([str(out), "--dry-run"], env)
    log = (out / "gpu-check.log").read_text()
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:] + log[-4000:]
    listed = subprocess.run(
        [sys.executable, str(REPO / "bench" / "gpu_check.py"), "--list"],
        capture_output=True, text=True, check=True, env=env,
    ).stdout.split()  # fmt: skip
    names = listed[::2]
    assert sum(int(s) for s in listed[1::2]) <= 330  # one call of 6 minutes holds it all
    report = json.loads((out / "gpu-check.json").read_text())
    assert report["dry_run"] is True and report["failed"] == []
    assert list(report["steps"]) == names
    assert names[0] == "preflight"
    assert {
        "versions", "pytest", "page_in", "nvme_read", "measure", "compile", "finetune", "predict"
    } <= set(names)  # fmt: skip
    for name, step in report["steps"].items():
        # a dry run judges nothing but the imports, which are as real on the CPU
        assert step["pass"] is (True if name == "preflight" else None), name
        assert "error" not in step["figures"], (name, step["figures"]["error"], log[-4000:])
        assert f"== {name} exit 0" in log
        assert (out / "steps" / f"{name}.json").is_file()
    steps = {k: v["figures"] for k, v in report["steps"].items()}
    assert steps["preflight"]["missing"] == {}
    assert steps["pytest"]["returncode"] == 0
    assert steps["page_in"]["bytes_equal"] and steps["nvme_read"]["bytes_equal"]
    assert report["steps"]["nvme_read"]["skipped"].startswith("kvikio not run")
    assert steps["measure"]["profile"]["device_type"] == "cpu"
    runs = steps["finetune"]["runs"]
    assert steps["finetune"]["model"]["must_page"] is False  # a tiny model on the CPU
    assert (
        "tokens_per_s" in runs["balance_beam"] and "plan: fit llama" in runs["balance_beam"]["plan"]
    )
    assert runs["fsdp_cpu_offload"] == {"skipped": "needs CUDA (dry run)"}
    ours = runs["balance_beam"]
    assert len(ours["losses"]) == 4 and all(0 < x < 20 for x in ours["losses"])  # 2 steps x 2
    flops = steps["measure"]["profile"]["device_flops"]
    assert ours["mfu_measured"] == ours["tokens_per_s"] * ours["model_flops_per_token"] / flops
    # one block eager and compiled (a tiny fp32 block under aot_eager): both timed, the same
    compiled = steps["compile"]
    assert compiled["backend"] == "aot_eager" and compiled["shape"]["hidden"] == 64
    assert compiled["eager_over_compiled"] == compiled["eager_ms"] / compiled["compiled_ms"]
    assert compiled["max_abs_diff"] < 1e-5
    # fp32 on the CPU: our layer-major generation gives Accelerate's (Hugging Face's) tokens
    assert steps["predict"]["same_tokens"] == 1.0
    # the NVMe scratch was a fresh folder outside OUTDIR, removed at the end
    assert "NVMe scratch " + str(tmp_path / "tmp" / "gpu-check-nvme.") in log
    assert list((tmp_path / "tmp").glob("gpu-check-nvme.*")) == []
    assert not (out / "nvme").exists()


def test_steps_run_only_those_after_the_preflight(tmp_path: Path) -> None:
    env = _env(tmp_path)
    out = tmp_path / "out"
    _earlier_results(out)
    done = _run([str(out), "--dry-run", "--steps", "page_in"], env)
    log = (out / "gpu-check.log").read_text()
    assert done.returncode == 0, done.stderr[-2000:] + log[-4000:]
    report = json.loads((out / "gpu-check.json").read_text())
    assert list(report["steps"]) == ["preflight", "page_in"], log[-2000:]
    assert report["steps"]["page_in"]["figures"]["bytes_equal"] is True
    assert sorted(p.name for p in (out / "steps").iterdir()) == ["page_in.json", "preflight.json"]
    assert "the first run's log" not in log  # the earlier results were replaced
    assert list((tmp_path / "tmp").glob("gpu-check-nvme.*")) == []


@pytest.mark.parametrize(
    ("args", "says"),
    [
        ([], "give the folder for the results first"),
        (["--dry-run"], "'--dry-run' stands where OUTDIR belongs"),
        (["--steps", "page_in"], "'--steps' stands where OUTDIR belongs"),
        (["", "--dry-run"], "OUTDIR is empty"),
        (["{out}", "--dry-run", "--bogus"], "unknown argument '--bogus'"),
        (["{out}", "--steps"], "--steps needs step names"),
        (["{out}/file", "--dry-run"], "exists and is not a folder"),
        (["{out}/file/sub", "--dry-run"], "cannot be created"),
        (["{out}", "--dry-run", "--steps", "page_in,pagein"], "no step 'pagein'"),
    ],
)  # fmt: skip
def test_bad_arguments_are_refused_before_anything_is_deleted(
    tmp_path: Path, args: list[str], says: str
) -> None:
    env = _env(tmp_path)
    out = tmp_path / "out"
    _earlier_results(out)
    (out / "file").write_text("not a folder")
    cwd = tmp_path / "cwd"  # a relative OUTDIR would land here
    _earlier_results(cwd)
    before = _tree(tmp_path)
    done = _run([a.format(out=out) for a in args], env, cwd=cwd)
    assert done.returncode == 2, done.stdout + done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 2 and says in lines[0], done.stderr
    assert lines[1] == "usage: bash scripts/gpu-check.sh OUTDIR [--dry-run] [--steps a,b]"
    assert _tree(tmp_path) == before
    assert not (Path("/") / "gpu-check.log").exists()


def test_an_unwritable_outdir_is_refused(tmp_path: Path) -> None:
    env = _env(tmp_path)
    if os.geteuid() == 0:  # permissions bind no root: a folder of procfs takes no file
        out = Path("/proc/self/fdinfo")
    else:
        out = tmp_path / "out"
        _earlier_results(out)
        out.chmod(0o555)
        before = _tree(out)
    try:
        done = _run([str(out), "--dry-run"], env)
    finally:
        if os.geteuid() != 0:
            out.chmod(0o755)
    assert done.returncode == 2, done.stdout + done.stderr
    lines = done.stderr.strip().splitlines()
    assert f"OUTDIR '{out}' is not writable" in lines[0] and lines[1].startswith("usage: ")
    if os.geteuid() != 0:
        assert _tree(out) == before


def test_runs_are_compared_on_throughput_measured_rate_and_loss(tmp_path: Path) -> None:
    sys.path.insert(0, str(REPO / "bench"))
    try:
        import gpu_check
    finally:
        sys.path.remove(str(REPO / "bench"))
    (tmp_path / "steps").mkdir()
    measured = {"figures": {"profile": {"device_flops": 5e14}}}
    (tmp_path / "steps" / "measure.json").write_text(json.dumps(measured))
    ctx = gpu_check.Ctx(out=tmp_path, dry=False)
    runs = {
        "balance_beam": {"tokens_per_s": 1000.0, "model_flops_per_token": 1e11,
                         "losses": [10.0, 9.0, 8.0]},
        "fsdp_cpu_offload": {"tokens_per_s": 500.0, "model_flops_per_token": 1e11,
                             "losses": [10.0, 9.9, 8.0, 7.0]},
        "deepspeed_zero3_offload": {"skipped": "deepspeed does not import"},
    }  # fmt: skip
    gpu_check.compare_runs(ctx, runs)
    assert runs["balance_beam"]["mfu_measured"] == pytest.approx(0.2)  # 1e14 of 5e14 FLOP/s
    assert runs["fsdp_cpu_offload"]["mfu_measured"] == pytest.approx(0.1)
    assert ctx.figures["ratio_balance_beam_over_fsdp_cpu_offload"] == 2.0
    # the worst micro-batch of those both ran: 0.9 of the peer's 9.9
    assert ctx.figures["loss_max_rel_diff_fsdp_cpu_offload"] == pytest.approx(0.9 / 9.9)
    assert "ratio_balance_beam_over_deepspeed_zero3_offload" not in ctx.figures


def test_the_fine_tune_model_must_page() -> None:
    sys.path.insert(0, str(REPO / "bench"))
    try:
        import gpu_check
    finally:
        sys.path.remove(str(REPO / "bench"))
    from transformers import LlamaConfig, LlamaForCausalLM

    spec = gpu_check.MUST_PAGE
    config = LlamaConfig(hidden_size=spec["hidden"], intermediate_size=spec["ffn"],
                         num_hidden_layers=spec["layers"], num_attention_heads=spec["heads"],
                         num_key_value_heads=spec["kv_heads"], vocab_size=spec["vocab"],
                         tie_word_embeddings=False)  # fmt: skip
    with torch.device("meta"):
        params = sum(p.numel() for p in LlamaForCausalLM(config).parameters())
    assert gpu_check._llama_params(spec) == params  # counted as transformers builds it
    assert 2 * params > spec["device_cap_gib"] * (1 << 30)  # bf16 weights above the cap
    assert spec["vocab"] >= 128_000
