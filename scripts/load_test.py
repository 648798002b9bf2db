"""Load test of `blockpilot serve`: N requests at several concurrency levels from a local client
(the official `openai` package, async, streaming), against a running server or one it starts.

    python scripts/load_test.py                                    # starts `blockpilot serve` (embedded default)
    python scripts/load_test.py --url http://127.0.0.1:8000        # a server that is already running
    python scripts/load_test.py --requests 8 --concurrency 1,4 --json runs/load.json
    python scripts/load_test.py --serve-args "--target DIR --drafter DIR" --prompts my.jsonl

First every prompt runs once alone (the single-request outputs); then, per concurrency level, the
same N requests run with at most that many in flight. Reported per level: completion tokens/s
over the level's wall time, p50/p99 latency (request sent -> last chunk), p50/p99 time to first
token (request sent -> first chunk with text), requests lost (an error, or a stream that ended
without a finish reason), and at temperature 0 requests whose text differs from their
single-request output. Prompts: the package's prompt sets (`humaneval`, `mtbench`, interleaved by
default) or a JSONL file, each sent as one user turn to /v1/chat/completions. Exit status 1 when a
request was lost or wrong.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path


@dataclasses.dataclass
class Outcome:
    """One request: its text, tokens, times (seconds from sending) and what the server reported."""

    prompt: int
    text: str = ""
    completion_tokens: int = 0
    latency_s: float = 0.0
    ttft_s: float | None = None
    finish_reason: str | None = None
    block_size: int | None = None
    tau: float | None = None
    error: str | None = None

    @property
    def lost(self) -> bool:
        return self.error is not None or self.finish_reason is None


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--url", help="a running server (http://host:port); default: start `blockpilot serve` here")
    p.add_argument("--serve-args", default="", help="extra `blockpilot serve` arguments for the server it starts")
    p.add_argument("--requests", type=int, default=64, help="requests per concurrency level")
    p.add_argument("--concurrency", default="1,4,16", help="comma list of concurrency levels")
    p.add_argument("--prompts", default="humaneval,mtbench",
                   help="comma list of prompt sets (humaneval, mtbench, sharegpt) or JSONL files, interleaved")
    p.add_argument("--max-tokens", type=int, default=128, help="max_tokens of every request")
    p.add_argument("--temperature", type=float, default=0.0, help="sampling temperature (0: outputs are checked)")
    p.add_argument("--model", help="model id to send (default: the server's first, GET /v1/models)")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds one request may take")
    p.add_argument("--start-timeout", type=float, default=900.0,
                   help="seconds to wait for a started server (the embedded engine builds on first use)")
    p.add_argument("--json", type=Path, help="write the report here as JSON")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    levels = [int(c) for c in args.concurrency.split(",") if c.strip()]
    if args.requests < 1 or not levels or min(levels) < 1:
        print("load_test: --requests and every --concurrency level must be >= 1", file=sys.stderr)
        return 2
    prompts = load_prompts(args.prompts, args.requests)
    server = None if args.url else StartedServer(shlex.split(args.serve_args), args.start_timeout)
    try:
        url = args.url or server.url
        report = asyncio.run(run(url, prompts, levels, args))
    finally:
        if server is not None:
            server.stop()
    print(table(report))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    bad = sum(level["lost"] + (level["wrong"] or 0) for level in report["levels"])
    if bad:
        print(f"load_test: {bad} requests lost or wrong", file=sys.stderr)
    return 1 if bad else 0


def load_prompts(spec: str, n: int) -> list[str]:
    """`n` prompt texts, taken in turn from each set of `spec` (cycling when a set runs out)."""
    from blockpilot.assets.prompts import load_dataset

    sets = [[p.text for p in load_dataset(name.strip())] for name in spec.split(",") if name.strip()]
    sets = [s for s in sets if s]
    if not sets:
        raise SystemExit(f"load_test: no prompts in {spec!r}")
    return [sets[i % len(sets)][(i // len(sets)) % len(sets[i % len(sets)])] for i in range(n)]


# ---------------------------------------------------------------- the client


async def run(url: str, prompts: list[str], levels: list[int], args) -> dict:
    import openai

    api = openai.AsyncOpenAI(base_url=f"{url.rstrip('/')}/v1", api_key="unused", max_retries=0,
                             timeout=args.timeout)
    try:
        model = args.model or (await api.models.list()).data[0].id
        alone = [await ask(api, model, i, text, args) for i, text in enumerate(prompts)]
        report = {"url": url, "model": model, "requests": len(prompts), "max_tokens": args.max_tokens,
                  "temperature": args.temperature, "single": summarize(alone, 1, None, None), "levels": []}
        for level in levels:
            began = time.perf_counter()
            outcomes = await run_level(api, model, prompts, level, args)
            wall = time.perf_counter() - began
            report["levels"].append(summarize(outcomes, level, wall, alone if args.temperature == 0 else None))
        return report
    finally:
        await api.close()


async def run_level(api, model: str, prompts: list[str], concurrency: int, args) -> list[Outcome]:
    gate = asyncio.Semaphore(concurrency)

    async def one(i: int, text: str) -> Outcome:
        async with gate:
            return await ask(api, model, i, text, args)

    return list(await asyncio.gather(*(one(i, text) for i, text in enumerate(prompts))))


async def ask(api, model: str, index: int, text: str, args) -> Outcome:
    """One streaming chat request; never raises (an error is recorded in the outcome)."""
    outcome = Outcome(prompt=index)
    sent = time.perf_counter()
    pieces = []
    try:
        stream = await api.chat.completions.create(
            model=model, messages=[{"role": "user", "content": text}], max_tokens=args.max_tokens,
            temperature=args.temperature, stream=True, stream_options={"include_usage": True})
        async for chunk in stream:
            if chunk.usage is not None:
                outcome.completion_tokens = chunk.usage.completion_tokens
            if not chunk.choices:
                continue
            choice = chunk.choices[0]
            if choice.delta.content:
                outcome.ttft_s = outcome.ttft_s if outcome.ttft_s is not None else time.perf_counter() - sent
                pieces.append(choice.delta.content)
            if choice.finish_reason is not None:
                outcome.finish_reason = choice.finish_reason
                extension = getattr(chunk, "blockpilot", None) or {}
                outcome.block_size, outcome.tau = extension.get("block_size"), extension.get("tau")
    except Exception as exc:  # noqa: BLE001 - a failed request is counted as lost, with its reason
        outcome.error = f"{type(exc).__name__}: {exc}"
    outcome.latency_s = time.perf_counter() - sent
    outcome.text = "".join(pieces)
    return outcome


# ---------------------------------------------------------------- the report


def percentile(values: list[float], q: float) -> float | None:
    """The q-th percentile (0..100) with linear interpolation; None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100
    low = int(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def summarize(outcomes: list[Outcome], concurrency: int, wall_s: float | None, alone: list[Outcome] | None) -> dict:
    done = [o for o in outcomes if not o.lost]
    tokens = sum(o.completion_tokens for o in done)
    wall_s = wall_s if wall_s is not None else sum(o.latency_s for o in outcomes)
    wrong = None
    if alone is not None:
        reference = {o.prompt: o for o in alone}
        wrong = sum(1 for o in done if reference[o.prompt].lost or o.text != reference[o.prompt].text)
    block_sizes: dict[str, int] = {}
    for o in done:
        block_sizes[str(o.block_size)] = block_sizes.get(str(o.block_size), 0) + 1
    taus = [o.tau for o in done if o.tau is not None]
    return {
        "concurrency": concurrency, "requests": len(outcomes), "lost": len(outcomes) - len(done), "wrong": wrong,
        "completion_tokens": tokens, "wall_s": round(wall_s, 3),
        "tokens_per_s": round(tokens / wall_s, 2) if wall_s else None,
        "latency_p50_s": _round(percentile([o.latency_s for o in done], 50)),
        "latency_p99_s": _round(percentile([o.latency_s for o in done], 99)),
        "ttft_p50_s": _round(percentile([o.ttft_s for o in done if o.ttft_s is not None], 50)),
        "ttft_p99_s": _round(percentile([o.ttft_s for o in done if o.ttft_s is not None], 99)),
        "mean_tau": _round(sum(taus) / len(taus)) if taus else None,
        "block_sizes": dict(sorted(block_sizes.items())),
        "errors": sorted({o.error for o in outcomes if o.error})[:5],
    }


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 4)


