"""`blockpilot build`: export a target + DFlash drafter to ONNX (and TensorRT) into an engine directory.

Without `--target`/`--drafter` it builds the embedded default (SmolLM2-135M-Instruct, its shipped
drafter and predictor). `parse_block_sizes` is re-exported here for scripts that import it from
this module.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from blockpilot.commands.common import (BLOCK_SIZES_EXAMPLE, add_dtype_arg, argument_type,
                                        parse_block_sizes)
from blockpilot.errors import UserError

MAX_SEQ_LEN = 1024
"""Default cache capacity of a build (prompt + new tokens + one block)."""


def add_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "build",
        help="export target + drafter to ONNX (and TensorRT engines) into an engine directory",
        description="Export the target (static-capacity KV cache) and the DFlash drafter to ONNX, one "
        "optimization profile per candidate block size (plus prefill), and write an engine directory "
        "with manifest.json. With --trt also build TensorRT engines (needs TensorRT and a GPU).",
    )
    p.add_argument("--target", type=Path,
                   help="Hugging Face target dir (default: the embedded SmolLM2-135M-Instruct; then also its "
                   "shipped drafter and predictor unless --drafter/--predictor are given)")
    p.add_argument("--drafter", type=Path,
                   help="DFlash drafter dir, z-lab format (default: the shipped drafter of the embedded target)")
    p.add_argument("--predictor", type=Path, help="block-size predictor .onnx to ship in the directory")
    p.add_argument("--no-predictor", action="store_true",
                   help="ship no predictor, not even the embedded target's: requests run the built block size "
                   "closest to the drafter's training block size unless they name one")
    p.add_argument("--block-sizes", type=argument_type(parse_block_sizes), metavar="LIST",
                   help=f"candidate block sizes, one profile each, e.g. {BLOCK_SIZES_EXAMPLE} (default: the "
                   "predictor's candidates, else the drafter's training block size +- 2)")
    p.add_argument("--max-seq-len", type=int,
                   help=f"cache capacity in tokens: prompt + new tokens + one block (default: {MAX_SEQ_LEN}, or "
                   "the target's max_position_embeddings if smaller)")
    add_dtype_arg(p, "precision of the exported graphs")
    p.add_argument("--opset", type=int, choices=(18, 24), default=24,
                   help="24: TensorScatter + Attention (TensorRT >= 10.15, in-place caches); 18: any TensorRT 10")
    p.add_argument("--out", type=Path, required=True, help="engine directory to write")
    p.add_argument("--trt", action="store_true", help="also build TensorRT engines (needs TensorRT and a GPU)")
    p.add_argument("--int4-drafter", action=argparse.BooleanOptionalAction, default=True,
                   help="also write drafter.int4.onnx, the drafter with 4-bit weights that onnxruntime runs (fp32 "
                   "builds; lossless: the target verifies every draft; about 2x faster drafter calls on CPU)")
    p.add_argument("--no-step-costs", dest="step_costs", action="store_false",
                   help="skip measuring the step-cost table (ms per target forward at K = 1 and each block size, "
                   "drafter ms per block size) on the built graphs; `blockpilot label --step-costs DIR` reads it")
    p.add_argument("--step-cost-context", type=int, default=256,
                   help="tokens in the cache while the step costs are measured")
    p.set_defaults(run=run)


def check_predictor(path: Path, target_dir: Path, drafter_dir: Path, block_sizes: tuple[int, ...]) -> None:
    """Raise `UserError` unless the predictor belongs to these models and chooses only built sizes."""
    from blockpilot.models.config import DecoderConfig, DrafterConfig, read_config_json
    from blockpilot.runtime.policy import OnnxBlockSizePolicy

    policy = OnnxBlockSizePolicy(path)
    target = DecoderConfig.from_dict(read_config_json(target_dir))
    drafter = DrafterConfig.from_dict(read_config_json(drafter_dir))
    policy.check_fits(target, drafter, lambda k: k == 1 or k in block_sizes)  # 1: plain decoding, always there
    policy.check_models(target_dir, drafter_dir)


def resolve_spec(args: argparse.Namespace):
    """The `BuildSpec` for the command line, with the embedded default and the defaults derived
    from the drafter (and predictor) filled in.

    Raises:
        UserError: a missing path (naming its flag), --target without --drafter, a predictor that
            does not fit.
    """
    from blockpilot.builder.engine_dir import BuildSpec
    from blockpilot.models.config import DecoderConfig, DrafterConfig, read_config_json
    from blockpilot.predictor.labelling import default_candidates

    target, drafter, predictor = _models(args)
    sizes = args.block_sizes
    if predictor is not None and args.predictor is None and sizes is not None:  # the shipped one, by default
        _check_shipped_predictor_fits(predictor, sizes)
    if sizes is None and predictor is not None:
        from blockpilot.runtime.policy import OnnxBlockSizePolicy

        sizes = tuple(k for k in OnnxBlockSizePolicy(predictor).candidates if k > 1)  # 1 needs no graph
    if sizes is None:
        sizes = default_candidates(DrafterConfig.from_dict(read_config_json(drafter)).block_size)
    if predictor is not None:
        check_predictor(predictor, target, drafter, sizes)
    max_seq_len = args.max_seq_len
    if max_seq_len is None:
        max_seq_len = min(MAX_SEQ_LEN, DecoderConfig.from_dict(read_config_json(target)).max_position_embeddings)
    return BuildSpec(target_dir=target, drafter_dir=drafter, out_dir=args.out, block_sizes=sizes,
                     max_seq_len=max_seq_len, dtype=args.dtype, predictor=predictor, trt=args.trt, opset=args.opset,
                     int4_drafter=args.int4_drafter)


def _check_shipped_predictor_fits(predictor: Path, sizes: tuple[int, ...]) -> None:
    from blockpilot.runtime.policy import OnnxBlockSizePolicy

    candidates = [k for k in OnnxBlockSizePolicy(predictor).candidates if k > 1]
    missing = [k for k in candidates if k not in sizes]
    if missing:
        listed = ",".join(map(str, sizes))
        raise UserError(f"the shipped predictor chooses among block sizes {','.join(map(str, candidates))}, and "
                        f"--block-sizes {listed} lacks {','.join(map(str, missing))}; add --no-predictor to build "
                        "without it, or drop --block-sizes to build its sizes")


def _models(args: argparse.Namespace) -> tuple[Path, Path, Path | None]:
    if args.no_predictor and args.predictor is not None:
        raise UserError("--predictor and --no-predictor contradict each other; pass one")
    for path, flag in ((args.target, "--target"), (args.drafter, "--drafter")):
        if path is not None and not path.is_dir():
            raise UserError(f"{flag} {path}: no such model directory")
    if args.predictor is not None and not args.predictor.is_file():
        raise UserError(f"--predictor {args.predictor}: no such file")
    if args.target is not None:
        if args.drafter is None:
            raise UserError(f"--target {args.target} needs --drafter DIR (the shipped drafter fits only the "
                            "embedded target)")
        return args.target, args.drafter, args.predictor
    from blockpilot.assets import default_drafter_dir, default_predictor_path
    from blockpilot.assets.smollm2 import smollm2_dir

    if args.drafter is not None:
        return smollm2_dir(), args.drafter, args.predictor
    predictor = None if args.no_predictor else args.predictor or default_predictor_path()
    return smollm2_dir(), default_drafter_dir(), predictor


def run(args: argparse.Namespace) -> int:
    from blockpilot.builder.engine_dir import build_engine_dir

    spec = resolve_spec(args)
    if args.step_cost_context < 1:
        raise UserError(f"--step-cost-context must be >= 1 (got {args.step_cost_context})")
    measure = None
    if args.step_costs:
        from blockpilot.runtime.step_costs import measure_engine_dir

        def measure(engine_dir: Path):
            return measure_engine_dir(engine_dir, context=args.step_cost_context)

    manifest = build_engine_dir(spec, log=lambda line: print(line, file=sys.stderr, flush=True),
                                measure_step_costs=measure)
    engines = "with TensorRT engines" if manifest.has_engines else "ONNX only"
    print(f"wrote {args.out} ({engines}; block sizes {list(manifest.block_sizes)}, "
          f"max sequence length {manifest.max_seq_len}, {manifest.dtype}, {len(manifest.files)} files)")
    if manifest.step_costs is not None:
        print(step_cost_line(manifest.step_costs))
    return 0


def step_cost_line(costs) -> str:
    """One line of a `StepCosts` table: the step ms of each block size and its ratio to plain decoding."""
    plain = costs.step_ms(1)
    sizes = ", ".join(f"{k}: {costs.step_ms(k):.1f} ({costs.step_ms(k) / plain:.2f}x)" for k in sorted(costs.target_ms))
    return (f"step costs ({costs.backend} {costs.dtype}, {costs.machine}, context {costs.context}), ms per step "
            f"by block size: {sizes}")
