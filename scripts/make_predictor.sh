#!/usr/bin/env bash
# Label, train and ship the block-size predictor of the embedded default for the drafter that is in
# src/blockpilot/assets/drafters/ now (rerun it after the drafter changes: the predictor is pinned to
# the drafter's weights, and the embedded engine dir rebuilds when the predictor file changes).
#
#   scripts/make_predictor.sh                 # everything: exact replay on five prompt sets the drafter never
#                                             # trained on (100 of its held-out split, 298 HumanEval-style
#                                             # stdlib-code tasks, 200 + 300 ShareGPT first turns of two files,
#                                             # 100 CHAMP math problems; the target's greedy answers are in data/)
#                                             # at T = 0, and on answers the target draws at T = 1 for the first
#                                             # 100 of each (`blockpilot answer --temperature`); the predictor
#                                             # takes the request's temperature as an input; the labels copy
#                                             # drafts by lookup where the runtime does (`label --lookup all`,
#                                             # the default) and price those steps without a drafter call
#   LIMIT=64 scripts/make_predictor.sh        # fewer prompts (the dataset resumes: rerun to add more)
#   SAMPLED= scripts/make_predictor.sh        # T = 0 labels only (a predictor without the temperature input)
#   SETS_ONLY=1 scripts/make_predictor.sh     # only write the five prompt sets to $RUNS and stop (seconds; what
#                                             # scripts/finetune_data.py and scripts/cpu_stage.sh need)
#
# Environment (defaults in brackets):
#   ANSWERS [data/smollm2-answers-9831.jsonl.gz]  the answers file the drafter was trained on
#   STDLIB [data/smollm2-stdlib-answers-3574.jsonl.gz]  answers to stdlib-code tasks the drafter never saw
#   SHAREGPT [data/smollm2-sharegpt-answers-1259.jsonl.gz]  answers to ShareGPT turns the drafter never saw
#   SHAREGPT_OPEN [data/smollm2-sharegpt-answers-open-818.jsonl.gz]  more of them, answered after the drafter
#   CHAMP [data/smollm2-champ-answers-270.jsonl.gz]  answers to natural-language competition math problems
#   HELDOUT_LIMIT [100]  SHAREGPT_LIMIT [200]  CHAMP_LIMIT [100]  how many of those are labelled at T = 0
#                 (the held-out split's templated arithmetic replays at tau ~6: a few hundred of it would
#                 outweigh the code and chat requests the embedded default serves)
#   VALID [256]  SEED [0]   the drafter's `train-drafter --valid/--seed`: its held-out split is labelled
#   CANDIDATES [1,2,3,4,6,8]   1 = plain decoding (10-16 never paid on a CPU: a block-10 step costs 1.6x
#                 a decode step for tau ~1.8)
#   MAX_NEW [96]   LIMIT [all]   RUNS [runs/predictor]
#   STEP_COSTS [measured here]  engine dir or JSON whose step-cost table scores the labels; without it the
#                 table is measured first on the embedded engine dir at the candidate sizes (quiet machine!)
#   LOOP_PROMPTS [3]  LOOP_TOKENS [64]  LOOP_ROUNDS [5]   its decode-loop steps: on the first LOOP_PROMPTS
#                 prompts of each label set (real drafts are accepted, as in use), LOOP_TOKENS new tokens each,
#                 the median of LOOP_ROUNDS interleaved rounds (single rounds of one random prompt wandered by
#                 10% at a block size on a quiet machine)
#   SAMPLED ["1.0:100"]   TEMPERATURE:N pairs: the first N prompts of each set answered by the target
#                 at that temperature and labelled by replay on those draws
#   JOBS [1]   labelling processes at once (one core each; 2 halves the wall time on a 2-core machine)
#   DRAFTER [the shipped drafter]  OUT [the shipped predictor]   to label and train for a candidate drafter
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
BP=${BP:-.venv/bin/blockpilot}
ANSWERS=${ANSWERS:-data/smollm2-answers-9831.jsonl.gz}
STDLIB=${STDLIB:-data/smollm2-stdlib-answers-3574.jsonl.gz}
SHAREGPT=${SHAREGPT:-data/smollm2-sharegpt-answers-1259.jsonl.gz}
SHAREGPT_OPEN=${SHAREGPT_OPEN:-data/smollm2-sharegpt-answers-open-818.jsonl.gz}
CHAMP=${CHAMP:-data/smollm2-champ-answers-270.jsonl.gz}
HELDOUT_LIMIT=${HELDOUT_LIMIT:-100}
CHAMP_LIMIT=${CHAMP_LIMIT:-100}
SHAREGPT_LIMIT=${SHAREGPT_LIMIT:-200}
VALID=${VALID:-256}
SEED=${SEED:-0}
CANDIDATES=${CANDIDATES:-1,2,3,4,6,8}
MAX_NEW=${MAX_NEW:-96}
RUNS=${RUNS:-runs/predictor}
SAMPLED=${SAMPLED-1.0:100}
JOBS=${JOBS:-1}
LOOP_TOKENS=${LOOP_TOKENS:-64}
LOOP_ROUNDS=${LOOP_ROUNDS:-5}
LOOP_PROMPTS=${LOOP_PROMPTS:-3}
DRAFTER=${DRAFTER:-src/blockpilot/assets/drafters/smollm2-135m-instruct-dflash-b8}
OUT=${OUT:-src/blockpilot/assets/predictors/smollm2-135m-instruct-dflash-b8.onnx}
mkdir -p "$RUNS"

