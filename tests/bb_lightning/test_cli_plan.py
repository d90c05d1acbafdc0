"""``bb-lightning plan`` in-process (fast) and once through the installed entry point."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from bb_lightning.cli import main, parse_size
from bb_lightning.planner import Plan


def test_parse_size_binary_and_decimal() -> None:
    assert parse_size("24GiB") == 24 * 2**30
    assert parse_size("1.5 TB") == 1_500_000_000_000
    assert parse_size("512mib") == 512 * 2**20
    assert parse_size("4096") == 4096
    with pytest.raises(ValueError, match="12XB"):
        parse_size("12XB")


def test_plan_prints_explain_and_json(capsys: pytest.CaptureFixture[str]) -> None:
    assert (
        main(
            [
                "plan",
                "--hardware",
                "rtx4090",
                "--model",
                "llama-1.5b",
                "--global-batch",
                "64s",
                "--seq-len",
                "1024",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "plan: fit llama-1.5b" in out and "global batch 64 seqs" in out
    assert (
        main(
            [
                "plan",
                "--hardware",
                "t4",
                "--model",
                "opt-30b",
                "--task",
                "predict",
                "--host-memory",
                "208GB",
                "--json",
            ]
        )
        == 0
    )
    plan = Plan.from_json(capsys.readouterr().out)
    assert plan.task == "predict" and plan.hardware.host_memory == 208 * 10**9
    assert plan.memory[1].budget == int(208e9 * 0.95)


def test_memory_options_override_the_preset(capsys: pytest.CaptureFixture[str]) -> None:
    assert (
        main(
            [
                "plan",
                "--hardware",
                "a100-80gb",
                "--device-memory",
                "24GiB",
                "--host-memory",
                "64GiB",
                "--no-nvme",
                "--json",
            ]
        )
        == 0
    )
    d = json.loads(capsys.readouterr().out)
    assert d["hardware"]["device_memory"] == 24 * 2**30
    assert d["hardware"]["nvme_capacity"] == 0


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["plan", "--hardware", "nosuchgpu"], "known presets"),
        (["plan", "--hardware", "t4", "--device-memory", "12XB"], "bad size '12XB'"),
        (["plan", "--hardware", "t4", "--model", "./no/such/dir"], "not a built-in name"),
        (
            [
                "plan",
                "--hardware",
                "a100-80gb",
                "--model",
                "llama-30b",
                "--no-nvme",
                "--host-memory",
                "128GiB",
            ],
            "--nvme-capacity",
        ),
        (["plan", "--hardware", "t4", "--global-batch", "many"], "--global-batch"),
        (["fit"], "not available in this build"),
    ],
)
def test_bad_arguments_exit_2_with_one_line(
    argv: list[str], needle: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert needle in err and "\n" not in err and "Traceback" not in err


def test_plot_writes_a_png(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    png = tmp_path / "roof.png"
    assert (
        main(
            [
                "plan",
                "--hardware",
                "a100-80gb",
                "--model",
                "llama-30b",
                "--host-memory",
                "1TiB",
                "--plot",
                str(png),
            ]
        )
        == 0
    )
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000


def test_help_shows_units(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["plan", "--help"])
    out = capsys.readouterr().out
    assert "GiB" in out and "tokens" in out


@pytest.mark.slow
def test_installed_entry_point() -> None:
    exe = shutil.which("bb-lightning") or str(Path(sys.executable).parent / "bb-lightning")
    res = subprocess.run(
        [
            exe,
            "plan",
            "--hardware",
            "a100-80gb",
            "--model",
            "llama-30b",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert res.returncode == 0, res.stderr
    assert "plan: fit llama-30b" in res.stdout and "tokens/s" in res.stdout
