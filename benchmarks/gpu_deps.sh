#!/usr/bin/env bash
# The test tools the GPU machine may lack: it has torch, triton and transformers but no network, and
# gpu_check.sh's CUDA tests need pytest. This unpacks pytest and its dependencies (pure-Python wheels
# only, so they import under any Python >= 3.10 the GPU machine has) into runs/gpu_deps, here, where
# the package registry is reachable. Carry that folder to the GPU machine (the device tool's `carry`
# with "runs/gpu_deps"); gpu_check.sh puts it on PYTHONPATH only when that machine has no pytest.
#
#   bash benchmarks/gpu_deps.sh [DEST]     # default DEST: runs/gpu_deps
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
DEST="${1:-$ROOT/runs/gpu_deps}"
rm -rf "$DEST"
"${PYTHON:-python}" -m pip install --quiet --no-deps --only-binary=:all: --implementation py --platform any \
  --python-version 3.10 --no-compile --target "$DEST" \
  "pytest>=8,<10" pluggy iniconfig packaging pygments exceptiongroup tomli typing_extensions
echo "pytest and its dependencies in $DEST ($(du -sh "$DEST" | cut -f1)); carry it to the GPU machine"
