"""Prometheus metrics of one server (one registry per app, so several apps in one process, as in
tests, do not share counters). All names start with `blockpilot_`; `/metrics` serves them in the
Prometheus text format.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client import CONTENT_TYPE_LATEST as CONTENT_TYPE  # noqa: F401 - re-exported for the app

TAU_BUCKETS = (1.0, 1.25, 1.5, 1.75, 2.0, 2.5, 3.0, 3.5, 4.0, 5.0, 6.0, 8.0, 10.0, 12.0, 16.0)
STEP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128)


class ServerMetrics:
    """The metric families. Thread-safe (prometheus-client locks internally): the scheduler
    thread records steps and the queue, the event loop records requests and tokens."""

    def __init__(self):
        self.registry = r = CollectorRegistry()
        self.requests = Counter("blockpilot_requests", "HTTP requests by path and status code",
                                ("path", "status"), registry=r)
        self.finished = Counter("blockpilot_generations", "generations by how they ended "
                                "(stop, length, cancelled)", ("finish_reason",), registry=r)
        self.prompt_tokens = Counter("blockpilot_prompt_tokens", "prompt tokens of generations", registry=r)
        self.completion_tokens = Counter("blockpilot_completion_tokens", "tokens generated", registry=r)
        self.tau = Histogram("blockpilot_tau", "tokens committed per verify step, one sample per generation",
                             buckets=TAU_BUCKETS, registry=r)
        self.block_size = Counter("blockpilot_block_size_chosen", "generations by the block size they ran at",
                                  ("block_size",), registry=r)
        self.queue_length = Gauge("blockpilot_queue_length", "requests waiting for a decoder slot", registry=r)
        self.active = Gauge("blockpilot_active_requests", "requests in the decoder", registry=r)
        self.step_seconds = Histogram("blockpilot_step_seconds", "wall time of one decoder step (every "
                                      "active request advances once)", buckets=STEP_BUCKETS, registry=r)
        self.step_requests = Histogram("blockpilot_step_requests", "requests advanced by one decoder step",
                                       buckets=BATCH_BUCKETS, registry=r)

    def record_generation(self, finish_reason: str, prompt_tokens: int, completion_tokens: int, result) -> None:
        """One generation ended (`result`: its `RequestResult`, None if it never started)."""
        self.finished.labels(finish_reason).inc()
        self.prompt_tokens.inc(prompt_tokens)
        self.completion_tokens.inc(completion_tokens)
        if result is not None and result.accept_lengths:
            self.tau.observe(result.tau)
        if result is not None:
            self.block_size.labels(str(result.block_size)).inc()

    def text(self) -> bytes:
        return generate_latest(self.registry)
