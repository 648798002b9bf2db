"""Headroom of per-prompt block-size choice: fixed sizes (1 = plain decoding) vs the per-prompt oracle vs a
trained predictor, in tau and in the tokens/s proxy (tau / step cost of the dataset's step-cost table), by
temperature and prompt category.

    python scripts/predictor_analysis.py --dataset runs/predictor/labels-t0 --prompts runs/predictor/heldout.jsonl \
        [--dataset D2 --prompts P2 ...] [--predictor P.onnx ...] [--step-costs ENGINE_DIR|JSON] [--json out.json]

Categories come from the `source` field of the prompts each dataset was labelled on (the file named in its
`meta.json`, rows matched by id; T > 0 datasets name the target's draws), or of the `--prompts` files given. With `--predictor`, `auto`
is measured on the test split that `blockpilot train-predictor` held out (same seed and fractions), so
train on the same datasets in the same order; the oracle and fixed columns there are of the same rows.

`--test-prompts OUT.jsonl` writes the prompts of that test split (one line each, however many temperatures
they were labelled at; `--test-from labels-t0` keeps those of the named datasets only), a prompt file for
`blockpilot profile --dataset` that measures the predictor on requests it never fitted or stopped on:

    python scripts/predictor_analysis.py --dataset runs/predictor/labels-t0 ... --test-prompts heldout-test.jsonl \
        --test-from labels-t0
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from blockpilot.predictor.labels import load_label_dataset
from blockpilot.predictor.train import TrainSettings, assemble, prompt_groups, split_indices


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--dataset", type=Path, action="append", required=True)
    p.add_argument("--prompts", type=Path, action="append", default=[],
                   help="JSONL with the source of every prompt (repeatable; default: each dataset's own prompts file)")
    p.add_argument("--predictor", type=Path, action="append", default=[], help="trained .onnx (repeatable)")
    p.add_argument("--step-costs", type=Path, help="score with this table instead of the datasets' own")
    p.add_argument("--block-sizes", help="a subset of the candidates, e.g. 1,4,8 (datasets labelled at others)")
    p.add_argument("--val-fraction", type=float, default=0.15)
    p.add_argument("--test-fraction", type=float, default=0.15)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path)
    p.add_argument("--test-prompts", type=Path, help="write the test split's prompts here (JSONL for `profile`)")
    p.add_argument("--test-from", action="append", default=[],
                   help="with --test-prompts: only prompts of this dataset (its directory name; repeatable)")
    return p.parse_args(argv)


def summarise(tau: torch.Tensor, throughput: torch.Tensor, candidates, chosen: dict[str, torch.Tensor]) -> dict:
    """Mean tau and tok/s of every fixed size, the best fixed one, the oracle and each chosen policy."""
    out = {"rows": len(tau)}
    for name, values in (("tau", tau), ("tok_s", throughput)):
        fixed = values.mean(dim=0)
        best = int(fixed.argmax())
        out[name] = {"fixed": {str(c): float(v) for c, v in zip(candidates, fixed)},
                     "best_fixed": [candidates[best], float(fixed[best])],
                     "oracle": float(values.max(dim=1).values.mean()),
                     **{policy: float(values.gather(1, idx[:, None]).mean()) for policy, idx in chosen.items()}}
    out["oracle_labels"] = {str(c): int(n) for c, n in zip(candidates, throughput.argmax(dim=1).bincount(
        minlength=len(candidates)).tolist())}
    return out


def main(argv=None) -> int:
    args = parse_args(argv)
    datasets = [load_label_dataset(path) for path in args.dataset]
    if args.step_costs is not None:
        from blockpilot.predictor.labelling import read_step_costs

        table = read_step_costs(args.step_costs)
        datasets = [d.with_step_costs(table) for d in datasets]
    from blockpilot.assets.prompts import load_jsonl_prompts

    prompts = {}
    own = [Path(d.meta["prompts_file"]) for d in datasets if d.meta.get("prompts_file")]
    for path in args.prompts or [p for p in own if p.is_file()]:
        prompts.update({p.id: p for p in load_jsonl_prompts(path)})
    sources = {i: p.category for i, p in prompts.items()}
    if args.block_sizes:
        sizes = tuple(int(k) for k in args.block_sizes.split(","))
        datasets = [d.restricted(sizes) for d in datasets]
    data = assemble(datasets, TrainSettings(objective="throughput"))
    category = [sources.get(i, "?") for d in datasets for i in d.ids]
    temperature = data.temperature[:, 0].tolist()
    _, _, test = split_indices(len(data.labels), args.val_fraction, args.test_fraction, args.seed,
                               prompt_groups(data.features))
    if args.test_prompts:
        write_test_prompts(args.test_prompts, test, [(path.name, d) for path, d in zip(args.dataset, datasets)],
                           prompts, set(args.test_from))
    chosen = {}
    for path in args.predictor:
        from blockpilot.runtime.policy import OnnxBlockSizePolicy

        policy = OnnxBlockSizePolicy(path)
        if policy.candidates != data.candidates:
            raise SystemExit(f"{path} chooses among {policy.candidates}, the datasets have {data.candidates}")
        kind = policy.info.feature_kind
        features = torch.cat([d.rows[kind].float() for d in datasets])
        probs = torch.cat([policy.probabilities(features[i:i + 1], temperature[i]) for i in range(len(features))])
        choice = probs.argmax(dim=1)
        if 1 in data.candidates:  # as the runtime: a request at a temperature the predictor does not cover decodes plainly
            plain = torch.tensor([not policy.covers_temperature(t) for t in temperature])
            choice = torch.where(plain, data.candidates.index(1), choice)
        chosen[f"auto:{path.stem}"] = choice
    result = {"candidates": list(data.candidates), "groups": {}}
    tok_s = data.throughput  # tau per second of step
    for split_name, rows in (("all", torch.arange(len(data.labels))), ("test", test)):
        if split_name == "all":
            policies = {}
        else:
            policies = {k: v[rows] for k, v in chosen.items()}
        groups = {"pooled": rows}
        for t in sorted(set(temperature)):
            groups[f"T={t:g}"] = rows[torch.tensor([temperature[i] == t for i in rows.tolist()], dtype=torch.bool)]
            for c in sorted(set(category)):
                keep = [temperature[i] == t and category[i] == c for i in rows.tolist()]
                groups[f"T={t:g} {c}"] = rows[torch.tensor(keep, dtype=torch.bool)]
        for name, idx in groups.items():
            if len(idx):
                sub = {k: v[[rows.tolist().index(i) for i in idx.tolist()]] for k, v in policies.items()}
                result["groups"][f"{split_name} {name}"] = summarise(data.tau[idx], tok_s[idx], data.candidates, sub)
    print(render(result))
    if args.json:
        args.json.write_text(json.dumps(result, indent=1) + "\n")
    return 0


def write_test_prompts(out: Path, test: torch.Tensor, datasets, prompts: dict, only: set[str]) -> None:
    """Write the test rows' prompts (first occurrence of each text) as profile's JSONL, `dataset` naming
    the label dataset each came from; rows of datasets outside `only` (when given) are left out."""
    origin = [(name, i) for name, d in datasets for i in d.ids]
    lines, seen = [], set()
    for row in sorted(test.tolist()):
        name, prompt_id = origin[row]
        prompt = prompts.get(prompt_id)
        if (only and name not in only) or prompt is None or prompt.text in seen:
            continue
        seen.add(prompt.text)
        lines.append(json.dumps({"id": prompt.id, "prompt": prompt.text, "category": prompt.category,
                                 "dataset": name}, ensure_ascii=False))
    if not lines:
        raise SystemExit(f"no test-split prompts found{' in ' + ', '.join(sorted(only)) if only else ''}")
    out.write_text("\n".join(lines) + "\n", encoding="utf-8")
    print(f"wrote {len(lines)} test-split prompts to {out}")


def render(result: dict) -> str:
    cands = result["candidates"]
    policies = sorted({k for g in result["groups"].values() for k in g["tau"] if k.startswith("auto:")})
    head = ["group", "rows"] + [f"fixed {c}" for c in cands] + ["best fixed", "oracle", "oracle / best"] + policies
    lines = ["| " + " | ".join(head) + " |", "|---" * len(head) + "|"]
    for name, g in result["groups"].items():
        for metric in ("tau", "tok_s"):
            m = g[metric]
            cells = [f"{name} ({metric})", str(g["rows"])] + [f"{m['fixed'][str(c)]:.3f}" if metric == "tau" else
                                                               f"{m['fixed'][str(c)]:.1f}" for c in cands]
            fmt = "{:.3f}" if metric == "tau" else "{:.1f}"
            cells += [f"{m['best_fixed'][0]}: " + fmt.format(m["best_fixed"][1]), fmt.format(m["oracle"]),
                      f"{m['oracle'] / m['best_fixed'][1]:.3f}"]
            cells += [fmt.format(m[p]) if p in m else "-" for p in policies]
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