def table(report: dict) -> str:
    head = ("| concurrency | requests | lost | wrong | completion tok/s | latency p50 / p99 s | TTFT p50 / p99 s "
            "| mean tau | block sizes |")
    rows = [f"model {report['model']} at {report['url']}, {report['requests']} requests per level, max_tokens "
            f"{report['max_tokens']}, temperature {report['temperature']}", "", head, "|" + "---|" * 9]
    for name, level in [("alone", report["single"])] + [(str(lv["concurrency"]), lv) for lv in report["levels"]]:
        wrong = "-" if level["wrong"] is None else level["wrong"]
        sizes = ", ".join(f"{k}: {v}" for k, v in level["block_sizes"].items())
        rows.append(f"| {name} | {level['requests']} | {level['lost']} | {wrong} | {level['tokens_per_s']} | "
                    f"{level['latency_p50_s']} / {level['latency_p99_s']} | {level['ttft_p50_s']} / "
                    f"{level['ttft_p99_s']} | {level['mean_tau']} | {sizes} |")
    return "\n".join(rows)


# ---------------------------------------------------------------- a server of its own


class StartedServer:
    """`blockpilot serve` in a subprocess on a free local port, until `stop` (SIGTERM, drained)."""

    def __init__(self, serve_args: list[str], start_timeout: float):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"
        extra = [] if "--log-level" in serve_args else ["--log-level", "warning"]
        command = [sys.executable, "-m", "blockpilot", "serve", "--host", "127.0.0.1", "--port", str(port),
                   *extra, *serve_args]
        print(f"load_test: starting {' '.join(command[2:])}", file=sys.stderr, flush=True)
        self.process = subprocess.Popen(command, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        self._wait_healthy(start_timeout)

    def _wait_healthy(self, timeout: float) -> None:
        import httpx

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise SystemExit(f"load_test: the server exited with status {self.process.returncode}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.5)
        self.stop()
        raise SystemExit(f"load_test: the server did not answer /health within {timeout:.0f} s")

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(120)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


if __name__ == "__main__":
    sys.exit(main())
