#!/usr/bin/env bash
# The one script a GPU machine runs (offline, <= 6 minutes): CUDA tests (graphs on/off), select_tree timings,
# lean-engine vs transformers AR tokens/s, ar/eagle3 tokens/s with CUDA graphs on vs off, C(k) with and without CUDA graphs on a
# random-weight Qwen3-30B-A3B-shaped model, the host syncs per speculative step before the verify, and a batch sweep (batched engine at B = 1, 2, 4, 8: ar/eagle3/joint-batch
# tokens/s, each request's greedy tokens checked against single-request ar) (benchmarks/gpu_check.py); then the TensorRT-LLM
# checks (benchmarks/gpu_check_trtllm.py, TRTLLM_TIMEOUT default 120 s; skipped where tensorrt_llm is absent). JSON goes under $OUT.
#
#   OUT=/path/to/out bash benchmarks/gpu_check.sh            # on the GPU machine
#   OUT=/tmp/smoke bash benchmarks/gpu_check.sh --cpu-smoke  # tiny shapes on CPU (CI runs this)
#
# TEST_TIMEOUT / MEASURE_TIMEOUT (seconds; defaults 75 for the kernel tests, 95 for the engine tests
# (22 tests, most a model load and a generation) and 180 for the measurements; a pytest run that ignores
# the interrupt is killed 5 s later) bound each pytest run and the measurements, so the whole script stays under
# 6 minutes (the batch sweep, last, skips the batch sizes it cannot start 30 s before MEASURE_TIMEOUT).
# Exit status 1 if a test, a measurement or the sweep's exactness check fails.
# Nothing is installed from the network: the project is used in place through PYTHONPATH
# (the GPU machine already has torch, triton and transformers). The CUDA tests need pytest: where the
# machine has none, runs/gpu_deps (made here by `bash benchmarks/gpu_deps.sh`, carried along) is used.
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
OUT="${OUT:-$ROOT/runs/gpu_check}"
SMOKE=""
[[ "${1:-}" == "--cpu-smoke" ]] && SMOKE="--cpu-smoke"
mkdir -p "$OUT"
cd "$ROOT"
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
PY="${PYTHON:-$(command -v python || command -v python3 || echo python)}"  # images often ship python3 only
status=0

run_tests() {  # name, default timeout, then pytest arguments; writes $OUT/tests_<name>.txt and keeps going on failure
  local name="$1" limit="${TEST_TIMEOUT:-$2}"; shift 2
  # SIGINT, not timeout's default SIGTERM: pytest then still writes the failures so far, the summary
  # (-rA: every test's outcome) and where it hung; -k 5 kills it if a CUDA call does not return.
  timeout -s INT -k 5 "$limit" "$PY" -m pytest -o addopts= -q -rA -p no:randomly -p no:cacheprovider "$@" \
    >"$OUT/tests_$name.txt" 2>&1
  local rc=$?
  echo "tests $name: exit $rc ($(tail -n 1 "$OUT/tests_$name.txt"))"
  [[ $rc -ne 0 && $rc -ne 5 ]] && status=1
}

echo "== gpu check ${SMOKE:-(full)} -> $OUT"
if ! "$PY" -c "import pytest" 2>/dev/null && [[ -d "$ROOT/runs/gpu_deps" ]]; then
  export PYTHONPATH="$PYTHONPATH:$ROOT/runs/gpu_deps"  # appended: nothing of the machine's own is shadowed
  echo "pytest from runs/gpu_deps"
fi
"$PY" -c "import pytest" 2>/dev/null || echo "no pytest here: the CUDA tests cannot run (bash benchmarks/gpu_deps.sh where pip works, then carry runs/gpu_deps)"
"$PY" -c "import torch; print('torch', torch.__version__, 'cuda', torch.cuda.is_available())"
run_tests kernels 75 tests/kernels/test_cuda.py
run_tests engine 95 tests/engine/test_cuda_engine.py
timeout "${MEASURE_TIMEOUT:-180}" "$PY" -m benchmarks.gpu_check --out "$OUT" --time-limit "${MEASURE_TIMEOUT:-180}" $SMOKE || status=1
# TensorRT-LLM section (benchmarks/gpu_check_trtllm.py): the worker's selection + copy padding captured in a CUDA
# graph (CUDA only); with tensorrt_llm installed also the version/contract/install checks and moespec-tiny on
# TensorRT-LLM against our engine. Sections that cannot run here (no CUDA, no tensorrt_llm) are skipped, not failed.
if [[ -z "$SMOKE" ]]; then
  timeout "${TRTLLM_TIMEOUT:-120}" "$PY" -m benchmarks.gpu_check_trtllm --out "$OUT" || status=1
fi
echo "== done (status $status); JSON: $OUT/gpu_check.json"
exit $status
