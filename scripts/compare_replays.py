"""Two drafters' `scripts/eval_drafter.py` results side by side, prompt by prompt.

For every dataset and block size both files measured: the mean tau of each (exact greedy replay at T = 0, and
the T = 1 sampling runs where both have them), the relative change, and the paired difference of per-prompt tau
with its standard error (the same prompts and, at T = 1, the same seeds: the paired error is far smaller than
either mean's). Both results must come from the same prompts and the same new-token limit for what is compared
(`--max-new-tokens` for the replays, `--t1-max-new-tokens` for the sampling runs).

    python scripts/compare_replays.py --base runs/eval-stage9-humaneval.json --new runs/eval-soup-humaneval.json \
        [--base ... --new ...] [--out compare.md]
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from pathlib import Path


def per_prompt_t0(entry: dict) -> dict[str, list[float]]:
    """Block size -> per-prompt replay tau (steps averaged per prompt, as `mean_tau`)."""
    steps = entry.get("tau_t0", {}).get("replay_steps", {})
    return {b: [sum(s) / len(s) for s in runs if s] for b, runs in steps.items()}


def per_prompt_t1(entry: dict) -> dict[str, list[float]]:
    return dict(entry.get("tau_t1", {}).get("per_prompt", {}))


def paired(base: list[float], new: list[float]) -> tuple[float, float, float, float]:
    """(mean base, mean new, mean of new - base, its standard error)."""
    diffs = [n - b for b, n in zip(base, new)]
    se = statistics.stdev(diffs) / math.sqrt(len(diffs)) if len(diffs) > 1 else float("nan")
    return statistics.fmean(base), statistics.fmean(new), statistics.fmean(diffs), se


def compare(base: dict, new: dict) -> list[dict]:
    """Rows {dataset, T, block, prompts, base, new, change, diff, se} for what both reports measured."""
    rows = []
    for dataset in sorted(set(base["datasets"]) & set(new["datasets"])):
        b_entry, n_entry = base["datasets"][dataset], new["datasets"][dataset]
        if b_entry.get("tau_t1", {}).get("prompts") != n_entry.get("tau_t1", {}).get("prompts"):
            raise ValueError(f"{dataset}: the T = 1 runs sampled different prompts")
        # each limit is checked where the section it governs is compared: a T = 1-only run (--replay-block-sizes '')
        # pairs with another whatever its greedy --max-new-tokens
        limits = {"0": ("--max-new-tokens", base.get("max_new_tokens"), new.get("max_new_tokens")),
                  "1": ("--t1-max-new-tokens", b_entry.get("t1_max_new_tokens"), n_entry.get("t1_max_new_tokens"))}
        for temp, pick in (("0", per_prompt_t0), ("1", per_prompt_t1)):
            b_taus, n_taus = pick(b_entry), pick(n_entry)
            sizes = sorted(set(b_taus) & set(n_taus), key=int)
            if not sizes:
                continue
            flag, b_limit, n_limit = limits[temp]
            if b_limit != n_limit:
                raise ValueError(f"the reports used different {flag} ({b_limit} and {n_limit}): rerun one of them")
            for size in sizes:
                if len(b_taus[size]) != len(n_taus[size]):
                    raise ValueError(f"{dataset} T={temp} block {size}: {len(b_taus[size])} prompts against "
                                     f"{len(n_taus[size])}; compare runs over the same prompts")
                mb, mn, diff, se = paired(b_taus[size], n_taus[size])
                rows.append({"dataset": dataset, "T": temp, "block": int(size), "prompts": len(b_taus[size]),
                             "base": mb, "new": mn, "change": mn / mb - 1, "diff": diff, "se": se})
    return rows


def table(rows: list[dict]) -> str:
    lines = ["| set | T | block | prompts | base tau | new tau | change | paired diff ± SE |",
             "|---|---|---|---|---|---|---|---|"]
    lines += [f"| {r['dataset']} | {r['T']} | {r['block']} | {r['prompts']} | {r['base']:.3f} | {r['new']:.3f} | "
              f"{r['change']:+.1%} | {r['diff']:+.3f} ± {r['se']:.3f} |" for r in rows]
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base", type=Path, action="append", required=True, help="eval_drafter.py JSON (repeatable)")
    ap.add_argument("--new", type=Path, action="append", required=True, help="its counterpart, in the same order")
    ap.add_argument("--out", type=Path, help="also write the table here")
    args = ap.parse_args(argv)
    if len(args.base) != len(args.new):
        print("error: give one --new per --base", file=sys.stderr)
        return 2
    rows = []
    try:
        for b, n in zip(args.base, args.new):
            rows += compare(json.loads(b.read_text()), json.loads(n.read_text()))
    except (OSError, ValueError, KeyError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if not rows:
        print("error: the reports share no dataset and block size", file=sys.stderr)
        return 2
    text = table(rows)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
