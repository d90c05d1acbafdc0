"""The README's commands that fit on a CPU run as written (blocks after ``<!-- test -->``)."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]


def testable_commands() -> list[str]:
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    blocks = re.findall(r"<!-- test -->\s*```bash\n(.*?)```", text, re.DOTALL)
    return [line for block in blocks for line in block.splitlines() if line.strip()]


def test_readme_has_testable_commands_and_quickstart_first() -> None:
    assert len(testable_commands()) >= 3
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    first = re.findall(r"```bash\n(.*?)```", text, re.DOTALL)[:2]
    assert first == [
        "bash scripts/setup.sh && .venv/bin/bb-lightning fit --config recipes/tiny-cpu.yaml\n",
        "bash scripts/test.sh\n",
    ]
    assert (ROOT / "recipes" / "tiny-cpu.yaml").is_file()


@pytest.mark.slow  # one interpreter start each (torch import): several seconds on 2 cores
@pytest.mark.parametrize("command", testable_commands())
def test_readme_command_runs(command: str) -> None:
    done = subprocess.run(
        command, shell=True, cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip()
