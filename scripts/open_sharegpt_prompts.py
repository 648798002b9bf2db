"""The ShareGPT first user turns that no answer file under `data/` answers yet: the prompts file for the next
round of `blockpilot answer` (more chat data for the drafter; the package holds ~11k first turns, the data ~8.7k
answers to them).

Kept: 5-1,500 characters, not equal to any HumanEval problem (wrapped or bare) or MT-Bench question, not
already answered in any `data/*.jsonl.gz`; one per distinct text; shuffled with a fixed seed, so the file is the
same on every machine and a stopped `answer` run resumes over the same order.

    python scripts/open_sharegpt_prompts.py --out runs/sharegpt-open.jsonl
    blockpilot answer --prompts runs/sharegpt-open.jsonl --out runs/sharegpt-open-answers.jsonl --batch-size 16

`--later-turns` lists the second and later user turns instead, each with its conversation so far
(ShareGPT's own replies) as `messages`, the whole conversation at most `--max-chars` long; the target
answers the last turn in that context (`blockpilot answer` reads the `messages` rows, and its rows
keep the earlier turns as `history`, which `train-drafter` formats with the chat template):

    python scripts/open_sharegpt_prompts.py --later-turns --out runs/sharegpt-later.jsonl

`--shortest-first` orders the list by characters (a later turn: its whole conversation) after the shuffle: on a
CPU a continuously batched step reads every sequence's cache, so short conversations give more answer tokens an
hour (the later turns up to 6,000 characters: `--later-turns --max-chars 6000 --shortest-first`).
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

from blockpilot.assets.prompts import evaluation_texts, load_sharegpt, load_sharegpt_later_turns
from blockpilot.training.data import read_answer_rows, row_key

ROOT = Path(__file__).resolve().parent.parent


def open_prompts(answer_files: list[Path], min_chars: int = 5, max_chars: int = 1500, seed: int = 0,
                 later_turns: bool = False, shortest_first: bool = False) -> list[dict]:
    """ShareGPT first turns (`later_turns`: later turns with their conversation, at most `max_chars`
    in all) not answered in `answer_files` and not an evaluation prompt, shuffled (`seed`); with
    `shortest_first`, then ordered by characters (the conversation's, for a later turn; ties keep the
    shuffled order)."""
    answered = {row_key(row) for path in answer_files for row in read_answer_rows(path)}
    evaluation = evaluation_texts()  # what `load_train_prompts` refuses
    prompts = load_sharegpt_later_turns(max_chars) if later_turns else load_sharegpt()
    seen, rows = set(), []
    for prompt in prompts:
        text, key = prompt.text, prompt.key
        if not min_chars <= len(text) <= max_chars or key in answered or text.strip() in evaluation or key in seen:
            continue
        seen.add(key)
        if prompt.history:
            messages = [{"role": role, "content": content} for role, content in prompt.history]
            rows.append({"id": f"sharegpt/{prompt.id}", "messages": messages + [{"role": "user", "content": text}],
                         "source": "sharegpt"})
        else:
            rows.append({"id": f"sharegpt/{prompt.id}", "prompt": text, "source": "sharegpt"})
    random.Random(seed).shuffle(rows)
    if shortest_first:
        rows.sort(key=conversation_chars)
    return rows


def conversation_chars(row: dict) -> int:
    """Characters of a prompts-file row: its prompt, or every message of its conversation."""
    return len(row["prompt"]) if "prompt" in row else sum(len(m["content"]) for m in row["messages"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--later-turns", action="store_true", help="second and later user turns, in context")
    parser.add_argument("--max-chars", type=int, default=1500, help="longest prompt (with --later-turns: conversation)")
    parser.add_argument("--shortest-first", action="store_true",
                        help="order by characters (a later turn: its whole conversation), shortest first: more "
                             "answer tokens an hour on a CPU, whose decode steps slow as the cache grows")
    args = parser.parse_args()
    files = sorted((ROOT / "data").glob("*.jsonl.gz"))
    rows = open_prompts(files, max_chars=args.max_chars, seed=args.seed, later_turns=args.later_turns,
                        shortest_first=args.shortest_first)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with open(args.out, "w", encoding="utf-8") as f:
        f.writelines(json.dumps(row) + "\n" for row in rows)
    kind = "later turns (in context)" if args.later_turns else "first turns"
    print(f"{len(rows)} open ShareGPT {kind} -> {args.out} (answered in {len(files)} files under data/ left out)")


if __name__ == "__main__":
    main()
