#!/usr/bin/env bash
# Set up (if needed) and run the whole test suite: lint, format check, types, tests.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/ruff check storage bb_lightning tests bench
.venv/bin/ruff format --check storage bb_lightning tests bench
# OpenMP threads waiting for work sleep instead of spinning: the two workers, the processes
# their tests start and mypy share 2 cores, where a spinning team takes the cores its
# neighbours wait for (four of the slowest test files ran 1.12-1.17 x faster this way)
export OMP_WAIT_POLICY="${OMP_WAIT_POLICY:-PASSIVE}"
# types are checked beside the tests: mypy is one process (about 75 s on a cold cache on
# these 2-core machines) and the tests leave about a fifth of two cores idle; its report
# follows the tests'
types_log="$(mktemp)"
.venv/bin/mypy >"$types_log" 2>&1 &
types_pid=$!
trap 'kill "$types_pid" 2>/dev/null || true' EXIT
# two worker processes (pytest-xdist) that take each other's queued tests when idle: on
# 2 cores pytest took 13.6-14.9 min this way, 16.5 with a fixed split, 19-20 in one process;
# -n 0 runs it in one
tests=0
.venv/bin/pytest -q -p no:cacheprovider -n 2 --dist worksteal "$@" || tests=$?
types=0
wait "$types_pid" || types=$?
echo "== mypy"
cat "$types_log"
rm -f "$types_log"
if [ "$types" -ne 0 ]; then exit "$types"; fi
exit "$tests"
