"""`blockpilot build`: export a target + DFlash drafter to ONNX (and TensorRT) into an engine directory."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from blockpilot.errors import UserError


def parse_block_sizes(text: str) -> tuple[int, ...]:
    """`"14-18"` -> (14, 15, 16, 17, 18); `"8,16"` and mixes like `"4,14-18"` work too."""
    sizes: set[int] = set()
    try:
        for part in text.split(","):
            low, _, high = part.strip().partition("-")
            sizes.update(range(int(low), int(high or low) + 1))
    except ValueError:
        raise UserError(f"--block-sizes {text!r} is not a list like 14-18 or 8,16") from None
    if not sizes:
        raise UserError(f"--block-sizes {text!r} names no block size; use e.g. 14-18")
    return tuple(sorted(sizes))


def add_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "build",
        help="export target + drafter to ONNX (and TensorRT engines) into an engine directory",
        description="Export the target (static-capacity KV cache) and the DFlash drafter to ONNX, one "
        "optimization profile per candidate block size (plus prefill), and write an engine directory "
        "with manifest.json. With --trt also build TensorRT engines (needs TensorRT and a GPU).",
    )
    p.add_argument("--target", type=Path, required=True, help="Hugging Face target directory")
    p.add_argument("--drafter", type=Path, required=True, help="DFlash drafter directory (z-lab format)")
    p.add_argument("--predictor", type=Path, help="block-size predictor .onnx to ship in the directory")
    p.add_argument("--block-sizes", default="14-18", help="candidate block sizes, e.g. 14-18 or 8,16")
    p.add_argument("--max-seq-len", type=int, required=True, help="cache capacity: prompt + new tokens + block")
    p.add_argument("--dtype", choices=("fp32", "fp16", "bf16"), default="fp32")
    p.add_argument("--opset", type=int, choices=(18, 24), default=24,
                   help="24: TensorScatter + Attention (TensorRT >= 10.15, in-place caches); 18: any TensorRT 10")
    p.add_argument("--out", type=Path, required=True, help="engine directory to write")
    p.add_argument("--trt", action="store_true", help="also build TensorRT engines")
    p.set_defaults(run=run)


def check_predictor(path: Path, target_dir: Path, drafter_dir: Path, block_sizes: tuple[int, ...]) -> None:
    """Raise `UserError` unless the predictor belongs to these models and chooses only built sizes."""
    from blockpilot.models.config import DecoderConfig, DrafterConfig, read_config_json
    from blockpilot.runtime.policy import OnnxBlockSizePolicy

    policy = OnnxBlockSizePolicy(path)
    target = DecoderConfig.from_dict(read_config_json(target_dir))
    drafter = DrafterConfig.from_dict(read_config_json(drafter_dir))
    policy.check_fits(target, drafter, lambda k: k in block_sizes)
    policy.check_models(target_dir, drafter_dir)


def run(args: argparse.Namespace) -> int:
    from blockpilot.builder.engine_dir import BuildSpec, build_engine_dir

    sizes = parse_block_sizes(args.block_sizes)
    if args.predictor is not None:
        check_predictor(args.predictor, args.target, args.drafter, sizes)
    spec = BuildSpec(target_dir=args.target, drafter_dir=args.drafter, out_dir=args.out, block_sizes=sizes,
                     max_seq_len=args.max_seq_len, dtype=args.dtype, predictor=args.predictor, trt=args.trt,
                     opset=args.opset)
    manifest = build_engine_dir(spec, log=lambda line: print(line, file=sys.stderr, flush=True))
    engines = "with TensorRT engines" if manifest.has_engines else "ONNX only"
    print(f"wrote {args.out} ({engines}; block sizes {list(manifest.block_sizes)}, "
          f"max sequence length {manifest.max_seq_len}, {manifest.dtype}, {len(manifest.files)} files)")
    return 0
