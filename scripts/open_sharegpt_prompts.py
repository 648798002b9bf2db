"""The ShareGPT first user turns that no answer file under `data/` answers yet: the prompts file for the next
round of `blockpilot answer` (more chat data for the drafter; the package holds ~11k first turns, the data ~8.7k
answers to them).

Kept: 5-1,500 characters, not equal to any HumanEval problem (wrapped or bare) or MT-Bench question, not
already answered in any `data/*.jsonl.gz`; one per distinct text; shuffled with a fixed seed, so the file is the
same on every machine and a stopped `answer` run resumes over the same order.

    python scripts/open_sharegpt_prompts.py --out runs/sharegpt-open.jsonl
    blockpilot answer --prompts runs/sharegpt-open.jsonl --out runs/sharegpt-open-answers.jsonl --batch-size 16
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

from blockpilot.assets.prompts import evaluation_texts, load_sharegpt
from blockpilot.training.data import read_answer_rows

ROOT = Path(__file__).resolve().parent.parent


def open_prompts(answer_files: list[Path], min_chars: int = 5, max_chars: int = 1500, seed: int = 0) -> list[dict]:
    """ShareGPT first turns not answered in `answer_files` and not an evaluation prompt, shuffled (`seed`)."""
    answered = {row["prompt"] for path in answer_files for row in read_answer_rows(path)}
    evaluation = evaluation_texts()  # what `load_train_prompts` refuses
    seen, rows = set(), []
    for prompt in load_sharegpt():
        text = prompt.text
        if not min_chars <= len(text) <= max_chars or text in answered or text.strip() in evaluation or text in seen:
            continue
        seen.add(text)
        rows.append({"id": f"sharegpt/{prompt.id}", "prompt": text, "source": "sharegpt"})
    random.Random(seed).shuffle(rows)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    files = sorted((ROOT / "data").glob("*.jsonl.gz"))
    rows = open_prompts(files, seed=args.seed)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with open(args.out, "w", encoding="utf-8") as f:
        f.writelines(json.dumps(row) + "\n" for row in rows)
    print(f"{len(rows)} open ShareGPT first turns -> {args.out} (answered in {len(files)} files under data/ left out)")


if __name__ == "__main__":
    main()
