"""The prompts JSONL and recipe YAML surfaces, with the contract of :mod:`fuzz_targets`.

Prompts: a prompts file and a predictions file from an earlier run, each mutated row by
row; the data module reads and batches the prompts, the prediction writer resumes from the
earlier file and every pending prompt is written. Beyond the contract, nothing is lost: the
output then holds every prompt's id exactly once. Recipes: a tiny fit and a tiny predict
recipe, mutated value by value; the command line parses and builds the module, the data
module and the trainer (nothing runs). A refusal must name the recipe file or a key whose
value was changed.
"""

from __future__ import annotations

import json
import os
import shutil
from collections import Counter
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import fuzz_mutate as mut
import fuzz_targets as targets
import yaml
from hypothesis import strategies as st

PROMPTS = [
    {"id": "a", "prompt": "def "},
    {"id": 7, "prompt": "class "},
    {"prompt": "import os\n"},
    {"id": "3", "prompt": "x = [1, 2"},
    {"id": "é", "prompt": "ünïcode ✓ \u2028 line"},
]
"""Seed prompts: string, integer, missing and line-number-like ids, unicode."""


def seed_prompts(root: Path) -> Path:
    """A prompts file and the predictions of two of its prompts (an interrupted run)."""
    out = root / "prompts"
    if not (out / "prompts.jsonl").is_file():
        out.mkdir(parents=True, exist_ok=True)
        lines = [json.dumps(row, ensure_ascii=False) for row in PROMPTS]
        (out / "prompts.jsonl").write_text("\n".join(lines) + "\n", encoding="utf-8")
        done = [{"id": "a", "token_ids": [1, 2], "text": "x"}, {"id": "7", "token_ids": []}]
        text = "".join(json.dumps(r) + "\n" for r in done)
        (out / "predictions.jsonl").write_text(text, encoding="utf-8")
    return out


def mutate_jsonl(data: st.DataObject, path: Path) -> None:
    """Change rows of a JSONL file: a row's JSON, a copied or dropped row, a torn last
    line, bytes anywhere."""
    lines = path.read_bytes().split(b"\n")
    kind = data.draw(
        st.sampled_from(["row", "row", "row", "copy", "drop", "torn", "bytes", "blank"]),
        label="jsonl kind",
    )
    at = data.draw(st.integers(0, max(0, len(lines) - 1)), label="line")
    if kind == "row":
        try:
            doc = json.loads(lines[at])
        except ValueError:
            doc = {"prompt": ""}
        if isinstance(doc, dict) and data.draw(st.booleans(), label="id only"):
            doc["id"] = data.draw(
                st.one_of(
                    st.sampled_from(["a", "7", 7, "3", 3, "line-3", "é", None, True, 7.0, -1]),
                    mut.JSON_VALUES,
                ),
                label="id",
            )
        else:
            doc = mut.mutate_json_doc(data, doc)
        lines[at] = json.dumps(doc, ensure_ascii=data.draw(st.booleans())).encode()
    elif kind == "copy":
        lines.insert(data.draw(st.integers(0, len(lines)), label="to"), lines[at])
    elif kind == "drop":
        del lines[at]
    elif kind == "torn":
        last = max(i for i, line in enumerate(lines) if line) if any(lines) else 0
        lines[last] = lines[last][: data.draw(st.integers(0, len(lines[last])), label="cut")]
        del lines[last + 1 :]
    elif kind == "blank":
        lines.insert(at, data.draw(st.sampled_from([b"", b"  ", b"\r", b"\t\t"]), label="blank"))
    else:
        lines[at] = data.draw(st.binary(max_size=40), label="raw")
    path.write_bytes(b"\n".join(lines))


