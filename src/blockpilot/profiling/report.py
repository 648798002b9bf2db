"""Profile outputs: `results.json`, `report.md` and PNG plots in one report directory.

Every file is written to a temporary name in the directory and renamed into place, so a reader
never sees half a file. `results.json` holds everything (rows, aggregates, speedups, errors,
machine, versions, command); `report.md` and the plots are views of it.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

from blockpilot.files import PUBLIC_FILE_MODE, write_text_atomic

PLOTS = ("tau_by_block_size.png", "oracle_block_sizes.png", "speedup.png")


def write_report(out_dir: Path, results: dict) -> list[Path]:
    """Write results.json, report.md and the plots that have data; stale plots are removed.

    Returns:
        The paths written.
    """
    out_dir.mkdir(parents=True, exist_ok=True)
    written = [out_dir / "results.json", out_dir / "report.md"]
    write_text_atomic(written[0], json.dumps(results, indent=1) + "\n")
    plots = write_plots(out_dir, results)
    write_text_atomic(written[1], markdown(results, [p.name for p in plots]))
    for name in PLOTS:
        if out_dir / name not in plots:
            (out_dir / name).unlink(missing_ok=True)
    return written + plots


# ---------------------------------------------------------------- markdown


def markdown(results: dict, plots: list[str]) -> str:
    """`report.md`: header, correctness, speedups, latency tables, block sizes, decode steps, plots."""
    parts = [_header(results), _correctness(results), _speedup_table(results), _fastest_plain_table(results),
             _latency_table(results),
             _category_table(results), _block_size_table(results), _decode_step_table(results)]
    parts.append("## Plots\n\n" + ("\n".join(f"![{p}]({p})" for p in plots) if plots else "No plot had data.") + "\n")
    return "\n".join(p for p in parts if p)


def _header(results: dict) -> str:
    m, v, w, s = results["machine"], results["versions"], results["workload"], results["sources"]
    status = ("complete" if results["status"] == "complete"
              else f"**PARTIAL** — interrupted; {len(results['rows'])} of {w['planned_runs']} runs measured")
    gpu = f", GPU {m['gpu']}" if m.get("gpu") else ""
    sets = ", ".join(f"{name} ({n} prompts)" for name, n in w["datasets"].items())
    return "\n".join([
        "# BlockPilot profile", "",
        f"- Status: {status}",
        f"- Command: `{' '.join(results['command'])}`",
        f"- Machine: {m['cpu']} ({m['cpu_count']} logical CPUs, {m['torch_threads']} torch threads){gpu}; "
        f"device `{m['device']}`; timing: {results['timing']}",
        "- Versions: " + ", ".join(f"{k} {val}" for k, val in v.items() if val),
        f"- Models: target `{s['target_dir']}`, "
        + (f"drafter `{s['drafter_dir']}`" if s.get("drafter_dir") else "no drafter")
        + (f", engine `{s['engine_dir']}`" if s.get("engine_dir") else "")
        + (f", predictor `{s['predictor']}`" if s.get("predictor") else "")
        + f"; our runner's backend {s['backend']}, dtype {s['dtype']}",
        f"- Workload: {sets}; max_new_tokens {w['max_new_tokens']}; temperatures "
        f"{', '.join(str(t) for t in w['temperatures'])}; batch 1",
        f"- Systems: {', '.join(results['systems'])} (interleaved prompt by prompt, order rotated per prompt)",
        f"- Warm-up: {w['warmup_runs']} request(s) per system before measuring, excluded from every number",
        "",
    ])


def _correctness(results: dict) -> str:
    errors = results["errors"]
    greedy = [r for r in results["rows"] if r["temperature"] == 0 and r["derived_from"] is None]
    if not greedy:
        return "## Correctness (T = 0)\n\nNo T = 0 runs: the equality check did not apply.\n"
    if not errors:
        n = len({(r["dataset"], r["prompt_id"]) for r in greedy})
        return (f"## Correctness (T = 0)\n\nOK: every system produced exactly `{results['reference']}`'s "
                f"tokens on all {n} requests.\n")
    lines = [f"## Correctness (T = 0)\n\n**ERROR: {len(errors)} output(s) differ from "
             f"`{results['reference']}`** (not lossless, or numerics differ at a near-tie):\n",
             "| system | dataset | prompt | first difference | tokens (ref / system) | token there (ref / system) "
             "| same output as |", "|---|---|---|---|---|---|---|"]
    for e in errors:
        lines.append(f"| {e['system']} | {e['dataset']} | {e['prompt_id']} | {e['first_difference']} | "
                     f"{e['reference_tokens']} / {e['system_tokens']} | {e['reference_token']} / {e['system_token']} "
                     f"| {', '.join(e['same_as']) or '–'} |")
    return "\n".join(lines) + "\n"


def _fmt(x, digits: int = 2, scale: float = 1.0) -> str:
    return "–" if x is None else f"{x * scale:.{digits}f}"


def _speedup_table(results: dict) -> str:
    return _speedups_markdown(results, results["speedups"], f"`{results['reference']}`")


def _fastest_plain_table(results: dict) -> str:
    """Speedups over the fastest plain decoding of each temperature; left out when that is the reference at
    every temperature (the table above then says it all)."""
    fastest = results.get("fastest_plain") or []  # absent in results.json files of older versions
    if all(f["system"] == results["reference"] for f in fastest):
        return ""
    bars = ", ".join(f"`{f['system']}` at T = {f['temperature']}" for f in fastest)
    return _speedups_markdown(results, results["speedups_over_fastest_plain"], f"the fastest plain decoding ({bars})")


def _speedups_markdown(results: dict, entries: list[dict], reference: str) -> str:
    lines = [f"## Speedup vs {reference} (same run; time per output token, pooled)\n",
             "| system | dataset | T | requests | mean tau | tokens/s (pooled) | speedup with prefill | "
             "speedup decode only |", "|---|---|---|---|---|---|---|---|"]
    several = len(results["workload"]["datasets"]) > 1  # else the "all" rows repeat the dataset's
    for e in entries:
        if e["dataset"] == "all" and not several:
            continue
        lines.append(f"| {e['system']} | {e['dataset']} | {e['temperature']} | {e['requests']} | {_fmt(e['tau'])} | "
                     f"{_fmt(e.get('tokens_per_s'), 1)} | {_fmt(e['with_prefill'])}x | {_fmt(e['decode_only'])}x |")
    return "\n".join(lines) + "\n"


def _stat(summary: dict | None, key: str, digits: int = 1, scale: float = 1.0) -> str:
    return "–" if summary is None else _fmt(summary[key], digits, scale)


def _latency_table(results: dict) -> str:
    lines = ["## Latency per request (all categories; mean / median / p90)\n",
             "| system | dataset | T | n | tokens/s | TTFT ms | TPOT ms | tau | output tokens |",
             "|---|---|---|---|---|---|---|---|---|"]
    for a in results["aggregates"]:
        if a["category"] != "all":
            continue
        cells = [" / ".join(_stat(a[m], k, d, sc) for k in ("mean", "median", "p90"))
                 for m, d, sc in (("tokens_per_s", 1, 1), ("ttft_s", 1, 1e3), ("tpot_s", 1, 1e3), ("tau", 2, 1),
                                  ("output_tokens", 0, 1))]
        head = f"| {a['system']} | {a['dataset']} | {a['temperature']} | {a['requests']} | "
        lines.append(head + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def _category_table(results: dict) -> str:
    rows = [a for a in results["aggregates"] if a["category"] != "all"]
    if len({a["category"] for a in rows}) < 2:
        return ""
    lines = ["## Per category (means)\n", "| dataset | category | T | system | n | tokens/s | TPOT ms | tau |",
             "|---|---|---|---|---|---|---|---|"]
    for a in rows:
        lines.append(f"| {a['dataset']} | {a['category']} | {a['temperature']} | {a['system']} | {a['requests']} | "
                     f"{_stat(a['tokens_per_s'], 'mean')} | {_stat(a['tpot_s'], 'mean', 1, 1e3)} | "
                     f"{_stat(a['tau'], 'mean', 2)} |")
    return "\n".join(lines) + "\n"


def _block_size_table(results: dict) -> str:
    chosen = [r for r in results["rows"] if r["system"] in ("bp-auto", "bp-oracle")]
    if not chosen:
        return ""
    counts: dict[tuple, dict[int, int]] = {}
    for r in chosen:
        key = (r["system"], r["dataset"], r["temperature"])
        counts.setdefault(key, {}).setdefault(r["block_size"], 0)
        counts[key][r["block_size"]] += 1
    note = f" (oracle: best of the sweep by {results['oracle_by']})" if results.get("oracle_by") else ""
    lines = [f"## Block sizes chosen per request{note}\n", "| system | dataset | T | block size: requests |",
             "|---|---|---|---|"]
    for (system, dataset, t), hist in sorted(counts.items(), key=str):
        sizes = ", ".join(f"{b}: {n}" for b, n in sorted(hist.items()))
        lines.append(f"| {system} | {dataset} | {t} | {sizes} |")
    return "\n".join(lines) + "\n"


def _decode_step_table(results: dict) -> str:
    """Measured ms per decode step at each block size each system ran (every dataset pooled), and its ratio
    to the reference's plain step at the same temperature: what a step-cost table should predict."""
    from blockpilot.profiling.stats import decode_steps

    entries = decode_steps(results["rows"])
    if not any(e["block_size"] > 1 for e in entries):
        return ""
    plain = {e["temperature"]: e["ms_per_step"] for e in entries if e["system"] == results["reference"]}
    lines = ["## Decode steps by block size (every dataset pooled)\n",
             "| system | T | block size | requests | steps | ms per step | step / reference step | "
             "tokens per step |", "|---|---|---|---|---|---|---|---|"]
    for e in entries:
        ratio = _fmt(e["ms_per_step"] / plain[e["temperature"]], 3) if e["temperature"] in plain else "–"
        lines.append(f"| {e['system']} | {e['temperature']} | {e['block_size']} | {e['requests']} | {e['steps']} | "
                     f"{_fmt(e['ms_per_step'])} | {ratio} | {_fmt(e['tokens_per_step'])} |")
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------- plots


