#!/usr/bin/env bash
# The committed moespec-tiny results: profile this CPU, then the main table and the ablations.
# Sizes fit well under an hour on the shared 2-core machine (1 torch thread, as profiled).
# The profile replaces the shipped one only because --out names it (no default writes shipped assets).
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=benchmarks/results
SHIPPED=trtllm_moespec/assets/moespec-tiny/cost_profile.json
mkdir -p "$OUT"
moespec profile --model moespec-tiny --repeats 40 --out "$SHIPPED" ${PROFILE_FLAGS:-} | tee "$OUT/profile.txt"
cp "$SHIPPED" "$OUT/cost_profile.json"
moespec bench --model moespec-tiny --datasets humaneval,mt_bench,gsm8k \
  --methods ar,eagle3,ddd,coverage,evict,ecospec,joint --guard-ablation evict,joint --temperature 0,1 \
  --num-prompts 8 --max-tokens 64 --repeats 3 --json "$OUT/bench.json" --markdown "$OUT/bench.md" --plots "$OUT/plots"
if [ -z "${SKIP_ABLATIONS:-}" ]; then
  moespec bench --model moespec-tiny --datasets humaneval --methods ar,eagle3,ecospec,joint,coverage --temperature 0 \
    --num-prompts 8 --max-tokens 64 --ecospec-global --gamma-sweep 3,4,5,6 --predictor-ablation --rho-sweep 0.5,0.8,0.95 \
    --json "$OUT/ablations.json" --markdown "$OUT/ablations.md" --plots "$OUT/ablation_plots"
fi
