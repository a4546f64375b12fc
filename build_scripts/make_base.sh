#!/usr/bin/env bash
# moespec-base, end to end: the commands that made the shipped assets (trtllm_moespec/assets/moespec-base/).
# Every step is time-bounded; each writes its log to runs/logs/. Run from the repository root.
#
#   bash build_scripts/make_base.sh tokenizer   # encode the corpus with moespec-tiny's tokenizer (~30 s)
#   bash build_scripts/make_base.sh target      # train the target, warm-started from moespec-tiny (TARGET_MIN minutes)
#   bash build_scripts/make_base.sh drafter-early   # meanwhile, on the other core: the drafter against an early
#                                              # checkpoint of the target (stopped when the target is done)
#   bash build_scripts/make_base.sh resume      # a later segment on any machine: a new run from the shipped target
#   bash build_scripts/make_base.sh drafter-resume  # a later drafter segment on any machine, from the shipped drafter;
#                                              # then `family-drafter` rebuilds what depends on the drafter
#   bash build_scripts/make_base.sh family      # export the target, then drafter, draft vocabulary, predictor head,
#                                              # calibrator prior, acceptance head, cost profile and the report
#   bash build_scripts/make_base.sh acceptance-head   # the acceptance head alone, on the shipped pair (~35 min)
# The fresh-layer cycle (the up-scaling's 16 fresh layers trained alone, block expansion), segment by segment;
# nothing shipped changes until `fresh-ship`:
#   bash build_scripts/make_base.sh fresh          # FRESH_MIN minutes of the fresh layers (resumes runs/base/target_fresh
#                                                  # when its checkpoint is here), exported to runs/base/target_fresh_export
#   bash build_scripts/make_base.sh fresh-drafter  # the drafter follows that export (warm-started from the shipped
#                                                  # drafter, or resumed), DRAFTER_MIN minutes
#   bash build_scripts/make_base.sh fresh-stage    # both exports into checkpoints/moespec-base-fresh/ (to commit: a
#                                                  # later machine, with no runs/, resumes or ships from them)
#   bash build_scripts/make_base.sh fresh-ship     # both into the assets, then the drafter's family, profile, report
#                                                  # (REPORTED=1: the report ran beside the drafter, `report` below)
#   bash build_scripts/make_base.sh report         # the report and layer ablation of TARGET (default: the shipped one)
# Environment: TARGET_MIN (default 65), EAGLE3_MIN (15), HEAD_MIN (4), LR (6e-4, the target's peak),
# DRAFTER_MIN (60), DRAFTER_LR (1e-3), THREADS (1), FRESH_MIN (90), FRESH_LR (1.5e-3),
# AUX_COEF (0.03, the weight of the fresh segments' per-layer router balancing loss, averaged over the layers that
# train), LAYERS (the layers a fresh-cycle segment trains; default the 16 fresh ones), TARGET (report's), REPORTED,
# PROFILED (1: leave the cost profile to benchmarks/base_suite.sh, which runs next).
# The router cycle (2026-12-05) is the same cycle on the source layers whose routing moespec-tiny left near-dead
# (an expert of layer 1 that no held-out token reached):
#   LAYERS=0,1,12,13 FRESH_MIN=30 FRESH_LR=5e-4 AUX_COEF=0.1 bash build_scripts/make_base.sh fresh
#   DRAFTER_MIN=30 bash build_scripts/make_base.sh fresh-drafter
#   TARGET=runs/base/target_fresh_export bash build_scripts/make_base.sh report   # beside the drafter
#   REPORTED=1 PROFILED=1 bash build_scripts/make_base.sh fresh-ship && bash benchmarks/base_suite.sh
set -euo pipefail
cd "$(dirname "$0")/.."
F="--family base"
A=trtllm_moespec/assets/moespec-base
R=runs/base
mkdir -p runs/logs
step="${1:?usage: make_base.sh tokenizer|target|drafter-early|resume|family|drafter-resume|family-drafter|fresh|fresh-drafter|fresh-stage|fresh-ship|report}"
FRESH_LAYERS=2-5,8-11,14-17,20-23  # the up-scaling's fresh layers (training/upscale.py), started as identities
STAGE=checkpoints/moespec-base-fresh  # the fresh cycle's exports between machines (fresh-stage), until shipped

