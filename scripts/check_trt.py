"""Check TensorRT engines against onnxruntime profile by profile, and time them (needs a GPU + TensorRT).

    python scripts/check_trt.py --target DIR --drafter DIR --block-sizes 14-18 --max-seq-len 512 \
        --dtype fp16 --out /tmp/engine          # builds the engine directory with --trt first
    python scripts/check_trt.py --engine-dir DIR  # a directory already built with --trt

1. For every optimization profile of both engines and each of its min/opt/max shapes, the same
   random valid inputs (`blockpilot.builder.profiles`) run through TensorRT (polygraphy `TrtRunner`
   at that profile) and onnxruntime (`OnnxrtRunner` on the ONNX graph the engine was built from);
   polygraphy's `Comparator` compares every output (caches included).
2. Each profile is timed at its opt shapes (median of --iterations TensorRT inferences).
3. Greedy generation through the tensorrt backend is compared token by token with onnxruntime,
   and both are timed (tokens/s).
bf16 builds have no onnxruntime reference: only the timings run. Exit status 0 when all matches.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np

TOLERANCE = {"fp32": 1e-3, "fp16": 5e-2, "bf16": 1e-1}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--engine-dir", type=Path, help="existing engine directory built with --trt")
    p.add_argument("--target", type=Path)
    p.add_argument("--drafter", type=Path)
    p.add_argument("--block-sizes", default="14-18")
    p.add_argument("--max-seq-len", type=int, default=512)
    p.add_argument("--dtype", choices=tuple(TOLERANCE), default="fp16")
    p.add_argument("--opset", type=int, choices=(18, 24), default=24)
    p.add_argument("--out", type=Path, default=Path("engine-trt-check"))
    p.add_argument("--iterations", type=int, default=50)
    p.add_argument("--max-new-tokens", type=int, default=64)
    return p.parse_args(argv)


def ensure_engine_dir(args) -> Path:
    if args.engine_dir is not None:
        return args.engine_dir
    if args.target is None or args.drafter is None:
        sys.exit("pass --engine-dir, or --target and --drafter to build one")
    from blockpilot.builder.engine_dir import BuildSpec, build_engine_dir
    from blockpilot.commands.build import parse_block_sizes

    spec = BuildSpec(args.target, args.drafter, args.out, parse_block_sizes(args.block_sizes), args.max_seq_len,
                     dtype=args.dtype, trt=True, opset=args.opset)
    started = time.perf_counter()
    build_engine_dir(spec, log=lambda line: print(line, flush=True))
    print(f"built {args.out} in {time.perf_counter() - started:.0f} s")
    return args.out


def profile_feeds(manifest, name: str, profile, vocab: int, rng) -> list[dict]:
    """Inputs at the min, opt and max shapes of `profile` (fp32 numbers for bf16 builds)."""
    from blockpilot.builder.profiles import SHAPE_CHOICES, drafter_feed, profile_shapes, target_feed

    entry = getattr(manifest, name)
    dtype = manifest.dtype if manifest.dtype != "bf16" else "fp32"
    feeds = []
    for choice in SHAPE_CHOICES:
        shapes = profile_shapes(profile, choice)
        if name == "target":
            feeds.append(target_feed(shapes, entry.past_names, vocab, dtype, rng, prefill=profile.block_size is None))
        else:
            feeds.append(drafter_feed(shapes, entry.past_names, vocab, dtype, rng))
    return feeds


def _as_trt_inputs(feed: dict, dtype: str) -> dict:
    if dtype != "bf16":
        return feed
    import torch

    return {k: torch.from_numpy(v).to(torch.bfloat16) if v.dtype == np.float32 else torch.from_numpy(v)
            for k, v in feed.items()}


def check_graph(engine_dir: Path, manifest, name: str, vocab: int, iterations: int) -> bool:
    """Compare and time every profile of one engine; True when all outputs match onnxruntime."""
    from polygraphy.backend.common import BytesFromPath
    from polygraphy.backend.onnxrt import OnnxrtRunner, SessionFromOnnx
    from polygraphy.backend.trt import EngineFromBytes, TrtRunner
    from polygraphy.comparator import Comparator, CompareFunc

    entry, rng, ok = getattr(manifest, name), np.random.default_rng(0), True
    engine = EngineFromBytes(BytesFromPath(str(engine_dir / entry.engine)))()
    tolerance = TOLERANCE[manifest.dtype]
    for index, profile in enumerate(entry.profiles):
        feeds = profile_feeds(manifest, name, profile, vocab, rng)
        trt_runner = TrtRunner(engine, optimization_profile=index)
        verdict = "no onnxruntime reference (bf16)"
        if manifest.dtype != "bf16":
            ort_runner = OnnxrtRunner(SessionFromOnnx(str(engine_dir / entry.onnx)))
            results = Comparator.run([trt_runner, ort_runner], data_loader=feeds)
            matched = bool(Comparator.compare_accuracy(
                results, compare_func=CompareFunc.simple(atol=tolerance, rtol=tolerance)))
            ok &= matched
            verdict = "matches onnxruntime" if matched else "MISMATCH"
        with TrtRunner(engine, optimization_profile=index) as runner:
            timings = []
            for _ in range(iterations):
                runner.infer(_as_trt_inputs(feeds[1], manifest.dtype))
                timings.append(runner.last_inference_time())
        print(f"{name:8s} profile {index} {profile.name:10s} opt {statistics.median(timings) * 1e3:8.3f} ms  {verdict}")
    return ok


def check_generation(engine_dir: Path, manifest, max_new_tokens: int) -> bool:
    """Greedy generation: tensorrt vs onnxruntime tokens and tokens/s per block size."""
    import torch

    from blockpilot.runtime.runner import Runner

    backends = ["tensorrt"] + (["onnxruntime"] if manifest.dtype != "bf16" else [])
    runners = {b: Runner.from_dir(engine_dir, backend=b) for b in backends}
    vocab = runners["tensorrt"].backend.target_config.vocab_size
    prompt = torch.randint(0, vocab, (32,), generator=torch.Generator().manual_seed(0))
    ok = True
    for block_size in (1, *manifest.block_sizes):
        outputs = {}
        for name, runner in runners.items():
            runner.generate([prompt], max_new_tokens=4, block_size=block_size, end_id=-1)  # warm-up
            started = time.perf_counter()
            outputs[name] = runner.generate([prompt], max_new_tokens=max_new_tokens, block_size=block_size,
                                            end_id=-1, return_dict=True)
            rate = max_new_tokens / (time.perf_counter() - started)
            print(f"generate block {block_size:2d} {name:12s} {rate:8.1f} tok/s  tau {outputs[name]['tau'][0]:.2f}")
        if "onnxruntime" in outputs:
            same = outputs["tensorrt"]["output_ids"].tolist() == outputs["onnxruntime"]["output_ids"].tolist()
            ok &= same
            print(f"generate block {block_size:2d} tokens {'identical' if same else 'DIFFER'} (tensorrt vs onnxruntime)")
    return ok


def main(argv=None) -> int:
    args = parse_args(argv)
    from blockpilot.builder.manifest import read_manifest

    engine_dir = ensure_engine_dir(args)
    manifest = read_manifest(engine_dir)
    if not manifest.has_engines:
        sys.exit(f"{engine_dir} has no TensorRT engines; build it with `blockpilot build --trt`")
    import json

    vocab = json.loads((engine_dir / manifest.target_dir / "config.json").read_text())["vocab_size"]
    ok = all([check_graph(engine_dir, manifest, name, vocab, args.iterations) for name in ("target", "drafter")])
    ok &= check_generation(engine_dir, manifest, args.max_new_tokens)
    print("all profiles match" if ok else "MISMATCHES found")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
