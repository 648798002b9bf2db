"""Tokens/s of autoregressive vs speculative decoding, and the share of wall time spent outside
model forwards (the Python decode loop: sampling, acceptance math, bookkeeping).

    python scripts/bench_runtime.py                      # embedded SmolLM2-135M-Instruct
    python scripts/bench_runtime.py --drafter DIR        # a trained DFlash drafter for it
    python scripts/bench_runtime.py --tiny               # a random tiny model: loop overhead dominates
    python scripts/bench_runtime.py --cpu-clock          # 1 thread, CPU-time clock (shared machines)

Modes, all greedy and checked token-identical to the autoregressive run:
    autoregressive   block size 1 (no drafting), the runtime's own baseline path
    dflash           the DFlash drafter: the shipped one, --drafter, or (when neither exists) a
                     random-init drafter of the right shape, which pays the real draft cost but
                     has tau ~1 (the table says which)
    oracle replay    drafts replay the autoregressive output (every draft accepted, draft cost
                     zero): the upper bound of speculation at that block size on this machine

"in forwards" is time inside backend calls (prefill, draft, verify: embeddings, layers, lm_head),
measured by wrapping the backend; "outside" is the rest of the wall time of `Runner.generate`.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path

import torch

from blockpilot.errors import UserError
from blockpilot.runtime.backend import TorchBackend
from blockpilot.runtime.runner import Runner

PROMPTS = (
    "Write a Python function that checks whether a number is prime.",
    "A train travels 60 km in 45 minutes. What is its average speed in km/h?",
    "Give three tips for writing clear emails.",
)


class TimedBackend:
    """Wraps a backend; adds the `clock` time of every prefill/draft/verify call to `forward_s`."""

    def __init__(self, inner, clock):
        self.inner = inner
        self.clock = clock
        self.forward_s = 0.0

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def _timed(self, method, *args):
        start = self.clock()
        try:
            return method(*args)
        finally:
            self.forward_s += self.clock() - start

    def prefill(self, *args):
        return self._timed(self.inner.prefill, *args)

    def draft(self, *args):
        return self._timed(self.inner.draft, *args)

    def verify(self, *args):
        return self._timed(self.inner.verify, *args)


class ReplayDraftBackend(TorchBackend):
    """Drafts the tokens of `self.sequence` (prompt + expected output) after the block's first
    position: a zero-cost drafter whose drafts are all accepted when the run reproduces it."""

    def __init__(self, target, drafter):
        super().__init__(target, drafter)
        self.sequence: list[int] = []

    def draft(self, state, last_tokens, new_taps, ctx_start, block_start, block_size):
        future = self.sequence[block_start + 1: block_start + block_size]
        return torch.tensor([future + [0] * (block_size - 1 - len(future))], device=self.device)


@dataclasses.dataclass
class Row:
    mode: str
    block_size: int
    tokens: int = 0
    steps: int = 0  # verify steps
    committed: int = 0  # tokens committed by verify steps (tau = committed / steps)
    wall_s: float = 0.0
    forward_s: float = 0.0
    outputs: list[list[int]] = dataclasses.field(default_factory=list)

    @property
    def tok_per_s(self) -> float:
        return self.tokens / self.wall_s


def run_mode(backend, mode: str, block_size: int, prompts: list[list[int]], max_new_tokens: int,
             clock, replay: list[list[int]] | None = None) -> Row:
    """Generate every prompt once (greedy, batch 1) and total tokens, steps and `clock` times."""
    timed = TimedBackend(backend, clock)
    runner = Runner(timed)
    row = Row(mode, block_size)
    for i, ids in enumerate(prompts):
        if replay is not None:
            backend.sequence = ids + replay[i]
        start = clock()
        out = runner.generate([torch.tensor(ids)], max_new_tokens=max_new_tokens, end_id=-1,
                              block_size=block_size, return_dict=True)
        row.wall_s += clock() - start
        length = int(out["sequence_lengths"][0, 0])
        row.outputs.append(out["output_ids"][0, 0, len(ids):length].tolist())
        row.tokens += length - len(ids)
        row.steps += len(out["accept_lengths"][0])
        row.committed += sum(out["accept_lengths"][0])
    row.forward_s = timed.forward_s
    return row


def load_models(args) -> tuple[TorchBackend, ReplayDraftBackend, list[list[int]], str]:
    """The DFlash backend, the replay backend over the same target, prompt ids, and a description."""
    from blockpilot.models.checkpoint import load_drafter, load_target

    if args.tiny:
        target, drafter = tiny_models()
        prompts = [list(range(3 + i, 40 + i)) for i in range(len(PROMPTS))]
        what = "random tiny Llama target (4 layers, hidden 64, vocab 1000) + random-init drafter (tau ~1)"
        return TorchBackend(target, drafter), ReplayDraftBackend(target, drafter), prompts, what
    target_dir, drafter_dir, what_drafter = resolve_smollm2(args.drafter)
    target = load_target(target_dir)
    drafter = load_drafter(drafter_dir) if drafter_dir is not None else random_drafter_for(target)
    prompts = encode(target_dir, PROMPTS)
    what = f"SmolLM2-135M-Instruct ({target_dir}) + {what_drafter}"
    return TorchBackend(target, drafter), ReplayDraftBackend(target, drafter), prompts, what


def resolve_smollm2(drafter: Path | None) -> tuple[Path, Path | None, str]:
    from blockpilot.assets import default_drafter_dir
    from blockpilot.assets.smollm2 import smollm2_dir

    if drafter is not None:
        return smollm2_dir(), drafter, f"drafter {drafter}"
    try:
        shipped = default_drafter_dir()
        return smollm2_dir(), shipped, f"shipped drafter {shipped.name}"
    except UserError:
        return smollm2_dir(), None, "random-init 1-layer DFlash drafter (no shipped drafter yet; tau ~1)"


def random_drafter_for(target):
    """A random DFlash drafter of the target's layer shape (B_train 16, 5 taps, 1 layer)."""
    from blockpilot.models.config import DrafterConfig, default_target_layer_ids
    from blockpilot.models.dflash import DFlashDrafter

    c = target.config
    layers = dataclasses.replace(c, family="qwen3", qk_norm=True, num_hidden_layers=1, tie_word_embeddings=False)
    config = DrafterConfig(layers, block_size=16, mask_token_id=0,
                           target_layer_ids=default_target_layer_ids(c.num_hidden_layers, 5),
                           num_target_layers=c.num_hidden_layers)
    torch.manual_seed(0)
    return DFlashDrafter(config, max_positions=target.max_positions).eval()


