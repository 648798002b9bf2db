"""`blockpilot profile`: latency and acceptance of our runner side by side with transformers peers."""

from __future__ import annotations

import argparse
import contextlib
import math
import signal
import sys
from pathlib import Path

from blockpilot.commands.common import (add_lookup_arg, add_verify_length_arg, add_model_args,
                                        argument_type, comma_list, finite_float, parse_block_sizes)
from blockpilot.errors import UserError

BASELINES = "ar,hf-ar,hf-dflash,hf-prompt-lookup"
BLOCK_MODES = ("auto", "sweep", "oracle")  # profiling.session.BLOCK_MODES, kept here so --help needs no torch


def add_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "profile",
        help="profile latency and acceptance against autoregressive and transformers peers",
        description="Run our runner (at fixed, predicted, swept or oracle block sizes) and peers "
        "(our autoregressive path, transformers generate, transformers DFlash with the same drafter, "
        "transformers prompt lookup) prompt by prompt, interleaved; write results.json, report.md and "
        "plots. At T=0 every system's tokens must equal autoregressive decoding's; a difference is "
        "reported as an error (exit status 1). Ctrl-C or SIGTERM writes what was measured, marked partial "
        "(exit 130).",
    )
    add_model_args(p, peers=True)
    p.add_argument("--predictor-threshold", type=finite_float,
                   help="override the predictor's fallback threshold (below it the runtime uses B_train)")
    p.add_argument("--dataset", action="append", default=[], required=True,
                   help="humaneval, mtbench, sharegpt, stdlib-code or a JSONL file of {\"prompt\": ...} "
                   "(repeatable)")
    p.add_argument("--limit", type=int, help="at most N prompts per dataset")
    p.add_argument("--block-sizes", type=argument_type(parse_block_sizes, BLOCK_MODES), default=(),
                   metavar="LIST",
                   help="our runner's block sizes: sizes and ranges (e.g. 6-8,10: one system each), auto "
                   "(the predictor), sweep (the predictor's candidates, else B_train +- 2), oracle (the best "
                   "fixed size per prompt, over the listed sizes or the sweep); default: auto with a predictor, "
                   "else the drafter's training block size")
    p.add_argument("--oracle-by", default="tau", choices=("tau", "time"), help="oracle picks the best sweep size by")
    p.add_argument("--temperature", default="0", help="comma list of temperatures, e.g. 0,1")
    p.add_argument("--baselines", default=BASELINES,
                   help="comma list of ar, ar-1row (plain decoding without the padding row: the fastest, "
                        "rounds unlike verify steps), hf-ar, hf-dflash, hf-prompt-lookup; ar is always run")
    p.add_argument("--max-new-tokens", type=int, default=128, help="tokens generated per request")
    p.add_argument("--verification", choices=("block", "token"), default="block",  # runtime.sampling.VERIFICATIONS
                   help="how our runner judges drafts drawn at T > 0: block verification (default; keeps the most "
                        "tokens per step) or token by token (rejection sampling); both lossless")
    add_lookup_arg(p, many=True)
    add_verify_length_arg(p, many=True)
    p.add_argument("--warmup", type=int, default=1, help="requests per system run before measuring")
    p.add_argument("--seed", type=int, default=0, help="sampling seed (one per prompt, derived from it)")
    p.add_argument("--out", type=Path, required=True, help="report directory")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from blockpilot.profiling.session import ProfileOptions, run_profile

    options = ProfileOptions(
        out_dir=args.out, datasets=args.dataset, sources=_sources(args),
        block_sizes=_block_modes(args.block_sizes), temperatures=_floats(args.temperature, "--temperature"),
        baselines=comma_list(args.baselines), candidates=_candidates(args.block_sizes), oracle_by=args.oracle_by,
        lookups=args.lookup,
        verify_lengths=args.verify_length,
        limit=args.limit, max_new_tokens=args.max_new_tokens, warmup=args.warmup, seed=args.seed,
        command=["blockpilot", *sys.argv[1:]], progress=not args.no_progress,
    )
    with _sigterm_as_interrupt():
        outcome = run_profile(options)
    print(summary(outcome))
    if outcome.interrupted:
        return 130
    return 1 if outcome.errors else 0


@contextlib.contextmanager
def _sigterm_as_interrupt():
    """Treat SIGTERM (a job's time limit, `timeout`) like Ctrl-C while profiling, so the rows measured
    so far are written, marked partial."""
    def interrupt(signum, frame):
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def summary(outcome) -> str:
    """A few lines: where the report is, speedups over all datasets, the equality verdict."""
    r = outcome.results
    lines = [f"profile {'PARTIAL (interrupted)' if outcome.interrupted else 'complete'}: "
             f"{len(r['rows'])} rows; report in {outcome.paths[0].parent}"]
    over_fastest = {(e["system"], e["temperature"]): e for e in r.get("speedups_over_fastest_plain", [])
                    if e["dataset"] == "all" and e["reference"] != r["reference"]}
    for e in r["speedups"]:
        if e["dataset"] == "all" and e["system"] != r["reference"]:
            fastest = over_fastest.get((e["system"], e["temperature"]))
            lines.append(f"  {e['system']:<18} T={e['temperature']:<4} tau {_f(e['tau'])}  speedup vs "
                         f"{r['reference']}: {_f(e['with_prefill'])}x with prefill, "
                         f"{_f(e['decode_only'])}x decode only"
                         + (f"; vs {fastest['reference']} (the fastest plain decoding): {_f(fastest['with_prefill'])}x"
                            if fastest and e["system"] != fastest["reference"] else ""))
    if r["errors"]:
        lines.append(f"ERROR: {len(r['errors'])} T=0 output(s) differ from {r['reference']} "
                     "(see report.md, section Correctness)")
    elif any(row["temperature"] == 0 for row in r["rows"]):
        lines.append(f"T=0 equality: every system produced exactly {r['reference']}'s tokens")
    return "\n".join(lines)


def _f(x) -> str:
    return "–" if x is None else f"{x:.2f}"


def _sources(args):
    from blockpilot.commands.common import resolve_models, torch_dtype
    from blockpilot.profiling.systems import ModelSources

    m = resolve_models(args, peers=True)
    return ModelSources(m.target, m.drafter, m.engine_dir, m.backend if m.engine_dir else None, m.device,
                        torch_dtype(m.dtype), m.predictor, args.predictor_threshold, m.tokenizer,
                        m.predictor_any_backend, args.verification)


def _floats(text: str, flag: str) -> list[float]:
    try:
        values = [float(part) for part in comma_list(text)]
        if not all(math.isfinite(v) for v in values):
            raise ValueError
        return values
    except ValueError:
        raise UserError(f"{flag} {text!r}: give numbers separated by commas, e.g. 0,1") from None


def _block_modes(block_sizes: tuple) -> list[int | str]:
    """Session modes from `--block-sizes`: "sweep" for the listed sizes (so the oracle covers them),
    then the keywords."""
    words = [b for b in block_sizes if isinstance(b, str)]
    listed = any(isinstance(b, int) for b in block_sizes)
    return (["sweep"] if listed and "sweep" not in words else []) + words


def _candidates(block_sizes: tuple) -> list[int] | None:
    """The listed sizes (the sweep's), or None for the default sweep."""
    return [b for b in block_sizes if isinstance(b, int)] or None
