"""`blockpilot label`: oracle block-size labels for predictor training (resumable)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def add_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "label",
        help="decode training prompts at every candidate block size and record tau, timings and prefill features",
        description="For every prompt and candidate block size, run speculative decoding and record the "
        "acceptance length (tau), tokens and step times, plus the prompt's prefill features. Writes a "
        "dataset directory (safetensors + meta.json); rerunning with the same --out resumes it.",
    )
    p.add_argument("--target", type=Path, help="target model dir (default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--drafter", type=Path, help="DFlash drafter dir (default: the embedded drafter)")
    p.add_argument("--prompts", type=Path, help="JSONL file, one {\"prompt\": ...} a line")
    p.add_argument("--replay-answers", type=Path, metavar="FILE",
                   help="instead of --prompts, at --temperature 0: a JSONL file of prompts with the target's "
                   "greedy answers ({\"prompt\", \"answer_ids\" or \"answer\", \"finish\"}); tau is replayed "
                   "exactly with drafter passes only, step times come from a short calibration")
    p.add_argument("--calibration-prompts", type=int, default=4,
                   help="replay: time draft + verify on this many prompts (default 4)")
    p.add_argument("--calibration-reps", type=int, default=5, help="replay: timed rounds per prompt (default 5)")
    p.add_argument("--note", default="", help="free text stored in the dataset's meta.json")
    p.add_argument("--candidates", help="block sizes: a range like 14-18 or a list like 14,16,18 "
                   "(default: the drafter's block size +- 2)")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--out", type=Path, required=True, help="dataset directory (created, or resumed)")
    p.add_argument("--limit", type=int, help="label only the first N prompts of the file")
    p.add_argument("--seed", type=int, default=0, help="sampling seed (per prompt: derived from it)")
    p.add_argument("--backend", default="torch")
    p.add_argument("--device", default="cpu")
    p.add_argument("--no-chat-template", action="store_true", help="tokenize prompts as plain text")
    p.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                   help="time steps by wall clock, or by this process's CPU time (on a shared machine; "
                   "use with OMP_NUM_THREADS=1)")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from blockpilot.predictor.labelling import LabelJob, parse_candidates, run_label_job

    job = LabelJob(
        target=args.target or _default_target(), drafter=args.drafter or _default_drafter(),
        prompts=args.prompts, out=args.out,
        candidates=parse_candidates(args.candidates) if args.candidates else None,
        temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, max_new_tokens=args.max_new_tokens,
        limit=args.limit, seed=args.seed, backend=args.backend, device=args.device,
        chat_template=not args.no_chat_template, clock=args.clock, replay_answers=args.replay_answers,
        calibration_prompts=args.calibration_prompts, calibration_reps=args.calibration_reps, note=args.note,
    )
    print(json.dumps(run_label_job(job)))
    return 0


def _default_target() -> Path:
    from blockpilot.assets.smollm2 import smollm2_dir

    return smollm2_dir()


def _default_drafter() -> Path:
    from blockpilot.assets import default_drafter_dir

    return default_drafter_dir()