def prompts_entries(case: Path, scratch: Path) -> None:
    """Read and batch the prompts; resume the writer and write every pending prompt; then
    every prompt's id must be in the output exactly once."""
    from bb_lightning.data import PromptsDataModule
    from bb_lightning.data.writer import JsonlPredictionWriter, read_jsonl

    prompts = case / "prompts.jsonl"
    before = targets.tree_digest(case)
    state: dict[str, Any] = {}

    def read() -> None:
        dm = PromptsDataModule(str(prompts), tokenizer="byte", batch_size=2)
        dm.setup("predict")
        state["dm"] = dm

    if not targets._expect(read, case):
        return
    targets._unchanged(case, before)
    dm = state["dm"]
    output = case / "predictions.jsonl"
    earlier = Counter(_ids(output))

    def resume() -> None:
        writer = JsonlPredictionWriter(
            output, fsync=False, rank=0, world_size=1, barrier=lambda: None
        )
        trainer = SimpleNamespace(global_rank=0, world_size=1, datamodule=dm)
        writer.setup(trainer, None, "predict")  # type: ignore[arg-type]
        for batch in dm.predict_dataloader():
            writer.write_records([{"id": rid, "token_ids": [0]} for rid in batch["id"]])
        writer.teardown(trainer, None, "predict")  # type: ignore[arg-type]

    if not targets._expect(resume, case):
        return
    wanted = [str(r["id"]) for r in dm.records]
    got = Counter(str(row["id"]) for row in read_jsonl(output))
    lost = [rid for rid in wanted if got[rid] == 0]
    twice = [rid for rid, n in got.items() if n > max(1, earlier[rid])]  # written again
    if lost or twice or len(set(wanted)) != len(wanted):
        raise targets.Crash(
            ("lost or repeated prompt", "writer"), f"lost {lost[:3]}, twice {twice[:3]}"
        )


def _ids(path: Path) -> list[str]:
    """The ids of the rows of a JSONL file that parse (the harness's own lenient read)."""
    out = []
    for line in path.read_bytes().split(b"\n"):
        try:
            row = json.loads(line)
        except (ValueError, RecursionError):
            continue
        if isinstance(row, dict) and "id" in row:
            out.append(str(row["id"]))
    return out


def seed_recipes(root: Path) -> Path:
    """A tiny fit recipe and a tiny predict recipe whose paths point inside the seed."""
    out = root / "recipes"
    if (out / "predict.yaml").is_file():
        return out
    out.mkdir(parents=True, exist_ok=True)
    shutil.copy(seed_prompts(root) / "prompts.jsonl", out / "prompts.jsonl")
    model = {
        "class_path": "bb_lightning.module.CausalLMModule",
        "init_args": {
            "model": {"model_type": "llama", **targets.TINY_CONFIG, "vocab_size": 264},
            "tokenizer": "byte",
        },
    }
    strategy = {
        "class_path": "bb_lightning.BalanceBeamStrategy",
        "init_args": {"hardware": "a100-80gb", "nvme_path": "NVME"},
    }
    trainer = {
        "strategy": strategy,
        "accelerator": "cpu",
        "precision": "32-true",
        "logger": False,
        "default_root_dir": "ROOT",
    }
    predict = {
        "seed_everything": 0,
        "model": {
            **model,
            "init_args": {**model["init_args"], "max_new_tokens": 4, "temperature": 0.0},
        },
        "data": {
            "class_path": "bb_lightning.data.PromptsDataModule",
            "init_args": {
                "path": "PROMPTS",
                "tokenizer": "byte",
                "batch_size": None,
                "max_prompt_len": 16,
            },
        },
        "trainer": {
            **trainer,
            "callbacks": [
                {
                    "class_path": "bb_lightning.writer.JsonlPredictionWriter",
                    "init_args": {"path": "OUT"},
                }
            ],
        },
    }
    fit = {
        "seed_everything": 0,
        "model": {
            **model,
            "init_args": {**model["init_args"], "learning_rate": 0.002, "warmup_steps": 2},
        },
        "data": {
            "class_path": "bb_lightning.data.TextDataModule",
            "init_args": {
                "paths": "PROMPTS",
                "tokenizer": "byte",
                "seq_len": 16,
                "batch_size": 2,
                "val_fraction": 0.0,
            },
        },
        "trainer": {**trainer, "max_steps": 2, "accumulate_grad_batches": 1},
    }
    for name, doc in (("predict", predict), ("fit", fit)):
        (out / f"{name}.yaml").write_text(yaml.safe_dump(doc, sort_keys=False), encoding="utf-8")
    return out


