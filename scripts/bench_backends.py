"""Tokens/s of the onnxruntime vs the torch backend on SmolLM2-135M, autoregressive and speculative.

    python scripts/bench_backends.py [--engine-dir DIR] [--drafter DIR] [--threads 1] [--prompts 4]

Builds an fp32 engine directory for SmolLM2 (unless --engine-dir is given) with the shipped drafter
when it is installed, else --drafter, else a randomly initialised drafter of the shipped shape
(3 layers, block size 16, mask token 16; speculation with it is measured for cost, its acceptance
is near 1). Both backends open the same directory and decode the same prompts (--dataset) greedily
(chat template) at block size 1 (autoregressive) and --block-size (speculative). Reported per
backend and mode: decode tokens/s by wall clock, and by this process's CPU time (robust when the
machine is shared: both backends use --threads threads), prefill excluded and included, tau, and
whether the tokens equal the torch backend's.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--engine-dir", type=Path)
    p.add_argument("--drafter", type=Path)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--max-seq-len", type=int, default=512)
    p.add_argument("--dataset", default="mtbench", help="prompt set: mtbench, humaneval, or a JSONL path")
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--work", type=Path, help="where to build the engine directory (default: a temp dir)")
    p.add_argument("--json", type=Path, help="also write the results here")
    return p.parse_args(argv)


def pick_drafter(args, target_dir: Path, work: Path) -> tuple[Path, str]:
    from blockpilot.assets import default_drafter_dir
    from blockpilot.errors import UserError

    if args.drafter is not None:
        return args.drafter, f"given drafter {args.drafter}"
    try:
        return default_drafter_dir(), "shipped drafter"
    except UserError:
        pass
    import dataclasses

    import torch

    from blockpilot.models.checkpoint import load_target, save_drafter
    from blockpilot.models.config import DrafterConfig, default_target_layer_ids
    from blockpilot.models.dflash import DFlashDrafter

    target = load_target(target_dir, max_positions=8).config
    layers = dataclasses.replace(target, family="qwen3", qk_norm=True, num_hidden_layers=3, tie_word_embeddings=False)
    config = DrafterConfig(layers, args.block_size, 16, default_target_layer_ids(target.num_hidden_layers, 5),
                           target.num_hidden_layers)
    torch.manual_seed(0)
    return save_drafter(DFlashDrafter(config), work / "random-drafter"), "random drafter (3 layers, DrafterConfig)"


def prompts(args, engine_dir: Path) -> list:
    from transformers import AutoTokenizer

    from blockpilot.assets.prompts import load_dataset

    tokenizer = AutoTokenizer.from_pretrained(engine_dir)
    texts = [p.text for p in load_dataset(args.dataset)[: args.prompts]]
    return [tokenizer.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True,
                                          tokenize=True, return_dict=False) for t in texts]


def measure(runner, prompt_ids: list[list[int]], block_size: int, max_new_tokens: int) -> dict:
    import torch

    runner.generate([torch.tensor(prompt_ids[0])], max_new_tokens=8, block_size=block_size, end_id=-1)  # warm-up
    tokens, decode_s, total_s, cpu_s, taus, outputs = 0, 0.0, 0.0, 0.0, [], []
    for ids in prompt_ids:
        cpu0 = time.process_time()
        result = runner.generate([torch.tensor(ids)], max_new_tokens=max_new_tokens, block_size=block_size,
                                 end_id=-1, return_dict=True)
        cpu_s += time.process_time() - cpu0
        timing = result["timings"][0]
        decode_s += timing["draft_s"] + timing["verify_s"]
        total_s += timing["prefill_s"] + timing["draft_s"] + timing["verify_s"]
        tokens += max_new_tokens
        taus.append(result["tau"][0])
        outputs.append(result["output_ids"][0, 0].tolist())
    return {"decode_tok_s": tokens / decode_s, "total_tok_s": tokens / total_s, "cpu_tok_s": tokens / cpu_s,
            "tau": sum(taus) / len(taus), "outputs": outputs}


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch

    from blockpilot.assets.smollm2 import smollm2_dir
    from blockpilot.builder.engine_dir import BuildSpec, build_engine_dir
    from blockpilot.runtime.engine_dir import open_engine_dir
    from blockpilot.runtime.runner import Runner

    torch.set_num_threads(args.threads)
    work = args.work or Path(tempfile.mkdtemp(prefix="bench-backends-"))
    work.mkdir(parents=True, exist_ok=True)
    engine_dir = args.engine_dir
    if engine_dir is not None:
        from blockpilot.builder.manifest import read_manifest

        drafter_note = "drafter built from " + read_manifest(engine_dir, verify_files=False).sources.get("drafter", "?")
    if engine_dir is None:
        drafter, drafter_note = pick_drafter(args, smollm2_dir(), work)
        engine_dir = work / "engine"
        build_engine_dir(BuildSpec(smollm2_dir(), drafter, engine_dir, (args.block_size,), args.max_seq_len),
                         log=lambda line: print(line, file=sys.stderr, flush=True))
    ids = prompts(args, engine_dir)
    rows = []
    for backend in ("torch", "onnxruntime"):
        opened = open_engine_dir(engine_dir, backend=backend, threads=args.threads)
        runner = Runner(opened.backend, default_block_size=opened.default_block_size)
        for mode, block_size in (("autoregressive", 1), ("speculative", args.block_size)):
            rows.append({"backend": backend, "mode": mode, "block_size": block_size,
                         **measure(runner, ids, block_size, args.max_new_tokens)})
    report(rows, drafter_note, args)
    if args.json:
        args.json.write_text(json.dumps({"drafter": drafter_note, "rows": rows}, indent=2))
    return 0


def report(rows: list[dict], drafter_note: str, args) -> None:
    reference = {r["mode"]: r["outputs"] for r in rows if r["backend"] == "torch"}
    print(f"SmolLM2-135M fp32, {args.prompts} {args.dataset} prompts x {args.max_new_tokens} new tokens, greedy, "
          f"{args.threads} thread(s); speculative drafter: {drafter_note}")
    print(f"{'backend':12s} {'mode':15s} {'K':>3s} {'decode tok/s':>12s} {'incl. prefill':>13s} "
          f"{'CPU-time tok/s':>14s} {'tau':>5s}  tokens == torch")
    for r in rows:
        same = r["outputs"] == reference[r["mode"]]
        print(f"{r['backend']:12s} {r['mode']:15s} {r['block_size']:3d} {r['decode_tok_s']:12.1f} "
              f"{r['total_tok_s']:13.1f} {r['cpu_tok_s']:14.1f} {r['tau']:5.2f}  {same}")


if __name__ == "__main__":
    sys.exit(main())
