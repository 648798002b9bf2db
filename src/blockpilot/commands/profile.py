"""`blockpilot profile`: latency and acceptance of our runner side by side with transformers peers."""

from __future__ import annotations

import argparse
import contextlib
import signal
import sys
from pathlib import Path

from blockpilot.devices import resolve_device
from blockpilot.errors import UserError

BASELINES = "ar,hf-ar,hf-dflash,hf-prompt-lookup"


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
    models = p.add_argument_group("models (default: the embedded SmolLM2-135M-Instruct and its drafter)")
    models.add_argument("--engine-dir", type=Path, help="engine directory (blockpilot build) for our runner; the "
                        "transformers peers then use its target/ and drafter/ unless --target/--drafter are given")
    models.add_argument("--target", type=Path, help="Hugging Face target dir")
    models.add_argument("--drafter", type=Path, help="DFlash drafter dir (z-lab format)")
    models.add_argument("--predictor", type=Path, help="block-size predictor .onnx (blockpilot train-predictor) "
                        "for --block-size auto (overrides an engine directory's)")
    models.add_argument("--predictor-threshold", type=float, help="override the predictor's fallback threshold")
    models.add_argument("--backend", help="our runner's backend (default: Runner.from_dir's)")
    models.add_argument("--device", default="auto", help="cpu, cuda, cuda:N or auto (default)")
    models.add_argument("--dtype", default="float32", help="float32 (default), bfloat16 or float16")
    p.add_argument("--dataset", action="append", default=[], required=True,
                   help="humaneval, mtbench, sharegpt or a JSONL file of {\"prompt\": ...} (repeatable)")
    p.add_argument("--limit", type=int, help="at most N prompts per dataset")
    p.add_argument("--block-size", default="",
                   help="comma list of N, auto, sweep, oracle (default: auto with a predictor, else the drafter's)")
    p.add_argument("--candidates",
                   help="sweep block sizes, e.g. 14-18 or 12,16,20 (default: the predictor's, else B_train+-2)")
    p.add_argument("--oracle-by", default="tau", choices=("tau", "time"), help="oracle picks the best sweep size by")
    p.add_argument("--temperature", default="0", help="comma list, e.g. 0,1 (default 0)")
    p.add_argument("--baselines", default=BASELINES, help=f"comma list (default {BASELINES}); ar is always run")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--warmup", type=int, default=1, help="requests per system run before measuring (default 1)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, required=True, help="report directory")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from blockpilot.profiling.session import ProfileOptions, run_profile

    options = ProfileOptions(
        out_dir=args.out, datasets=args.dataset, sources=_sources(args),
        block_sizes=_block_modes(args.block_size), temperatures=_floats(args.temperature, "--temperature"),
        baselines=_names(args.baselines), candidates=_candidates(args.candidates), oracle_by=args.oracle_by,
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
    for e in r["speedups"]:
        if e["dataset"] == "all" and e["system"] != r["reference"]:
            lines.append(f"  {e['system']:<18} T={e['temperature']:<4} tau {_f(e['tau'])}  speedup vs "
                         f"{r['reference']}: {_f(e['with_prefill'])}x with prefill, "
                         f"{_f(e['decode_only'])}x decode only")
    if r["errors"]:
        lines.append(f"ERROR: {len(r['errors'])} T=0 output(s) differ from {r['reference']} "
                     "(see report.md, section Correctness)")
    elif any(row["temperature"] == 0 for row in r["rows"]):
        lines.append(f"T=0 equality: every system produced exactly {r['reference']}'s tokens")
    return "\n".join(lines)


def _f(x) -> str:
    return "–" if x is None else f"{x:.2f}"


def _sources(args):
    from blockpilot.profiling.session import resolve_dtype
    from blockpilot.profiling.systems import ModelSources

    target, drafter, predictor, tokenizer = args.target, args.drafter, args.predictor, None
    for path, flag in ((args.engine_dir, "--engine-dir"), (target, "--target"), (drafter, "--drafter")):
        if path is not None and not Path(path).is_dir():
            raise UserError(f"{flag} {path}: no such directory")
    if args.engine_dir is not None:
        target, drafter, tokenizer = _engine_models(args.engine_dir, target, drafter)
    elif target is None:
        target, drafter, predictor = _embedded_default(drafter, predictor)
    if predictor is not None and not predictor.is_file():
        raise UserError(f"--predictor {predictor}: no such file")
    device = resolve_device(args.device)
    return ModelSources(target, drafter, args.engine_dir, args.backend, device, resolve_dtype(args.dtype),
                        predictor, args.predictor_threshold, tokenizer)


def _engine_models(engine_dir: Path, target: Path | None, drafter: Path | None) -> tuple[Path, Path, Path]:
    """Target and drafter dirs for the transformers peers (the engine's copies unless given) and the
    tokenizer dir (the engine dir, which holds the target's tokenizer files)."""
    from blockpilot.builder.manifest import read_manifest

    manifest = read_manifest(engine_dir, verify_files=False)
    return (target or engine_dir / manifest.target_dir, drafter or engine_dir / manifest.drafter_dir,
            engine_dir if manifest.tokenizer_files else (target or engine_dir / manifest.target_dir))


def _embedded_default(drafter: Path | None, predictor: Path | None) -> tuple[Path, Path | None, Path | None]:
    """The embedded SmolLM2 target, its shipped drafter unless `drafter` is given (None when none is
    shipped: then only block size 1 and the drafter-free peers can run), and the shipped predictor
    for the shipped drafter unless `predictor` is given."""
    from blockpilot.assets import default_drafter_dir, default_predictor_path
    from blockpilot.assets.smollm2 import smollm2_dir

    if drafter is None:
        try:
            drafter = default_drafter_dir()
        except UserError:
            return smollm2_dir(), None, predictor
        predictor = predictor or default_predictor_path()
    return smollm2_dir(), drafter, predictor


def _names(text: str) -> list[str]:
    return [part.strip() for part in text.split(",") if part.strip()]


def _floats(text: str, flag: str) -> list[float]:
    try:
        return [float(part) for part in _names(text)]
    except ValueError:
        raise UserError(f"{flag} {text!r}: give numbers separated by commas, e.g. 0,1") from None


def _block_modes(text: str) -> list[int | str]:
    return [int(part) if part.lstrip("-").isdigit() else part for part in _names(text)]


def _candidates(text: str | None) -> list[int] | None:
    """"14-18" -> [14..18]; "12,16,20" -> [12, 16, 20]."""
    if not text:
        return None
    try:
        if "-" in text:
            low, high = (int(x) for x in text.split("-"))
            sizes = list(range(low, high + 1))
        else:
            sizes = [int(x) for x in _names(text)]
    except ValueError:
        sizes = []
    if not sizes:
        raise UserError(f"--candidates {text!r}: give a range like 14-18 or a list like 12,16,20")
    return sizes
