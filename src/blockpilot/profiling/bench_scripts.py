"""What the interleaved benchmark scripts under `scripts/` share: their common arguments, the
onnxruntime runner over an engine directory (the embedded default's unless one is named) and the
HumanEval + MT-Bench prompts they decode."""

from __future__ import annotations

import argparse
from pathlib import Path


def add_common_args(parser: argparse.ArgumentParser, prompts: int) -> None:
    """--prompts, --offset, --max-new-tokens, --threads, --engine-dir and --json."""
    parser.add_argument("--prompts", type=int, default=prompts, help="prompts of each set")
    parser.add_argument("--offset", type=int, default=0, help="first prompt of each set")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=None, help="onnxruntime threads (default: all cores)")
    parser.add_argument("--engine-dir", type=Path, help="default: the embedded default's (built on first use)")
    parser.add_argument("--json", type=Path, help="write the totals here")


def open_runner(args: argparse.Namespace):
    """The onnxruntime `Runner` over `args.engine_dir` (set to the embedded default's when None)."""
    from blockpilot.runtime.runner import Runner

    if args.engine_dir is None:
        from blockpilot.builder.embedded import embedded_engine_dir

        args.engine_dir = embedded_engine_dir()
    return Runner.from_engine_dir(args.engine_dir, backend="onnxruntime", threads=args.threads)


def prompt_sets(args: argparse.Namespace):
    """The SmolLM2 tokenizer and `[(set name, prompt text)]`: `args.prompts` HumanEval problems, then as
    many MT-Bench first turns, each from `args.offset` on. Returns `(tokenizer, set names, prompts)`."""
    from blockpilot.assets.prompts import load_humaneval, load_mtbench
    from blockpilot.assets.smollm2 import smollm2_dir
    from blockpilot.text import load_tokenizer

    sets = {"humaneval": load_humaneval(), "mtbench": load_mtbench()}
    prompts = [(name, q.text) for name, items in sets.items() for q in items[args.offset: args.offset + args.prompts]]
    return load_tokenizer(smollm2_dir()), list(sets), prompts
