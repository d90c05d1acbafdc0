#!/usr/bin/env bash
# Create .venv and install Balance Beam with its dev tools, pinned by constraints.txt.
# Idempotent: a second run only checks that everything is installed.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
    "$PY" -m venv .venv
fi
.venv/bin/python -m pip install -q --upgrade "pip>=24" >/dev/null
# torch first, from its exact pin: any other request would pull a CUDA build.
.venv/bin/python -m pip install -q -c constraints.txt "torch==2.13.0"
.venv/bin/python -m pip install -q -c constraints.txt -e ".[dev]"