def _placed(text: str, case: Path) -> str:
    for word, path in (
        ("NVME", case / "nvme"),
        ("ROOT", case / "runs"),
        ("PROMPTS", case / "prompts.jsonl"),
        ("OUT", case / "out.jsonl"),
    ):
        text = text.replace(f": {word}\n", f": {path}\n")
    return text


def mutate_recipe(data: st.DataObject, path: Path) -> None:
    """Swap, drop or add recipe values (mostly under ``init_args`` and ``trainer``), or
    damage the YAML's bytes."""
    if data.draw(st.integers(0, 5), label="yaml?") == 0:
        mut.mutate_bytes_file(data, path)
        return
    try:
        doc = yaml.safe_load(path.read_text(encoding="utf-8"))
    except (ValueError, RecursionError, yaml.YAMLError):
        mut.mutate_bytes_file(data, path)
        return
    path.write_text(yaml.safe_dump(mut.mutate_json_doc(data, doc)), encoding="utf-8")


def _changed_keys(old: Any, new: Any) -> set[str]:
    """Every key along a path where ``old`` and ``new`` differ."""
    if isinstance(old, dict) and isinstance(new, dict):
        out: set[str] = set()
        for key in set(old) | set(new):
            if old.get(key, object()) != new.get(key, object()):
                out |= {str(key)} | _changed_keys(old.get(key), new.get(key))
        return out
    if isinstance(old, list) and isinstance(new, list) and len(old) == len(new):
        return set().union(*(_changed_keys(a, b) for a, b in zip(old, new, strict=True)))
    return set()


def recipe_entries(case: Path, scratch: Path) -> None:
    """Parse each recipe and build its module, data module and trainer (no run)."""
    from bb_lightning.cli.lightning import BalanceBeamCLI, _argv, _build_lightning_cli

    class _BuildOnly(BalanceBeamCLI):
        def _run_subcommand(self, subcommand: str) -> None:
            """Nothing: only the parse and the build are wanted."""

    seeds = scratch.parent / "seeds" / "recipes"
    for task in ("fit", "predict"):
        recipe = case / f"{task}.yaml"
        try:
            old = yaml.safe_load(_placed((seeds / f"{task}.yaml").read_text("utf-8"), case))
            new = yaml.safe_load(recipe.read_text("utf-8"))
        except (ValueError, RecursionError, yaml.YAMLError):
            new = None
        words = _changed_keys(old, new) if isinstance(new, dict) else set()

        def build(recipe: Path = recipe, task: str = task) -> None:
            from jsonargparse import ArgumentError

            from bb_lightning.cli.errors import UsageError, first_line

            cwd = os.getcwd()  # a recipe without default_root_dir writes its model config here
            os.chdir(scratch)
            try:
                with _argv(["bb-lightning"]):
                    _build_lightning_cli([task, "--config", str(recipe)], cls=_BuildOnly)
            except ArgumentError as err:
                raise UsageError(first_line(err)) from None  # as run_lightning_cli does
            finally:
                os.chdir(cwd)

        targets._expect(build, case, words=words)


def _prompt_files(root: Path) -> list[list[Path]]:
    return [[root / "prompts.jsonl"], [root / "predictions.jsonl"]]


def _recipe_files(root: Path) -> list[list[Path]]:
    for name in ("fit.yaml", "predict.yaml"):
        path = root / name
        if "NVME" in path.read_text(encoding="utf-8"):
            path.write_text(_placed(path.read_text(encoding="utf-8"), root), encoding="utf-8")
    return [[root / "fit.yaml"], [root / "predict.yaml"]]


SURFACES: dict[str, targets.Surface] = {
    "prompts": targets.Surface(
        "prompts", seed_prompts, _prompt_files, mutate_jsonl, prompts_entries
    ),
    "recipe": targets.Surface("recipe", seed_recipes, _recipe_files, mutate_recipe, recipe_entries),
}
"""The prompts and recipe surfaces."""