"$PY" scripts/heldout_split.py --answers "$ANSWERS" --valid "$VALID" --seed "$SEED" --out "$RUNS/heldout.jsonl"
# Four more sets the drafter never trained on, closer to real requests than its own split: every 12th
# stdlib-code task from the 6th on (298), the first 300 answers of each ShareGPT file, the CHAMP math problems.
"$PY" - "$STDLIB" "$SHAREGPT" "$SHAREGPT_OPEN" "$CHAMP" "$RUNS" <<'EOF'
import gzip, json, sys
std, sharegpt, sharegpt_open, champ, runs = sys.argv[1:]
rows = lambda path: [json.loads(line) for line in gzip.open(path, "rt") if line.strip()]
with open(f"{runs}/stdlib-300.jsonl", "w") as out:
    out.writelines(json.dumps(r) + "\n" for r in rows(std)[5::12][:300])
with open(f"{runs}/sharegpt-new-300.jsonl", "w") as out:
    out.writelines(json.dumps(r) + "\n" for r in rows(sharegpt)[:300])
with open(f"{runs}/sharegpt-open-300.jsonl", "w") as out:
    out.writelines(json.dumps(r) + "\n" for r in rows(sharegpt_open)[:300])
with open(f"{runs}/champ.jsonl", "w") as out:
    out.writelines(json.dumps(r) + "\n" for r in rows(champ))
EOF
if [[ -n "${SETS_ONLY:-}" ]]; then
  echo "wrote the label sets to $RUNS (SETS_ONLY: nothing labelled)"
  exit 0
fi
# The step-cost table of the backend that runs the embedded default (onnxruntime fp32 engine dir), timed
# with the default threads (as `generate` and `profile` run) on the first LOOP_PROMPTS prompts of each
# label set but the held-out split (its templated arithmetic is not what the embedded default serves).
if [[ -z "${STEP_COSTS:-}" ]]; then
  STEP_COSTS="$RUNS/step-costs.json"
  if [[ ! -f "$STEP_COSTS" ]]; then
    "$PY" - "$STEP_COSTS" "$CANDIDATES" "$LOOP_TOKENS" "$LOOP_ROUNDS" "$LOOP_PROMPTS" \
        "$RUNS/stdlib-300.jsonl" "$RUNS/sharegpt-new-300.jsonl" "$RUNS/sharegpt-open-300.jsonl" "$RUNS/champ.jsonl" <<'EOF'
import json, sys
from blockpilot.builder.embedded import embedded_engine_dir
from blockpilot.runtime.step_costs import measure_engine_dir
candidates = [int(c) for c in sys.argv[2].split(",") if int(c) > 1]
n = int(sys.argv[5])
prompts = [json.loads(line)["prompt"] for path in sys.argv[6:10] for line in open(path).readlines()[:n]]
table = measure_engine_dir(embedded_engine_dir(), backend="onnxruntime", block_sizes=candidates,
                           loop_tokens=int(sys.argv[3]), loop_rounds=int(sys.argv[4]), loop_prompts=prompts)
