#!/usr/bin/env bash
# Set up (if needed) and run the whole test suite: lint, format check, types, tests.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/ruff check storage bb_lightning tests bench
.venv/bin/ruff format --check storage bb_lightning tests bench
.venv/bin/mypy
.venv/bin/pytest -q -p no:cacheprovider "$@"
