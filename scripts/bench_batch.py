"""Throughput of batched decoding against running the same requests one after another.

    python scripts/bench_batch.py                          # embedded default, batches 1, 4, 8, 16
    python scripts/bench_batch.py --block-size 1           # plain decoding batched
    python scripts/bench_batch.py --engine-dir DIR --batches 1,4 --requests 8 --json out.json

For each batch size the same requests (first turns of MT-Bench and HumanEval problems, alternating,
through the chat template) are decoded by `Runner.generate(..., max_batch=b)`: b = 1 is the
sequential baseline. Reported: generated tokens per second over the whole run (prefills included),
mean tau, and whether every request's tokens equal the sequential run's (T=0). One run per batch
size, in one process: ratios, not absolute speeds, are what carries over between machines.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch

from blockpilot.errors import UserError


def load_prompts(tokenizer, count: int) -> list[torch.Tensor]:
    from blockpilot.assets.prompts import load_humaneval, load_mtbench
    from blockpilot.text import chat_prompt_ids

    pools = [load_mtbench(), load_humaneval()]
    picked = [pools[i % 2][i // 2] for i in range(count)]
    return [torch.tensor(chat_prompt_ids(tokenizer, p.text, True)) for p in picked]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--engine-dir", help="engine directory (default: the embedded default's)")
    parser.add_argument("--batches", default="1,4,8,16", help="batch sizes to run (1 = one after another)")
    parser.add_argument("--requests", type=int, default=16, help="requests per run")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--block-size", default=None, help="an int or 'auto' (default: the runner's default)")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args(argv)
    try:
        from blockpilot.runtime.runner import Runner
        from blockpilot.text import load_tokenizer

        if args.engine_dir is None:
            from blockpilot.builder.embedded import embedded_engine_dir

            args.engine_dir = str(embedded_engine_dir())
        runner = Runner.from_dir(args.engine_dir, backend="onnxruntime")
        tokenizer = load_tokenizer(args.engine_dir)
        block = int(args.block_size) if args.block_size not in (None, "auto") else args.block_size
        prompts = load_prompts(tokenizer, args.requests)
        batches = [int(b) for b in args.batches.split(",")]
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    runner.generate(prompts[:1], max_new_tokens=4, block_size=block)  # warm-up (first-call allocations)
    rows, reference = [], None
    for b in batches:
        start = time.perf_counter()
        out = runner.generate(prompts, max_new_tokens=args.max_new_tokens, block_size=block, max_batch=b,
                              return_dict=True)
        wall = time.perf_counter() - start
        tokens = [int(n) - len(p) for n, p in zip(out["sequence_lengths"][:, 0], prompts)]
        outputs = [out["output_ids"][i, 0, len(p): len(p) + t].tolist() for i, (p, t) in enumerate(zip(prompts, tokens))]
        reference = reference if reference is not None else outputs
        rows.append({"batch": b, "requests": len(prompts), "tokens": sum(tokens), "wall_s": wall,
                     "tok_per_s": sum(tokens) / wall, "tau": sum(out["tau"]) / len(prompts),
                     "block_sizes": sorted(set(out["block_sizes"])), "same_tokens": outputs == reference})
        print(f"batch {b:>2}: {rows[-1]['tok_per_s']:.1f} tok/s ({wall:.1f} s), tau {rows[-1]['tau']:.2f}, "
              f"same tokens as batch {batches[0]}: {rows[-1]['same_tokens']}", file=sys.stderr, flush=True)
    base = rows[0]["tok_per_s"]
    print(f"| batch | tok/s | x batch {batches[0]} | tau | block sizes | same tokens |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['batch']} | {r['tok_per_s']:.1f} | {r['tok_per_s'] / base:.2f} | {r['tau']:.2f} | "
              f"{','.join(map(str, r['block_sizes']))} | {'yes' if r['same_tokens'] else 'NO'} |")
    if args.json:
        with open(args.json, "w") as stream:
            json.dump({"engine_dir": args.engine_dir, "max_new_tokens": args.max_new_tokens,
                       "block_size": args.block_size, "runs": rows}, stream, indent=1)
    return 0 if all(r["same_tokens"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
