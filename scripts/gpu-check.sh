#!/usr/bin/env bash
# The checks of a GPU machine in one call of at most 6 minutes (the steps' limits sum to
# 330 s), on a bare machine: PyTorch with CUDA and Lightning installed, no network. The
# first step (preflight) installs what the machine lacks from the wheels
# scripts/device-wheels.sh downloaded beforehand (.device-wheels/, carried with the work
# tree) and imports every module the steps need; the repository itself is put on
# PYTHONPATH, not installed. Each step runs under its own time limit and writes
# OUTDIR/steps/STEP.json as soon as it finishes; OUTDIR/gpu-check.json merges them at the
# end, OUTDIR/gpu-check.log holds every step's output. NVMe scratch is a new folder under
# $BB_NVME_DIR (else $TMPDIR or /tmp), never under OUTDIR, removed on exit.
# --dry-run runs every step's Python on the CPU at tiny sizes; --steps a,b runs only those
# (after the preflight). The steps: bench/gpu_check.py.
set -uo pipefail
USAGE="usage: bash scripts/gpu-check.sh OUTDIR [--dry-run] [--steps a,b]"
refuse() {
    echo "gpu-check: $1" >&2
    echo "$USAGE" >&2
    exit 2
}
[ $# -ge 1 ] || refuse "give the folder for the results first"
case "$1" in
    "") refuse "OUTDIR is empty: give the folder for the results" ;;
    -*) refuse "'$1' stands where OUTDIR belongs: give the folder first, then the options" ;;
esac
OUTARG="$1"
shift
DRY=()
STEPS=""
while [ $# -gt 0 ]; do
    case "$1" in
        --dry-run) DRY=(--dry-run) ;;
        --steps)
            if [ $# -lt 2 ] || [ -z "$2" ]; then
                refuse "--steps needs step names, such as --steps page_in,nvme_read"
            fi
            STEPS="$2"
            shift
            ;;
        --steps=*) STEPS="${1#--steps=}" ;;
        *) refuse "unknown argument '$1'" ;;
    esac
    shift
done
if [ -e "$OUTARG" ] && [ ! -d "$OUTARG" ]; then
    refuse "OUTDIR '$OUTARG' exists and is not a folder: give a folder"
fi
mkdir -p -- "$OUTARG" 2>/dev/null || refuse "OUTDIR '$OUTARG' cannot be created: give a writable folder"
PROBE="$(mktemp "$OUTARG/.gpu-check-write.XXXXXX" 2>/dev/null)" ||
    refuse "OUTDIR '$OUTARG' is not writable: give a writable folder"
rm -f -- "$PROBE"
OUT="$(cd -- "$OUTARG" && pwd)"
REPO="$(cd -- "$(dirname -- "$0")/.." && pwd)"
cd "$REPO" || exit 2
PY="${PYTHON:-}"
if [ -z "$PY" ]; then
    if [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY="$(command -v python3)"; fi
fi
export BB_DEVICE_WHEELS="${BB_DEVICE_WHEELS:-$REPO/.device-wheels}"
export BB_DEVICE_SITE="${BB_DEVICE_SITE:-$REPO/.device-site}"
export PYTHONPATH="$REPO:$REPO/bench:$BB_DEVICE_SITE${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1

LISTED="$("$PY" bench/gpu_check.py --list)" || refuse "bench/gpu_check.py --list failed with $PY"
NAMES=" $(echo "$LISTED" | awk '{print $1}' | tr '\n' ' ')"
if [ -n "$STEPS" ]; then
    for step in ${STEPS//,/ }; do
        case "$NAMES" in
            *" $step "*) ;;
            *) refuse "--steps: no step '$step'; the steps are:$NAMES" ;;
        esac
    done
fi

SCRATCH_ROOT="${BB_NVME_DIR:-${TMPDIR:-/tmp}}"
mkdir -p -- "$SCRATCH_ROOT" 2>/dev/null || refuse "NVMe folder '$SCRATCH_ROOT' cannot be created: set BB_NVME_DIR to a writable folder"
SCRATCH="$(mktemp -d "$SCRATCH_ROOT/gpu-check-nvme.XXXXXX" 2>/dev/null)" ||
    refuse "NVMe folder '$SCRATCH_ROOT' is not writable: set BB_NVME_DIR to a writable folder"
trap 'rm -rf -- "$SCRATCH"' EXIT
trap 'exit 143' TERM INT
case "$SCRATCH/" in
    "$OUT"/*) refuse "NVMe scratch '$SCRATCH' lies under OUTDIR: set BB_NVME_DIR outside it" ;;
esac
export BB_NVME_DIR="$SCRATCH"

LOG="$OUT/gpu-check.log"
rm -rf -- "$OUT/steps" "$OUT/gpu-check.json"
: >"$LOG"
echo "== $(date -u +%FT%TZ) python $PY, NVMe scratch $SCRATCH, steps ${STEPS:-all}" >>"$LOG"
while read -r step limit; do
    if [ "$step" != preflight ] && [ -n "$STEPS" ]; then
        case ",$STEPS," in *",$step,"*) ;; *) continue ;; esac
    fi
    echo "== $step (limit ${limit} s) $(date -u +%H:%M:%S)" >>"$LOG"
    timeout -k 5 "$limit" "$PY" bench/gpu_check.py "$OUT" --step "$step" "${DRY[@]}" >>"$LOG" 2>&1
    rc=$?
    echo "== $step exit $rc" >>"$LOG"
    if [ "$step" = preflight ] && ! grep -q '"pass": \(true\|null\)' "$OUT/steps/preflight.json" 2>/dev/null; then
        echo "== preflight failed: the other steps are not run" >>"$LOG"
        break
    fi
done <<<"$LISTED"
COLLECT=()
[ -n "$STEPS" ] && COLLECT=(--only "preflight,$STEPS")
"$PY" bench/gpu_check.py "$OUT" --collect "${DRY[@]}" "${COLLECT[@]}" | tee -a "$LOG"
