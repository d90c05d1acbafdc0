#!/usr/bin/env bash
# Set up (if needed) and run the whole test suite: lint, format check, types, tests.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/ruff check storage bb_lightning tests bench
.venv/bin/ruff format --check storage bb_lightning tests bench
.venv/bin/mypy
# two worker processes (pytest-xdist): a quarter less wall time on 2 cores; -n 0 runs serially
.venv/bin/pytest -q -p no:cacheprovider -n 2 "$@"
