"""Step costs: ms per target forward at K = 1..16 query tokens and drafter ms per block size, for
every backend and dtype the package offers, beside this machine's floors.

    python scripts/bench_steps.py                                   # embedded SmolLM2 + shipped drafter
    python scripts/bench_steps.py --engine-dir DIR                  # add an existing engine dir (onnxruntime)
    python scripts/bench_steps.py --tiny                            # random tiny model (seconds; for tests)
    python scripts/bench_steps.py --paths torch-fp32,onnxruntime-fp32 --json out.json

Each path is opened through the package's own `Backend` interface and timed exactly as the decode
loop calls it (`blockpilot.runtime.step_costs.time_backend`, which `blockpilot build` also runs): a
prefill of `--context` tokens, then `verify` of K tokens at that position (K = 1 is a
plain decoding step), and `draft` of a block of K (K - 1 draft tokens) with one new context
position. Reported: median ms over `--repeats` calls after warm-up, and the ratio of a speculative
step (draft(K) + verify(K)) to a plain decoding step (verify(1)).

Floors of this machine, measured here: memory bandwidth (a streaming read of a buffer larger than the
last-level cache) gives the weight-read time of one forward (weight bytes / bandwidth); the
matrix-product peak (large products in fp32 and bf16) gives the FLOP time (2 x weight elements x K /
peak). A forward cannot be faster than the larger of the two.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

from blockpilot.runtime.step_costs import machine_class, median_seconds, time_backend

DEFAULT_PATHS = ("torch-fp32", "torch-bf16", "onnxruntime-fp32")


@dataclasses.dataclass
class PathResult:
    name: str
    verify_ms: dict[int, float]
    draft_ms: dict[int, float]
    weight_bytes: int
    one_row_ms: float | None = None  # a 1-row step where the backend pads plain decoding (not lossless)

    def step_ratio(self, k: int) -> float | None:
        if k == 1:
            return 1.0
        if k not in self.verify_ms or k not in self.draft_ms:
            return None
        return (self.verify_ms[k] + self.draft_ms[k]) / self.verify_ms[1]


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--paths", default=",".join(DEFAULT_PATHS),
                   help="backend-dtype paths to measure: torch-fp32, torch-bf16, onnxruntime-fp32")
    p.add_argument("--engine-dir", type=Path, help="engine dir for onnxruntime paths (default: build one)")
    p.add_argument("--tiny", action="store_true", help="a random tiny target + drafter instead of SmolLM2")
    p.add_argument("--k-max", type=int, default=16, help="largest K (query tokens / block size)")
    p.add_argument("--context", type=int, default=256, help="tokens already in the cache")
    p.add_argument("--repeats", type=int, default=15, help="timed calls per point (median reported)")
    p.add_argument("--threads", type=int, default=None, help="torch / onnxruntime threads (default: all cores)")
    p.add_argument("--no-floors", action="store_true", help="skip the bandwidth / peak measurements")
    p.add_argument("--work", type=Path, help="where to build an engine dir (default: a temp dir)")
    p.add_argument("--json", type=Path, help="write the results here")
    return p.parse_args(argv)


# ---------------------------------------------------------------- floors

def measure_floors(repeats: int = 5) -> dict:
    """Streaming-read bandwidth (GB/s) and matrix-product peaks (GFLOP/s) of this machine."""
    buffer = torch.ones(256 * 1024 * 1024 // 4)  # 1 GiB of fp32, far above any last-level cache
    read_s = median_seconds(lambda: buffer.sum(), repeats)
    peaks = {name: product_peak_gflop_s(dtype, repeats) for name, dtype in (("fp32", torch.float32),
                                                                            ("bf16", torch.bfloat16))}
    return {"bandwidth_gb_s": buffer.numel() * 4 / read_s / 1e9, "peak_gflop_s": peaks}


def product_peak_gflop_s(dtype: torch.dtype, repeats: int, largest: int = 2048, enough_s: float = 0.05) -> float:
    """GFLOP/s of square products in `dtype`: sizes double from 256 until one product takes `enough_s`
    or reaches `largest`. A CPU without native bf16 (no AVX512-BF16 or AMX) emulates bf16 products
    far slower than fp32 ones (1.2 against ~100 GFLOP/s on a 2-core AVX2 EPYC): 2048 wide, 14 s a product."""
    n = 256
    while True:
        a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
        start = time.perf_counter()
        a @ b
        if n >= largest or time.perf_counter() - start >= enough_s:
            return 2 * n ** 3 / median_seconds(lambda: a @ b, repeats) / 1e9
        n *= 2


def floor_ms(weight_bytes: int, weight_elems: int, k: int, floors: dict, dtype: str) -> float:
    read = weight_bytes / (floors["bandwidth_gb_s"] * 1e9)
    flops = 2 * weight_elems * k / (floors["peak_gflop_s"][dtype] * 1e9)
    return 1e3 * max(read, flops)


# ---------------------------------------------------------------- models and backends

def models(tiny: bool, work: Path) -> tuple[Path, Path]:
    """(target dir, drafter dir): the embedded default, or a random tiny pair saved under `work`."""
    if not tiny:
        from blockpilot.assets import default_drafter_dir
        from blockpilot.assets.smollm2 import smollm2_dir

        return smollm2_dir(), default_drafter_dir()
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from fixtures import make_drafter, make_hf_target  # the test suite's tiny-model registry

    target = make_hf_target(work)
    return target, make_drafter(work, target)


def open_path(name: str, target_dir: Path, drafter_dir: Path, engine_dir_for, k_max: int, threads):
    """A `Backend` for `name` ("torch-fp32", "torch-bf16", "onnxruntime-fp32")."""
    backend, _, dtype = name.partition("-")
    if backend == "torch":
        from blockpilot.builder.engine_dir import TORCH_DTYPES
        from blockpilot.runtime.runner import Runner

        return Runner.from_dir(target_dir, drafter_dir=drafter_dir, dtype=TORCH_DTYPES[dtype], max_block_size=k_max).backend
    if backend == "onnxruntime":
        from blockpilot.runtime.engine_dir import open_engine_dir

        return open_engine_dir(engine_dir_for(dtype), backend="onnxruntime", threads=threads).backend
    raise SystemExit(f"bench_steps: unknown path {name!r}")


def weight_footprint(backend) -> tuple[int, int]:
    """(bytes, elements) of the weights one target forward reads: layers + lm_head."""
    c = backend.target_config
    h, i, hd = c.hidden_size, c.intermediate_size, c.head_dim
    per_layer = h * hd * (c.num_attention_heads * 2 + c.num_key_value_heads * 2) + 3 * h * i
    elems = c.num_hidden_layers * per_layer + c.vocab_size * h
    size = 2 if getattr(backend, "dtype", torch.float32) in (torch.bfloat16, torch.float16) else 4
    return elems * size, elems


# ---------------------------------------------------------------- report

def table(results: list[PathResult], floors: dict | None, k_max: int) -> str:
    ks = list(range(1, k_max + 1))
    lines = ["| path | " + " | ".join(f"K={k}" for k in ks) + " |", "|---" * (len(ks) + 1) + "|"]
    for r in results:
        lines.append(f"| {r.name} target verify ms | " + " | ".join(
            f"{r.verify_ms[k]:.1f}" if k in r.verify_ms else "-" for k in ks) + " |")
        lines.append(f"| {r.name} drafter ms | " + " | ".join(
            f"{r.draft_ms[k]:.1f}" if k in r.draft_ms else "-" for k in ks) + " |")
        lines.append(f"| {r.name} (draft + verify) / decode step | " + " | ".join(
            f"{r.step_ratio(k):.2f}" if r.step_ratio(k) is not None else "-" for k in ks) + " |")
        if floors:
            dtype = "bf16" if "bf16" in r.name else "fp32"
            elems = r.weight_bytes // (2 if dtype == "bf16" else 4)
            lines.append(f"| {r.name} floor ms (weights read / FLOPs) | " + " | ".join(
                f"{floor_ms(r.weight_bytes, elems, k, floors, dtype):.1f}" for k in ks) + " |")
    return "\n".join(lines)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    names = [n.strip() for n in args.paths.split(",") if n.strip()]
    with tempfile.TemporaryDirectory() as tmp:
        work = args.work or Path(tmp)
        target_dir, drafter_dir = models(args.tiny, work)
        built: dict[str, Path] = {}

        def engine_dir_for(dtype: str) -> Path:
            if args.engine_dir is not None:
                return args.engine_dir
            if dtype not in built:
                from blockpilot.builder.engine_dir import BuildSpec, build_engine_dir

                out = work / f"engine-{dtype}"
                print(f"building {out} ...", file=sys.stderr)
                build_engine_dir(BuildSpec(target_dir, drafter_dir, out, tuple(range(2, args.k_max + 1)),
                                           max_seq_len=args.context + 4 * args.k_max, dtype=dtype))
                built[dtype] = out
            return built[dtype]

        results = []
        for name in names:
            backend = open_path(name, target_dir, drafter_dir, engine_dir_for, args.k_max, args.threads)
            verify_ms, draft_ms, one_row = time_backend(backend, range(1, args.k_max + 1), args.context, args.repeats)
            results.append(PathResult(name, verify_ms, draft_ms, weight_footprint(backend)[0], one_row))
            print(f"{name}: K=1 {verify_ms[1]:.1f} ms", file=sys.stderr, flush=True)
            del backend
    floors = None if args.no_floors else measure_floors()
    print(table(results, floors, args.k_max))
    for r in results:
        if r.one_row_ms is not None:
            print(f"\n{r.name}: plain decoding runs 2 rows ({r.verify_ms[1]:.1f} ms) so that it rounds like every "
                  f"block size; an unpadded 1-row step takes {r.one_row_ms:.1f} ms")
    if floors:
        print(f"\nfloors: streaming read {floors['bandwidth_gb_s']:.1f} GB/s; products "
              f"fp32 {floors['peak_gflop_s']['fp32']:.0f} GFLOP/s, bf16 {floors['peak_gflop_s']['bf16']:.0f} GFLOP/s; "
              f"threads {torch.get_num_threads()}, context {args.context}")
    if args.json:
        payload = {"context": args.context, "threads": torch.get_num_threads(), "floors": floors,
                   "machine": machine_description(),
                   "paths": [dataclasses.asdict(r) for r in results]}
        args.json.write_text(json.dumps(payload, indent=1))
    return 0


def machine_description() -> dict:
    return {"cpu": machine_class(), "cores": os.cpu_count(), "torch": torch.__version__}


if __name__ == "__main__":
    sys.exit(main())
