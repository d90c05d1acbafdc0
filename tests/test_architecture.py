"""The import directions of ``docs/architecture.md`` ("Import directions"), checked on the code.

Every ``.py`` file under ``storage/`` and ``bb_lightning/`` is parsed with :mod:`ast`; every
import counts, at module level, inside functions and under ``if TYPE_CHECKING:``, and so
does ``importlib.import_module("...")`` with a literal name. Relative imports are resolved,
and ``from package import name`` names the submodule when ``name`` is one. Each layer may
import only the modules its rule lists; a failure lists the offending edges as
``file:line: importer -> imported``.
"""

from __future__ import annotations

import ast
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).parents[1]
PACKAGES = ("storage", "bb_lightning")
"""Top-level packages that are ours; every other import is a third-party one."""

PLACEMENT_MODULE = "bb_lightning.placement"
"""The Placement: what the planner decides and the engine executes (the one module the
engine imports on the planner's side; it may not exist yet, a rule for it costs nothing)."""
LEAVES = ("bb_lightning.shapes",)
"""Conventions the planner prices and the engine executes; they import nothing of ours."""
CLI_PACKAGE = "bb_lightning.cli"
"""The ``bb-lightning`` command line, the top layer: no module outside it imports it."""
GLUE_PACKAGE = "bb_lightning.strategy"
"""The Lightning glue: the strategy, its calls, ranks, session, hand-back, dry run, callbacks."""
UPWARD = (GLUE_PACKAGE, CLI_PACKAGE, "bb_lightning.module")
"""The Lightning glue, the user's module and the CLI: no lower layer imports them."""

HF_PACKAGE = "bb_lightning.hf"
"""Hugging Face models and checkpoints: loading, converting, adapters, export."""
DATA_PACKAGE = "bb_lightning.data"
"""Text as users bring it: data modules, documents, tokenizers, the predictions file."""
STRUCTURE_MODULE = "bb_lightning.hf.structure"
"""Finding a model's parts by structure and one meta-device trace (the probes' way in)."""

PENDING_EDGES: dict[tuple[str, str], str] = {}
"""Known violations, each to be removed from here in the change that removes the edge."""


@dataclass(frozen=True)
class Rule:
    """What the modules under ``layer`` may import."""

    layer: str
    """Module prefix the rule governs (the most specific rule wins)."""
    ours: tuple[str, ...]
    """Module prefixes of ours it may import (everything else of ours is a violation)."""
    never: tuple[str, ...] = ()
    """Third-party module prefixes it must not import."""


RULES = (
    Rule("storage", ("storage",), never=("lightning", "pytorch_lightning", "transformers")),
    Rule(
        "bb_lightning.planner",
        ("bb_lightning.planner", "storage.tiers", PLACEMENT_MODULE, *LEAVES),
        never=("lightning", "pytorch_lightning", "transformers"),
    ),
    Rule("bb_lightning.engine", ("bb_lightning.engine", "storage", PLACEMENT_MODULE, *LEAVES)),
    Rule(PLACEMENT_MODULE, (PLACEMENT_MODULE, "storage", *LEAVES)),
    Rule(
        "bb_lightning.probe",
        (
            "bb_lightning.probe",
            "bb_lightning.planner",
            "bb_lightning.engine",
            STRUCTURE_MODULE,
            "storage",
            PLACEMENT_MODULE,
            *LEAVES,
        ),
    ),
    Rule(
        HF_PACKAGE,
        (
            HF_PACKAGE,
            "bb_lightning.probe",
            "bb_lightning.planner",
            "bb_lightning.engine",
            "storage",
            PLACEMENT_MODULE,
            *LEAVES,
        ),
        never=("lightning", "pytorch_lightning"),
    ),
    Rule(DATA_PACKAGE, (DATA_PACKAGE, "bb_lightning.bounds")),
    *(Rule(leaf, (leaf,)) for leaf in LEAVES),
)


@dataclass(frozen=True)
class Edge:
    """One import: ``importer`` imports ``imported`` at ``path:line``."""

    importer: str
    imported: str
    path: str
    line: int

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: {self.importer} -> {self.imported}"