staged() {  # staged NAME FALLBACK -> the staged export NAME (target, eagle3) when one is committed and not yet
  # superseded by a later ship (fresh-ship marks it: deleting ~90 MB in the ship's own submission passes its size limit)
  if [[ -f "$STAGE/$1/config.json" && ! -f "$STAGE/SUPERSEDED" ]]; then echo "$STAGE/$1"; else echo "$2"; fi
}

from_stage() {  # from_stage NAME -> the staged export NAME; fails when none is committed or it is superseded
  local d; d="$(staged "$1" "")"
  if [[ -z "$d" ]]; then echo "no run here and no current staged $1 in $STAGE to ship" >&2; exit 2; fi
  echo "$d"
}

# A run continues from its checkpoint when one is here (a new cosine segment), else starts from $2's export.
segment() {  # segment RUN_DIR INIT_FROM MINUTES LR -> the flags of a new or resumed segment
  if [[ -f "$1/ckpt/progress.json" ]]; then
    echo "--resume --minutes $3 --extend-minutes $3 --extend-lr $4"
  else
    echo "--init-from $2 --minutes $3 --lr $4"
  fi
}

# What the target is made of (held-out loss, routing, every expert and layer ablated): TARGET, the shipped one by
# default; `TARGET=runs/base/target_fresh_export make_base.sh report` runs it beside the drafter's last segment.
report() {
  local t="${TARGET:-$A/target}"
  python build_scripts/train_model.py $F report --target "$t" --predictor "$A/predictor" --reps 3 --ablation-windows 2 \
    --threads 1 --out benchmarks/results/base/report.json 2>&1 | tee runs/logs/base_report.log
  python -m benchmarks.layer_ablation --target "$t" --group $FRESH_LAYERS --threads 1 \
    --json benchmarks/results/base/layer_ablation.json 2>&1 | tee runs/logs/layer_ablation.log
}

report_and_profile() {
  if [[ -z "${REPORTED:-}" ]]; then report; fi  # REPORTED=1: `report` already ran on this target
  # the tree the model ships with (its default: LLM, the CLI and the benchmarks draft the tree its profile names):
  # 6,8,32 over EAGLE's 4,8,32, where half of joint's speculative steps accepted the whole depth 4 (runs/tree)
  if [[ -z "${PROFILED:-}" ]]; then  # PROFILED=1: benchmarks/base_suite.sh profiles it next (its profile stage)
    moespec profile --model moespec-base --tree 6,8,32 --repeats 40 --out "$A/cost_profile.json" \
      | tee benchmarks/results/base/profile.txt
  fi
}

# What depends on the drafter: its draft vocabulary (the export pruned to 512 tokens), the predictor head on its
# hidden states and the calibrator prior from replay records of its trees.
drafter_family() {
  python -m benchmarks.draft_vocab --model moespec-base --pruned 512 --spec-prompts 1 --prompts 4 --export 512 \
    --out benchmarks/results/base/draft_vocab_cpu.json 2>&1 | tee runs/logs/base_draft_vocab.log
  python build_scripts/train_model.py $F predictor-head --minutes "${HEAD_MIN:-4}" --train-windows 128 --threads 1 \
    2>&1 | tee runs/logs/base_predictor_head.log
  python build_scripts/train_model.py $F export-predictor-head
  # calibrator prior: T=0 and T=1 records on prompts 9-32 (T=1: 9-20) of each dataset, after the bench's first 8
  # (prompts 33-40 check the fit: --skip-prompts 32 --num-prompts 8), with the model's own 6,8,32 tree
  moespec replay record --model moespec-base --tree 6,8,32 --datasets humaneval,mt_bench,gsm8k \
    --skip-prompts 8 --num-prompts 24 --max-tokens 64 --no-hidden --out "$R/replay/train_t0.safetensors"
  moespec replay record --model moespec-base --tree 6,8,32 --datasets humaneval,mt_bench,gsm8k \
    --skip-prompts 8 --num-prompts 12 --max-tokens 64 --temperature 1 --no-hidden --out "$R/replay/train_t1.safetensors"
  moespec replay fit-calibrator "$R/replay/train_t0.safetensors" "$R/replay/train_t1.safetensors" --out "$A/values/calibrator.json"
  acceptance_head
}

