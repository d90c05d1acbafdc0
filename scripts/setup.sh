#!/usr/bin/env bash
# Create .venv and install Balance Beam with its dev tools, pinned by constraints.txt.
# Idempotent: a second run only checks that everything is installed.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
    "$PY" -m venv .venv
fi
# Where a local wheel folder exists (the reference machines keep the CPU torch
# wheel there), let pip look in it.
FIND_LINKS=()
if [ -d /opt/wheels ]; then FIND_LINKS=(--find-links /opt/wheels); fi
# torch first, from its exact pin: any other request would pull a CUDA build.
.venv/bin/python -m pip install -q "${FIND_LINKS[@]}" -c constraints.txt "torch==2.13.0"
.venv/bin/python -m pip install -q "${FIND_LINKS[@]}" -c constraints.txt -e ".[dev]"