def _within(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def module_name(path: Path, root: Path = ROOT) -> str:
    """``storage/io.py`` -> ``storage.io``; ``bb_lightning/probe/__init__.py`` -> ``bb_lightning.probe``."""
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_in(
    source: str, module: str, *, path: str, is_package: bool = False, known: Iterable[str] = ()
) -> list[Edge]:
    """Every import in ``source``, the text of ``module`` (a package's ``__init__`` when
    ``is_package``), resolved against the module names in ``known``."""
    modules = set(known)
    package = module if is_package else module.rpartition(".")[0]
    edges: list[Edge] = []

    def add(name: str, node: ast.AST) -> None:
        edges.append(Edge(module, name, path, getattr(node, "lineno", 0)))

    for node in ast.walk(ast.parse(source, filename=path)):
        if isinstance(node, ast.Import):
            for alias in node.names:
                add(alias.name, node)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join([*anchor, *([base] if base else [])])
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                add(sub if sub in modules else base, node)
        elif isinstance(node, ast.Call) and (name := _imported_by_call(node)) is not None:
            add(name, node)
    return sorted(set(edges), key=lambda e: (e.line, e.imported))


def _imported_by_call(node: ast.Call) -> str | None:
    """The literal module name of ``importlib.import_module("...")`` / ``__import__("...")``."""
    func = node.func
    called = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
    if called not in ("import_module", "__import__") or not node.args:
        return None
    first = node.args[0]
    return first.value if isinstance(first, ast.Constant) and isinstance(first.value, str) else None


def project_edges(root: Path = ROOT) -> list[Edge]:
    """The imports of every ``.py`` file under the packages in :data:`PACKAGES`."""
    files = sorted(f for pkg in PACKAGES for f in (root / pkg).rglob("*.py"))
    known = {module_name(f, root) for f in files}
    edges: list[Edge] = []
    for f in files:
        edges += imports_in(
            f.read_text(encoding="utf-8"),
            module_name(f, root),
            path=str(f.relative_to(root)),
            is_package=f.name == "__init__.py",
            known=known,
        )
    return edges


def rule_for(module: str) -> Rule | None:
    """The most specific rule governing ``module`` (None: unconstrained, e.g. the glue)."""
    matching = [r for r in RULES if _within(module, r.layer)]
    return max(matching, key=lambda r: len(r.layer), default=None)


def violations(edges: Iterable[Edge]) -> Iterator[tuple[Edge, str]]:
    """Each edge that breaks its importer's rule, with the reason."""
    for edge in edges:
        name = edge.imported
        if _within(name, CLI_PACKAGE) and not _within(edge.importer, CLI_PACKAGE):
            yield edge, f"imports the command line: nothing outside {CLI_PACKAGE} imports it"
            continue
        rule = rule_for(edge.importer)
        if rule is None:
            continue
        if any(_within(name, up) for up in UPWARD):
            yield edge, f"imports upward: {rule.layer} is below {', '.join(UPWARD)}"
        elif any(_within(name, pkg) for pkg in PACKAGES):
            if not any(_within(name, ok) for ok in rule.ours):
                yield edge, f"{rule.layer} may import only {', '.join(rule.ours)}"
        elif any(_within(name, bad) for bad in rule.never):
            yield edge, f"{rule.layer} must not import {', '.join(rule.never)}"


def report(found: Iterable[tuple[Edge, str]]) -> str:
    return "\n".join(f"  {edge}  ({why})" for edge, why in found)


def test_layers_import_only_downwards() -> None:
    edges = project_edges()
    scanned = {e.importer for e in edges}
    assert {
        "storage.store",
        "bb_lightning.planner.search",
        "bb_lightning.engine.pager",
        "bb_lightning.hf.hf_load",
        "bb_lightning.data.modules",
        "bb_lightning.cli.commands",
    } <= scanned
    found = list(violations(edges))
    new = [(e, why) for e, why in found if (e.importer, e.imported) not in PENDING_EDGES]
    assert not new, "imports against docs/architecture.md, 'Import directions':\n" + report(new)
    seen = {(e.importer, e.imported) for e, _ in found}
    gone = [f"  {a} -> {b}" for a, b in PENDING_EDGES if (a, b) not in seen]
    assert not gone, (
        "pending exceptions that no longer occur; remove them from PENDING_EDGES:\n"
        + ("\n".join(gone))
    )


SYNTHETIC = """\
from typing import TYPE_CHECKING

import torch
from storage.tiers import Tier
from . import kv
from ..planner import plan
from bb_lightning.shapes import cache_length

if TYPE_CHECKING:
    from bb_lightning.strategy.core import BalanceBeamStrategy


def late() -> None:
    import importlib

    from bb_lightning.hf import structure
    importlib.import_module("bb_lightning.probe.measure")
"""


def test_the_checker_catches_violations_in_a_synthetic_engine_module() -> None:
    known = {"bb_lightning.engine.kv", "bb_lightning.planner.plan", "bb_lightning.hf.structure"}
    edges = imports_in(SYNTHETIC, "bb_lightning.engine.fake", path="fake.py", known=known)
    imported = {e.imported: e.line for e in edges}
    assert imported["bb_lightning.engine.kv"] == 5 and imported["bb_lightning.planner.plan"] == 6
    found = list(violations(edges))
    reasons = {str(e): why for e, why in found}
    assert list(reasons) == [
        "fake.py:6: bb_lightning.engine.fake -> bb_lightning.planner.plan",
        "fake.py:10: bb_lightning.engine.fake -> bb_lightning.strategy.core",
        "fake.py:16: bb_lightning.engine.fake -> bb_lightning.hf.structure",
        "fake.py:17: bb_lightning.engine.fake -> bb_lightning.probe.measure",
    ]
    assert reasons["fake.py:10: bb_lightning.engine.fake -> bb_lightning.strategy.core"].startswith(
        "imports upward"
    )
    assert (
        sum(why.startswith("bb_lightning.engine may import only") for why in reasons.values()) == 3
    )
    assert "fake.py:6: bb_lightning.engine.fake -> bb_lightning.planner.plan" in report(found)
    storage = imports_in("import transformers\nimport torch\n", "storage.x", path="x.py")
    assert [str(e) for e, _ in violations(storage)] == ["x.py:1: storage.x -> transformers"]


def test_the_checker_keeps_hf_off_the_glue_and_data_off_the_engine() -> None:
    known = {"bb_lightning.hf.lora", "bb_lightning.engine.pager", "bb_lightning.strategy.session"}
    hf = imports_in(
        "import lightning.pytorch as pl\n"
        "from bb_lightning.strategy import session\n"
        "from bb_lightning.engine import pager\n"
        "from . import lora\n",
        "bb_lightning.hf.fake",
        path="hf.py",
        known=known,
    )
    assert sorted((str(e), why) for e, why in violations(hf)) == [
        ("hf.py:1: bb_lightning.hf.fake -> lightning.pytorch",
         "bb_lightning.hf must not import lightning, pytorch_lightning"),
        ("hf.py:2: bb_lightning.hf.fake -> bb_lightning.strategy.session",
             "imports upward: bb_lightning.hf is below bb_lightning.strategy, bb_lightning.cli, "
             "bb_lightning.module"),
    ]  # fmt: skip
    data = imports_in(
        "import lightning.pytorch as pl\n"
        "from bb_lightning.engine import pager\n"
        "from bb_lightning.bounds import check_int\n"
        "from bb_lightning.strategy.core import BalanceBeamStrategy\n",
        "bb_lightning.data.fake",
        path="data.py",
        known=known,
    )
    assert [(str(e), why.split(":")[0]) for e, why in violations(data)] == [
        ("data.py:2: bb_lightning.data.fake -> bb_lightning.engine.pager",
         "bb_lightning.data may import only bb_lightning.data, bb_lightning.bounds"),
        ("data.py:4: bb_lightning.data.fake -> bb_lightning.strategy.core", "imports upward"),
    ]  # fmt: skip


CLI_MODULES = ("commands", "lightning", "errors", "recipe_dryrun")
"""The command line's modules, each in :data:`CLI_PACKAGE` (none of them at the top level)."""


def test_the_command_line_is_one_package_that_nothing_else_imports() -> None:
    scanned = {e.importer for e in project_edges()}
    assert {f"{CLI_PACKAGE}.{name}" for name in CLI_MODULES} <= scanned
    assert not {f"bb_lightning.{name}" for name in ("lightning_cli", "cli_errors")} & scanned
    known = {
        "bb_lightning.cli.errors",
        "bb_lightning.cli.lightning",
        "bb_lightning.strategy.session",
    }
    glue = imports_in(
        "from bb_lightning.cli.errors import UsageError\n"
        "from bb_lightning.cli import main\n"
        "from bb_lightning.strategy import session\n",
        "bb_lightning.strategy.session",
        path="session.py",
        known=known,
    )
    assert [(str(e), why) for e, why in violations(glue)] == [
        ("session.py:1: bb_lightning.strategy.session -> bb_lightning.cli.errors",
         "imports the command line: nothing outside bb_lightning.cli imports it"),
        ("session.py:2: bb_lightning.strategy.session -> bb_lightning.cli",
         "imports the command line: nothing outside bb_lightning.cli imports it"),
    ]  # fmt: skip
    inside = imports_in(
        "from bb_lightning.cli import errors\nfrom bb_lightning.strategy import session\n",
        "bb_lightning.cli.lightning",
        path="lightning.py",
        known=known,
    )
    assert not list(violations(inside))


OLD_PUBLIC_PATHS: dict[str, tuple[str, tuple[str, ...]]] = {
    "bb_lightning.data": (
        "bb_lightning.data.modules",
        ("TextDataModule", "PromptsDataModule", "SeededSampler", "prompt_digest"),
    ),
    "bb_lightning.writer": ("bb_lightning.data.writer", ("JsonlPredictionWriter", "read_jsonl")),
    "bb_lightning.export": ("bb_lightning.hf.export", ("export_hf",)),
}
"""Paths users write (recipes' ``class_path``, the README, error messages) of modules that
moved into a package: old path -> (new home, names it still gives)."""


def test_each_old_public_path_still_gives_its_names() -> None:
    import importlib

    for old, (home, names) in OLD_PUBLIC_PATHS.items():
        module, moved = importlib.import_module(old), importlib.import_module(home)
        for name in names:
            assert getattr(module, name) is getattr(moved, name), f"{old}.{name}"
            assert name in module.__all__, f"{old}.__all__ lacks {name}"


PLACEMENT_HOME_DIRS = ("storage", "bb_lightning", "bench", "tests")
"""Where imports of ``Placement`` are checked (the code, its benchmarks and its tests)."""


def placement_imports_elsewhere(root: Path = ROOT) -> list[str]:
    """Each ``from M import Placement`` whose ``M`` is not the Placement module, as
    ``path:line: M``: one concept, imported from its own module."""
    found: list[str] = []
    for f in sorted(g for d in PLACEMENT_HOME_DIRS for g in (root / d).rglob("*.py")):
        tree = ast.parse(f.read_text(encoding="utf-8"), filename=str(f))
        for node in ast.walk(tree):
            if not isinstance(node, ast.ImportFrom) or node.level or node.module is None:
                continue
            if node.module != PLACEMENT_MODULE and any(a.name == "Placement" for a in node.names):
                found.append(f"{f.relative_to(root)}:{node.lineno}: {node.module}")
    return found


def test_placement_is_imported_from_its_own_module() -> None:
    elsewhere = placement_imports_elsewhere()
    assert not elsewhere, (
        f"Placement imported through another module (import it from {PLACEMENT_MODULE}):\n  "
        + "\n  ".join(elsewhere)
    )


MAX_MODULE_LINES = 600
"""Most lines a module of the packages may have (a file read in one sitting)."""
MAX_FUNCTION_LINES = 100
"""Most lines one function or method may span, ``end_lineno - lineno + 1`` (decorators aside)."""
OVERSIZED: dict[str, int] = {}
"""Modules still over :data:`MAX_MODULE_LINES` while they are split, each with the most
lines it may have until then: this list only shrinks (remove an entry once its module is
under the limit; never add one)."""
TIGHTER: dict[str, int] = {"bb_lightning/strategy/core.py": 480}
"""Modules held under a lower limit: the strategy keeps Lightning's hooks, each delegating
(the devices and ranks are in ``ranks.py``, data parallelism in ``world.py``)."""


def oversized(root: Path = ROOT) -> list[str]:
    """Each module over :data:`MAX_MODULE_LINES` lines (beyond its :data:`OVERSIZED` entry)
    and each function over :data:`MAX_FUNCTION_LINES`, as ``path: what``."""
    found: list[str] = []
    for f in sorted(g for pkg in PACKAGES for g in (root / pkg).rglob("*.py")):
        text = f.read_text(encoding="utf-8")
        path = str(f.relative_to(root))
        lines = len(text.splitlines())
        limit = OVERSIZED.get(path, TIGHTER.get(path, MAX_MODULE_LINES))
        if lines > limit:
            found.append(f"{path}: {lines} lines > {limit}")
        for node in ast.walk(ast.parse(text, filename=path)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                span = (node.end_lineno or node.lineno) - node.lineno + 1
                if span > MAX_FUNCTION_LINES:
                    found.append(f"{path}:{node.lineno}: {node.name}() spans {span} lines")
    return found


def test_no_module_or_function_is_over_its_size_limit() -> None:
    found = oversized()
    assert not found, (
        f"over {MAX_MODULE_LINES} lines a module or {MAX_FUNCTION_LINES} a function (split it "
        "by responsibility):\n  " + "\n  ".join(found)
    )


def test_the_size_check_catches_a_long_module_and_a_long_function(tmp_path: Path) -> None:
    pkg = tmp_path / "storage"
    pkg.mkdir()
    body = "".join(f"    x{i} = {i}\n" for i in range(MAX_FUNCTION_LINES))
    (pkg / "long_function.py").write_text(f"def f() -> None:\n{body}")
    (pkg / "long_module.py").write_text("x = 1\n" * (MAX_MODULE_LINES + 1))
    (pkg / "fine.py").write_text("def g() -> None:\n" + "    pass\n" * (MAX_FUNCTION_LINES - 1))
    (tmp_path / "bb_lightning").mkdir()
    assert oversized(tmp_path) == [
        f"storage/long_function.py:1: f() spans {MAX_FUNCTION_LINES + 1} lines",
        f"storage/long_module.py: {MAX_MODULE_LINES + 1} lines > {MAX_MODULE_LINES}",
    ]
