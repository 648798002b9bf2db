"""`blockpilot generate`: speculative (or autoregressive) generation from text prompts.

Text goes to stdout as tokens are committed; one line of statistics per prompt (tokens, tau,
block size, tokens/s) goes to stderr. Every prompt is tokenized and checked against the cache
capacity before the first one runs, so a bad prompt file fails before any output.

The models come from `commands.common.open_runner`: without `--target` or `--engine-dir` the
embedded SmolLM2-135M-Instruct with the drafter and block-size predictor shipped for it; an
engine directory (`blockpilot build`) brings its own. Without a drafter, decoding is
autoregressive (block size 1); with a predictor, the block size is chosen per prompt ("auto").
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path

from blockpilot.commands.common import (add_lookup_arg, add_verify_length_arg, add_model_args,
                                        finite_float, open_runner, parse_block_size)
from blockpilot.errors import UserError
from blockpilot.text import chat_prompt_ids, load_tokenizer, one_line


def add_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "generate",
        help="generate text with DFlash speculative decoding",
        description="Generate text for one prompt or a file of prompts with DFlash speculative decoding "
        "(lossless: the output is distributed exactly as the target's own). Text streams to stdout; "
        "tau and tokens/s go to stderr.",
    )
    add_model_args(p)
    add_lookup_arg(p)
    add_verify_length_arg(p)
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--prompt", help="one prompt")
    source.add_argument("--prompts-file", type=Path,
                        help='prompts: .jsonl with one {"prompt": ...} a line, else one prompt a line')
    p.add_argument("--block-size", metavar="N|auto",
                   help="tokens per verify step, or 'auto' (the predictor chooses per prompt); default: auto "
                   "with a predictor, else the drafter's training block size")
    p.add_argument("--temperature", type=finite_float, default=0.0, help="sampling temperature; 0 = greedy")
    p.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens (0 = all)")
    p.add_argument("--top-p", type=finite_float, default=1.0, help="nucleus sampling mass (1 = all)")
    p.add_argument("--seed", type=int, help="random seed for sampling (same seed, same output)")
    p.add_argument("--max-new-tokens", type=int, default=256, help="at most this many tokens per prompt")
    p.add_argument("--compare-plain", action="store_true",
                   help="also decode each prompt without speculation (block size 1, same seed) and report "
                   "the speedup and whether the tokens are the same")
    p.add_argument("--no-chat-template", action="store_true",
                   help="feed the prompt as plain text even when the tokenizer has a chat template")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    block_size = parse_block_size(args.block_size)
    texts = read_prompts(args.prompt, args.prompts_file)
    opened = open_runner(args)
    runner = opened.runner
    tokenizer = load_tokenizer(opened.choice.tokenizer)
    end_id = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else runner.end_id
    batch = [chat_prompt_ids(tokenizer, text, not args.no_chat_template) for text in texts]
    # generate(streaming=True) checks its input before returning the (lazy) stream, so every
    # prompt is validated here, before any text is written.
    streams = [
        runner.generate([ids], max_new_tokens=args.max_new_tokens, end_id=end_id, temperature=args.temperature,
                        top_k=args.top_k, top_p=args.top_p, random_seed=args.seed, block_size=block_size,
                        streaming=True, return_dict=True)
        for ids in batch
    ]
    if opened.note:
        print(f"note: {opened.note}", file=sys.stderr)
    sampling = dict(max_new_tokens=args.max_new_tokens, end_id=end_id, temperature=args.temperature,
                    top_k=args.top_k, top_p=args.top_p, random_seed=args.seed)
    if args.compare_plain:  # first calls pay one-time allocations; keep them out of both timings
        for size in (1, block_size):
            runner.generate([batch[0]], **{**sampling, "max_new_tokens": 4}, block_size=size)
    for number, (ids, stream) in enumerate(zip(batch, streams), 1):
        stats = stream_text(stream, len(ids), tokenizer, sys.stdout)
        print(f"[{number}/{len(batch)}] {stats}", file=sys.stderr, flush=True)
        if args.compare_plain:
            print(f"[{number}/{len(batch)}] {compare_with_plain(runner, ids, sampling, stats)}", file=sys.stderr,
                  flush=True)
    return 0


def compare_with_plain(runner, ids: list[int], sampling: dict, stats) -> str:
    """Plain decoding of `ids` with the same settings: its tokens/s after prefill beside the
    speculative run's (`stats`), and whether the tokens are the same."""
    plain = runner.generate([torch_tensor(ids)], **sampling, block_size=1, return_dict=True)
    timing = plain["timings"][0]
    tokens = plain["output_ids"][0, 0, len(ids):int(plain["sequence_lengths"][0, 0])].tolist()
    rate = (len(tokens) - 1) / (timing["draft_s"] + timing["verify_s"]) if len(tokens) > 1 else 0.0
    same = "same tokens" if tokens == stats.tokens else "different tokens"
    if sampling["temperature"] > 0:
        same += " (expected at T > 0: same distribution, different draws)"
    speedup = f"{stats.decode_rate / rate:.2f}x" if rate else "-"
    return f"plain decoding {rate:.1f} tok/s after prefill; speculative {speedup} faster; {same}"


