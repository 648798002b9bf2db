"""Build, check and time the TensorRT engines of the embedded default on a GPU machine: one command, one JSON.

    python scripts/check_trt.py                      # embedded default (SmolLM2-135M + shipped drafter)
    python scripts/check_trt.py --dry-run            # everything up to TensorRT, on a CPU machine
    python scripts/check_trt.py --engine-dir DIR     # a directory already built with `blockpilot build --trt`
    python scripts/check_trt.py --target DIR --drafter DIR --block-sizes 14-18 --max-seq-len 512

1. Build: `build_engine_dir` exports the graphs and (without --dry-run) builds both engines, one
   optimization profile per block size (plus prefill for the target).
2. Profiles: for every profile of both graphs and each of its min/opt/max shapes, the same random
   valid inputs (`blockpilot.builder.profiles`) run through onnxruntime (the reference, polygraphy's
   `OnnxrtRunner` on the ONNX graph the engine was built from) and, without
   --dry-run, through the tensorrt backend's own execution path (`TrtGraph.run`, caches bound as
   at decode time); every output (caches included) is compared. Each profile is timed at its opt
   shapes with CUDA events (median of --iterations runs after a warm-up).
3. Generation: greedy speculative decoding at every built block size must give exactly the tokens of
   plain decoding (block size 1) on the same backend (onnxruntime, and tensorrt without --dry-run);
   tokens/s and tau per block size; tensorrt vs onnxruntime tokens are compared as well (required to
   agree for fp32 builds only: fp16 near-ties may flip).

The report (`--json`, default OUT/check_trt.json) says `ok` and why not; exit status 0 when ok,
1 when a check fails, 2 for a usage mistake. Defaults fit a single GPU in well under 10 minutes.
bf16 builds have no onnxruntime reference: their engines are timed only.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

TOLERANCE = {"fp32": 1e-3, "fp16": 5e-2, "bf16": 1e-1}
PROMPT = "Write a Python function that checks whether a number is prime."


@dataclasses.dataclass(frozen=True)
class CheckSpec:
    """What to check (parsed from the command line)."""

    engine_dir: Path | None
    target: Path | None
    drafter: Path | None
    out: Path
    block_sizes: str
    max_seq_len: int
    dtype: str
    opset: int
    iterations: int
    max_new_tokens: int
    dry_run: bool
    json_path: Path | None


def parse_args(argv=None) -> CheckSpec:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--engine-dir", type=Path, help="existing engine directory (built with --trt unless --dry-run)")
    p.add_argument("--target", type=Path, help="target directory (default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--drafter", type=Path, help="drafter directory (default: the shipped drafter)")
    p.add_argument("--out", type=Path, default=Path("engine-trt-check"), help="engine directory to build")
    p.add_argument("--block-sizes", default="6-10")
    p.add_argument("--max-seq-len", type=int, default=512)
    p.add_argument("--dtype", choices=tuple(TOLERANCE), default="fp16")
    p.add_argument("--opset", type=int, choices=(18, 24), default=24)
    p.add_argument("--iterations", type=int, default=50, help="timed runs per profile")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--dry-run", action="store_true", help="stop before TensorRT (for a CPU machine)")
    p.add_argument("--json", type=Path, dest="json_path", help="report path (default: OUT/check_trt.json)")
    args = p.parse_args(argv)
    return CheckSpec(**vars(args))


def check_environment(spec: CheckSpec) -> None:
    """Raise `UserError` when the machine cannot run what `spec` asks for."""
    from blockpilot.errors import UserError

    if (spec.target is None) != (spec.drafter is None):
        raise UserError("pass both --target and --drafter, or neither for the embedded default")
    if spec.engine_dir is not None and spec.target is not None:
        raise UserError("pass --engine-dir or --target/--drafter, not both")
    if spec.dry_run:
        return
    import importlib.util

    import torch

    missing = [m for m in ("tensorrt", "polygraphy") if importlib.util.find_spec(m) is None]
    if missing or not torch.cuda.is_available():
        lacking = f"{' and '.join(missing)} not installed" if missing else "no CUDA GPU"
        raise UserError(f"the TensorRT checks need TensorRT, polygraphy and a CUDA GPU ({lacking}); "
                        "use --dry-run on this machine")


def ensure_engine_dir(spec: CheckSpec, log) -> Path:
    """The engine directory to check: `--engine-dir`, or one built now into `--out`."""
    if spec.engine_dir is not None:
        return spec.engine_dir
    from blockpilot.builder.engine_dir import BuildSpec, build_engine_dir
    from blockpilot.commands.build import parse_block_sizes

    target, drafter = spec.target, spec.drafter
    if target is None:
        from blockpilot.assets import default_drafter_dir
        from blockpilot.assets.smollm2 import smollm2_dir

        target, drafter = smollm2_dir(), default_drafter_dir()
    build_engine_dir(BuildSpec(target, drafter, spec.out, parse_block_sizes(spec.block_sizes), spec.max_seq_len,
                               dtype=spec.dtype, trt=not spec.dry_run, opset=spec.opset), log=log)
    return spec.out


# ---------------------------------------------------------------- per-profile comparison and timing


def profile_feeds(manifest, name: str, profile, vocab: int, rng) -> dict[str, dict]:
    """Valid inputs at the min, opt and max shapes of `profile` (fp32 numbers for bf16 builds)."""
    from blockpilot.builder.profiles import SHAPE_CHOICES, drafter_feed, profile_shapes, target_feed

    entry = getattr(manifest, name)
    dtype = manifest.dtype if manifest.dtype != "bf16" else "fp32"
    feeds = {}
    for choice in SHAPE_CHOICES:
        shapes = profile_shapes(profile, choice)
        if name == "target":
            feeds[choice] = target_feed(shapes, entry.past_names, vocab, dtype, rng, prefill=profile.block_size is None)
        else:
            feeds[choice] = drafter_feed(shapes, entry.past_names, vocab, dtype, rng)
    return feeds


def onnxruntime_outputs(runner, feed: dict) -> dict[str, np.ndarray]:
    """Every output of the reference graph (polygraphy `OnnxrtRunner`, already activated)."""
    return dict(runner.infer(feed))


class TrtProfileRunner:
    """One engine through the tensorrt backend's `TrtGraph`, fed from numpy, outputs back as numpy."""

    def __init__(self, engine_path: Path, entry, manifest):
        import torch

        from blockpilot.runtime.trt_backend import TORCH_DTYPES, TrtGraph, load_engine

        self.torch, self.entry = torch, entry
        self.graph = TrtGraph(load_engine(engine_path), entry)
        self.float_type = TORCH_DTYPES[manifest.dtype]
        self.in_place = manifest.opset >= 24

    def _tensor(self, array: np.ndarray):
        tensor = self.torch.from_numpy(np.ascontiguousarray(array)).cuda()
        return tensor.to(self.float_type) if tensor.is_floating_point() else tensor

    def run(self, index: int, feed: dict) -> dict[str, np.ndarray]:
        from blockpilot.runtime.trt_backend import CacheBuffers

        past = [self._tensor(feed[n]) for n in self.entry.past_names]
        caches = CacheBuffers(past, None if self.in_place else [self.torch.empty_like(t) for t in past])
        inputs = {k: self._tensor(v) for k, v in feed.items() if k not in self.entry.past_names}
        outputs = self.graph.run(index, inputs, caches)
        self.torch.cuda.synchronize()
        outputs.update(zip(self.entry.present_names, caches.current))
        return {k: v.float().cpu().numpy() for k, v in outputs.items()}

    def time_ms(self, index: int, feed: dict, iterations: int) -> float:
        """Median CUDA-event time of one execution at profile `index` (inputs already on the GPU)."""
        from blockpilot.runtime.trt_backend import CacheBuffers

        past = [self._tensor(feed[n]) for n in self.entry.past_names]
        inputs = {k: self._tensor(v) for k, v in feed.items() if k not in self.entry.past_names}
        times = []
        for i in range(iterations + 3):
            caches = CacheBuffers(list(past), None if self.in_place else [self.torch.empty_like(t) for t in past])
            start, end = self.torch.cuda.Event(enable_timing=True), self.torch.cuda.Event(enable_timing=True)
            start.record()
            self.graph.run(index, inputs, caches)
            end.record()
            end.synchronize()
            if i >= 3:  # warm-up runs are not counted
                times.append(start.elapsed_time(end))
        return statistics.median(times)


