"""The bad-input catalogue: each case gives one stderr line naming the value and the fix.

Every case runs ``bb_lightning.cli.main`` in-process as a user's command line would,
and must exit with code 2, print exactly one line on stderr (no traceback) that holds
the named words, and write no file. The Troubleshooting table of docs/guide.md lists the
same cases (the README gives one of them and links there).
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from bb_lightning.cli import main
from bb_lightning.engine.checkpoint import VERSION


def _llama(layers: int) -> LlamaConfig:
    return LlamaConfig(
        hidden_size=32, num_hidden_layers=layers, num_attention_heads=2, intermediate_size=64,
        vocab_size=264, max_position_embeddings=64,
    )  # fmt: skip


@pytest.fixture(scope="module")
def inputs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Models, data, prompts and a checkpoint written once; the cases only read them."""
    root = tmp_path_factory.mktemp("inputs")
    torch.manual_seed(0)
    for name, layers in (("model", 2), ("model3", 3)):
        AutoModelForCausalLM.from_config(_llama(layers)).save_pretrained(root / name)
    for name, cut in (("truncated", 0.5), ("garbage", 0.0)):
        shutil.copytree(root / "model", root / name)
        weights = root / name / "model.safetensors"
        data = weights.read_bytes()
        weights.write_bytes(data[: int(len(data) * cut)] if cut else b"\x00garbage" * 64)
    (root / "text.txt").write_text("def f(x):\n    return x + 1\n" * 100)
    (root / "prompts.jsonl").write_text('{"id": "a", "prompt": "def "}\n')
    (root / "not-json.jsonl").write_text('{"id": "a", "prompt": "def "}\nnot json\n')
    (root / "no-prompt.jsonl").write_text('{"id": "a", "text": "def "}\n')
    (root / "long.jsonl").write_text(json.dumps({"id": "a", "prompt": "x" * 100}) + "\n")
    dup = [
        {"id": "a", "prompt": "def "},
        {"id": "a", "prompt": "class "},
        {"id": "b", "prompt": "x"},
    ]
    (root / "dup-ids.jsonl").write_text("".join(json.dumps(r) + "\n" for r in dup))
    for name, text in {
        "typo-init.yaml": "model:\n  init_args:\n    learning_rat: 0.1\n",
        "typo-trainer.yaml": "trainer:\n  max_step: 3\n",
        "unknown.yaml": "trainer:\n  qqqq: 3\n",
        "typo-top.yaml": "modle:\n  class_path: bb_lightning.module.CausalLMModule\n",
    }.items():
        (root / name).write_text(text)
    ck = root / "ck"
    assert main(["fit", *_fit(root, root / "model"), "--trainer.max_steps=1",
                 f"--trainer.default_root_dir={root / 'run'}",
                 "--trainer.enable_checkpointing=true",
                 "--trainer.callbacks+=lightning.pytorch.callbacks.ModelCheckpoint",
                 f"--trainer.callbacks.dirpath={ck}", "--trainer.callbacks.filename=ck"]) == 0  # fmt: skip
    shutil.copytree(ck / "ck.ckpt", root / "newer.ckpt")
    meta = json.loads((root / "newer.ckpt" / "meta.json").read_text())
    (root / "newer.ckpt" / "meta.json").write_text(json.dumps({**meta, "version": VERSION + 1}))
    assert main(["convert", str(root / "model"), str(root / "store"), "--no-progress"]) == 0
    group = json.loads((root / "store" / "zarr.json").read_text())
    (root / "store" / "zarr.json").write_text(json.dumps({**group, "zarr_format": 4}))
    return root


def _common(root: Path, model: Path) -> list[str]:
    return [
        "--seed_everything=0",
        "--model.class_path=bb_lightning.module.CausalLMModule",
        f"--model.init_args.model={model}",
        "--trainer.accelerator=cpu",
        "--trainer.logger=false",
        "--trainer.enable_checkpointing=false",
        "--trainer.enable_progress_bar=false",
        "--trainer.enable_model_summary=false",
        "--trainer.strategy.init_args.hardware=t4",  # a preset: no measuring
        "--throughput=false",
    ]


def _fit(root: Path, model: Path) -> list[str]:
    return [
        *_common(root, model),
        "--data.class_path=bb_lightning.data.TextDataModule",
        f"--data.init_args.paths={root / 'text.txt'}",
        "--data.init_args.seq_len=16",
        "--data.init_args.val_fraction=0",
        "--data.init_args.batch_size=2",
    ]


def _predict(root: Path, model: Path, prompts: str, out: Path) -> list[str]:
    return [
        *_common(root, model),
        "--data.class_path=bb_lightning.data.PromptsDataModule",
        f"--data.init_args.path={root / prompts}",
        "--trainer.callbacks+=bb_lightning.writer.JsonlPredictionWriter",
        f"--trainer.callbacks.path={out / 'predictions.jsonl'}",
    ]


Argv = Callable[[Path, Path], list[str]]
"""(inputs folder, output folder) -> the command line after ``bb-lightning``."""

