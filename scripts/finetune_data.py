"""The training answers of the shipped drafter's CPU fine-tunes, built from the answer files in `data/`.

Every answer the project holds except the prompts that the block-size predictor is labelled on
(`scripts/make_predictor.sh` writes those sets to `runs/predictor/`), the later turns of conversations that open
with one of them, and, of the templated arithmetic word problems, all but 600 (they replay at tau ~6 already and
would otherwise be a quarter of the data); shuffled. Nothing from HumanEval or MT-Bench is in any of the files.

Stages 4 and 5 (sessions 16 and 18) read the five answer files of `ANSWERS` (and the CHAMP file for the label
sets): 12,669 answers (`--first-turns-only`, md5 99f6d9db...). Session 20 added the target's answers to ShareGPT
later turns, answered in conversation (`LATER_TURNS`); stage 6 (session 21, on a GPU) read this script's output at
commit 82e8c43, when that file held 1,724 turns: 14,265 answers, md5 3e6d4a98... (with today's 2,171 turns,
`--no-package-code` gives 14,683). Session 21 added the target's answers to HumanEval-style prompts written from
third-party packages' documented functions (`PACKAGE_CODE`); stage 7 (session 22) trained on those 7,168 with
1,000 rows of stage 6's data, not on this script's output (see the drafter's MODEL_CARD). Session 23 added 2,117
more later turns (`LATER_TURNS`' second file; stage 8 trained on them, session 24): the default output grew from
21,851 rows (md5 74dfa294...) to 23,806 (md5 b9a13312...). Session 25 added the last 302 later turns
(`LATER_TURNS`' third file), less those whose conversation opens with a label-set prompt; the new default
output's size and md5 are not recorded (the label sets in `runs/predictor/` were not on that machine). Session 27
added 1,347 later turns (`LATER_TURNS`' fourth file) and session 28 3,225 more package-code answers
(`PACKAGE_CODE`' second file); stage 10 (session 29) trained on both with `--focus` (below): 5,478 rows, md5
3076b3fe.... Sessions 30 and 31 added 2,809 more package-code answers (`PACKAGE_CODE`' third and fourth files;
stage 11, session 31, trained on them alone and was not shipped) and 1,301 later turns (`LATER_TURNS`' fifth file);
stage 12 (session 32, shipped) trained on all three with `--focus`: 5,007 rows, md5 256491c2.... Sessions 33-42
added the sixth later-turn file and package-code files 5-9 (stages 13-15 read some of them as `--focus`); files 6-9
joined `PACKAGE_CODE` only in session 42 (until then the default output, 34,349 rows, left their 3,232 rows out).
Session 43 added package-code file 10, session 44 file 11 and the answers to the target's own chat queries
(`MAGPIE`, `scripts/magpie_prompts.py`), session 46 the seventh later-turn file (852 turns).

    python scripts/finetune_data.py --out runs/finetune-answers.jsonl
    blockpilot train-drafter --init-from src/blockpilot/assets/drafters/smollm2-135m-instruct-dflash-b8 \\
        --answers runs/finetune-answers.jsonl --out runs/b8-ft --block-size 8 --time-budget 60 \\
        --sequences-per-step 16 --anchors 32 --lr 2e-4 --valid 64 --eval-every 8 --checkpoint-every 5

A fine-tune on new answers that should not forget the old (stage 7's recipe, then written by hand): every row of
the `--focus` files, then `--replay` rows of the rest, shuffled with `--seed`; average the result with its start
(`scripts/interpolate_drafters.py`):

    python scripts/finetune_data.py --focus data/<new answers>.jsonl.gz --replay 1000 --out runs/focus-mix.jsonl
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

from blockpilot.training.data import read_answer_rows, row_history, row_key

ROOT = Path(__file__).resolve().parent.parent
ANSWERS = ["data/smollm2-answers-9831.jsonl.gz", "data/smollm2-stdlib-answers-3574.jsonl.gz",
           "data/smollm2-sharegpt-answers-1259.jsonl.gz", "data/smollm2-sharegpt-answers-open-818.jsonl.gz",
           "data/smollm2-sharegpt-answers-open2-426.jsonl.gz"]
LATER_TURNS = ["data/smollm2-sharegpt-answers-later-2171.jsonl.gz", "data/smollm2-sharegpt-answers-later2-2117.jsonl.gz",
               "data/smollm2-sharegpt-answers-later3-302.jsonl.gz",
               "data/smollm2-sharegpt-answers-later4-1347.jsonl.gz", "data/smollm2-sharegpt-answers-later5-1301.jsonl.gz",
               "data/smollm2-sharegpt-answers-later6-1420.jsonl.gz", "data/smollm2-sharegpt-answers-later7-852.jsonl.gz"]
PACKAGE_CODE = ["data/smollm2-package-code-answers-7168.jsonl.gz", "data/smollm2-package-code-answers2-3225.jsonl.gz",
                "data/smollm2-package-code-answers3-2291.jsonl.gz", "data/smollm2-package-code-answers4-518.jsonl.gz",
                "data/smollm2-package-code-answers5-473.jsonl.gz", "data/smollm2-package-code-answers6-661.jsonl.gz",
                "data/smollm2-package-code-answers7-1086.jsonl.gz", "data/smollm2-package-code-answers8-1485.jsonl.gz",
                "data/smollm2-package-code-answers9-3517.jsonl.gz",
                "data/smollm2-package-code-answers10-1148.jsonl.gz", "data/smollm2-package-code-answers11-192.jsonl.gz"]
MAGPIE = ["data/smollm2-magpie-answers-1024.jsonl.gz"]
LABEL_SETS = ["runs/predictor/heldout.jsonl", "runs/predictor/stdlib-300.jsonl", "runs/predictor/sharegpt-new-300.jsonl",
              "runs/predictor/sharegpt-open-300.jsonl", "data/smollm2-champ-answers-270.jsonl.gz"]
MATH_KEPT = 600
KEYS = ("source", "prompt", "history", "answer", "answer_ids", "finish")


def training_rows(files: list[str], excluded: set[str], opening: set[str]) -> list[dict]:
    """The rows of `files` (paths under ROOT) whose key is not in `excluded` (the label sets' prompts) and
    whose conversation does not open with a prompt of `opening` (the label sets' first turns: a later turn
    there would show the drafter that prompt too)."""
    return [row for path in files for row in read_answer_rows(ROOT / path) if row_key(row) not in excluded
            and not any(content in opening for _, content in row_history(row)[:1])]


def thin_math(rows: list[dict], seed: int) -> list[dict]:
    """`rows` with only MATH_KEPT of their templated arithmetic problems (a seeded choice), shuffled."""
    math = [row for row in rows if row.get("source") == "synthetic-math"]
    random.Random(seed).shuffle(math)
    kept = [row for row in rows if row.get("source") != "synthetic-math"] + math[:MATH_KEPT]
    random.Random(seed + 1).shuffle(kept)
    return kept


def focused(focus: list[dict], rest: list[dict], replay: int, seed: int, mix_size: int = 0) -> list[dict]:
    """A fine-tune on new data that holds on to the old: every row of `focus`, then `replay` rows of
    `rest` (shuffled with `seed`; rows also in `focus` are not repeated), or more when that leaves the mix
    under `mix_size` rows."""
    keys = {row_key(row) for row in focus}
    rest = [row for row in rest if row_key(row) not in keys]
    random.Random(seed).shuffle(rest)
    return focus + rest[:max(replay, mix_size - len(focus))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--first-turns-only", action="store_true",
                        help="leave out the later-turn answers (stages 4 and 5's data, byte for byte)")
    parser.add_argument("--no-package-code", action="store_true",
                        help="leave out the package-code answers")
    parser.add_argument("--focus", action="append", default=[], metavar="FILE",
                        help="an answers file under data/ to fine-tune on (repeatable): the output is all of its "
                        "rows, then --replay rows of the rest (what stage 7 did by hand)")
    parser.add_argument("--replay", type=int, default=1000, help="with --focus: rows of the rest that follow")
    parser.add_argument("--mix-size", type=int, default=0,
                        help="with --focus: replay more rows when the mix would otherwise be smaller than this "
                        "(a 45-minute CPU fine-tune overfits a mix of ~2,300 rows: stage 13's first try)")
    args = parser.parse_args()
    missing = [p for p in LABEL_SETS + args.focus if not (ROOT / p).exists()]
    if missing:
        hint = "write them first with `SETS_ONLY=1 scripts/make_predictor.sh` (seconds)" \
            if missing[0] in LABEL_SETS else "give a file under data/"
        raise SystemExit(f"error: {missing[0]} is missing; {hint}")
    label_rows = [row for path in LABEL_SETS for row in read_answer_rows(ROOT / path)]
    excluded = {row_key(row) for row in label_rows}
    opening = {row["prompt"] for row in label_rows if not row.get("history")}
    files = ANSWERS + ([] if args.first_turns_only else LATER_TURNS)
    files += [] if args.first_turns_only or args.no_package_code else PACKAGE_CODE
    files += [] if args.first_turns_only else MAGPIE
    kept = thin_math(training_rows([f for f in files if f not in args.focus], excluded, opening), args.seed)
    if args.focus:
        kept = focused(training_rows(args.focus, excluded, opening), kept, args.replay, args.seed, args.mix_size)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with open(args.out, "w", encoding="utf-8") as f:
        f.writelines(json.dumps({k: row[k] for k in KEYS if k in row}) + "\n" for row in kept)
    math = sum(row.get("source") == "synthetic-math" for row in kept)
    print(f"{len(kept)} answers ({len(kept) - math} others, {math} synthetic-math) -> {args.out}; "
          f"{len(excluded)} label-set prompts left out")


if __name__ == "__main__":
    main()
