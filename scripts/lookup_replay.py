"""Tokens per step of the drafter, of lookup drafts (`blockpilot.runtime.lookup`) and of the two combined,
by exact greedy replay of the decode loop over the target's own answers (T = 0).

For every answer position the drafter's block is computed once (one batched pass over blocks anchored at
every position, `training.evaluate.anchored_correct`, which is what the decode loop's drafter call computes
for that position) and the lookup draft from the tokens before it; each rule then replays the greedy
loop step by step: the drafter alone, lookup alone (a step without a match drafts nothing and keeps one
token), the runtime's rule (lookup where the context's last `--min-ngram`+ tokens occurred before, the
drafter elsewhere) for each `--min-ngram`, and a per-step oracle of the two. tau is averaged per prompt,
then over prompts (DFlash's convention, as `scripts/eval_drafter.py`).

`--lookup-lengths 8,12,16` adds the runtime's rule with copies of those lengths (a copying step verifies
L tokens, a drafting step the block size), and `--step-costs` (a `scripts/bench_steps.py --json` file)
prices every rule's steps with its verify and drafter times (a copying step makes no drafter call):
modelled tokens per second against plain decoding's one-row step, pooled over a set's answers. With
`--step-costs` the runtime's rule is also replayed with adaptive verify lengths (`runtime.policy.verify_rows`
on the drafter's top probabilities, priced by that table: a drafting step verifies only the rows that pay)
and with a per-step oracle of the verify length (the accepted drafts + 1 rows).

    python scripts/lookup_replay.py --answers ~/.cache/blockpilot/eval/answers/humaneval-greedy-128.jsonl \
        --answers ~/.cache/blockpilot/eval/answers/mtbench-greedy-128.jsonl --block-sizes 4,6,8 --out lookup.json
"""

from __future__ import annotations

import argparse
import itertools
import json
from pathlib import Path

import torch
from tqdm import tqdm

from blockpilot.assets import default_drafter_dir
from blockpilot.assets.smollm2 import smollm2_dir
from blockpilot.models.checkpoint import load_drafter, load_target
from blockpilot.runtime.lookup import MAX_NGRAM, MIN_NGRAM, PromptLookup
from blockpilot.text import chat_prompt_ids, load_tokenizer
from blockpilot.training.data import read_answer_rows
from blockpilot.runtime.policy import verify_rows
from blockpilot.training.evaluate import anchored_drafts, sequence_taps


def leading_matches(draft, truth) -> int:
    n = 0
    for x, y in zip(draft, truth):
        if x != y:
            break
        n += 1
    return n


@torch.inference_mode()
def accepted_per_position(target, drafter, ids: list[int], prompt_len: int, block_size: int, min_ngrams,
                          taps: torch.Tensor | None = None, copy_length: int | None = None):
    """Per answer position `pos` (ids[pos] is the block's first token): the drafter's accepted drafts, per
    n-gram floor the lookup draft's accepted drafts (None: no match) of a copy of `copy_length - 1` tokens
    (default: the block's), and the drafter's top probability at each slot (what adaptive verify lengths
    read). `taps`: the target's taps of `ids` (`training.evaluate.sequence_taps`; computed when not given)."""
    copy_length = copy_length or block_size
    n = len(ids)
    if taps is None:
        taps = sequence_taps(target, ids, drafter.config.target_layer_ids)
    correct, _, confidence = anchored_drafts(target, drafter, ids, torch.arange(prompt_len, n - 1), block_size, taps)
    drafter_acc = correct.long().cumprod(1).sum(1).tolist()
    lookups = {m: PromptLookup(ids[:prompt_len], min_ngram=m, max_ngram=max(m, MAX_NGRAM)) for m in min_ngrams}
    lookup_acc = {m: [] for m in min_ngrams}
    for pos in range(prompt_len, n - 1):
        truth = ids[pos + 1: pos + copy_length]
        for m, lookup in lookups.items():
            lookup.extend([ids[pos]])
            copy = lookup.propose(copy_length - 1)
            lookup_acc[m].append(None if copy is None else leading_matches(copy, truth))
    return drafter_acc, lookup_acc, confidence.tolist()


def replay(choose, length: int) -> list[int]:
    """Tokens committed per step of a greedy loop over `length` positions; `choose(i)` -> accepted drafts."""
    steps, i = [], 0
    while i < length:
        a = choose(i)
        steps.append(a + 1)
        i += a + 1
    return steps


def step_starts(steps: list[int]) -> list[int]:
    """The position each step of `replay`'s result starts at."""
    return list(itertools.accumulate(steps[:-1], initial=0))


def step_ms(costs: dict, block_size: int, step: tuple[int, int, bool]) -> float:
    """ms of a step that verifies `step[1]` tokens, with a drafter call at `block_size` unless it copied (a
    lookup-only step without a match counts as copied: it calls nothing)."""
    _, width, copied = step
    return costs["verify"][width] + (0.0 if copied else costs["draft"][block_size])