# The learned acceptance head (values='head'): T=0 records with the drafter's node features on prompts the
# benchmarks never use (9-88 of each data set to train, 89-148 of HumanEval and GSM8K to pick the head kept,
# MT-Bench having 80), ~30 min of records, then under a minute of training (it stops when the validation loss
# has not improved for 8 checks); the bench's held-out records give the ranking report.
acceptance_head() {
  local rec="moespec replay record --model moespec-base --max-tokens 64"
  [[ -f $R/replay/head_train1.safetensors ]] || $rec --datasets humaneval,mt_bench,gsm8k --skip-prompts 8 \
    --num-prompts 40 --out "$R/replay/head_train1.safetensors"
  [[ -f $R/replay/head_train2.safetensors ]] || $rec --datasets humaneval,mt_bench,gsm8k --skip-prompts 48 \
    --num-prompts 40 --out "$R/replay/head_train2.safetensors"
  [[ -f $R/replay/head_val.safetensors ]] || $rec --datasets humaneval,gsm8k --skip-prompts 88 --num-prompts 60 \
    --out "$R/replay/head_val.safetensors"
  [[ -f $R/replay/heldout_t0.safetensors ]] || $rec --datasets humaneval,mt_bench,gsm8k --num-prompts 8 \
    --out "$R/replay/heldout_t0.safetensors"
  python -m trtllm_moespec.training.train_acceptance_head --train "$R/replay/head_train1.safetensors" \
    "$R/replay/head_train2.safetensors" --val "$R/replay/head_val.safetensors" \
    --heldout "$R/replay/heldout_t0.safetensors" --intermediate 64 --minutes 5 --out "$R/acceptance_head" \
    --export "$A/acceptance-head" 2>&1 | tee runs/logs/base_acceptance_head.log
  cp "$R/acceptance_head/metrics.json" benchmarks/results/base/acceptance_head.json
}

case "$step" in
tokenizer)
  python build_scripts/train_model.py $F tokenizer --reuse trtllm_moespec/assets/moespec-tiny/target ;;
target)
  # 1 torch thread keeps the other core free; up-scaling moespec-tiny (training/upscale.py) is the jump start
  python build_scripts/train_model.py $F target --minutes "${TARGET_MIN:-65}" --batch-size 4 --lr "${LR:-6e-4}" \
    --threads 1 --init-from trtllm_moespec/assets/moespec-tiny/target 2>&1 | tee runs/logs/base_target.log ;;
resume)
  # a fresh machine has no optimizer state: start a new segment from the shipped (exported) target
  python build_scripts/train_model.py $F target --minutes "${TARGET_MIN:-65}" --batch-size 4 --lr "${LR:-3e-4}" \
    --threads 1 --out "$R/target_$(date +%Y%m%d%H%M)" --init-from "$A/target" 2>&1 | tee runs/logs/base_resume.log ;;
drafter-early)
  python build_scripts/train_model.py $F export-target --out "$R/target_early"
  python build_scripts/train_model.py $F eagle3 --target "$R/target_early" --minutes 60 --threads 1 2>&1 \
    | tee runs/logs/base_eagle3.log ;;
