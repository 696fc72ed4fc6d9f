#!/usr/bin/env bash
# On a machine with the package index: download the wheels scripts/gpu_wheels.txt lists (what a
# GPU machine's image lacks) for Python 3.12 on x86_64 Linux into .gpu_wheels/ (ignored by git;
# GPU_WHEELS=DIR for another folder). The folder travels with the working tree to the GPU machine,
# where scripts/gpu_check.sh installs it. About 3 MiB.
set -euo pipefail
cd "$(dirname "$0")/.."
wheels=${GPU_WHEELS:-.gpu_wheels}
mkdir -p "$wheels"
python -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 \
    --platform any --dest "$wheels" $(grep -v '^#' scripts/gpu_wheels.txt)
du -sh "$wheels"
