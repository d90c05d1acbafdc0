"""The plans of the recipes and of the README's plan commands, byte for byte.

Each recipe is planned as ``bb-lightning fit|predict --config RECIPE --dry-run`` plans it
(the dry run itself left out) on the preset its ``# preset:`` line names (``t4`` for the
recipes that name ``measure``: no probing) with its ``# plan-as:`` model shape; each
``bb-lightning plan`` command of the README (dry runs and plots aside, its data-parallel
plans added) runs as written, with ``--json``.
The plan JSON and ``explain()`` are compared with the files under ``snapshots/``, so a
change that moves a plan's figure shows here. After an intended pricing change regenerate
them with :data:`REGEN` and commit them with the change.
"""

from __future__ import annotations

import difflib
import json
import os
import re
from pathlib import Path
from typing import Any

import pytest

import bb_lightning.cli.commands as commands
from bb_lightning.cli import main
from bb_lightning.planner import Plan

ROOT = Path(__file__).resolve().parents[3]
SNAPSHOTS = Path(__file__).resolve().parent / "snapshots"
REGEN = (
    "BB_REGEN_PLANS=1 .venv/bin/pytest -q -p no:cacheprovider -n 0 "
    "tests/bb_lightning/planner/test_plan_snapshots.py"
)
RECIPES = sorted((ROOT / "recipes").glob("*.yaml"))
STAND_IN = "t4"
"""The preset of a recipe that names ``measure`` (the smallest GPU preset)."""


def _header(path: Path, key: str) -> str | None:
    """A recipe's ``# key: value`` line (a note in two spaces and brackets dropped)."""
    m = re.search(rf"^# {key}:\s*(.+?)(\s{{2,}}\(.*)?$", path.read_text(), re.MULTILINE)
    return m.group(1).strip() if m else None


def _readme_plans() -> dict[str, list[str]]:
    """The README's ``bb-lightning plan`` commands (no dry run, no plot), by a name made
    of their arguments."""
    readme = (ROOT / "README.md").read_text()
    found = re.findall(r"^\.venv/bin/bb-lightning (plan .*)$", readme, re.MULTILINE)
    argvs = [line.split("#")[0].split() for line in found]
    runs = [c for c in argvs if "--dry-run" not in c and "--plot" not in c]
    return {"-".join(a.lstrip("-") for a in c[1:]).lower(): c for c in runs}


DATA_PARALLEL = "plan --model llama-30b --hardware h100 --seq-len 2048 --global-batch 512s"
"""The README's data-parallel plans (in its prose): this on 8 GPUs, and on two nodes of 8."""
README_PLANS = _readme_plans() | {
    "llama-30b-h100-8-gpus": [*DATA_PARALLEL.split(), "--devices", "8"],
    "llama-30b-h100-2-nodes-of-8": [*DATA_PARALLEL.split(), "--devices", "8", "--num-nodes", "2"],
}


def _differs(name: str, text: str) -> str:
    """How ``text`` differs from the snapshot ``name`` as a unified diff ("" when equal);
    under ``BB_REGEN_PLANS=1`` the snapshot is written instead."""
    path = SNAPSHOTS / name
    if os.environ.get("BB_REGEN_PLANS") == "1":
        path.parent.mkdir(exist_ok=True)
        path.write_text(text)
        return ""
    if not path.is_file():
        return f"no snapshot {path.relative_to(ROOT)}\n"
    want = path.read_text()
    lines = difflib.unified_diff(
        want.splitlines(keepends=True), text.splitlines(keepends=True), f"snapshots/{name}", "now"
    )
    return "".join(lines)


def _check(stem: str, plan_json: str, explain: str) -> None:
    """The plan holds every tier within its budget, and its JSON and ``explain()`` equal
    their snapshots, else one failure with both diffs and the command that regenerates them
    (a regenerated snapshot never records a plan over its budget)."""
    __tracebackhide__ = True
    over = [m for m in json.loads(plan_json)["memory"] if m["used"] > m["budget"]]
    assert not over, f"{stem}: a tier over its budget: {over}"
    diffs = _differs(f"{stem}.json", plan_json) + _differs(f"{stem}.txt", explain)
    if diffs:
        pytest.fail(f"{stem}: the plan differs from its snapshot:\n{diffs}\nintended? {REGEN}")


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: p.stem)
def test_a_recipe_plans_as_its_snapshot(recipe: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    task = "predict" if recipe.stem.endswith("-predict") else "fit"
    hardware = _header(recipe, "preset")
    assert hardware is not None, f"{recipe.name} has no '# preset:' line"
    args = [task, "--config", str(recipe)]
    preset = STAND_IN if hardware == "measure" else hardware
    args.append(f"--trainer.strategy.init_args.hardware={preset}")
    spec = _header(recipe, "plan-as")
    if spec is not None:  # the checkpoint is absent: its shape
        args.append(f"--model.init_args.model={spec}")
    planned: list[Any] = []

    def record(plan: Any, config: Any, *, lora: Any = None) -> int:
        planned.append(plan)
        return 0

    monkeypatch.setattr(commands, "_dry_run", record)
    monkeypatch.chdir(ROOT)  # the recipes' relative prompts files
    assert main([*args, "--dry-run"]) == 0
    (plan,) = planned
    _check(f"recipe-{recipe.stem}", plan.to_json() + "\n", plan.explain() + "\n")


@pytest.mark.parametrize("name", sorted(README_PLANS))
def test_a_readme_plan_command_plans_as_its_snapshot(
    name: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main([*README_PLANS[name], "--json"]) == 0
    plan_json = capsys.readouterr().out
    # planned once: the explanation of the plan read back (the round trip keeps every field)
    _check(f"plan-{name}", plan_json, Plan.from_json(plan_json).explain() + "\n")


def test_the_readme_names_plan_commands() -> None:
    assert len(README_PLANS) >= 2, README_PLANS