drafter-resume)
  # a fresh machine has no drafter checkpoint: a new run warm-started from the shipped (pruned) drafter
  python build_scripts/train_model.py $F eagle3 --init-from "$A/eagle3" --minutes "${DRAFTER_MIN:-60}" \
    --lr "${DRAFTER_LR:-1e-3}" --threads "${THREADS:-1}" --out "$R/eagle3_resume" 2>&1 | tee runs/logs/base_eagle3_resume.log ;;
acceptance-head)
  acceptance_head ;;
family-drafter)
  # after drafter-resume: the export, its draft vocabulary, the predictor head and the calibrator prior
  python build_scripts/train_model.py $F export-eagle3 --run "$R/eagle3_resume"
  drafter_family ;;
family)
  RUN="${RUN:-$R/target}"
  python build_scripts/train_model.py $F export-target --run "$RUN"
  # the drafter follows the final target in an appended segment (from scratch: eagle3 --minutes EAGLE3_MIN)
  python build_scripts/train_model.py $F eagle3 --resume --extend-minutes "${EAGLE3_MIN:-15}" --extend-lr 1e-3 \
    --threads 2 2>&1 | tee runs/logs/base_eagle3_final.log
  python build_scripts/train_model.py $F export-eagle3
  drafter_family
  report_and_profile ;;
fresh)
  # block expansion: only the fresh layers train (the first segment, 30 minutes, ran at lr 2e-3)
  python build_scripts/train_model.py $F target --out "$R/target_fresh" --batch-size 4 --threads 1 \
    --aux-coef "${AUX_COEF:-0.03}" --train-layers "${LAYERS:-$FRESH_LAYERS}" $(segment "$R/target_fresh" "$(staged target "$A/target")" "${FRESH_MIN:-90}" "${FRESH_LR:-1.5e-3}") \
    2>&1 | tee -a runs/logs/target_fresh.log
  python build_scripts/train_model.py $F export-target --run "$R/target_fresh" --out "$R/target_fresh_export" ;;
fresh-drafter)
  T="$R/target_fresh_export"; [[ -d "$T" ]] || T="$(staged target "$A/target")"
  python build_scripts/train_model.py $F eagle3 --target "$T" --out "$R/eagle3_fresh" \
    --threads "${THREADS:-1}" $(segment "$R/eagle3_fresh" "$(staged eagle3 "$A/eagle3")" "${DRAFTER_MIN:-60}" "${DRAFTER_LR:-1e-3}") \
    2>&1 | tee -a runs/logs/eagle3_fresh.log ;;
report)
  report ;;
fresh-stage)
  # the drafter's export is unpruned (the draft vocabulary is pruned when shipped, drafter_family)
  rm -rf "$STAGE/target" "$STAGE/eagle3" "$STAGE/SUPERSEDED" && mkdir -p "$STAGE"
  python build_scripts/train_model.py $F export-target --run "$R/target_fresh" --out "$STAGE/target"
  python build_scripts/train_model.py $F export-eagle3 --run "$R/eagle3_fresh" --target "$STAGE/target" \
    --out "$STAGE/eagle3" ;;
fresh-ship)
  # from this machine's runs when they are here, else from the staged exports of an earlier machine
  if [[ -f "$R/target_fresh/ckpt/progress.json" ]]; then
    python build_scripts/train_model.py $F export-target --run "$R/target_fresh"
    if [[ -d "$STAGE" ]]; then date -u +%FT%TZ > "$STAGE/SUPERSEDED"; fi  # the shipped target is newer than the staged
  else
    src="$(from_stage target)"  # its own statement, so set -e stops here when there is nothing to ship
    cp "$src"/* "$A/target/"
  fi
  if [[ -f "$R/eagle3_fresh/ckpt/progress.json" ]]; then
    python build_scripts/train_model.py $F export-eagle3 --run "$R/eagle3_fresh"
  else
    src="$(from_stage eagle3)"
    rm -rf "$A/eagle3" && cp -r "$src" "$A/eagle3"
  fi
  drafter_family
  report_and_profile ;;
*)
  echo "unknown step $step" >&2; exit 2 ;;
esac
