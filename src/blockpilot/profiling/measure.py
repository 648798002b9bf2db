"""The measurement loop, the T = 0 equality check, and oracle rows derived from a sweep.

Systems are interleaved prompt by prompt: for each temperature and each request every system runs
once, in an order rotated by one per request, so slow drifts of the machine (other jobs, clock
changes) hit all systems alike. Warm-up requests run first and are not recorded.

A row is a JSON-ready dict per (system, request, temperature); see `make_row` for its keys.
"""

from __future__ import annotations

import dataclasses
import zlib
from collections.abc import Callable

from blockpilot.profiling.systems import Measurement, System
from blockpilot.profiling.workload import Request

REFERENCE = "ar"
"""The system every other is compared with: our runner at block size 1."""
ROUNDS_OTHERWISE = {"ar-1row"}
"""Plain decoding that rounds unlike every verify step by design (a speed baseline): its T = 0 output
may differ from the reference's at a near-tie, which is not an error."""


@dataclasses.dataclass
class Plan:
    """What to measure.

    Args:
        systems: every system, `REFERENCE` among them.
        requests: the prompts, already tokenized.
        temperatures: each one is a full pass over requests x systems.
        max_new_tokens: generation budget per request.
        warmup: requests (from the start of `requests`) each system runs before measuring.
        seed: base seed; request i at temperature t gets the same seed on every system.
    """

    systems: list[System]
    requests: list[Request]
    temperatures: list[float]
    max_new_tokens: int
    warmup: int = 1
    seed: int = 0


@dataclasses.dataclass
class Measured:
    rows: list[dict]
    interrupted: bool
    warmup_runs: int  # requests run and discarded per system


def request_seed(base: int, request: Request, temperature: float) -> int:
    """Seed shared by all systems for one request at one temperature."""
    return zlib.crc32(f"{base}/{request.dataset}/{request.id}/{temperature}".encode())


def run_plan(plan: Plan, progress: Callable[[int], object] = lambda n: None) -> Measured:
    """Warm up, then measure every (temperature, request, system) in interleaved order.

    A `KeyboardInterrupt` stops the loop; the rows measured so far are returned with
    `interrupted=True`.

    Args:
        plan: what to measure.
        progress: called with the number of runs still to do, then with 1 after each run.

    Returns:
        The rows and whether the loop was interrupted.
    """
    total = len(plan.temperatures) * len(plan.requests) * len(plan.systems)
    warm = plan.requests[: plan.warmup]
    progress(total + len(warm) * len(plan.systems))
    rows: list[dict] = []
    try:
        for system in plan.systems:
            system.prepare()
        for request in warm:
            for system in plan.systems:
                system.generate(request, plan.temperatures[0], plan.seed, plan.max_new_tokens)
                progress(1)
        for temperature in plan.temperatures:
            for index, request in enumerate(plan.requests):
                seed = request_seed(plan.seed, request, temperature)
                for order, system in enumerate(_rotated(plan.systems, index)):
                    m = system.generate(request, temperature, seed, plan.max_new_tokens)
                    rows.append(make_row(system, request, temperature, seed, order, m))
                    progress(1)
    except KeyboardInterrupt:
        return Measured(rows, True, len(warm))
    return Measured(rows, False, len(warm))


def _rotated(items: list, shift: int) -> list:
    k = shift % len(items)
    return items[k:] + items[:k]


def make_row(system: System, request: Request, temperature: float, seed: int, order: int,
             m: Measurement) -> dict:
    """One result row: identity, sizes, times (s), rates, acceptance, block size."""
    n = len(m.output_ids)
    decode_s = m.total_s - m.ttft_s
    return {
        "system": system.name, "kind": system.kind, "dataset": request.dataset, "prompt_id": request.id,
        "category": request.category, "temperature": temperature, "seed": seed, "order": order,
        "prompt_tokens": len(request.input_ids), "output_tokens": n,
        "ttft_s": m.ttft_s, "total_s": m.total_s, "decode_s": decode_s,
        "tpot_s": decode_s / (n - 1) if n > 1 else None,
        "tokens_per_s": n / m.total_s if m.total_s > 0 else None,
        "tau": m.tau, "verify_steps": m.verify_steps,
        "block_size": m.block_size, "block_size_prob": m.block_size_prob,
        "block_size_switches": m.block_size_switches,
        "predictor_ms": m.predictor_s * 1e3 if m.predictor_s is not None else None,
        "derived_from": None, "output_ids": m.output_ids,
    }


def greedy_mismatches(rows: list[dict], reference: str = REFERENCE) -> list[dict]:
    """Every T = 0 row whose output differs from the reference system's on the same request.

    Returns:
        One error dict per mismatch (systems in `ROUNDS_OTHERWISE` are not checked): system, dataset,
        prompt id, where the outputs first differ,
        both lengths and both tokens there (None past an end), and `same_as`: the other systems
        whose output on that request is identical to this one's (e.g. every transformers system
        agreeing with each other points at numerics of the two implementations, not at a method).
    """
    greedy = [r for r in rows if r["temperature"] == 0 and r["system"] not in ROUNDS_OTHERWISE]
    expected = {(r["dataset"], r["prompt_id"]): r["output_ids"] for r in greedy if r["system"] == reference}
    errors = []
    for row in greedy:
        key = (row["dataset"], row["prompt_id"])
        if row["system"] == reference or key not in expected or expected[key] == row["output_ids"]:
            continue
        want, got = expected[key], row["output_ids"]
        at = next((i for i, (a, b) in enumerate(zip(want, got)) if a != b), min(len(want), len(got)))
        errors.append({
            "error": "greedy output differs from the reference", "reference": reference,
            "system": row["system"], "dataset": row["dataset"], "prompt_id": row["prompt_id"],
            "first_difference": at, "reference_tokens": len(want), "system_tokens": len(got),
            "reference_token": want[at] if at < len(want) else None,
            "system_token": got[at] if at < len(got) else None,
            "same_as": [r["system"] for r in greedy if (r["dataset"], r["prompt_id"]) == key
                        and r["system"] != row["system"] and r["output_ids"] == got],
        })
    return errors


def oracle_rows(rows: list[dict], sweep: list[str], by: str = "tau") -> list[dict]:
    """Per request and temperature, the best row among the `sweep` systems, as system "bp-oracle".

    Args:
        rows: measured rows.
        sweep: names of the fixed-block-size systems to choose among.
        by: "tau" (highest acceptance length; ties to the faster) or "time" (lowest time per
            output token, prefill excluded).

    Returns:
        Copies of the chosen rows with `system="bp-oracle"` and `derived_from` the chosen system;
        only requests on which every sweep system has a row.
    """
    groups: dict[tuple, list[dict]] = {}
    for row in rows:
        if row["system"] in sweep:
            groups.setdefault((row["dataset"], row["prompt_id"], row["temperature"]), []).append(row)
    derived = []
    for group in groups.values():
        if len(group) < len(sweep):
            continue
        best = min(group, key=_oracle_key(by))
        derived.append(dict(best, system="bp-oracle", kind="bp", derived_from=best["system"], order=None))
    return derived


def _oracle_key(by: str) -> Callable[[dict], tuple]:
    def time_per_token(row: dict) -> float:
        return row["decode_s"] / max(row["output_tokens"] - 1, 1)

    if by == "tau":
        return lambda row: (-(row["tau"] or 0.0), time_per_token(row))
    return lambda row: (time_per_token(row), -(row["tau"] or 0.0))