def write_plots(out_dir: Path, results: dict) -> list[Path]:
    """The plots that have data: tau by block size, oracle block sizes, speedup per system."""
    import matplotlib

    matplotlib.use("Agg")
    written = []
    for name, draw in zip(PLOTS, (_plot_tau_by_block, _plot_oracle_sizes, _plot_speedups)):
        if draw(out_dir / name, results):
            written.append(out_dir / name)
    return written


def _save(fig, path: Path) -> None:
    import matplotlib.pyplot as plt

    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".png", dir=path.parent)
    os.close(fd)
    try:
        fig.savefig(tmp, dpi=110, bbox_inches="tight")
        os.chmod(tmp, PUBLIC_FILE_MODE)
        os.replace(tmp, path)
    finally:
        plt.close(fig)
        Path(tmp).unlink(missing_ok=True)


def _plot_tau_by_block(path: Path, results: dict) -> bool:
    """Mean tau against fixed block size (ar is block size 1), one line per dataset x T."""
    import matplotlib.pyplot as plt

    lines: dict[tuple, dict[int, list[float]]] = {}
    for r in results["rows"]:
        fixed = r["kind"] in ("ar", "bp") and r["derived_from"] is None and r["system"] != "bp-auto"
        if fixed and r["tau"] is not None and r["block_size"] is not None:
            lines.setdefault((r["dataset"], r["temperature"]), {}).setdefault(r["block_size"], []).append(r["tau"])
    if not any(len(sizes) > 1 for sizes in lines.values()):
        return False
    fig, ax = plt.subplots(figsize=(6, 4))
    for (dataset, t), sizes in sorted(lines.items()):
        xs = sorted(sizes)
        ax.plot(xs, [sum(sizes[x]) / len(sizes[x]) for x in xs], marker="o", label=f"{dataset}, T={t}")
    ax.set_xticks(sorted({size for sizes in lines.values() for size in sizes}))
    ax.set(xlabel="block size (1 = ar)", ylabel="mean acceptance length tau", title="tau by block size")
    ax.grid(alpha=0.3)
    ax.legend()
    _save(fig, path)
    return True