def tiny_models():
    from blockpilot.models.config import DecoderConfig
    from blockpilot.models.decoder import Decoder

    config = DecoderConfig(family="llama", vocab_size=1000, hidden_size=64, intermediate_size=128,
                           num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                           rms_norm_eps=1e-6, rope_theta=10000.0, max_position_embeddings=1024)
    torch.manual_seed(0)
    target = Decoder(config).eval()
    return target, random_drafter_for(target)


def encode(target_dir: Path, texts) -> list[list[int]]:
    from transformers import AutoTokenizer

    from blockpilot.text import chat_prompt_ids as encode_prompt

    tokenizer = AutoTokenizer.from_pretrained(target_dir)
    return [encode_prompt(tokenizer, text) for text in texts]


def print_table(rows: list[Row], baseline: Row) -> None:
    print(f"{'mode':<16}{'block':>6}{'tokens':>8}{'tau':>7}{'tok/s':>8}{'speedup':>9}"
          f"{'in forwards':>13}{'outside':>9}{'same as AR':>12}")
    for r in rows:
        outside = 1 - r.forward_s / r.wall_s
        print(f"{r.mode:<16}{r.block_size:>6}{r.tokens:>8}{r.committed / r.steps:>7.2f}{r.tok_per_s:>8.1f}"
              f"{r.tok_per_s / baseline.tok_per_s:>8.2f}x{r.forward_s / r.wall_s:>12.1%}{outside:>9.1%}"
              f"{'yes' if r.outputs == baseline.outputs else 'NO':>12}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--drafter", type=Path, help="DFlash drafter for SmolLM2 (default: the shipped one)")
    parser.add_argument("--tiny", action="store_true", help="random tiny target instead of SmolLM2")
    parser.add_argument("--block-sizes", default="4,8,16", help="comma-separated speculative block sizes")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--cpu-clock", action="store_true",
                        help="one torch thread, times read from this thread's CPU clock: robust to other "
                        "processes on a shared machine (\"wall\" then means CPU seconds)")
    args = parser.parse_args(argv)
    clock = time.perf_counter
    if args.cpu_clock:
        torch.set_num_threads(1)
        clock = time.thread_time
    dflash, replay_backend, prompts, what = load_models(args)
    print(f"models: {what}\nprompts: {len(prompts)} ({sum(map(len, prompts))} tokens), max_new_tokens "
          f"{args.max_new_tokens}, greedy, batch 1, fp32, torch threads {torch.get_num_threads()}, clock "
          f"{'thread CPU time' if args.cpu_clock else 'wall'}\n", flush=True)
    run_mode(dflash, "warm-up", 1, prompts[:1], 4, clock)
    baseline = run_mode(dflash, "autoregressive", 1, prompts, args.max_new_tokens, clock)
    rows = [baseline]
    for k in (int(b) for b in args.block_sizes.split(",")):
        rows.append(run_mode(dflash, "dflash", k, prompts, args.max_new_tokens, clock))
        rows.append(run_mode(replay_backend, "oracle replay", k, prompts, args.max_new_tokens, clock,
                             baseline.outputs))
    print_table(rows, baseline)
    return 0


if __name__ == "__main__":
    sys.exit(main())