def read_step_costs(path: Path) -> dict:
    """{"verify": {K: ms}, "draft": {K: ms}, "plain": ms} of the first path of a bench_steps JSON file."""
    entry = json.loads(path.read_text())["paths"][0]
    return {"verify": {int(k): v for k, v in entry["verify_ms"].items()},
            "draft": {int(k): v for k, v in entry["draft_ms"].items()}, "plain": entry["one_row_ms"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--answers", type=Path, action="append", required=True, help="greedy answers JSONL (repeatable)")
    ap.add_argument("--target", type=Path, help="default: the embedded SmolLM2-135M-Instruct")
    ap.add_argument("--drafter", type=Path, help="default: the shipped drafter")
    ap.add_argument("--block-sizes", default="4,6,8")
    ap.add_argument("--min-ngram", default="2,3,4", help="lookup n-gram floors to compare")
    ap.add_argument("--lookup-lengths", default="", help=f"copy lengths to try with the shipped floor ({MIN_NGRAM})")
    ap.add_argument("--step-costs", type=Path, help="scripts/bench_steps.py --json output: price the rules")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    with torch.inference_mode():
        run(args)


def run(args: argparse.Namespace) -> None:
    target_dir = args.target or smollm2_dir()
    target, drafter = load_target(target_dir), load_drafter(args.drafter or default_drafter_dir())
    tokenizer = load_tokenizer(target_dir)
    sizes = [int(b) for b in args.block_sizes.split(",")]
    floors = [int(m) for m in args.min_ngram.split(",")]
    lengths = [int(n) for n in args.lookup_lengths.split(",") if n.strip()]
    costs = read_step_costs(args.step_costs) if args.step_costs else None
    report = {"drafter": str(args.drafter or default_drafter_dir()), "sets": {},
              **({"step_costs": costs} if costs else {})}
    for path in args.answers:
        taus: dict[str, list[float]] = {}
        totals: dict[str, list[float]] = {}  # rule -> [tokens, ms]
        for row in tqdm(list(read_answer_rows(path)), desc=path.name, unit="answer"):
            prompt = chat_prompt_ids(tokenizer, row["prompt"])
            ids = prompt + row["answer_ids"] + ([tokenizer.eos_token_id] if row["finish"] == "stop" else [])
            taps = sequence_taps(target, ids, drafter.config.target_layer_ids)
            for b in sizes:
                drafter_acc, lookup_acc, confidence = accepted_per_position(
                    target, drafter, ids, len(prompt), b, sorted({*floors, MIN_NGRAM}), taps,
                    copy_length=max([b, *lengths]))
                # rule -> per position: (accepted drafts, tokens verified, whether the draft was copied)
                rules = {f"b{b} drafter": lambda i: (drafter_acc[i], b, False),
                         f"b{b} lookup only": lambda i: (0, 1, True) if lookup_acc[floors[0]][i] is None else (
                             min(lookup_acc[floors[0]][i], b - 1), b, True)}
                for m in floors:
                    acc = lookup_acc[m]
                    rules[f"b{b} lookup n>={m}, else drafter"] = lambda i, acc=acc: (
                        (drafter_acc[i], b, False) if acc[i] is None else (min(acc[i], b - 1), b, True))
                    rules[f"b{b} oracle n>={m}"] = lambda i, acc=acc: (
                        (drafter_acc[i], b, False) if acc[i] is None or drafter_acc[i] >= min(acc[i], b - 1)
                        else (min(acc[i], b - 1), b, True))
                for n in lengths:
                    acc = lookup_acc[MIN_NGRAM]
                    rules[f"b{b} lookup n>={MIN_NGRAM} copying {n}, else drafter"] = lambda i, acc=acc, n=n: (
                        (drafter_acc[i], b, False) if acc[i] is None else (min(acc[i], n - 1), n, True))
                if costs:  # the runtime's rule with adaptive verify lengths (`Runner.verify_length`), and an oracle
                    acc = lookup_acc[MIN_NGRAM]
                    verify_ms = costs["verify"].__getitem__

                    def adaptive(i, acc=acc):
                        if acc[i] is not None:
                            return min(acc[i], b - 1), b, True
                        rows = verify_rows(confidence[i], verify_ms, costs["draft"][b])
                        return min(drafter_acc[i], rows - 1), rows, False

                    rules[f"b{b} lookup n>={MIN_NGRAM}, else drafter, adaptive verify"] = adaptive
                    rules[f"b{b} lookup n>={MIN_NGRAM}, else drafter, oracle verify"] = lambda i, acc=acc: (
                        (min(acc[i], b - 1), b, True) if acc[i] is not None else
                        (drafter_acc[i], drafter_acc[i] + 1, False))
                for name, rule in rules.items():
                    steps = replay(lambda i: rule(i)[0], len(drafter_acc))
                    taus.setdefault(name, []).append(sum(steps) / len(steps))
                    if costs:
                        total = totals.setdefault(name, [0.0, 0.0])
                        total[0] += sum(steps)
                        total[1] += sum(step_ms(costs, b, rule(i)) for i in step_starts(steps))
        report["sets"][path.name] = {"answers": len(next(iter(taus.values()))),
                                    "tau": {k: round(sum(v) / len(v), 4) for k, v in taus.items()}}
        if costs:  # tokens per ms of each rule over plain decoding's (one token a one-row step)
            report["sets"][path.name]["speed_vs_plain"] = {k: round(t / ms * costs["plain"], 4)
                                                           for k, (t, ms) in totals.items()}
        print(json.dumps({path.name: report["sets"][path.name]}, indent=1))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
