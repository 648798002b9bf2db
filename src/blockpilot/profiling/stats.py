"""Aggregates over result rows and speedups against the reference system.

Aggregates: mean, median and p90 of every per-request metric, per system x dataset x category x
temperature, plus category "all" per system x dataset x temperature.

Speedup of a system = reference time per output token / the system's, each pooled over the
requests both systems completed (sum of times / sum of tokens), on the same run. "with prefill"
uses whole-request time over output tokens; "decode only" uses time after the first token over
output tokens after the first (DFlash's own harness reports the latter). The same speedups are also
taken over the fastest of the package's plain decoding systems at each temperature (`fastest_plain`),
the bar speculative decoding has to clear.

Decode steps: milliseconds per step of the decode loop at each block size a system ran, pooled over
its requests (time after the first token over target passes after the prefill): the measured
counterpart of the step-cost table the predictor's labels are scored with.
"""

from __future__ import annotations

import math
import statistics

METRICS = ("prompt_tokens", "output_tokens", "ttft_s", "tpot_s", "tokens_per_s", "tau", "block_size",
           "predictor_ms")
"""Per-request fields that are aggregated (None values are left out)."""

ALL = "all"

PLAIN_DECODING = ("ar", "ar-1row")
"""The package's own plain decoding systems (the reference and `--baselines ar-1row`)."""


def summarize(values: list[float]) -> dict | None:
    """`{"mean", "median", "p90", "n"}` of the non-None `values`, or None if there are none."""
    xs = sorted(v for v in values if v is not None)
    if not xs:
        return None
    return {"mean": statistics.fmean(xs), "median": statistics.median(xs), "p90": _percentile(xs, 0.9),
            "n": len(xs)}


def _percentile(sorted_xs: list[float], q: float) -> float:
    """Linear-interpolated quantile `q` of sorted values (numpy's default method)."""
    position = q * (len(sorted_xs) - 1)
    lower = math.floor(position)
    upper = min(lower + 1, len(sorted_xs) - 1)
    return sorted_xs[lower] + (sorted_xs[upper] - sorted_xs[lower]) * (position - lower)


def aggregates(rows: list[dict]) -> list[dict]:
    """One entry per system x dataset x category (and "all") x temperature, with a summary per metric.

    Ordered by dataset, temperature, category ("all" first), then systems in order of first row."""
    rank = {name: i for i, name in enumerate(dict.fromkeys(r["system"] for r in rows))}
    groups: dict[tuple, list[dict]] = {}
    for row in rows:
        for category in (row["category"], ALL):
            key = (row["dataset"], row["temperature"], category != ALL, category, rank[row["system"]])
            groups.setdefault(key, []).append(row)
    return [
        {"system": group[0]["system"], "dataset": dataset, "category": category, "temperature": temperature,
         "requests": len(group), **{m: summarize([r[m] for r in group]) for m in METRICS}}
        for (dataset, temperature, _, category, _), group in sorted(groups.items())
    ]


def speedups(rows: list[dict], reference: str) -> list[dict]:
    """Speedup of every system over `reference`, per dataset x temperature and over all datasets.

    Returns:
        Entries with system, dataset ("all" for every dataset), temperature, requests (paired),
        `with_prefill`, `decode_only` (None where undefined) and the system's mean tau.
    """
    by_key = {(r["system"], r["dataset"], r["prompt_id"], r["temperature"]): r for r in rows}
    systems = list(dict.fromkeys(r["system"] for r in rows))
    scopes = sorted({(r["dataset"], r["temperature"]) for r in rows})
    scopes += sorted({(ALL, t) for _, t in scopes})  # over every dataset (the same rows when only one)
    entries = []
    for dataset, temperature in scopes:
        for system in systems:
            pairs = [(by_key[(reference, *k[1:])], row) for k, row in by_key.items()
                     if k[0] == system and k[3] == temperature and (dataset == ALL or k[1] == dataset)
                     and (reference, *k[1:]) in by_key]
            if pairs:
                entries.append(_speedup_entry(system, dataset, temperature, pairs))
    return entries


def _speedup_entry(system: str, dataset: str, temperature: float, pairs: list[tuple[dict, dict]]) -> dict:
    refs, runs = [p[0] for p in pairs], [p[1] for p in pairs]
    tau = summarize([r["tau"] for r in runs])
    per_token = _per_token(runs, "total_s", 0)
    return {
        "system": system, "dataset": dataset, "temperature": temperature, "requests": len(pairs),
        "with_prefill": _ratio(_per_token(refs, "total_s", 0), per_token),
        "decode_only": _ratio(_per_token(refs, "decode_s", 1), _per_token(runs, "decode_s", 1)),
        "tau": tau["mean"] if tau else None,
        "tokens_per_s": 1.0 / per_token if per_token else None,  # pooled: all output tokens / all request time
    }


def fastest_plain(rows: list[dict]) -> dict[float, str]:
    """The package's fastest plain decoding at each temperature: of the `PLAIN_DECODING` systems that ran,
    the one with the least time per output token (prefill included), pooled over every dataset. It is the bar
    speculative decoding has to clear, and not always `ar`: `ar-1row` skips the padding row that makes `ar`
    round like the verify steps."""
    fastest = {}
    for temperature in sorted({r["temperature"] for r in rows}):
        per_token = {system: _per_token([r for r in rows if r["system"] == system and r["temperature"] == temperature],
                                        "total_s", 0) for system in PLAIN_DECODING}
        measured = {system: t for system, t in per_token.items() if t}
        if measured:
            fastest[temperature] = min(measured, key=measured.get)
    return fastest


def speedups_over_fastest_plain(rows: list[dict], fastest: dict[float, str]) -> list[dict]:
    """`speedups` of every system over the fastest plain decoding of its temperature (`fastest`, what
    `fastest_plain(rows)` returns); each entry also names that system as `reference`."""
    entries = []
    for temperature, reference in fastest.items():
        at_t = [r for r in rows if r["temperature"] == temperature]
        entries += [{**e, "reference": reference} for e in speedups(at_t, reference)]
    return entries


def _per_token(rows: list[dict], time_key: str, skip: int) -> float | None:
    """Sum of `time_key` over the sum of (output tokens - skip); None when no tokens."""
    tokens = sum(max(r["output_tokens"] - skip, 0) for r in rows)
    return sum(r[time_key] for r in rows) / tokens if tokens else None


def _ratio(reference: float | None, system: float | None) -> float | None:
    if reference is None or not system:
        return None
    return reference / system


def decode_steps(rows: list[dict]) -> list[dict]:
    """Pooled decode-loop steps per system x temperature x block size (over every dataset).

    Returns:
        Entries with system, temperature, block_size, requests, steps, `ms_per_step` (sum of decode
        time over sum of steps) and `tokens_per_step` (output tokens after the first over steps), for
        rows that record their steps and block size (derived rows left out).
    """
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        if r.get("derived_from") or not r.get("verify_steps") or r.get("block_size") is None:
            continue
        groups.setdefault((r["system"], r["temperature"], r["block_size"]), []).append(r)
    entries = []
    for (system, temperature, block_size), group in sorted(groups.items(), key=lambda kv: str(kv[0])):
        steps = sum(r["verify_steps"] for r in group)
        entries.append({"system": system, "temperature": temperature, "block_size": block_size,
                        "requests": len(group), "steps": steps,
                        "ms_per_step": 1e3 * sum(r["decode_s"] for r in group) / steps,
                        "tokens_per_step": sum(max(r["output_tokens"] - 1, 0) for r in group) / steps})
    return entries
