"""One profile, end to end: check the inputs, build the systems, measure, write the report.

Everything a user can get wrong (prompt sets, baselines, block sizes, the output path) is checked
before the first measurement, so a mistake ends in one `UserError` line and leaves no report
behind. A Ctrl-C during measurement still writes what was measured, marked partial.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from blockpilot.errors import UserError
from blockpilot.runtime.settings import DEFAULT_LOOKUP, DEFAULT_VERIFY_LENGTH
from blockpilot.runtime.runner import supported_sizes
from blockpilot.profiling.measure import REFERENCE, Plan, greedy_mismatches, oracle_rows, run_plan
from blockpilot.profiling.systems import Models, ModelSources, RunnerSystem, System, SystemRegistry, default_registry

BLOCK_MODES = ("auto", "sweep", "oracle")
SWEEP_RADIUS = 2


@dataclasses.dataclass
class ProfileOptions:
    """A profile's settings (the command line, parsed).

    Args:
        out_dir: report directory.
        datasets: prompt set names or JSONL paths.
        sources: where the models come from.
        block_sizes: our runner's modes: ints, "auto", "sweep", "oracle"; empty: the runner's
            default (auto with a predictor, else the drafter's training block size).
        temperatures: sampling temperatures (0 = greedy).
        baselines: registry names; "ar" is always measured (the reference).
        candidates: block sizes of the sweep (None: the predictor's, else B_train +- 2).
        oracle_by: "tau" or "time" (see `measure.oracle_rows`).
        lookups: `Runner.lookup` values; each of our runner's block sizes runs once per value, the
            systems of the second and later values named with a `-lookup-<value>` suffix.
        verify_lengths: `Runner.verify_length` values, the same way (suffix `-verify-<value>`).
        limit, max_new_tokens, warmup, seed: workload size and reproducibility.
        command: the command line, recorded in the report.
        progress: show a tqdm bar.
    """

    out_dir: Path
    datasets: list[str]
    sources: ModelSources
    block_sizes: list[int | str] = dataclasses.field(default_factory=list)
    temperatures: list[float] = dataclasses.field(default_factory=lambda: [0.0])
    baselines: list[str] = dataclasses.field(default_factory=lambda: ["ar"])
    candidates: list[int] | None = None
    oracle_by: str = "tau"
    lookups: list[str] = dataclasses.field(default_factory=lambda: [DEFAULT_LOOKUP])
    verify_lengths: list[str] = dataclasses.field(default_factory=lambda: [DEFAULT_VERIFY_LENGTH])
    limit: int | None = None
    max_new_tokens: int = 128
    warmup: int = 1
    seed: int = 0
    command: list[str] = dataclasses.field(default_factory=list)
    progress: bool = True


@dataclasses.dataclass
class ProfileOutcome:
    results: dict
    paths: list[Path]

    @property
    def interrupted(self) -> bool:
        return self.results["status"] != "complete"

    @property
    def errors(self) -> list[dict]:
        return self.results["errors"]


def run_profile(options: ProfileOptions, registry: SystemRegistry | None = None, runner=None) -> ProfileOutcome:
    """Measure every system on every request and write the report into `options.out_dir`.

    Args:
        options: what to profile.
        registry: baseline factories (default: `systems.default_registry()`).
        runner: a built `Runner` for our systems (default: loaded from `options.sources`).

    Returns:
        The results (as in results.json) and the files written.

    Raises:
        UserError: anything wrong with the options, found before measuring.
    """
    from blockpilot.profiling.timing import make_clock

    _check_options(options)
    requests = _load_requests(options)
    models = Models(options.sources, make_clock(options.sources.device), runner)
    systems, sweep = _build_systems(options, models, registry or default_registry())
    _check_capacity(requests, systems, models, options.max_new_tokens)
    plan = Plan(systems, requests, options.temperatures, options.max_new_tokens, options.warmup, options.seed)
    measured = _run_with_progress(plan, options.progress)
    rows = measured.rows
    if "oracle" in options.block_sizes:
        rows = rows + oracle_rows(measured.rows, sweep, options.oracle_by)
    results = _results(options, plan, systems, rows, measured, models.runner.backend.name)
    from blockpilot.profiling.report import write_report

    return ProfileOutcome(results, write_report(options.out_dir, results))


def _check_options(options: ProfileOptions) -> None:
    if options.out_dir.exists() and not options.out_dir.is_dir():
        raise UserError(f"--out {options.out_dir} is a file; give a directory for the report")
    if not options.datasets:
        raise UserError("no prompt set given; pass --dataset humaneval, mtbench, sharegpt or a JSONL file")
    for value, what in ((options.limit, "--limit"), (options.max_new_tokens, "--max-new-tokens")):
        if value is not None and value < 1:
            raise UserError(f"{what} must be >= 1 (got {value})")
    if options.warmup < 0:
        raise UserError(f"--warmup must be >= 0 (got {options.warmup})")
    if not options.temperatures or any(t < 0 for t in options.temperatures):
        raise UserError(f"temperatures must be >= 0 (got {options.temperatures})")
    if options.oracle_by not in ("tau", "time"):
        raise UserError(f"--oracle-by must be tau or time (got {options.oracle_by!r})")
    bad = [b for b in options.block_sizes if not isinstance(b, int) and b not in BLOCK_MODES]
    if bad or any(isinstance(b, int) and b < 1 for b in options.block_sizes):
        first = (bad or [b for b in options.block_sizes if isinstance(b, int) and b < 1])[0]
        raise UserError(f"block size {first!r} is not a positive integer, auto, sweep or oracle")


def _load_requests(options: ProfileOptions):
    from blockpilot.profiling.workload import load_requests, load_tokenizer

    s = options.sources
    tokenizer = load_tokenizer(s.tokenizer_dir or s.target_dir or s.engine_dir)
    return load_requests(options.datasets, tokenizer, options.limit)


def _build_systems(options: ProfileOptions, models: Models, registry: SystemRegistry) -> tuple[list[System], list[str]]:
    """The reference, then our runner's systems, then the other baselines; and the sweep's names."""
    baselines = [b for b in dict.fromkeys(options.baselines) if b != REFERENCE]
    peers = [registry.create(name, models) for name in baselines]  # checks names before loading models
    ours: dict[str, int | str] = {}
    sweep = []
    for mode in options.block_sizes or [None]:
        for name, block in _runner_block_sizes(mode, models.runner, options.candidates):
            if block != 1:  # block size 1 is the reference itself
                ours[name] = block
            sweep += [name] if mode in ("sweep", "oracle") and name not in sweep else []
    ordered = sorted(ours.items(), key=lambda item: (item[1] == "auto", item[1] if item[1] != "auto" else 0))
    systems = [registry.create(REFERENCE, models)] + [
        RunnerSystem(name + (f"-lookup-{lookup}" if i else "") + (f"-verify-{verify}" if j else ""), models, block,
                     lookup=lookup, verify_length=verify)
        for name, block in ordered for i, lookup in enumerate(options.lookups)
        for j, verify in enumerate(options.verify_lengths)]
    return systems + [p for p in peers if p.name not in {s.name for s in systems}], sweep


def _runner_block_sizes(mode, runner, candidates: list[int] | None) -> list[tuple[str, int | str]]:
    """(system name, block size) pairs for one `--block-sizes` mode, checked against the runner."""
    if mode is None:
        mode = "auto" if runner.policy is not None else runner.default_block_size
    if mode == "auto":
        if runner.policy is None:
            raise UserError("--block-sizes auto needs a block-size predictor, and this runner has none; "
                            "profile an engine directory built with a predictor, or give a block size")
        return [("bp-auto", "auto")]
    sizes = [mode] if isinstance(mode, int) else _sweep_sizes(runner, candidates)
    for size in sizes:
        _check_block_size(runner, size)
    return [(f"bp-b{size}" if size > 1 else REFERENCE, size) for size in sizes]


def _sweep_sizes(runner, candidates: list[int] | None) -> list[int]:
    if candidates:
        return sorted(set(candidates))
    if runner.policy is not None:
        return sorted(runner.policy.candidates)
    drafter = runner.backend.drafter_config
    if drafter is None:
        raise UserError("--block-sizes sweep/oracle needs a drafter; pass --drafter DIR")
    b = drafter.block_size
    sizes = range(b - SWEEP_RADIUS, b + SWEEP_RADIUS + 1)
    return [k for k in sizes if k >= 2 and runner.backend.supports_block_size(k)]


def _check_block_size(runner, size: int) -> None:
    if size > 1 and runner.backend.drafter_config is None:
        raise UserError(f"block size {size} needs a drafter; pass --drafter DIR or use --block-sizes 1")
    if not runner.backend.supports_block_size(size):
        raise UserError(f"block size {size} is not supported by this {runner.backend.name} backend; "
                        f"choose one it supports ({supported_sizes(runner.backend)})")


def _check_capacity(requests, systems: list[System], models: Models, max_new_tokens: int) -> None:
    """Raise `UserError` naming the longest prompt if it cannot fit our runner's cache."""
    runner = models.runner
    auto = [runner.default_block_size, *(runner.policy.candidates if runner.policy is not None else ())]
    largest = max((size for s in systems if isinstance(s, RunnerSystem)
                   for size in (auto if s.block_size == "auto" else [s.block_size])), default=1)
    longest = max(requests, key=lambda r: len(r.input_ids))
    need = len(longest.input_ids) + max_new_tokens + largest
    if need > runner.backend.max_capacity:
        raise UserError(
            f"prompt {longest.id} ({len(longest.input_ids)} tokens) + --max-new-tokens {max_new_tokens} + block "
            f"{largest} exceeds the model's {runner.backend.max_capacity} positions; lower --max-new-tokens, "
            "use --limit or a prompt file with shorter prompts"
        )


def _run_with_progress(plan: Plan, show: bool):
    from tqdm import tqdm

    bar = tqdm(total=0, unit="run", desc="profile", disable=not show, dynamic_ncols=True)
    state = {"started": False}

    def progress(n: int) -> None:
        if not state["started"]:
            bar.total, state["started"] = n, True
            bar.refresh()
        else:
            bar.update(n)

    try:
        return run_plan(plan, progress)
    finally:
        bar.close()


def _results(options: ProfileOptions, plan: Plan, systems: list[System], rows: list[dict], measured,
             backend: str) -> dict:
    from blockpilot.profiling.stats import aggregates, fastest_plain, speedups, speedups_over_fastest_plain
    from blockpilot.profiling.timing import machine_description, software_versions, timing_method

    s = options.sources
    fastest = fastest_plain(rows)
    names = [system.name for system in systems]
    names += ["bp-oracle"] if any(r["system"] == "bp-oracle" for r in rows) else []
    datasets: dict[str, int] = {}
    for request in plan.requests:
        datasets[request.dataset] = datasets.get(request.dataset, 0) + 1
    return {
        "status": "partial" if measured.interrupted else "complete",
        "command": options.command,
        "reference": REFERENCE,
        "systems": names,
        "oracle_by": options.oracle_by if "oracle" in options.block_sizes else None,
        "sources": {"target_dir": _str(s.target_dir), "drafter_dir": _str(s.drafter_dir),
                    "engine_dir": _str(s.engine_dir), "predictor": _str(s.predictor), "backend": backend,
                    "dtype": str(s.dtype).removeprefix("torch.")},
        "workload": {"datasets": datasets, "max_new_tokens": plan.max_new_tokens, "temperatures": plan.temperatures,
                     "seed": plan.seed, "warmup_runs": measured.warmup_runs,
                     "planned_runs": len(plan.temperatures) * len(plan.requests) * len(plan.systems)},
        "machine": machine_description(s.device),
        "timing": timing_method(s.device),
        "versions": software_versions(),
        "errors": greedy_mismatches([r for r in rows if r["derived_from"] is None]),
        "speedups": speedups(rows, REFERENCE),
        "fastest_plain": [{"temperature": t, "system": system} for t, system in fastest.items()],
        "speedups_over_fastest_plain": speedups_over_fastest_plain(rows, fastest),
        "aggregates": aggregates(rows),
        "rows": rows,
    }


def _str(path) -> str | None:
    return str(path) if path is not None else None
