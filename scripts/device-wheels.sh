#!/usr/bin/env bash
# Download, on a machine with network access, the wheels that a bare GPU machine (PyTorch
# with CUDA and Lightning preinstalled, Python 3.12, no network) lacks for
# scripts/gpu-check.sh, into DIR (default .device-wheels, git-ignored): the store's
# (zarr, numcodecs, crc32c), the CLI's (jsonargparse), transformers and Accelerate with
# their dependencies, pytest, and kvikio with its cuFile library for each CUDA major
# version asked (the GPU check installs the one matching the image's torch). Every wheel
# is pinned to the versions tested here and downloaded without its dependencies (so
# neither torch nor numpy is fetched); the check installs only those the machine lacks.
# About 50 MB in all.
# Usage: bash scripts/device-wheels.sh [DIR] [--cuda 12,13] [--print]
#   --print lists the requirements it would download and exits.
set -euo pipefail
usage() {
    echo "usage: bash scripts/device-wheels.sh [DIR] [--cuda 12,13] [--print] ($1)" >&2
    exit 2
}
DIR=""
CUDA="12,13"
PRINT=0
while [ $# -gt 0 ]; do
    case "$1" in
        --print) PRINT=1 ;;
        --cuda)
            [ $# -ge 2 ] || usage "--cuda needs a value such as 12 or 12,13"
            CUDA="$2"
            shift
            ;;
        --cuda=*) CUDA="${1#--cuda=}" ;;
        -*) usage "unknown option '$1'" ;;
        *)
            [ -z "$DIR" ] || usage "one DIR only, got '$DIR' and '$1'"
            [ -n "$1" ] || usage "DIR is empty: give a folder or leave it out"
            DIR="$1"
            ;;
    esac
    shift
done
cd "$(dirname "$0")/.."
DIR="${DIR:-.device-wheels}"

# the versions of the reference environment (constraints.txt where it pins one)
REQS=(
    zarr==3.1.6 numcodecs==0.16.6 crc32c==2.9.post0 google-crc32c==1.9.0 donfig==0.8.1.post1
    jsonargparse==4.53.0 docstring-parser==0.18.0 typeshed-client==2.15.0
    importlib-resources==7.1.0 typing-extensions==4.16.0 psutil==7.2.2 safetensors==0.8.0
    transformers==5.24.0 tokenizers==0.23.3 huggingface-hub==2.4.0 hf-xet==1.8.0
    regex==2026.12.2 httpx2==2.17.0 httpcore2==2.17.0 h11==0.16.0 anyio==4.16.0 idna==3.21
    typer==0.29.2 click==8.5.1 rich==15.0.0 markdown-it-py==4.3.0 mdurl==0.1.2
    pygments==2.21.0 shellingham==1.5.4 annotated-doc==0.0.7 truststore==0.10.5
    pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5
    accelerate==1.16.0 pytest==9.2.0 pluggy==1.7.0 iniconfig==2.3.1
    rapids-logger==0.3.0 cuda-pathfinder==1.9.1
)
IFS=',' read -r -a MAJORS <<<"$CUDA"
for major in "${MAJORS[@]}"; do
    case "$major" in
        12) REQS+=(kvikio-cu12==26.10.0 libkvikio-cu12==26.10.0 nvidia-cufile-cu12==1.14.1.1) ;;
        13) REQS+=(kvikio-cu13==26.10.0 libkvikio-cu13==26.10.0 nvidia-cufile==1.15.1.6) ;;
        *) usage "--cuda $CUDA: each CUDA major version must be 12 or 13" ;;
    esac
done

if [ "$PRINT" = 1 ]; then
    printf '%s\n' "${REQS[@]}"
    exit 0
fi
PY="${PYTHON:-.venv/bin/python}"
[ -x "$PY" ] || PY="$(command -v python3)"
mkdir -p "$DIR"
# cupy, which kvikio's metadata requires, is left out: kvikio's file reads into torch
# tensors do not use it, and its wheel alone is larger than all the others together
"$PY" -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --abi cp312 --platform manylinux_2_28_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    --platform manylinux_2_5_x86_64 --platform manylinux1_x86_64 \
    -d "$DIR" "${REQS[@]}"
du -sh "$DIR"
