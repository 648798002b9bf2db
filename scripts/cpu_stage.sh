#!/usr/bin/env bash
# One CPU fine-tune stage of the shipped SmolLM2 drafter, unattended and resumable (the recipe of stages 7-9 in the
# drafter's MODEL_CARD), each step skipped when its output is already in $C:
#   1. the mix: every row of the FOCUS answer files, then REPLAY seeded rows of every other answer file of data/,
#      or more when the mix would otherwise hold fewer than MIX rows (45 minutes of steps on ~2,300 rows overfit:
#      ~8 passes, the held-out tau falling from the first evaluation on; stage 13's first try)
#      (scripts/finetune_data.py; it leaves out the predictor's label sets, so runs/predictor/ must hold them:
#      when they are missing, `SETS_ONLY=1 scripts/make_predictor.sh` writes them first, in seconds)
#   2. `blockpilot train-drafter` from DRAFTER: the target's taps first (~1,100 tokens/s on a 2-core AMD EPYC), then
#      BUDGET minutes of steps; rerun the script after an interruption and it resumes from the last checkpoint.
#      With LAYERS above DRAFTER's depth, DRAFTER is first deepened to LAYERS (scripts/grow_drafter.py -> $C/init,
#      drafting exactly as DRAFTER) and trained from there. With MAX_STEPS the cosine schedule is that many steps
#      whatever the budget, so a run longer than one sitting goes on along the same schedule when the script is
#      rerun (BUDGET then caps the minutes of all sittings together)
#   3. the fine-tune averaged with its start (scripts/interpolate_drafters.py --alpha ALPHA) -> $C/soup
#   4. exact greedy replay of $C/soup on all 164 HumanEval problems and all 80 MT-Bench first turns, 128 new tokens,
#      at BLOCKS (scripts/eval_drafter.py, one single-threaded process per set, both at once)
#   5. $C/soup against DRAFTER, prompt by prompt (scripts/compare_replays.py -> $C/compare.md): BASE_EVAL names a
#      folder holding DRAFTER's replays as {humaneval,mtbench}.json (step 4's command); without it DRAFTER is
#      replayed the same way first
# Nothing is shipped: copy $C/soup over the shipped drafter only if it wins, then rerun scripts/make_predictor.sh
# (the predictor is pinned to the drafter's weights).
#
#   FOCUS="data/new-a.jsonl.gz data/new-b.jsonl.gz" C=~/.cache/blockpilot/train-runs/s29 SEED=10 scripts/cpu_stage.sh
#   # a 5-layer run of 4,000 steps over several sittings (stage 17; rerun the same line to go on):
#   FOCUS="..." REPLAY=3000 MIX=0 MIX_SEED=17 LAYERS=5 MAX_STEPS=4000 BUDGET=600 C=... SEED=17 scripts/cpu_stage.sh
#
# Environment (defaults in brackets): FOCUS (required)  C [~/.cache/blockpilot/train-runs/stage]  REPLAY [1000]
#   MIX [4000]  MIX_SEED [0] the mix's shuffle  BUDGET [45] minutes of steps  MAX_STEPS [fitted to BUDGET]
#   LAYERS [DRAFTER's]  SEED [0] the trainer's  LR [2e-4]  SEQS [16]  ANCHORS [32]  VALID [64]  EVAL_EVERY [10] minutes
#   ALPHA [0.5]  BLOCKS [2,3,4,6,8]  SETS [humaneval mtbench]  LIMIT [all] prompts per set (quick checks)
#   BASE_EVAL [replay DRAFTER]  DRAFTER [the shipped drafter]  ANSWERS_DIR [~/.cache/blockpilot/eval/answers] the
#   target's greedy answers to the sets (made once, ~6 minutes, then reused)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
BP=${BP:-.venv/bin/blockpilot}
: "${FOCUS:?name the new answer files, e.g. FOCUS=\"data/a.jsonl.gz data/b.jsonl.gz\"}"
C=${C:-$HOME/.cache/blockpilot/train-runs/stage}
REPLAY=${REPLAY:-1000}
MIX=${MIX:-4000}
BUDGET=${BUDGET:-45}
MAX_STEPS=${MAX_STEPS:-}
LAYERS=${LAYERS:-}
MIX_SEED=${MIX_SEED:-0}
EVAL_EVERY=${EVAL_EVERY:-10}
SEED=${SEED:-0}
LR=${LR:-2e-4}
SEQS=${SEQS:-16}
ANCHORS=${ANCHORS:-32}
VALID=${VALID:-64}
ALPHA=${ALPHA:-0.5}
BLOCKS=${BLOCKS:-2,3,4,6,8}
SETS=${SETS:-humaneval mtbench}
LIMIT=${LIMIT:-}
DRAFTER=${DRAFTER:-src/blockpilot/assets/drafters/smollm2-135m-instruct-dflash-b8}
ANSWERS_DIR=${ANSWERS_DIR:-$HOME/.cache/blockpilot/eval/answers}
mkdir -p "$C/eval"
log() { echo "[$(date -u +%H:%M:%S)] $*" | tee -a "$C/stage.log"; }