open(sys.argv[1], "w").write(json.dumps(table.to_dict(), indent=1) + "\n")
print(json.dumps(table.to_dict()))
EOF
  fi
fi

export OMP_NUM_THREADS=1  # one torch thread: the labelling clock is this process's compute
label_set() {  # exact replay labels of one prompt set at one temperature (the dataset resumes if rerun)
  local file limit out note t=${2:-0} n=${3:-}
  case $1 in
    heldout) file="$RUNS/heldout.jsonl" limit=${LIMIT:-$HELDOUT_LIMIT} out="$RUNS/labels-t0"
             note="held-out split of $ANSWERS (--valid $VALID --seed $SEED)" ;;
    stdlib) file="$RUNS/stdlib-300.jsonl" limit=${LIMIT:-} out="$RUNS/labels-stdlib-t0" ;;
    sharegpt) file="$RUNS/sharegpt-new-300.jsonl" limit=${LIMIT:-$SHAREGPT_LIMIT} out="$RUNS/labels-sharegpt-t0" ;;
    sharegpt-open) file="$RUNS/sharegpt-open-300.jsonl" limit=${LIMIT:-} out="$RUNS/labels-sharegpt-open-t0" ;;
    champ) file="$RUNS/champ.jsonl" limit=${LIMIT:-$CHAMP_LIMIT} out="$RUNS/labels-champ-t0" ;;
  esac
  note="${note:-"$file (not in the drafter's training data)"}, T = $t exact replay"
  if [[ $t != 0 ]]; then  # the target's own draws at T (the replay needs max(CANDIDATES) - 1 tokens past MAX_NEW)
    local name; name=$(basename "$file" .jsonl)
    local drawn="$RUNS/answers-$name-t$t.jsonl"
    "$BP" answer --prompts "$file" --limit "$n" --temperature "$t" --seed "$SEED" --batch-size 32 \
        --max-new-tokens $((MAX_NEW + ${CANDIDATES##*,} - 1)) --out "$drawn"
    file=$drawn limit=$n out="$RUNS/labels-$name-t$t"
  fi
  "$BP" label --drafter "$DRAFTER" --replay-answers "$file" --block-sizes "$CANDIDATES" --temperature "$t" \
      --step-costs "$STEP_COSTS" --max-new-tokens "$MAX_NEW" ${limit:+--limit "$limit"} --out "$out" \
      --clock cpu --calibration-prompts 1 --calibration-reps 2 --note "$note"
}
lane() {  # every temperature of the given sets
  for set in "$@"; do label_set "$set"; done
  for pair in $SAMPLED; do for set in "$@"; do label_set "$set" "${pair%%:*}" "${pair##*:}"; done; done
}
if (( JOBS > 1 )); then  # two lanes of about equal work
  lane heldout sharegpt champ & other=$!
  lane stdlib sharegpt-open
  wait "$other"
else
  lane heldout stdlib sharegpt sharegpt-open champ
fi
datasets=(--dataset "$RUNS/labels-t0" --dataset "$RUNS/labels-stdlib-t0" --dataset "$RUNS/labels-sharegpt-t0"
          --dataset "$RUNS/labels-sharegpt-open-t0" --dataset "$RUNS/labels-champ-t0")
for pair in $SAMPLED; do
  for name in heldout stdlib-300 sharegpt-new-300 sharegpt-open-300 champ; do datasets+=(--dataset "$RUNS/labels-$name-t${pair%%:*}"); done
done
temperature=$([[ -n "$SAMPLED" ]] && echo "--with-temperature --temperature-heads" || true)
# --step-costs again: labels made earlier with another table are re-scored with this one
"$BP" train-predictor "${datasets[@]}" --objective throughput --loss regret --features pooled --hidden 64 $temperature \
    --step-costs "$STEP_COSTS" \
    --target "$("$PY" -c "from blockpilot.assets.smollm2 import smollm2_dir; print(smollm2_dir())")" \
    --drafter "$DRAFTER" --out "$OUT"
echo "wrote $OUT (report beside it); the embedded engine dir rebuilds on next use"
