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
        (["plan", "--hardware", "t4", "--seq-len", "0"], "--seq-len: '0' is not an integer >= 1"),
        (
            ["plan", "--hardware", "t4", "--task", "predict", "--prompt-len", "0"],
            "--prompt-len: '0' is not an integer >= 1",
        ),
        (
            ["plan", "--hardware", "t4", "--task", "predict", "--prompt-len", "100000"],
            "exceeds tiny-llama's context",
        ),
        (["plan", "--hardware", "t4", "--plot", "/nonexistent/dir/x.png"], "does not exist"),
    ],
)
def test_bad_arguments_exit_2_with_one_line(
    argv: list[str], needle: str, capsys: pytest.CaptureFixture[str]
) -> None:
    try:
        code = main(argv)
    except SystemExit as exit_:  # argparse's own checks (--seq-len 0) exit with 2
        code = exit_.code  # type: ignore[assignment]
    assert code == 2
    err = capsys.readouterr().err.strip()
    assert needle in err and "\n" not in err and "Traceback" not in err


def test_bad_plot_path_fails_before_planning(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["plan", "--hardware", "t4", "--plot", str(tmp_path)]) == 2
    out, err = capsys.readouterr()
    assert out == "" and "is a directory" in err and "\n" not in err.strip()


def test_config_of_another_family_gives_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from transformers import T5Config

    T5Config(num_layers=2, d_model=64, d_ff=128, num_heads=2).save_pretrained(tmp_path)
    assert main(["plan", "--hardware", "t4", "--model", str(tmp_path / "config.json")]) == 2
    err = capsys.readouterr().err.strip()
    assert "'t5'" in err and "causal" in err and "\n" not in err


def test_top_level_help_is_plain_text(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["--help"])
    out = capsys.readouterr().out
    assert "plan" in out and ":data:" not in out and "``" not in out


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


def test_plan_for_several_ranks_prints_one_rank_and_the_layout(
    capsys: pytest.CaptureFixture[str],
) -> None:
    argv = ["plan", "--model", "llama-1.5b", "--hardware", "a100-80gb", "--seq-len", "1024"]
    assert main([*argv, "--devices", "4", "--num-nodes", "2", "--json"]) == 0
    several = json.loads(capsys.readouterr().out)
    assert main([*argv, "--json"]) == 0
    one = json.loads(capsys.readouterr().out)
    assert main([*argv, "--devices", "4", "--num-nodes", "2"]) == 0
    text = capsys.readouterr().out
    assert "data parallel: 8 ranks, 4 per node on 2 node(s)" in text
    assert several["hardware"]["world_size"] == 8
    assert several["hardware"]["ranks_per_node"] == 4
    assert one["hardware"].get("world_size", 1) == 1
    assert several["tokens_per_s"] > one["tokens_per_s"]  # the job's, over 8 ranks
    with pytest.raises(SystemExit) as exc:
        main([*argv, "--devices", "0"])
    assert exc.value.code == 2


def test_plan_takes_the_collective_bandwidths_given(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["plan", "--model", "llama-1.5b", "--hardware", "a100-80gb", "--seq-len", "1024"]
    argv += ["--devices", "4", "--num-nodes", "2", "--json"]
    assert main(argv) == 0
    preset_links = json.loads(capsys.readouterr().out)
    assert main([*argv, "--intra-node-bandwidth", "10", "--inter-node-bandwidth", "0.5"]) == 0
    given = json.loads(capsys.readouterr().out)
    assert preset_links["hardware"]["inter_node_bandwidth"] == 0.8 * 200e9 / 8  # HDR, datasheet
    assert given["hardware"]["intra_node_bandwidth"] == 10e9
    assert given["hardware"]["inter_node_bandwidth"] == 0.5e9
    assert given["predicted"]["net"] > preset_links["predicted"]["net"]
    for bad in ("0", "-1", "fast"):
        with pytest.raises(SystemExit) as exc:
            main([*argv, "--inter-node-bandwidth", bad])
        assert exc.value.code == 2
        assert f"'{bad}' is not a number > 0" in capsys.readouterr().err


def test_plan_swaps_saved_activations_unless_told_not_to(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """A 370M Llama on a 4 GiB device whose links have headroom: by default the planner
    prices each paged block both ways and swaps the saved activations of some instead of
    recomputing them (faster); ``--no-swap-activations`` recomputes every paged block."""
    argv = ["plan", "--model", "llama-370m", "--hardware", "rtx4090", "--device-memory", "4GiB"]
    argv += ["--seq-len", "1024", "--global-batch", "32s", "--json"]
    assert main(argv) == 0
    swapping = json.loads(capsys.readouterr().out)
    assert main([*argv, "--no-swap-activations"]) == 0
    recomputing = json.loads(capsys.readouterr().out)
    assert swapping["overrides"]["swap_activations"] is True
    assert recomputing["overrides"]["swap_activations"] is False
    assert swapping["placement"]["swapped"] and not recomputing["placement"]["swapped"]
    assert swapping["tokens_per_s"] > recomputing["tokens_per_s"]
    reason = next(r for r in swapping["reasons"] if r.startswith("per block"))
    assert "recompute" in reason and "swap" in reason
