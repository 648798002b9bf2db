"""Wall time of a short `blockpilot generate` on the embedded default, with and without what opening an engine
directory keeps in the user cache (the remembered file digests and the optimized onnxruntime copies).

"before" clears `cache_dir()/digests/` and sets BLOCKPILOT_ORT_CACHE=0, so every file is hashed and every graph
optimized and prepacked again, as each run did before they were kept; "after" is a run with both warm (an untimed
run first puts back the digests the clearing removed). Rounds alternate the two; medians are reported.

    python scripts/bench_startup.py --rounds 6 [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

from blockpilot.assets.packages import cache_dir
from blockpilot.runtime.ort_session import CACHE_ENV

COMMAND = [str(Path(sys.executable).with_name("blockpilot")), "generate", "--prompt", "hi", "--max-new-tokens", "4"]


def timed(env: dict) -> float:
    began = time.perf_counter()
    subprocess.run(COMMAND, env=env, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return time.perf_counter() - began


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    warm = dict(os.environ)
    warm.pop(CACHE_ENV, None)
    cold = {**warm, CACHE_ENV: "0"}
    subprocess.run(COMMAND, env=warm, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # builds all
    times: dict[str, list[float]] = {"before": [], "after": []}
    for _ in range(args.rounds):
        shutil.rmtree(cache_dir() / "digests", ignore_errors=True)
        times["before"].append(timed(cold))
        timed(warm)  # the optimized copies' digests, cleared above
        times["after"].append(timed(warm))
    result = {"command": " ".join(COMMAND[1:]), "rounds": args.rounds, "seconds": times,
              "median_s": {k: round(statistics.median(v), 2) for k, v in times.items()}}
    print(f"`{result['command']}`, medians of {args.rounds}: before {result['median_s']['before']} s, "
          f"after {result['median_s']['after']} s ({result['median_s']['before'] / result['median_s']['after']:.2f}x)")
    if args.json:
        args.json.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