def compare_outputs(reference: dict, ours: dict, tolerance: float, exact_ids: bool) -> tuple[dict, list[str]]:
    """Max abs difference per output, and the problems: float outputs off by more than `tolerance`
    times their scale, integer outputs (token ids) that differ when `exact_ids`."""
    diffs, problems = {}, []
    for name, ref in reference.items():
        got = ours[name]
        if ref.dtype.kind == "f":
            diffs[name] = float(np.max(np.abs(ref.astype(np.float32) - got))) if ref.size else 0.0
            scale = max(1.0, float(np.max(np.abs(ref))) if ref.size else 1.0)
            if not diffs[name] <= tolerance * scale:
                problems.append(f"{name} off by {diffs[name]:.3g}")
        else:
            diffs[name] = int(np.sum(ref != got.astype(ref.dtype)))
            if exact_ids and diffs[name]:
                problems.append(f"{name}: {diffs[name]} ids differ")
    return diffs, problems


def check_profile(index, profile, feeds, reference_runner, trt_runner, dtype: str, iterations: int) -> dict:
    """One profile: onnxruntime reference at its min/opt/max shapes; TensorRT compared and timed when present."""
    row = {"index": index, "name": profile.name, "block_size": profile.block_size,
           "shapes": {c: {k: list(np.shape(v)) for k, v in f.items()} for c, f in feeds.items()},
           "max_abs_diff": {}, "problems": [], "matches": None, "trt_ms_opt": None}
    for choice, feed in feeds.items() if reference_runner is not None else ():
        reference = onnxruntime_outputs(reference_runner, feed)
        if not all(np.isfinite(v).all() for v in reference.values() if v.dtype.kind == "f"):
            row["problems"].append(f"onnxruntime gave non-finite outputs at the {choice} shapes")
        if trt_runner is not None:
            diffs, problems = compare_outputs(reference, trt_runner.run(index, feed), TOLERANCE[dtype], dtype == "fp32")
            row["max_abs_diff"][choice] = diffs
            row["problems"] += [f"{choice}: {p}" for p in problems]
        row["matches"] = not row["problems"]
    if trt_runner is not None:
        row["trt_ms_opt"] = trt_runner.time_ms(index, feeds["opt"], iterations)
    return row


