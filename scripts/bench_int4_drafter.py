"""The engine dir's 4-bit drafter copy against its fp32 drafter graph on onnxruntime, interleaved prompt by prompt.

For each prompt (the first N HumanEval problems and MT-Bench first turns from --offset on) it decodes plainly,
then speculatively at --block-size with `drafter.int4.onnx` and with `drafter.onnx` (the order alternates from
prompt to prompt), checks that all three outputs are the same tokens, and prints per system the wall time, its
ratio to plain decoding, the time inside drafter and target calls, and tau. T = 0, 128 new tokens, batch 1.

    python scripts/bench_int4_drafter.py --prompts 12 --offset 10 --block-size 4 [--engine-dir DIR] [--json F]
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from blockpilot.profiling.bench_scripts import add_common_args, open_runner, prompt_sets
from blockpilot.runtime.onnx_backend import make_session
from blockpilot.text import chat_prompt_ids


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--block-size", type=int, default=4)
    add_common_args(p, prompts=12)
    args = p.parse_args()
    runner = open_runner(args)
    backend = runner.backend
    if backend.manifest.ort_drafter is None:
        raise SystemExit(f"{args.engine_dir} has no 4-bit drafter copy; build it without --no-int4-drafter")
    sessions = {"int4": backend.drafter.session,
                "fp32": make_session(args.engine_dir / backend.manifest.drafter.onnx, args.threads)}
    tokenizer, sets, prompts = prompt_sets(args)
    spent = {"draft": 0.0, "verify": 0.0}
    for call in spent:
        def timed(*a, _inner=getattr(backend, call), _name=call, **kw):
            start = time.perf_counter()
            try:
                return _inner(*a, **kw)
            finally:
                spent[_name] += time.perf_counter() - start
        setattr(backend, call, timed)
    systems = ("plain", "int4", "fp32")
    totals = {s: {"time_s": 0.0, "draft_s": 0.0, "verify_s": 0.0, "tau": {n: [] for n in sets}} for s in systems}
    runner.generate([torch.tensor(chat_prompt_ids(tokenizer, prompts[0][1]))], max_new_tokens=8,
                    block_size=args.block_size)  # warm-up
    for i, (dataset, text) in enumerate(prompts):
        ids = torch.tensor(chat_prompt_ids(tokenizer, text))
        reference = None
        for system in systems if i % 2 == 0 else systems[::-1]:
            if system != "plain":
                backend.drafter.session = sessions[system]
            spent.update(draft=0.0, verify=0.0)
            start = time.perf_counter()
            out = runner.generate([ids], max_new_tokens=args.max_new_tokens, return_dict=True,
                                  block_size=1 if system == "plain" else args.block_size)
            total = totals[system]
            total["time_s"] += time.perf_counter() - start
            total["draft_s"] += spent["draft"]
            total["verify_s"] += spent["verify"]
            total["tau"][dataset].append(out["tau"][0])
            reference = out["output_ids"] if reference is None else reference
            if not torch.equal(out["output_ids"], reference):
                raise SystemExit(f"prompt {i}: {system} differs from the other systems' tokens (a bug)")
    plain = totals["plain"]["time_s"]
    for system, total in totals.items():
        taus = "  ".join(f"tau {n} {sum(v) / len(v):.3f}" for n, v in total["tau"].items())
        print(f"{system:5s} block {1 if system == 'plain' else args.block_size}: {total['time_s']:.1f} s "
              f"({plain / total['time_s']:.3f}x plain), drafter {total['draft_s']:.2f} s, target {total['verify_s']:.2f} s, "
              f"{taus}")
    print(f"every output equal: {len(prompts)} prompts x {len(systems)} systems")
    if args.json:
        args.json.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "totals": totals}, indent=1))


if __name__ == "__main__":
    main()