def torch_tensor(ids: list[int]):
    import torch

    return torch.tensor(ids)


def read_prompts(prompt: str | None, prompts_file: Path | None) -> list[str]:
    """The prompt texts: `prompt`, or those of `prompts_file` (.jsonl objects, else one a line).

    Raises:
        UserError: a prompt is empty or whitespace, or the file is unreadable or has no prompts.
    """
    if prompts_file is None:
        if not prompt or not prompt.strip():
            raise UserError("the prompt is empty; pass some text with --prompt")
        return [prompt]
    if prompts_file.suffix == ".jsonl":
        from blockpilot.assets.prompts import load_jsonl_prompts

        return [p.text for p in load_jsonl_prompts(prompts_file)]
    try:
        lines = prompts_file.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise UserError(f"cannot read prompts file {prompts_file} ({one_line(exc)}); check the path") from None
    texts = [line for line in lines if line.strip()]
    if not texts:
        raise UserError(f"prompts file {prompts_file} has no prompts; write one prompt a line")
    return texts


class TextStream:
    """Turns a growing list of output tokens into text increments.

    The whole output is decoded each time and the part not yet written is returned, except trailing
    U+FFFD characters: those are an incomplete multi-token character, held back until its last token
    arrives (or written as they are by `finish`, when the output ends inside one).
    """

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.written = ""

    def update(self, tokens: list[int], final: bool = False) -> str:
        """Text to write after `tokens` (all output tokens so far)."""
        text = self.tokenizer.decode(tokens, skip_special_tokens=True)
        if not final:
            text = text.rstrip("\ufffd")
        if len(text) <= len(self.written):
            return ""
        new, self.written = text[len(self.written):], text
        return new


@dataclasses.dataclass(frozen=True)
class StreamStats:
    line: str  # the statistics line for stderr
    tokens: list[int]
    decode_rate: float  # tokens/s after prefill

    def __str__(self) -> str:
        return self.line


def stream_text(stream, prompt_len: int, tokenizer, out) -> StreamStats:
    """Write one request's text to `out` as it is committed; return its statistics."""
    text = TextStream(tokenizer)
    start = time.perf_counter()
    result = None
    for result in stream:
        length = int(result["sequence_lengths"][0, 0])
        out.write(text.update(result["output_ids"][0, 0, prompt_len:length].tolist()))
        out.flush()
    wall = time.perf_counter() - start
    tokens = result["output_ids"][0, 0, prompt_len:int(result["sequence_lengths"][0, 0])].tolist()
    out.write(text.update(tokens, final=True) + "\n")
    out.flush()
    timing = result["timings"][0]
    decode_s = timing["draft_s"] + timing["verify_s"]
    steps = len(result["accept_lengths"][0])
    rate = (len(tokens) - 1) / decode_s if decode_s else 0.0
    line = (f"{len(tokens)} tokens, tau {result['tau'][0]:.2f} over {steps} steps, block size "
            f"{result['block_sizes'][0]}, {len(tokens) / wall:.1f} tok/s "
            f"({rate:.1f} tok/s after prefill {timing['prefill_s']:.2f} s)")
    return StreamStats(line, tokens, rate)
