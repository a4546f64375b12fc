#!/usr/bin/env bash
# Node values and offline policy scoring on moespec-tiny (issue 10): the commands behind
# benchmarks/results/value_ranking.* and replay_heldout*.*. Records live in runs/ (git-ignored, ~130 MB).
# Held-out = the bench's prompts (first 8 of each dataset); the calibrator prior and the acceptance head
# were fitted on the next 12 (T=0) and 4 (T=1) prompts of each dataset.
set -euo pipefail
R=runs/replay
moespec replay record --datasets humaneval,mt_bench,gsm8k --num-prompts 8 --max-tokens 64 --out $R/heldout_t0.safetensors
moespec replay record --datasets humaneval,mt_bench,gsm8k --skip-prompts 8 --num-prompts 12 --max-tokens 64 --out $R/train_t0.safetensors
moespec replay record --datasets humaneval,mt_bench,gsm8k --skip-prompts 8 --num-prompts 4 --max-tokens 64 --temperature 1 --no-hidden --out $R/train_t1.safetensors
moespec replay fit-calibrator $R/train_t0.safetensors $R/train_t1.safetensors --out trtllm_moespec/assets/moespec-tiny/values/calibrator.json
python -m trtllm_moespec.training.train_acceptance_head --train $R/train_t0.safetensors --out runs/acceptance_head --minutes 5 \
    --export trtllm_moespec/assets/moespec-tiny/acceptance-head
moespec replay rank $R/heldout_t0.safetensors --values raw,calibrated,head --k 1,2,4,8,16 \
    --json benchmarks/results/value_ranking.json --markdown benchmarks/results/value_ranking.md
moespec replay score $R/heldout_t0.safetensors --policies eagle3,evict,ecospec,joint,coverage --values raw,calibrated,head \
    --cost fit --json benchmarks/results/replay_heldout.json --markdown benchmarks/results/replay_heldout.md
moespec replay score $R/heldout_t0.safetensors --policies eagle3,evict,ecospec,joint,coverage --values raw,calibrated,head \
    --cost table --json benchmarks/results/replay_heldout_table.json --markdown benchmarks/results/replay_heldout_table.md
python -m benchmarks.bench_values $R/heldout_t0.safetensors --json benchmarks/results/value_cost.json