def _plot_oracle_sizes(path: Path, results: dict) -> bool:
    """Histogram of the per-request oracle block sizes, one bar group per dataset x T."""
    import matplotlib.pyplot as plt

    chosen = [r for r in results["rows"] if r["system"] == "bp-oracle"]
    if not chosen:
        return False
    groups = sorted({(r["dataset"], r["temperature"]) for r in chosen})
    sizes = sorted({r["block_size"] for r in chosen})
    width = 0.8 / len(groups)
    fig, ax = plt.subplots(figsize=(6, 4))
    for i, (dataset, t) in enumerate(groups):
        counts = [sum(1 for r in chosen if (r["dataset"], r["temperature"], r["block_size"]) == (dataset, t, b))
                  for b in sizes]
        ax.bar([b + (i - (len(groups) - 1) / 2) * width for b in sizes], counts, width, label=f"{dataset}, T={t}")
    ax.set(xlabel="oracle block size", ylabel="requests", xticks=sizes,
           title=f"per-request oracle block size (by {results.get('oracle_by')})")
    ax.legend()
    _save(fig, path)
    return True


def _plot_speedups(path: Path, results: dict) -> bool:
    """Speedup vs the reference per system (all datasets), with prefill and decode only, per T."""
    import matplotlib.pyplot as plt

    entries = [e for e in results["speedups"] if e["dataset"] == "all" and e["system"] != results["reference"]]
    if not entries:
        return False
    labels = [f"{e['system']}\nT={e['temperature']}" for e in entries]
    xs = range(len(entries))
    fig, ax = plt.subplots(figsize=(max(6, 0.9 * len(entries)), 4))
    ax.bar([x - 0.2 for x in xs], [e["with_prefill"] or 0 for e in entries], 0.4, label="with prefill")
    ax.bar([x + 0.2 for x in xs], [e["decode_only"] or 0 for e in entries], 0.4, label="decode only")
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks(list(xs), labels, fontsize=7, rotation=30, ha="right")
    ax.set(ylabel=f"speedup vs {results['reference']}", title="speedup per system")
    ax.legend()
    _save(fig, path)
    return True