if [ ! -s "$C/mix.jsonl" ]; then
  [ -f runs/predictor/heldout.jsonl ] || SETS_ONLY=1 PY="$PY" scripts/make_predictor.sh | tee -a "$C/stage.log"
  focus=(); for f in $FOCUS; do focus+=(--focus "$f"); done
  $PY scripts/finetune_data.py "${focus[@]}" --replay "$REPLAY" --mix-size "$MIX" --seed "$MIX_SEED" --out "$C/mix.jsonl.tmp" | tee -a "$C/stage.log"
  mv "$C/mix.jsonl.tmp" "$C/mix.jsonl"
fi
log "mix: $(wc -l < "$C/mix.jsonl") answers, md5 $(md5sum < "$C/mix.jsonl" | cut -c1-8)"

depth() { $PY -c 'import json, sys; print(json.load(open(sys.argv[1] + "/config.json"))["num_hidden_layers"])' "$1"; }
if [ -n "$LAYERS" ] && [ "$LAYERS" != "$(depth "$DRAFTER")" ]; then  # deepen first; train and average from there
  [ -d "$C/init" ] || $PY scripts/grow_drafter.py --drafter "$DRAFTER" --layers "$LAYERS" --out "$C/init" | tee -a "$C/stage.log"
  DRAFTER=$C/init
fi

if [ ! -f "$C/finetune/model.safetensors" ]; then
  resume=(); [ -f "$C/work/checkpoint/train_state.pt" ] && resume=(--resume)
  log "train-drafter ${resume[*]:-(from $DRAFTER)}, $BUDGET minutes of steps${MAX_STEPS:+, a $MAX_STEPS-step schedule}"
  $BP train-drafter --init-from "$DRAFTER" --layers "$(depth "$DRAFTER")" --answers "$C/mix.jsonl" --out "$C/finetune" --work-dir "$C/work" \
    --block-size 8 --time-budget "$BUDGET" --sequences-per-step "$SEQS" --anchors "$ANCHORS" --lr "$LR" \
    --valid "$VALID" --eval-every "$EVAL_EVERY" --checkpoint-every 5 --seed "$SEED" --device cpu \
    ${MAX_STEPS:+--max-steps "$MAX_STEPS"} "${resume[@]}" \
    2> >(stdbuf -oL tr '\r' '\n' | grep --line-buffered -v "%|" >> "$C/train.log") | tee -a "$C/stage.log"
fi
[ -d "$C/soup" ] || $PY scripts/interpolate_drafters.py --a "$DRAFTER" --b "$C/finetune" --alpha "$ALPHA" --out "$C/soup"

replay() {  # replay drafter $1 on every set into $2/{set}.json, one single-threaded process per set
  local pids=() ds
  mkdir -p "$2"
  for ds in $SETS; do
    [ -s "$2/$ds.json" ] && continue
    OMP_NUM_THREADS=1 $PY scripts/eval_drafter.py --drafter "$1" --datasets "$ds" --max-new-tokens 128 \
      --block-sizes '' --replay-block-sizes "$BLOCKS" --replay-prompts 1000 ${LIMIT:+--limit $LIMIT} \
      --answers-dir "$ANSWERS_DIR" --out "$2/$ds.json" > "$2/$ds.log" 2>&1 &
    pids+=($!)
  done
  for pid in "${pids[@]}"; do wait "$pid" || { log "replay of $1 failed: see $2/*.log"; exit 1; }; done
}
base=${BASE_EVAL:-$C/eval/base}
[ -n "${BASE_EVAL:-}" ] || { log "replaying $DRAFTER"; replay "$DRAFTER" "$base"; }
log "replaying $C/soup"
replay "$C/soup" "$C/eval/soup"
args=(); for ds in $SETS; do args+=(--base "$base/$ds.json" --new "$C/eval/soup/$ds.json"); done
$PY scripts/compare_replays.py "${args[@]}" --out "$C/compare.md"
log "done: $C/compare.md"
