"""Rebuild the sequences `train-drafter` held out (`--valid N`, `--seed S`) as a JSONL answers file.

They are prompts the drafter never trained on, with the target's answers: exact-replay labelling data for the
predictor (`blockpilot label --replay-answers`). Rows are interleaved by source so that `--limit` mixes them.

    python scripts/heldout_split.py --answers data/smollm2-answers-9831.jsonl.gz --valid 256 --out heldout.jsonl
"""

from __future__ import annotations

import argparse
import gzip
import json
from pathlib import Path

import torch

from blockpilot.assets.smollm2 import smollm2_dir
from blockpilot.text import load_tokenizer
from blockpilot.training.data import tokenize_rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--answers", type=Path, required=True, help="the answers file train-drafter read (.jsonl or .gz)")
    ap.add_argument("--valid", type=int, default=48)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-len", type=int, default=512)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    opener = gzip.open if args.answers.suffix == ".gz" else open
    with opener(args.answers, "rt") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    sequences = tokenize_rows(rows, load_tokenizer(smollm2_dir()), args.max_len)
    if len(sequences) != len(rows):
        raise SystemExit("some rows are too short to train on: the row <-> sequence mapping is ambiguous")
    order = torch.randperm(len(sequences), generator=torch.Generator().manual_seed(args.seed)).tolist()
    held = [{"id": f"{args.answers.name.split('.')[0]}/{i + 1}", **rows[i]} for i in sorted(order[: args.valid])]
    by_source: dict[str, list[dict]] = {}
    for row in held:
        by_source.setdefault(row.get("source", ""), []).append(row)
    mixed = [by_source[s].pop(0) for _ in range(max(map(len, by_source.values())))
             for s in list(by_source) if by_source[s]]
    args.out.write_text("".join(json.dumps(r) + "\n" for r in mixed))
    print(f"{len(mixed)} held-out rows -> {args.out}")


if __name__ == "__main__":
    main()
