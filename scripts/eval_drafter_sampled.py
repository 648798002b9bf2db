"""Acceptance length (tau) of a drafter at T > 0 on every prompt of HumanEval / MT-Bench, by exact replay.

Speculative sampling with a deterministic drafter accepts a draft while it equals the target's posterior
draw, so replaying the decode loop over one draw of the target's own continuation (plain sampling at the
same temperature) gives every step's acceptance length with exactly the distribution that decoding gives
it (`blockpilot.predictor.replay`). Per dataset this script

1. draws the target's answers at `--temperature` with the embedded engine dir's onnxruntime plain
   decoding, batched (cached in `--out`, resumable; seeds derived from `--seed` and the prompt),
2. replays every block size on them with `blockpilot label --replay-answers` (one label dataset per set),
3. writes `tau.json` and `tau.md`: mean tau per block size (per prompt, then over prompts) and per category.

    python scripts/eval_drafter_sampled.py --drafter DIR --datasets humaneval,mtbench --temperature 1 \
        --block-sizes 1,2,3,4,6,8,10,12,16 --max-new-tokens 128 --out runs/eval-t1

The prompts are evaluation prompts: the answers are for measuring, never for training.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--drafter", type=Path, help="DFlash drafter dir (default: the shipped drafter)")
    p.add_argument("--datasets", default="humaneval,mtbench")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--block-sizes", default="1,2,3,4,6,8,10,12,16")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--limit", type=int, help="first N prompts per dataset")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, required=True)
    return p.parse_args(argv)


def draw_answers(prompts, path: Path, temperature: float, max_new_tokens: int, seed: int) -> None:
    """The target's answers drawn at `temperature` (plain decoding on the embedded engine dir), into `path`."""
    from transformers import AutoTokenizer

    from blockpilot.builder.embedded import embedded_engine_dir
    from blockpilot.runtime.runner import Runner
    from blockpilot.runtime.sampling import SamplingParams
    from blockpilot.training.data import answer_with_runner

    engine_dir = embedded_engine_dir()
    runner = Runner.from_engine_dir(engine_dir, backend="onnxruntime")
    answer_with_runner(runner, AutoTokenizer.from_pretrained(engine_dir), [p.text for p in prompts],
                       max_new_tokens=max_new_tokens, batch_size=32, out_path=path,
                       sources=[p.category for p in prompts], sampling=SamplingParams(temperature), seed=seed)


def shipped_step_costs(path: Path) -> Path:
    """The step-cost table of the shipped predictor's labels, as a JSON file at `path` (it scores the
    label datasets' throughput columns; tau, what this script reports, does not depend on it)."""
    from blockpilot.assets import default_predictor_path
    from blockpilot.runtime.policy import OnnxBlockSizePolicy

    path.write_text(json.dumps(OnnxBlockSizePolicy(default_predictor_path()).step_costs.to_dict(), indent=1) + "\n")
    return path


def summarise(dataset, category_of: dict[str, str]) -> dict:
    """Mean tau per candidate over the dataset's rows, and per category (`category_of`: row id -> category)."""
    tau = dataset.rows["tau"].double()
    out = {"prompts": len(tau), "tau": {str(c): float(v) for c, v in zip(dataset.candidates, tau.mean(dim=0))}}
    by_category: dict[str, list[int]] = {}
    for i, row_id in enumerate(dataset.ids):
        by_category.setdefault(category_of.get(row_id, "?"), []).append(i)
    out["by_category"] = {c: {str(k): float(v) for k, v in zip(dataset.candidates, tau[rows].mean(dim=0))}
                          for c, rows in sorted(by_category.items())}
    return out


def main(argv=None) -> int:
    from blockpilot.assets import default_drafter_dir
    from blockpilot.assets.prompts import load_dataset, load_jsonl_prompts
    from blockpilot.assets.smollm2 import smollm2_dir
    from blockpilot.predictor.labelling import LabelJob, run_label_job
    from blockpilot.predictor.labels import load_label_dataset

    args = parse_args(argv)
    sizes = tuple(int(k) for k in args.block_sizes.split(","))
    args.out.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(1)  # one core for the replay; the draws above use the engine's own threads
    step_costs = shipped_step_costs(args.out / "step-costs.json")
    report = {"drafter": str(args.drafter or default_drafter_dir()), "temperature": args.temperature,
              "max_new_tokens": args.max_new_tokens, "datasets": {}}
    for name in args.datasets.split(","):
        prompts = load_dataset(name)[: args.limit]
        answers = args.out / f"answers-{name}-t{args.temperature:g}.jsonl"
        # the replay compares drafts up to max(sizes) - 1 tokens past the budget: draw them too
        draw_answers(prompts, answers, args.temperature, args.max_new_tokens + max(sizes) - 1, args.seed)
        labels = args.out / f"labels-{name}-t{args.temperature:g}"
        run_label_job(LabelJob(
            target=smollm2_dir(), drafter=args.drafter or default_drafter_dir(), prompts=None, replay_answers=answers,
            out=labels, candidates=sizes, temperature=args.temperature, max_new_tokens=args.max_new_tokens,
            seed=args.seed, clock="cpu", calibration_prompts=1, calibration_reps=1,
            step_costs=step_costs, note=f"{name} at T = {args.temperature:g}: drafter evaluation"))
        category_of = {p.id: p.category for p in load_jsonl_prompts(answers)}  # the label rows' ids
        report["datasets"][name] = summarise(load_label_dataset(labels), category_of)
    (args.out / "tau.json").write_text(json.dumps(report, indent=1) + "\n")
    lines = ["| set | prompts | " + " | ".join(str(k) for k in sizes) + " |", "|---" * (len(sizes) + 2) + "|"]
    for name, entry in report["datasets"].items():
        lines.append(f"| {name} | {entry['prompts']} | " + " | ".join(f"{entry['tau'][str(k)]:.2f}" for k in sizes) + " |")
        for category, taus in entry["by_category"].items():
            lines.append(f"| {name} {category} | | " + " | ".join(f"{taus[str(k)]:.2f}" for k in sizes) + " |")
    (args.out / "tau.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