def check_profiles(engine_dir: Path, manifest, spec: CheckSpec, vocab: int, log) -> list[dict]:
    from polygraphy.backend.onnxrt import OnnxrtRunner

    from blockpilot.runtime.onnx_backend import make_session  # on the package's shared thread pool

    rows = []
    for name in ("target", "drafter"):
        entry, rng = getattr(manifest, name), np.random.default_rng(0)
        reference = OnnxrtRunner(make_session(engine_dir / entry.onnx))
        trt_runner = None if spec.dry_run else TrtProfileRunner(engine_dir / entry.engine, entry, manifest)
        with reference:
            for index, profile in enumerate(entry.profiles):
                feeds = profile_feeds(manifest, name, profile, vocab, rng)
                row = {"graph": name, **check_profile(index, profile, feeds, reference if manifest.dtype != "bf16"
                                                      else None, trt_runner, manifest.dtype, spec.iterations)}
                timing = f"{row['trt_ms_opt']:8.3f} ms" if row["trt_ms_opt"] is not None else "   (no TensorRT)"
                log(f"{name:8s} profile {index:2d} {profile.name:10s} {timing}  matches: {row['matches']}")
                rows.append(row)
    return rows


# ---------------------------------------------------------------- generation


def prompt_ids(engine_dir: Path, manifest, vocab: int, max_new_tokens: int):
    """The chat-formatted default prompt with the directory's tokenizer (else 32 seeded random ids),
    cut to its last tokens where the cache capacity needs it."""
    import torch

    from blockpilot.errors import UserError

    room = manifest.max_seq_len - max_new_tokens - max(manifest.block_sizes) - 1
    if room < 1:
        raise UserError(f"--max-new-tokens {max_new_tokens} leaves no room for a prompt in the capacity of "
                        f"{manifest.max_seq_len}; use at most {manifest.max_seq_len - max(manifest.block_sizes) - 2}")
    ids = torch.randint(0, vocab, (32,), generator=torch.Generator().manual_seed(0))
    if manifest.tokenizer_files:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(str(engine_dir))
        if tokenizer.chat_template:
            ids = tokenizer.apply_chat_template([{"role": "user", "content": PROMPT}], add_generation_prompt=True,
                                                tokenize=True, return_dict=False)
        else:
            ids = tokenizer(PROMPT)["input_ids"]
    return torch.as_tensor(ids)[-room:]


