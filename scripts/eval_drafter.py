"""Acceptance length (tau) of a drafter at many block sizes on HumanEval / MT-Bench.

T = 0: over the target's own greedy answers (generated once with transformers, batched, cached):
anchored tau (a block at every answer position, one batched pass per size) at every block size,
and exact replay of the greedy decode loop (blockpilot.training.evaluate) at a few sizes.
T = 1: real speculative sampling through the Runner on a subsample of prompts.

    python scripts/eval_drafter.py --drafter DIR --datasets humaneval,mtbench --block-sizes 2-20 \
        --out runs/eval.json [--t1-prompts 8 --t1-max-new-tokens 64]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from tqdm import tqdm

from blockpilot.assets.prompts import load_dataset
from blockpilot.assets.smollm2 import smollm2_dir
from blockpilot.models.checkpoint import load_drafter, load_target
from blockpilot.runtime.runner import Runner
from blockpilot.runtime.sampling import VERIFICATIONS
from blockpilot.text import chat_prompt_ids
from blockpilot.training.data import read_answer_rows, regenerate_answers
from blockpilot.training.evaluate import anchored_tau, mean_tau, replay_block_sizes, sequence_taps


def parse_range(text: str) -> list[int]:
    """`2-20`, `4,8,16` or a mix such as `2-4,8`; empty text: no sizes."""
    sizes = []
    for part in filter(None, text.split(",")):
        lo, _, hi = part.partition("-")
        sizes += range(int(lo), int(hi or lo) + 1)
    return sizes


def greedy_rows(target_dir: Path, dataset: str, cache: Path, max_new_tokens: int,
                limit: int | None = None, offset: int = 0) -> list[dict]:
    prompts = load_dataset(dataset)[offset:][:limit]
    regenerate_answers(target_dir, [p.text for p in prompts], max_new_tokens=max_new_tokens, batch_size=16,
                       out_path=cache, sources=[p.category for p in prompts])
    by_prompt = {r["prompt"]: r for r in read_answer_rows(cache)}
    return [dict(by_prompt[p.text], category=p.category, id=p.id) for p in prompts]


def eval_t0(target, drafter, tokenizer, rows, block_sizes, replay_sizes, replay_prompts, stride,
            checkpoint=None) -> dict:
    """Anchored (simulated) tau at every size on all rows; exact replay at `replay_sizes` on a subset."""
    anchored = {b: [] for b in block_sizes}
    steps: dict[int, list[list[int]]] = {b: [] for b in replay_sizes}
    for i, row in enumerate(tqdm(rows, desc="T=0", unit="prompt")):
        prompt = chat_prompt_ids(tokenizer, row["prompt"])
        ids = prompt + row["answer_ids"] + ([tokenizer.eos_token_id] if row["finish"] == "stop" else [])
        taps = sequence_taps(target, ids, drafter.config.target_layer_ids)
        for b in block_sizes:
            anchored[b].append(anchored_tau(target, drafter, ids, len(prompt), b, taps, stride))
        if i < replay_prompts and replay_sizes:
            for b, run in zip(replay_sizes, replay_block_sizes(target, drafter, ids, len(prompt), replay_sizes, taps)):
                steps[b].append(run)
        if checkpoint is not None and (i + 1) % 10 == 0:  # partial results survive an interrupted run
            checkpoint({"partial_prompts": i + 1, "replay": {b: mean_tau(s) for b, s in steps.items()},
                        "replay_steps": steps})
    return {"anchored": {b: _nanmean(v) for b, v in anchored.items()},
            "replay": {b: mean_tau(s) for b, s in steps.items()}, "replay_prompts": min(replay_prompts, len(rows)),
            "replay_steps": steps}


def _nanmean(values: list[float]) -> float:
    kept = [v for v in values if v == v]
    return sum(kept) / len(kept) if kept else float("nan")


def spread(rows: list, n: int) -> list:
    """`n` rows evenly spaced over `rows` (all of them when n >= len(rows))."""
    if n >= len(rows):
        return list(rows)
    return [rows[i * len(rows) // n] for i in range(n)]


def eval_t1(runner, tokenizer, rows, block_sizes, n_prompts, max_new_tokens, checkpoint=None) -> dict:
    """Real speculative sampling at T=1 through the Runner on `n_prompts` rows spread over the set;
    the same seed per prompt at every size. Per-prompt tau kept (partial results every prompt)."""
    taus = {b: [] for b in block_sizes}
    chosen = spread(rows, n_prompts)
    for i, row in enumerate(tqdm(chosen, desc="sampling T=1", unit="prompt")):
        ids = torch.tensor(chat_prompt_ids(tokenizer, row["prompt"]))
        for b in block_sizes:
            out = runner.generate([ids], max_new_tokens=max_new_tokens, temperature=1.0, block_size=b,
                                  random_seed=1000 + i, return_dict=True)
            taus[b].append(out["tau"][0])
        if checkpoint is not None:
            checkpoint({"partial_prompts_t1": i + 1, "tau_t1": {b: sum(v) / len(v) for b, v in taus.items()},
                        "tau_t1_per_prompt": taus})
    return {"mean": {b: sum(v) / len(v) for b, v in taus.items()}, "per_prompt": taus,
            "prompts": [row["id"] for row in chosen]}


@torch.inference_mode()
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--drafter", type=Path, required=True)
    ap.add_argument("--target", type=Path)
    ap.add_argument("--datasets", default="humaneval,mtbench")
    ap.add_argument("--block-sizes", default="2-20", help="anchored-tau sizes, e.g. 2-20 or 4,8,16 ('' : none)")
    ap.add_argument("--limit", type=int, help="first N prompts per dataset at T=0")
    ap.add_argument("--offset", type=int, default=0, help="skip the first N prompts of each dataset (to split a run)")
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--replay-block-sizes", default="16", help="exact replay sizes, e.g. 2-20 (per-prompt steps saved)")
    ap.add_argument("--replay-prompts", type=int, default=10)
    ap.add_argument("--anchor-stride", type=int, default=1, help="anchor every k-th answer position")
    ap.add_argument("--t1-prompts", type=int, default=0,
                    help="prompts per dataset at T=1, spread evenly over the set (0: skip)")
    ap.add_argument("--t1-max-new-tokens", type=int, default=64)
    ap.add_argument("--t1-block-sizes", help="default: --block-sizes")
    ap.add_argument("--verification", choices=VERIFICATIONS, default="block",
                    help="how T=1 drafts are judged: block verification (the runtime's default) or token by token")
    ap.add_argument("--answers-dir", type=Path, default=Path("runs/answers"))
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    from transformers import AutoTokenizer

    target_dir = args.target or smollm2_dir()
    target, drafter = load_target(target_dir), load_drafter(args.drafter)
    tokenizer = AutoTokenizer.from_pretrained(target_dir)
    sizes = parse_range(args.block_sizes)
    t1_sizes = parse_range(args.t1_block_sizes) if args.t1_block_sizes else sizes
    replay_sizes = parse_range(args.replay_block_sizes)
    # the Runner serves up to 2 x B_train by default; measuring larger sizes is the point here
    runner = Runner.from_dir(target_dir, drafter_dir=args.drafter, max_block_size=max([*t1_sizes, 2]))
    runner.verification = args.verification
    args.answers_dir.mkdir(parents=True, exist_ok=True)
    report = {"drafter": str(args.drafter), "max_new_tokens": args.max_new_tokens, "verification": args.verification,
              "datasets": {}}
    for dataset in args.datasets.split(","):
        began = time.time()
        rows = greedy_rows(target_dir, dataset, args.answers_dir / f"{dataset}-greedy-{args.max_new_tokens}.jsonl",
                           args.max_new_tokens, args.limit, args.offset)
        def checkpoint(partial, dataset=dataset):
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.with_suffix(".partial.json").write_text(json.dumps({**report, "partial": {dataset: partial}}))

        entry = {}
        if sizes or replay_sizes:
            entry.update(prompts_t0=len(rows), anchor_stride=args.anchor_stride,
                         tau_t0=eval_t0(target, drafter, tokenizer, rows, sizes, replay_sizes, args.replay_prompts,
                                        args.anchor_stride, checkpoint))
        if args.t1_prompts:
            entry.update(prompts_t1=min(args.t1_prompts, len(rows)), t1_max_new_tokens=args.t1_max_new_tokens,
                         tau_t1=eval_t1(runner, tokenizer, rows, t1_sizes, args.t1_prompts, args.t1_max_new_tokens,
                                        checkpoint))
        entry["seconds"] = round(time.time() - began)
        report["datasets"][dataset] = entry
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=1))
        print(json.dumps({dataset: entry}))


if __name__ == "__main__":
    main()
