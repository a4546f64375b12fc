#!/usr/bin/env bash
# The committed moespec-base results (issue 25): every method interleaved in one run, then offline replay
# on held-out prompts, the batched engine at B = 1, 4, 8 and the regime plot. 1 torch thread, as profiled.
# Run on a quiet machine (nothing else running): about 2.5 hours on the 2-core CPU at the full sizes.
#   bash benchmarks/base_suite.sh                  # everything
#   STAGES="bench" REPEATS=1 bash benchmarks/base_suite.sh   # a subset (stages: profile tune bench values replay batch overhead regime)
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=benchmarks/results/base
R=runs/base/replay
M=moespec-base
STAGES="${STAGES:-profile tune bench values replay batch overhead regime}"
mkdir -p "$OUT" "$R"
has() { [[ " $STAGES " == *" $1 "* ]]; }

if has profile; then  # the shipped profile is replaced only because --out names it
  moespec profile --model $M --repeats "${PROFILE_REPEATS:-20}" --out trtllm_moespec/assets/$M/cost_profile.json \
    | tee "$OUT/profile.txt"
fi
if has tune; then  # EcoSpec's budget chosen as its paper chose gamma, on prompts the bench never uses (after its 8)
  [[ -f $R/train_t0.safetensors ]] || moespec replay record --model $M --datasets humaneval,mt_bench,gsm8k \
    --skip-prompts 8 --num-prompts 24 --max-tokens 64 --no-hidden --out $R/train_t0.safetensors
  moespec replay tune $R/train_t0.safetensors --policy ecospec --option budget \
    --out trtllm_moespec/assets/$M/policy_defaults.json --markdown "$OUT/ecospec_budget.md"
fi
if has bench; then
  # the committed run (benchmarks/results/base/bench.md): PROMPTS=5 TOKENS=96 REPEATS=1 STAGES=bench (28 min)
  moespec bench --model $M --datasets humaneval,mt_bench,gsm8k --methods ar,eagle3,evict,ecospec,joint \
    --guard-ablation evict,ecospec,joint \
    --temperature 0,1 --num-prompts "${PROMPTS:-8}" --max-tokens "${TOKENS:-128}" --repeats "${REPEATS:-3}" \
    --json "$OUT/bench.json" --markdown "$OUT/bench.md" --plots "$OUT/plots"
  # the guard's prior for sampled requests: the unguarded joint's T=1 cells beside ar's (the guard ablation)
  python -m benchmarks.guard_prior "$OUT/bench.json" --out trtllm_moespec/assets/$M/policy_defaults.json
fi
if has values; then  # the model's value model (the acceptance head) against the calibrated values, live (2 runs per cell)
  moespec bench --model $M --datasets humaneval,mt_bench,gsm8k --methods ar,evict,joint --values-sweep calibrated \
    --temperature 0 --num-prompts "${PROMPTS:-8}" --max-tokens "${TOKENS:-128}" --repeats 2 \
    --json "$OUT/values_head_ab_t0.json" --markdown "$OUT/values_head_ab_t0.md"
  moespec bench --model $M --datasets humaneval,mt_bench,gsm8k --methods ar,joint --values-sweep calibrated \
    --temperature 1 --num-prompts "${PROMPTS:-8}" --max-tokens "${TOKENS:-128}" --repeats 2 \
    --json "$OUT/values_head_ab_t1.json" --markdown "$OUT/values_head_ab_t1.md"
fi
if has replay; then  # held-out: the bench's prompts, which neither training nor the calibrator prior saw
  # with the drafter's node features, which the acceptance head reads
  moespec replay record --model $M --datasets humaneval,mt_bench,gsm8k --num-prompts "${PROMPTS:-8}" --max-tokens 64 \
    --out $R/heldout_t0.safetensors
  moespec replay score $R/heldout_t0.safetensors --policies eagle3,evict,ecospec,joint,coverage \
    --values raw,calibrated,head --cost fit --hindsight --true-experts --json "$OUT/replay_heldout.json" --markdown "$OUT/replay_heldout.md"
fi
if has batch; then
  python -m benchmarks.bench_batch_steps --model $M --batch-sizes 1,4,8 --methods ar,joint,joint-batch,eagle3 \
    --tokens 64 --repeats "${BATCH_REPEATS:-3}" --json "$OUT/batch_steps_cpu.json"
  # served as a server would: 24 data-set requests through B slots, freed slots refilled (steady state)
  python -m benchmarks.bench_batch_steps --model $M --batch-sizes 1,4,8 --methods ar,joint,joint-batch,eagle3 \
    --tokens 64 --repeats "${BATCH_REPEATS:-3}" --requests 24 --json "$OUT/batch_served_cpu.json"
fi
if has overhead; then  # a speculative step's overhead and its anatomy, the compiled host work beside the reference:
  # eagle3 (the whole tree verified) and joint (its node values, selection and their update too)
  python -m benchmarks.bench_step_overhead --model $M --repeats "${OVERHEAD_REPEATS:-7}" --json "$OUT/step_overhead_cpu.json"
  python -m benchmarks.bench_step_overhead --model $M --policy joint --repeats "${OVERHEAD_REPEATS:-7}" \
    --json "$OUT/step_overhead_joint_cpu.json"
  # the goal's own measure: C(0) - plain - the drafter forwards, those timed inside the C(0) steps
  python -m benchmarks.bench_c0_overhead --model $M --steps "${C0_STEPS:-400}" --json "$OUT/c0_overhead_cpu.json" \
    | tee "$OUT/c0_overhead.txt"
fi
if has regime; then
  python -m benchmarks.regime_plot --out benchmarks/results/regime.png
fi
