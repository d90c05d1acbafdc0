#!/usr/bin/env bash
# The checks of a first run on a GPU machine, each step under its own time limit (8
# minutes at most in all): writes OUTDIR/gpu-check.json and OUTDIR/gpu-check.log.
# --dry-run runs every step's Python on the CPU at tiny sizes. The steps: bench/gpu_check.py.
# Usage: bash scripts/gpu-check.sh OUTDIR [--dry-run]
set -uo pipefail
if [ $# -lt 1 ]; then
    echo "usage: $0 OUTDIR [--dry-run]" >&2
    exit 2
fi
OUT="$(mkdir -p "$1" && cd "$1" && pwd)"
shift
DRY=()
if [ "${1:-}" = "--dry-run" ]; then DRY=(--dry-run); fi
cd "$(dirname "$0")/.."
PY="${PYTHON:-.venv/bin/python}"
[ -x "$PY" ] || PY="$(command -v python3)"
LOG="$OUT/gpu-check.log"
rm -rf "$OUT/steps"
: >"$LOG"
while read -r step limit; do
    echo "== $step (limit ${limit} s) $(date -u +%H:%M:%S)" >>"$LOG"
    timeout -k 10 "$limit" "$PY" bench/gpu_check.py "$OUT" --step "$step" "${DRY[@]}" >>"$LOG" 2>&1
    echo "== $step exit $?" >>"$LOG"
done < <("$PY" bench/gpu_check.py --list)
"$PY" bench/gpu_check.py "$OUT" --collect "${DRY[@]}" | tee -a "$LOG"
