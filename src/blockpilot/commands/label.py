"""`blockpilot label`: oracle block-size labels for predictor training (resumable)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from blockpilot.commands.common import (BLOCK_SIZES_EXAMPLE, add_device_arg, add_lookup_arg, argument_type,
                                        finite_float, parse_block_sizes)
from blockpilot.errors import UserError


def add_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "label",
        help="decode training prompts at every candidate block size and record tau, timings and prefill features",
        description="For every prompt and candidate block size, run speculative decoding and record the "
        "acceptance length (tau), tokens and step times, plus the prompt's prefill features. Writes a "
        "dataset directory (safetensors + meta.json); rerunning with the same --out resumes it.",
    )
    p.add_argument("--target", type=Path, help="target model dir (default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--drafter", type=Path, help="DFlash drafter dir (default: the shipped drafter)")
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--prompts", type=Path, help="JSONL file, one {\"prompt\": ...} a line: decode every "
                        "prompt at every candidate block size")
    source.add_argument("--replay-answers", type=Path, metavar="FILE",
                        help="instead of --prompts: a JSONL file of prompts with the target's answers ({\"prompt\", "
                        "\"answer_ids\" or \"answer\", \"finish\"}), greedy at --temperature 0, else drawn at "
                        "the same --temperature/--top-k/--top-p (`blockpilot answer --temperature T`); tau is "
                        "replayed exactly with drafter passes only, step times come from a short calibration")
    p.add_argument("--calibration-prompts", type=int, default=4,
                   help="replay: time draft + verify on this many prompts")
    p.add_argument("--calibration-reps", type=int, default=5, help="replay: timed rounds per prompt")
    p.add_argument("--note", default="", help="free text stored in the dataset's meta.json")
    p.add_argument("--block-sizes", type=argument_type(parse_block_sizes),
                   metavar="LIST", help=f"candidate block sizes, at least two, e.g. {BLOCK_SIZES_EXAMPLE} or "
                   "1,4,6,8,10,12,16; 1 is plain decoding (default: 1 and the drafter's training block size +- 2)")
    p.add_argument("--step-costs", type=Path, metavar="PATH",
                   help="step-cost table for the throughput labels: an engine dir (`blockpilot build` measures it "
                   "on its graphs) or a JSON file; use the backend and dtype that will run the predictor "
                   "(default: measured on the labelling backend)")
    p.add_argument("--temperature", type=finite_float, default=0.0, help="sampling temperature; 0 = greedy")
    p.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens (0 = all)")
    p.add_argument("--top-p", type=finite_float, default=1.0, help="nucleus sampling mass (1 = all)")
    p.add_argument("--max-new-tokens", type=int, default=128, help="tokens decoded per prompt and block size")
    p.add_argument("--out", type=Path, required=True, help="dataset directory (created, or resumed)")
    p.add_argument("--limit", type=int, help="label only the first N prompts of the file")
    p.add_argument("--seed", type=int, default=0, help="sampling seed (per prompt: derived from it)")
    add_device_arg(p)
    p.add_argument("--no-chat-template", action="store_true", help="tokenize prompts as plain text")
    p.add_argument("--greedy-drafts", action="store_true",
                   help="at T > 0, label greedy drafts accepted by 'sample, then match' instead of drafts drawn "
                        "from the drafter and accepted by rejection sampling (what the runtime does by default)")
    add_lookup_arg(p)
    p.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                   help="time steps by wall clock, or by this process's CPU time (on a shared machine; "
                   "use with OMP_NUM_THREADS=1)")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from blockpilot.devices import resolve_device
    from blockpilot.predictor.labelling import LabelJob, run_label_job

    if args.block_sizes is not None and len(args.block_sizes) < 2:
        raise UserError(f"--block-sizes {','.join(map(str, args.block_sizes))}: label needs at least two "
                        "candidate block sizes")
    if args.step_costs is not None and not args.step_costs.exists():
        raise UserError(f"--step-costs {args.step_costs}: no such engine directory or file")
    job = LabelJob(
        target=args.target or _default_target(), drafter=args.drafter or _default_drafter(),
        prompts=args.prompts, out=args.out, candidates=args.block_sizes,
        temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, max_new_tokens=args.max_new_tokens,
        limit=args.limit, seed=args.seed, device=resolve_device(args.device),
        chat_template=not args.no_chat_template, clock=args.clock, replay_answers=args.replay_answers,
        calibration_prompts=args.calibration_prompts, calibration_reps=args.calibration_reps, note=args.note,
        step_costs=args.step_costs, sampled_drafts=not args.greedy_drafts, lookup=args.lookup,
    )
    print(json.dumps(run_label_job(job)))
    return 0


def _default_target() -> Path:
    from blockpilot.assets.smollm2 import smollm2_dir

    return smollm2_dir()


def _default_drafter() -> Path:
    from blockpilot.assets import default_drafter_dir

    return default_drafter_dir()