CASES: dict[str, tuple[Argv, list[str]]] = {
    # case: (command line, words the one stderr line must hold)
    "recipe key with a typo (model init_args)": (
        lambda r, o: ["fit", *_fit(r, r / "model"), "--config", str(r / "typo-init.yaml")],
        ["'model.init_args.learning_rat'", "did you mean 'learning_rate'?"],
    ),
    "recipe key with a typo (trainer)": (
        lambda r, o: ["fit", *_fit(r, r / "model"), "--config", str(r / "typo-trainer.yaml")],
        ["'trainer.max_step'", "did you mean 'trainer.max_steps'?"],
    ),
    "recipe key close to no valid key": (
        lambda r, o: ["fit", *_fit(r, r / "model"), "--config", str(r / "unknown.yaml")],
        ["'trainer.qqqq'", "no valid key is close", "bb-lightning fit --help"],
    ),
    "recipe key with a typo (top level)": (
        lambda r, o: ["fit", "--config", str(r / "typo-top.yaml")],
        ["'modle.class_path'", "did you mean 'model.class_path'?"],
    ),
    "truncated .safetensors given to convert": (
        lambda r, o: ["convert", str(r / "truncated"), str(o / "z"), "--no-progress"],
        ["truncated/model.safetensors", "truncated or corrupt", "save_pretrained"],
    ),
    "truncated .safetensors given to fit": (
        lambda r, o: ["fit", *_fit(r, r / "truncated"), "--trainer.max_steps=1"],
        ["truncated/model.safetensors", "truncated or corrupt"],
    ),
    "corrupt .safetensors given to predict": (
        lambda r, o: ["predict", *_predict(r, r / "garbage", "prompts.jsonl", o)],
        ["garbage/model.safetensors", "truncated or corrupt"],
    ),
    "checkpoint of another model": (
        lambda r, o: ["fit", *_fit(r, r / "model3"), f"--ckpt_path={r / 'ck' / 'ck.ckpt'}"],
        ["ck.ckpt", "does not match the model", "load it into the model it was saved from"],
    ),
    "checkpoint of a newer format version": (
        lambda r, o: ["fit", *_fit(r, r / "model"), f"--ckpt_path={r / 'newer.ckpt'}"],
        ["newer.ckpt", f"format version {VERSION + 1}", "reads versions"],
    ),
    "store of a newer zarr format": (
        lambda r, o: ["convert", str(r / "model"), str(r / "store"), "--no-progress"],
        ["zarr_format 4", "zarr v3 only"],
    ),
    "wrong dtype (convert)": (
        lambda r, o: ["convert", str(r / "model"), str(o / "z"), "--dtype", "bf17"],
        ["'bf17'", "did you mean 'bf16'?"],
    ),
    "wrong dtype (export)": (
        lambda r, o: ["export", str(r / "ck" / "ck.ckpt"), str(o / "hf"), "--dtype", "fp33"],
        ["'fp33'", "did you mean 'fp32'?"],
    ),
    "wrong dtype (fit precision)": (
        lambda r, o: ["fit", *_fit(r, r / "model"), "--trainer.precision=bf17"],
        ["trainer.precision='bf17'", "bf16-true", "closest: 'bf16'"],
    ),
    "prompts line that is not JSON": (
        lambda r, o: ["predict", *_predict(r, r / "model", "not-json.jsonl", o)],
        ["not-json.jsonl:2", "not valid JSON", "fix or remove the line"],
    ),
    "prompts line without a prompt": (
        lambda r, o: ["predict", *_predict(r, r / "model", "no-prompt.jsonl", o)],
        ["no-prompt.jsonl:1", "no string field 'prompt'"],
    ),
    "prompts with an id given twice": (
        lambda r, o: ["predict", *_predict(r, r / "model", "dup-ids.jsonl", o)],
        ["dup-ids.jsonl:2", "id 'a' is also the id of line 1", "give one of the rows another id"],
    ),
    "prompt longer than the context": (
        lambda r, o: ["predict", *_predict(r, r / "model", "long.jsonl", o)],
        ["exceeds", "context of 64 tokens", "shorten the prompt"],
    ),
}


def _files(root: Path) -> dict[str, int]:
    return {str(p.relative_to(root)): p.stat().st_size for p in root.rglob("*")}


@pytest.fixture
def out(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """An empty working directory (relative outputs land here) and measuring cache."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("BB_CACHE_DIR", str(tmp_path / "cache"))
    yield tmp_path


@pytest.mark.parametrize("case", list(CASES))
def test_bad_input_gives_one_line_and_exit_2(
    case: str, inputs: Path, out: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv, words = CASES[case]
    before = _files(inputs), _files(out)
    try:
        code = main(argv(inputs, out))
    except SystemExit as exit_:
        code = exit_.code  # type: ignore[assignment]
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert code == 2, err
    assert len(lines) == 1 and "Traceback" not in err, err
    for word in words:
        assert word in lines[0], (word, lines[0])
    assert (_files(inputs), _files(out)) == before, "the failed command wrote files"
    assert os.listdir(out) == [], os.listdir(out)


def test_rows_without_ids_beside_line_number_ids_give_one_record_each(
    inputs: Path, out: Path
) -> None:
    rows = [{"prompt": "def "}, {"id": "1", "prompt": "class "}, {"id": 4, "prompt": "x"},
            {"prompt": "import "}]  # fmt: skip
    prompts = out / "mixed.jsonl"
    prompts.write_text("".join(json.dumps(r) + "\n" for r in rows))
    argv = _predict(inputs, inputs / "model", str(prompts), out)
    assert main(["predict", *argv, "--model.init_args.max_new_tokens=2"]) == 0
    records = [json.loads(line) for line in (out / "predictions.jsonl").read_text().splitlines()]
    assert [r["id"] for r in records] == ["line-1", "1", "4", "line-4"]
    assert all(len(r["token_ids"]) == 2 for r in records), records
