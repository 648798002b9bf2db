"""`blockpilot train-drafter`: train a DFlash drafter for a target on its own answers."""

from __future__ import annotations

import argparse
from pathlib import Path

from blockpilot.commands.common import add_device_arg, finite_float


def add_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "train-drafter",
        help="train a DFlash drafter on the target's own answers (self-distillation)",
        description="Train a DFlash block-diffusion drafter for a target (DFlash recipe: self-distilled "
        "answers, random anchors, block-sparse attention, per-slot loss decay). Resumable.",
    )
    p.add_argument("--target", type=Path, help="target model dir (default: embedded SmolLM2-135M-Instruct)")
    p.add_argument("--out", type=Path, required=True, help="output drafter dir (z-lab format)")
    p.add_argument("--block-size", type=int, default=8,
                   help="the drafter's training block size B_train (one value; 8 is the shipped drafter's, which "
                   "beat 16 at every inference block size on SmolLM2)")
    p.add_argument("--layers", type=int, default=3, help="drafter layers")
    p.add_argument("--taps", type=int, default=5, help="number of tapped target layers")
    p.add_argument("--mask-token-id", type=int, help="mask token id (default: the embedded model's unused special token)")
    p.add_argument("--answers", type=Path, action="append", default=[],
                   help="JSONL (.jsonl.gz too) of {prompt, answer, finish} from the target (repeatable)")
    p.add_argument("--prompts", help="prompts to answer with the target first: a JSONL file of {prompt}, or a "
                   "training set (sharegpt, stdlib-code)")
    p.add_argument("--regenerate", type=int, default=0, help="how many --prompts to answer (0: none)")
    p.add_argument("--gen-max-new-tokens", type=int, default=256, help="tokens per answer for --regenerate")
    p.add_argument("--gen-batch-size", type=int, default=16, help="prompts answered per batch")
    add_device_arg(p)
    p.add_argument("--max-len", type=int, default=512, help="tokens per training sequence")
    p.add_argument("--time-budget", type=finite_float, required=True, help="minutes of training (the schedule fits it)")
    p.add_argument("--max-steps", type=int, help="stop after N steps (default: as many as the time budget allows)")
    p.add_argument("--sequences-per-step", type=int, default=8, help="training sequences per optimizer step")
    p.add_argument("--anchors", type=int, default=16, help="anchored blocks per sequence")
    p.add_argument("--lr", type=finite_float, default=6e-4, help="peak AdamW learning rate (cosine schedule)")
    p.add_argument("--gamma", type=finite_float, help="loss decay (default 7 for B>=16, 5 for B>=10, else 4)")
    p.add_argument("--distill", type=finite_float, default=0.0,
                   help="weight in [0, 1] of the target's own next-token distribution in every slot's target "
                   "(0: hard labels only, the DFlash recipe); drafts drawn from such a drafter are accepted more "
                   "often at T > 0. Caches the target's top --distill-top-k ids per position with the taps")
    p.add_argument("--distill-top-k", type=int, default=32, help="ids of the target's distribution kept per position")
    p.add_argument("--distill-temperature", type=finite_float, default=1.0,
                   help="temperature of the target's distribution that the drafter learns")
    p.add_argument("--valid", type=int, default=48, help="held-out sequences for the periodic tau")
    p.add_argument("--eval-every", type=finite_float, default=5.0, help="minutes between validation evals")
    p.add_argument("--checkpoint-every", type=finite_float, default=10.0, help="minutes between checkpoints")
    p.add_argument("--work-dir", type=Path, help="features cache + checkpoints (default: OUT.work)")
    p.add_argument("--resume", action="store_true", help="continue from the work dir's checkpoint")
    p.add_argument("--init-from", type=Path, help="start from this drafter's weights (and draft vocabulary) instead of "
                   "a random drafter: fine-tuning; its shape must match --block-size/--layers/--taps")
    p.add_argument("--no-autocast", action="store_true", help="train in fp32 instead of bf16 autocast")
    p.add_argument("--seed", type=int, default=0, help="random seed (anchors, split, initialisation)")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from blockpilot.training.pipeline import train_drafter_from_args

    train_drafter_from_args(args)
    return 0
