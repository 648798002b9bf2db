"""What a block-size predictor would have done in a finished `blockpilot profile` run, without decoding again.

For every request and temperature of the run, the predictor chooses from the prompt's prefill alone (one
prefill per request, no decoding); the request's measured time at that block size is then looked up in the
run's own fixed-size systems (`bp-b<k>`; block size 1 is the run's `ar`, the plain decoding the runtime
uses when a predictor says 1). Choices the run did not measure are counted and left out of the totals.
This reuses one run's measurements for several predictors: an estimate for choosing between them (each
request's time at a size is the same measurement whichever predictor picks it), never a substitute for
profiling the one that ships.

    python scripts/choices_on_profile.py --run docs/benchmarks/smollm2-cpu-intel-s14/results.json \\
        --predictor src/blockpilot/assets/predictors/smollm2-135m-instruct-dflash-b8.onnx \\
        [--predictor runs/predictor/new.onnx ...] [--engine-dir ENGINE_DIR] [--json out.json]

Datasets are re-read from the run's own command (`--dataset` values, paths relative to the repository).
Output: pooled tokens/s (prefill included, as `profile` reports) per dataset, temperature and predictor,
beside the run's fixed sizes, its fastest plain decoding and the per-request oracle over the measured sizes
(`profile`'s own `--oracle-by time`: lowest decode time per token).
"""

from __future__ import annotations

import argparse
import collections
import json
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--run", type=Path, required=True, help="results.json of a `blockpilot profile` run")
    p.add_argument("--predictor", type=Path, action="append", required=True, help="predictor .onnx (repeatable)")
    p.add_argument("--engine-dir", type=Path, help="engine dir to prefill on (default: the embedded one)")
    p.add_argument("--json", type=Path, help="write the table as JSON too")
    return p.parse_args(argv)


def command_values(run: dict, flag: str) -> list[str]:
    """The values given to `flag` in the profile command that wrote `run` (in order; empty if absent)."""
    command = run["command"]
    return [command[i + 1] for i, arg in enumerate(command[:-1]) if arg == flag]


def choose(engine_dir: Path, predictor: Path, requests, temperatures) -> dict:
    """{(dataset, prompt id, temperature): block size} the predictor picks from each prefill."""
    from blockpilot.runtime.runner import Runner

    runner = Runner.from_dir(engine_dir, predictor=predictor)
    chosen = {}
    for request in requests:
        for t in temperatures:
            out = runner.generate([torch.tensor(request.input_ids)], max_new_tokens=1, temperature=t,
                                  block_size="auto", return_dict=True)
            chosen[(request.dataset, request.id, t)] = int(out["block_sizes"][0])
    return chosen


def pooled(rows) -> float:
    rows = list(rows)
    return sum(r["output_tokens"] for r in rows) / sum(r["total_s"] for r in rows) if rows else float("nan")


def main() -> None:
    args = parse_args()
    from blockpilot.builder.embedded import embedded_engine_dir
    from blockpilot.profiling.measure import oracle_rows
    from blockpilot.profiling.workload import load_requests, load_tokenizer

    run = json.loads(args.run.read_text())
    engine_dir = args.engine_dir or embedded_engine_dir()
    temperatures = run["workload"]["temperatures"]
    datasets = [str(ROOT / d) if (ROOT / d).exists() else d for d in command_values(run, "--dataset")]
    limit = int(command_values(run, "--limit")[-1]) if command_values(run, "--limit") else None
    requests = load_requests(datasets, load_tokenizer(engine_dir), limit)
    sets = list(run["workload"]["datasets"])
    measured = {(r["system"], r["dataset"], r["prompt_id"], r["temperature"]): r for r in run["rows"]}
    fixed = sorted({int(s[4:]) for s in run["systems"] if s.startswith("bp-b")})
    sizes = {1: "ar", **{k: f"bp-b{k}" for k in fixed}}
    oracle = {(r["dataset"], r["prompt_id"], r["temperature"]): r  # profile's oracle by time over the measured sizes
              for r in oracle_rows(run["rows"], list(sizes.values()), by="time")}
    choices = {str(p): choose(engine_dir, p, requests, temperatures) for p in args.predictor}

    table = []
    for t in temperatures:
        for name, subset in [("pooled", requests), *[(d, [r for r in requests if r.dataset == d]) for d in sets]]:
            keys = [(r.dataset, r.id, t) for r in subset]
            entry = {"temperature": t, "set": name, "requests": len(keys)}
            for system in run["systems"]:
                entry[system] = pooled(measured[(system, *k)] for k in keys)
            entry["oracle"] = pooled(oracle[k] for k in keys)
            for p, chosen in choices.items():
                picked = [(k, chosen[k]) for k in keys]
                entry[p] = pooled(measured[(sizes[b], *k)] for k, b in picked if b in sizes)
                for k in fixed:  # the fixed sizes on the same requests (all of them unless some were unmeasured)
                    entry[f"{p}:b{k}"] = pooled(measured[(f"bp-b{k}", *key)] for key, b in picked if b in sizes)
                entry[p + ":unmeasured"] = sum(b not in sizes for _, b in picked)
                entry[p + ":sizes"] = dict(sorted(collections.Counter(b for _, b in picked).items()))
            table.append(entry)
    for entry in table:
        best = max(fixed, key=lambda k: entry[f"bp-b{k}"])
        plain = max(entry.get("ar-1row", 0.0), entry["ar"])
        print(f"T={entry['temperature']} {entry['set']} ({entry['requests']}): plain {plain:.1f}, "
              + ", ".join(f"b{k} {entry[f'bp-b{k}']:.1f}" for k in fixed)
              + (f", auto (run) {entry['bp-auto']:.1f}" if "bp-auto" in entry else "")
              + f", oracle {entry['oracle']:.1f}")
        for p in choices:
            same = entry[f"{p}:b{best}"]  # fixed `best` on the requests whose choice was measured
            print(f"    {p}: {entry[p]:.1f} = {entry[p] / same:.3f}x fixed {best}, "
                  f"{entry[p] / plain:.3f}x plain; sizes {entry[p + ':sizes']}"
                  + (f"; {entry[p + ':unmeasured']} unmeasured, left out (fixed {best} there: {same:.1f})"
                     if entry[p + ":unmeasured"] else ""))
    if args.json:
        args.json.write_text(json.dumps(table, indent=1) + "\n")


if __name__ == "__main__":
    main()
