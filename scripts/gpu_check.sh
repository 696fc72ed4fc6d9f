#!/usr/bin/env bash
# The GPU path in one command (README "Checking a GPU machine"):
#   bash scripts/gpu_check.sh [--out FILE]     on a GPU machine, with .gpu_wheels/ beside it
#   bash scripts/gpu_check.sh --cpu            the same steps on the CPU with the tiny model (CI)
# On a GPU it first installs the wheels of scripts/gpu_wheels.txt (downloaded by
# scripts/gpu_wheels.sh) and areal-flow itself into a temporary site folder, offline; a wheel
# missing from the folder stops it at once, naming the package. Then scripts/gpu_check.py.
set -euo pipefail
cd "$(dirname "$0")/.."
if [[ " $* " != *" --cpu "* ]]; then
  wheels=${GPU_WHEELS:-.gpu_wheels}
  while read -r requirement; do
    name=${requirement%%==*} version=${requirement#*==}
    wheel=$(echo "$name" | tr 'A-Z-' 'a-z_')-$version-  # a wheel's file name (PEP 427)
    if ! ls "$wheels" 2>/dev/null | tr 'A-Z' 'a-z' | grep -q "^$wheel"; then
      echo "gpu_check: no wheel of ${requirement} in ${wheels}/: run scripts/gpu_wheels.sh on a" \
           "machine with the package index and bring the folder along" >&2
      exit 2
    fi
  done < <(grep -v '^#' scripts/gpu_wheels.txt | grep .)
  site=$(mktemp -d)
  python -m pip install --quiet --no-deps --no-index --find-links "$wheels" --target "$site" \
      "$wheels"/*.whl .
  export PYTHONPATH="$site:$PWD${PYTHONPATH:+:$PYTHONPATH}"
fi
exec python scripts/gpu_check.py "$@"
