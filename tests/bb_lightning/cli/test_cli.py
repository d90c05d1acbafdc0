"""``bb-lightning convert`` / ``export`` / subcommand help, against safetensors and plain zarr."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import zarr
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, LlamaConfig

from bb_lightning.cli import main
from bb_lightning.hf.convert import checkpoint_files, convert_checkpoint


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A sharded bf16 Hugging Face checkpoint of a tiny Llama."""
    cfg = LlamaConfig(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
        vocab_size=100,
    )  # fmt: skip
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg).to(torch.bfloat16)
    out = tmp_path_factory.mktemp("hf") / "tiny"
    model.save_pretrained(out, max_shard_size="20KB")
    return str(out)


def _reference(hf_dir: str) -> dict[str, torch.Tensor]:
    ref: dict[str, torch.Tensor] = {}
    for f in checkpoint_files(hf_dir):
        ref.update(load_file(str(f)))
    return ref


def _as_torch(array: zarr.Array) -> torch.Tensor:
    values = torch.from_numpy(np.ascontiguousarray(array[...]))
    if array.attrs.get("torch_dtype") == "bfloat16":
        return values.view(torch.bfloat16)
    return values


def test_convert_matches_safetensors_read_by_plain_zarr(hf_dir: str, tmp_path, capsys) -> None:
    ref = _reference(hf_dir)
    assert len(checkpoint_files(hf_dir)) > 1  # sharded
    assert main(["convert", hf_dir, str(tmp_path / "z"), "--no-progress"]) == 0
    assert f"converted {len(ref)} tensors" in capsys.readouterr().out
    group = zarr.open_group(str(tmp_path / "z"), mode="r")
    assert sorted(group.array_keys()) == sorted(ref)
    for name, tensor in ref.items():
        assert torch.equal(_as_torch(group[name]), tensor), name
    assert group.attrs["hf_config"]["hidden_size"] == 32


def test_convert_casts_and_resumes_after_an_interruption(hf_dir: str, tmp_path) -> None:
    ref = _reference(hf_dir)
    target = tmp_path / "z"
    first = convert_checkpoint(hf_dir, target, dtype="float32", progress=False)
    assert (first.written, first.skipped) == (len(ref), 0)
    # An interrupted run: one tensor created but its chunk never written.
    victims = sorted(ref)[:2]
    (target / victims[0] / "c" / "0" / "0").unlink(missing_ok=False)
    again = convert_checkpoint(hf_dir, target, dtype="float32", progress=False)
    assert (again.written, again.skipped) == (1, len(ref) - 1)
    bf16 = convert_checkpoint(hf_dir, target, progress=False)  # dtype changes: all rewritten
    assert bf16.written == len(ref)
    group = zarr.open_group(str(target), mode="r")
    for name in victims:
        assert torch.equal(_as_torch(group[name]), ref[name])


def test_convert_chunked_pieces_match(hf_dir: str, tmp_path) -> None:
    ref = _reference(hf_dir)
    convert_checkpoint(hf_dir, tmp_path / "z", dtype="float32", piece_bytes=4096, progress=False)
    group = zarr.open_group(str(tmp_path / "z"), mode="r")
    big = max(ref, key=lambda k: ref[k].numel())
    assert ref[big].numel() * 4 > 4096  # written in several pieces
    assert torch.equal(_as_torch(group[big]), ref[big].float())


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["convert", "/nonexistent/ckpt", "/tmp/out"], "is not a directory"),
        (["convert", "/", "/tmp/out", "--capacity", "lots"], "bad size"),
        (["export", "/nonexistent/ckpt", "/tmp/out"], "is not a directory"),
        (["fit", "--trainer.no_such_key=1"], "no_such_key"),
    ],
)
def test_bad_arguments_give_one_line_and_exit_2(argv: list[str], needle: str, capsys) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and needle in err[0] and "Traceback" not in err[0]


def test_convert_reports_missing_safetensors(tmp_path, capsys) -> None:
    assert main(["convert", str(tmp_path), str(tmp_path / "z")]) == 2
    assert "holds no *.safetensors" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("sub", "unit"),
    [("plan", "tokens"), ("convert", "bytes"), ("export", "bytes"), ("fit", "microseconds")],
)
def test_subcommand_help_states_units(sub: str, unit: str, capsys) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main([sub, "--help"])
    assert exit_info.value.code == 0
    assert unit in capsys.readouterr().out
