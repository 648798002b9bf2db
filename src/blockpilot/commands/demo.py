"""`blockpilot demo`: a few built-in prompts, autoregressive vs speculative, as a table."""

from __future__ import annotations

import argparse
import sys
import time

from blockpilot.commands.common import (add_lookup_arg, add_verify_length_arg, add_model_args,
                                        open_runner, parse_block_size)

DEMO_PROMPTS = (
    ("code", "Write a Python function that returns the n-th Fibonacci number."),
    ("code", "Write a Python function that checks whether a string is a palindrome."),
    ("math", "Tom has 12 apples. He gives 5 to Anna and buys 8 more. How many apples does Tom have now?"),
    ("chat", "Give me three tips for staying focused while studying."),
)


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("demo", help="run built-in prompts: autoregressive vs speculative tokens/s",
                              description="Generate for a few built-in prompts with the embedded default "
                              "model (or --target/--drafter, or --engine-dir), autoregressively and "
                              "speculatively, and print tokens/s, tau and the block size used.")
    add_model_args(p)
    add_lookup_arg(p)
    add_verify_length_arg(p)
    p.add_argument("--block-size", metavar="N|auto",
                   help="tokens per verify step, or 'auto' (the predictor chooses per prompt); default: auto "
                   "with a predictor, else the drafter's training block size")
    p.add_argument("--max-new-tokens", type=int, default=96, help="tokens generated per prompt")
    p.set_defaults(run=run)


def _timed(runner, ids, max_new_tokens, block_size):
    import torch

    began = time.perf_counter()
    out = runner.generate([torch.tensor(ids)], max_new_tokens=max_new_tokens, block_size=block_size,
                          return_dict=True)
    seconds = time.perf_counter() - began
    produced = int(out["sequence_lengths"][0, 0]) - len(ids)
    return out, produced / seconds


def run(args: argparse.Namespace) -> int:
    from blockpilot.text import chat_prompt_ids, load_tokenizer

    block_size = parse_block_size(args.block_size)
    opened = open_runner(args)
    runner = opened.runner
    if opened.note:
        print(f"note: {opened.note}", file=sys.stderr)
    tokenizer = load_tokenizer(opened.choice.tokenizer)
    prompts = [chat_prompt_ids(tokenizer, text) for _, text in DEMO_PROMPTS]
    for index, ids in enumerate(prompts):  # a bad --max-new-tokens or block size fails before the table starts
        runner.check_prompt(ids, args.max_new_tokens, block_size, index)
    _timed(runner, prompts[0], 8, block_size)  # warm-up, not reported
    header = f"{'prompt':<8}{'AR tok/s':>10}{'spec tok/s':>12}{'speedup':>9}{'tau':>7}{'block':>7}"
    print(header)
    print("-" * len(header))
    for (category, _), ids in zip(DEMO_PROMPTS, prompts):
        ar, ar_rate = _timed(runner, ids, args.max_new_tokens, 1)
        spec, spec_rate = _timed(runner, ids, args.max_new_tokens, block_size)
        if not torch_equal(ar["output_ids"], spec["output_ids"]):
            print(f"error: speculative output differs from autoregressive output for a {category} prompt",
                  file=sys.stderr)
            return 1
        print(f"{category:<8}{ar_rate:>10.1f}{spec_rate:>12.1f}{spec_rate / ar_rate:>8.2f}x"
              f"{spec['tau'][0]:>7.2f}{spec['block_sizes'][0]:>7}")
    return 0


def torch_equal(a, b) -> bool:
    import torch

    return bool(torch.equal(a, b))
