"""The acceptance rules of sampled requests against each other and plain decoding, at T > 0.

For each prompt (the first N HumanEval problems and MT-Bench first turns from --offset on) and each block
size, it decodes at --temperature in every way of --kinds, interleaved (the order turns from prompt to
prompt), after plain decoding: "block" (drafts drawn from the drafter's distribution, block verification:
the runtime's default), "token" (the same drafts, judged token by token by rejection sampling,
`Runner.verification = "token"`) and "greedy" (greedy drafts and "sample, then match",
`Runner.sampled_drafts = False`). Every system uses the same
seed per prompt; the outputs differ (each is one draw from the target's distribution). Prints per
system the wall time, its ratio to plain decoding and tau per set, as JSON lines; `--json` writes them.

    python scripts/bench_sampled_drafts.py --prompts 20 --block-sizes 3,4 --temperature 1 [--kinds block,token]
        [--engine-dir DIR]
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from blockpilot.profiling.bench_scripts import add_common_args, open_runner, prompt_sets
from blockpilot.text import chat_prompt_ids


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--block-sizes", default="3,4")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--kinds", default="block,token,greedy", help="acceptance rules to compare: block, token, greedy")
    add_common_args(p, prompts=20)
    args = p.parse_args()
    runner = open_runner(args)
    if not getattr(runner.backend, "draft_logits", False):
        raise SystemExit(f"{args.engine_dir}'s drafter graph has no draft_logits output; rebuild it")
    tokenizer, sets, prompts = prompt_sets(args)
    sizes = [int(k) for k in args.block_sizes.split(",")]
    kinds = [k.strip() for k in args.kinds.split(",") if k.strip()]
    if not kinds or set(kinds) - {"block", "token", "greedy"}:
        raise SystemExit(f"--kinds {args.kinds!r}: choose among block, token, greedy")
    systems = ["plain"] + [f"{kind}-b{k}" for k in sizes for kind in kinds]
    totals = {s: {"time_s": 0.0, "tokens": 0, "tau": {n: [] for n in sets}} for s in systems}
    runner.generate([torch.tensor(chat_prompt_ids(tokenizer, prompts[0][1]))], max_new_tokens=8, block_size=sizes[0])
    for i, (dataset, text) in enumerate(prompts):
        ids = torch.tensor(chat_prompt_ids(tokenizer, text))
        for system in systems if i % 2 == 0 else systems[::-1]:
            kind, _, size = system.partition("-b")
            runner.sampled_drafts = kind != "greedy"
            runner.verification = "token" if kind == "token" else "block"
            start = time.perf_counter()
            out = runner.generate([ids], max_new_tokens=args.max_new_tokens, return_dict=True, random_seed=i,
                                  temperature=args.temperature, block_size=int(size) if size else 1)
            total = totals[system]
            total["time_s"] += time.perf_counter() - start
            total["tokens"] += int(out["sequence_lengths"][0, 0]) - len(ids)
            total["tau"][dataset].append(out["tau"][0])
        print(f"{i + 1}/{len(prompts)}", flush=True)
    plain = totals["plain"]["time_s"] / max(totals["plain"]["tokens"], 1)
    report = []
    for system, total in totals.items():
        per_token = total["time_s"] / max(total["tokens"], 1)
        row = {"system": system, "temperature": args.temperature, "ms_per_token": round(1000 * per_token, 2),
               "speedup": round(plain / per_token, 3),
               **{f"tau_{n}": round(sum(t) / len(t), 3) for n, t in total["tau"].items() if t}}
        report.append(row)
        print(json.dumps(row))
    if args.json:
        args.json.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "systems": report}, indent=1))


if __name__ == "__main__":
    main()
