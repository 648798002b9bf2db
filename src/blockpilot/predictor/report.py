"""The predictor's report: how its choices compare with every fixed block size and with the oracle.

Per split (validation and test), from the labelled tau and step times of each row:
    accuracy        predicted class == oracle class under the training objective
    confusion       rows: oracle class, columns: predicted class (candidate order)
    tau             mean tau of `auto` (the predictor's choice), of every fixed candidate, of the
                    per-prompt tau oracle, and the regret oracle - auto
    throughput      the same for the proxy tau / mean step seconds (tokens per second of decoding)
    thresholds      tau and throughput of auto falling back to B_train under each threshold
    by_temperature  tau and throughput of auto, the best fixed candidate and the oracle among the
                    rows labelled at each temperature (when the split holds more than one)

Written next to the ONNX as `<name>.report.json` and `<name>.report.md`.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from pathlib import Path

import torch

from blockpilot.runtime.policy import select_block_size

THRESHOLDS = (0.0, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9)


def evaluate_choices(chosen: torch.Tensor, values: torch.Tensor, candidates: tuple[int, ...]) -> dict:
    """Mean of `values` `(N, K)` for the chosen classes `(N,)`, each fixed class, and the per-row best.

    Returns:
        {"auto", "fixed": {size: mean}, "best_fixed", "oracle", "regret"} as floats.
    """
    values = values.double()
    auto = float(values.gather(1, chosen[:, None]).mean())
    fixed = {str(c): float(v) for c, v in zip(candidates, values.mean(dim=0))}
    oracle = float(values.max(dim=1).values.mean())
    return {"auto": auto, "fixed": fixed, "best_fixed": max(fixed.values()), "oracle": oracle,
            "regret": oracle - auto}


def evaluate_split(probabilities: torch.Tensor, labels: torch.Tensor, tau: torch.Tensor, throughput: torch.Tensor,
                   candidates: tuple[int, ...], b_train: int) -> dict:
    """Accuracy, confusion matrix, tau and throughput of the predictor on one split (see module docstring)."""
    k = len(candidates)
    predicted = probabilities.argmax(dim=1)
    confusion = torch.zeros(k, k, dtype=torch.int64)
    confusion.index_put_((labels, predicted), torch.ones_like(labels), accumulate=True)
    result = {
        "rows": len(labels), "accuracy": float((predicted == labels).double().mean()),
        "confusion": confusion.tolist(), "label_counts": labels.bincount(minlength=k).tolist(),
        "tau": evaluate_choices(predicted, tau, candidates),
        "throughput": evaluate_choices(predicted, throughput, candidates),
    }
    if b_train in candidates:
        result["thresholds"] = _threshold_sweep(probabilities, tau, throughput, candidates, b_train)
    return result


def _threshold_sweep(probabilities, tau, throughput, candidates, b_train) -> list[dict]:
    cands = torch.tensor(candidates)
    rows = []
    for threshold in THRESHOLDS:
        sizes, _ = select_block_size(probabilities, cands, b_train, threshold)
        chosen = (sizes[:, None] == cands[None, :]).double().argmax(dim=1)  # (N,) class of each chosen size
        unsure = probabilities.max(dim=1).values < threshold
        rows.append({"threshold": threshold, "fallback_share": float(unsure.double().mean()),
                     "tau": float(tau.double().gather(1, chosen[:, None]).mean()),
                     "throughput": float(throughput.double().gather(1, chosen[:, None]).mean())})
    return rows


def build_report(data, splits: dict[str, torch.Tensor], predict: Callable[[torch.Tensor], torch.Tensor],
                 settings, history: dict, parity: float, metadata: dict[str, str]) -> dict:
    """The report of a trained predictor (a JSON-able dict).

    Args:
        data: the `TrainingData` it was trained on.
        splits: "train", "val", "test" row indices.
        predict: row indices -> `(n, K)` probabilities.
        settings: its `TrainSettings`.
        history: `fit`'s summary; parity: torch vs onnxruntime max abs difference; metadata: its ONNX metadata.
    """
    evaluated = {}
    for name, rows in splits.items():
        if name == "train" or not len(rows):
            continue
        probabilities = predict(rows)
        evaluated[name] = evaluate_split(probabilities, data.labels[rows], data.tau[rows], data.throughput[rows],
                                         data.candidates, data.b_train)
        temperatures = data.temperature[rows, 0]
        values = temperatures.unique()
        if len(values) > 1:
            chosen, tau, throughput = probabilities.argmax(dim=1), data.tau[rows], data.throughput[rows]
            evaluated[name]["by_temperature"] = {
                f"{float(t):g}": {"rows": int(at.sum()),
                                  "tau": evaluate_choices(chosen[at], tau[at], data.candidates),
                                  "throughput": evaluate_choices(chosen[at], throughput[at], data.candidates)}
                for t in values for at in [temperatures == t]}
    return {
        "settings": dataclasses.asdict(settings), "candidates": list(data.candidates), "b_train": data.b_train,
        "split_rows": {name: len(rows) for name, rows in splits.items()},
        "label_counts_all": data.labels.bincount(minlength=len(data.candidates)).tolist(),
        "history": history, "onnx_parity_max_abs_diff": parity, "metadata": metadata,
        "evaluated_on": "test" if "test" in evaluated else "val", "splits": evaluated,
    }


def report_paths(onnx_path: Path) -> tuple[Path, Path]:
    """(`<stem>.report.json`, `<stem>.report.md`) next to `onnx_path`."""
    onnx_path = Path(onnx_path)
    stem = onnx_path.with_suffix("")
    return stem.with_name(stem.name + ".report.json"), stem.with_name(stem.name + ".report.md")


def write_report(report: dict, onnx_path: Path) -> None:
    """Write the report as JSON and markdown next to `onnx_path`."""
    json_path, md_path = report_paths(onnx_path)
    json_path.write_text(json.dumps(report, indent=2) + "\n")
    md_path.write_text(render_markdown(report, Path(onnx_path).name))


def render_markdown(report: dict, name: str) -> str:
    """A short human-readable version of the report."""
    s = report["settings"]
    split = report["splits"][report["evaluated_on"]]
    lines = [
        f"# Block-size predictor `{name}`", "",
        f"Objective `{s['objective']}`, features `{s['features']}`, hidden {s['hidden']}, "
        f"temperature input: {s['with_temperature']}. Rows: {report['split_rows']}. "
        f"Best epoch {report['history']['best_epoch']} of {report['history']['epochs']}. "
        f"ONNX vs torch max |diff| {report['onnx_parity_max_abs_diff']:.1e}.", "",
        f"## {report['evaluated_on']} split ({split['rows']} prompts)", "",
        f"Accuracy {split['accuracy']:.3f} (oracle labels per class: {split['label_counts']}).", "",
        "| policy | tau | throughput proxy (tok/s of decode) |", "|---|---|---|",
    ]
    for size in report["candidates"]:
        tau, throughput = split["tau"]["fixed"][str(size)], split["throughput"]["fixed"][str(size)]
        lines.append(f"| fixed {size} | {tau:.3f} | {throughput:.2f} |")
    for key in ("auto", "oracle"):
        lines.append(f"| **{key}** | {split['tau'][key]:.3f} | {split['throughput'][key]:.2f} |")
    for t, part in split.get("by_temperature", {}).items():
        best = max(part["throughput"]["fixed"], key=part["throughput"]["fixed"].get)
        lines.append(f"| auto at T = {t} ({part['rows']} rows; best fixed {best}: tau {part['tau']['fixed'][best]:.3f}, "
                     f"{part['throughput']['best_fixed']:.2f}; oracle {part['throughput']['oracle']:.2f}) "
                     f"| {part['tau']['auto']:.3f} | {part['throughput']['auto']:.2f} |")
    regret = f"tau {split['tau']['regret']:.3f}, throughput {split['throughput']['regret']:.2f}"
    lines += ["", f"Regret vs oracle: {regret}.",
              "", "Confusion matrix (rows: oracle, columns: predicted; order " + str(report["candidates"]) + "):", ""]
    lines += ["    " + " ".join(f"{v:5d}" for v in row) for row in split["confusion"]]
    if "thresholds" in split:
        lines += ["", "| fallback threshold | share falling back | tau | throughput |", "|---|---|---|---|"]
        lines += [f"| {t['threshold']:.1f} | {t['fallback_share']:.2f} | {t['tau']:.3f} | {t['throughput']:.2f} |"
                  for t in split["thresholds"]]
    return "\n".join(lines) + "\n"
