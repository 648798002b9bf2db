"""Drafter training throughput (anchored blocks per second) on this machine, one process.

Times `Trainer.train_step` on the real SmolLM2 target weights and the shipped drafter, with sequences
tokenized from the committed training answers (their true lengths) and random target taps (the step's
cost does not depend on their values). Prints one JSON line: wall-clock and
process CPU seconds per step (the second is less sensitive to other processes on a shared machine).

    OMP_NUM_THREADS=1 python scripts/bench_train_step.py --sequences 16 --anchors 32 --steps 6
"""

from __future__ import annotations

import argparse
import gzip
import json
import time
from pathlib import Path

import torch

from blockpilot.assets.smollm2 import smollm2_dir
from blockpilot.models.checkpoint import load_drafter, load_target
from blockpilot.text import load_tokenizer
from blockpilot.training.data import tokenize_rows
from blockpilot.training.trainer import TrainConfig, TrainData, Trainer

ROOT = Path(__file__).resolve().parents[1]
DRAFTER = ROOT / "src/blockpilot/assets/drafters/smollm2-135m-instruct-dflash-b8"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sequences", type=int, default=16)
    ap.add_argument("--anchors", type=int, default=32)
    ap.add_argument("--steps", type=int, default=6, help="timed steps (after 2 untimed)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--no-autocast", action="store_true")
    ap.add_argument("--max-len", type=int, default=512)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    target_dir = smollm2_dir()
    target, drafter = load_target(target_dir), load_drafter(DRAFTER)
    tokenizer = load_tokenizer(target_dir)
    with gzip.open(ROOT / "data/smollm2-answers-9831.jsonl.gz", "rt") as f:
        rows = [json.loads(line) for _, line in zip(range(256), f)]
    sequences = tokenize_rows(rows, tokenizer, args.max_len)
    width = len(drafter.config.target_layer_ids) * target.config.hidden_size
    gen = torch.Generator().manual_seed(0)
    items = [(s, torch.randn(len(s.ids), width, generator=gen).to(torch.bfloat16)) for s in sequences]
    config = TrainConfig(time_budget_s=1e9, max_steps=10_000, sequences_per_step=args.sequences,
                         anchors_per_sequence=args.anchors, gamma=4.0, autocast=not args.no_autocast)
    trainer = Trainer(drafter, target, TrainData(items, []), config, Path("/tmp/bench-train-step"))
    drafter.train()
    for _ in range(2):
        trainer.train_step()
    began, cpu_began = time.perf_counter(), time.process_time()
    for _ in range(args.steps):
        trainer.train_step()
    seconds = (time.perf_counter() - began) / args.steps
    cpu_seconds = (time.process_time() - cpu_began) / args.steps  # this process's CPU time: less sensitive to load
    blocks = args.sequences * args.anchors
    print(json.dumps({"s_per_step": round(seconds, 3), "blocks_per_s": round(blocks / seconds, 1),
                      "cpu_s_per_step": round(cpu_seconds, 3), "blocks_per_cpu_s": round(blocks / cpu_seconds, 1),
                      "sequences": args.sequences, "anchors": args.anchors, "block_size": drafter.config.block_size,
                      "threads": args.threads, "autocast": not args.no_autocast, "torch": torch.__version__}))


if __name__ == "__main__":
    main()