def generate_timed(runner, prompt, block_size: int, max_new_tokens: int) -> tuple[list[int], float, float]:
    """(tokens, tokens/s, tau) of one greedy request after a short warm-up."""
    import torch

    runner.generate([prompt], max_new_tokens=4, block_size=block_size, end_id=-1)
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    sync()
    started = time.perf_counter()
    out = runner.generate([prompt], max_new_tokens=max_new_tokens, block_size=block_size, end_id=-1,
                          return_dict=True)
    sync()
    seconds = time.perf_counter() - started
    tokens = out["output_ids"][0, 0].tolist()[len(prompt):]
    return tokens, max_new_tokens / seconds, float(out["tau"][0])


def first_difference(a: list[int], b: list[int]) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None if len(a) == len(b) else min(len(a), len(b)))


def check_generation(engine_dir: Path, manifest, spec: CheckSpec, vocab: int, log) -> tuple[list[dict], dict]:
    """Greedy equality of speculative and plain decoding per backend; tensorrt vs onnxruntime tokens."""
    from blockpilot.runtime.runner import Runner

    backends = (["onnxruntime"] if manifest.dtype != "bf16" else []) + ([] if spec.dry_run else ["tensorrt"])
    prompt = prompt_ids(engine_dir, manifest, vocab, spec.max_new_tokens)
    rows, plain = [], {}
    for backend in backends:
        runner = Runner.from_dir(engine_dir, backend=backend)
        for block_size in (1, *manifest.block_sizes):
            tokens, rate, tau = generate_timed(runner, prompt, block_size, spec.max_new_tokens)
            plain.setdefault(backend, tokens)
            diff = first_difference(plain[backend], tokens)
            rows.append({"backend": backend, "block_size": block_size, "tokens_per_s": rate, "tau": tau,
                         "equals_plain": diff is None, "first_difference": diff})
            log(f"generate {backend:12s} block {block_size:2d} {rate:8.1f} tok/s  tau {tau:5.2f}  "
                f"{'= plain' if diff is None else f'DIFFERS from plain at token {diff}'}")
    cross = {}
    if {"tensorrt", "onnxruntime"} <= set(plain):
        diff = first_difference(plain["onnxruntime"], plain["tensorrt"])
        cross = {"equal": diff is None, "first_difference": diff, "required": manifest.dtype == "fp32"}
    return rows, cross


# ---------------------------------------------------------------- report


def run_checks(spec: CheckSpec, log) -> dict:
    import torch

    from blockpilot.builder.manifest import read_manifest

    started = time.perf_counter()
    engine_dir = ensure_engine_dir(spec, log)
    built = time.perf_counter()
    manifest = read_manifest(engine_dir)
    if not spec.dry_run and not manifest.has_engines:
        from blockpilot.errors import UserError

        raise UserError(f"{engine_dir} has no TensorRT engines; build it with `blockpilot build --trt`")
    vocab = json.loads((engine_dir / manifest.target_dir / "config.json").read_text())["vocab_size"]
    profiles = check_profiles(engine_dir, manifest, spec, vocab, log)
    checked = time.perf_counter()
    generation, cross = check_generation(engine_dir, manifest, spec, vocab, log)
    done = time.perf_counter()
    failures = [f"{r['graph']} profile {r['name']}: {'; '.join(r['problems'])}" for r in profiles if r["problems"]]
    failures += [f"{r['backend']} block {r['block_size']} differs from plain decoding at token {r['first_difference']}"
                 for r in generation if not r["equals_plain"]]
    if cross and cross["required"] and not cross["equal"]:
        failures.append(f"tensorrt and onnxruntime tokens differ at token {cross['first_difference']}")
    return {
        "ok": not failures, "failures": failures, "dry_run": spec.dry_run, "engine_dir": str(engine_dir),
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "dtype": manifest.dtype, "opset": manifest.opset, "max_seq_len": manifest.max_seq_len,
        "block_sizes": list(manifest.block_sizes), "versions": manifest.versions,
        "seconds": {"build": built - started, "profiles": checked - built, "generation": done - checked,
                    "total": done - started},
        "profiles": profiles, "generation": generation, "tensorrt_vs_onnxruntime": cross,
    }


def main(argv=None) -> int:
    from blockpilot.errors import UserError

    spec = parse_args(argv)
    log = lambda line: print(line, file=sys.stderr, flush=True)  # noqa: E731
    try:
        check_environment(spec)
        report = run_checks(spec, log)
    except UserError as exc:
        print(f"check_trt: {exc}", file=sys.stderr)
        return 2
    path = spec.json_path or Path(report["engine_dir"]) / "check_trt.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=1) + "\n")
    print(f"{'ok' if report['ok'] else 'FAILED: ' + '; '.join(report['failures'])} "
          f"({report['seconds']['total']:.0f} s, report {path})")
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
