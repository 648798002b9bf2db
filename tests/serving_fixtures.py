"""What the serving tests share: a tiny chat target with a long cache, the server in a thread,
and reference outputs from a runner of its own."""

from __future__ import annotations

import random
import socket
import threading
import time
from pathlib import Path

from cli_fixtures import BYTE_VOCAB, IM_END, IM_START, byte_tokenizer
from fixtures import make_drafter, make_hf_target

MODEL = "tiny"


def make_served_dirs(tmp: Path, positions: int = 4096) -> tuple[Path, Path]:
    """A tiny byte-tokenizer chat target whose cache holds `positions` (so that a request can run
    long enough to be interrupted), and a block-4 drafter for it."""
    target = make_hf_target(tmp, "llama", vocab_size=BYTE_VOCAB, bos_token_id=IM_START, eos_token_id=IM_END,
                            pad_token_id=IM_END, max_position_embeddings=positions)
    byte_tokenizer().save_pretrained(target)
    return target, make_drafter(tmp, target, block_size=4)


def serve_args(target: Path, drafter: Path, *extra: str):
    """`blockpilot serve` arguments, parsed by the real command line."""
    from blockpilot.cli import build_parser

    return build_parser().parse_args(["serve", "--target", str(target), "--drafter", str(drafter),
                                      "--served-model-name", MODEL, *extra])


def free_port() -> int:
    """A port free now, from the range `bind(0)` draws from (the kernel's ephemeral ports)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def free_port_for_ray(low: int = 20000, high: int = 32000) -> int:
    """A port free now and outside the ranges a starting Ray cluster binds by itself: its workers' 10002-19999
    and the kernel's ephemeral ports (32768 on), where its other processes bind port 0. A `free_port` lost that
    race once in CI: Ray's own process took it before Serve's HTTP proxy bound it ("Failed to bind")."""
    for port in random.Random().sample(range(low, high), 200):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port in {low}-{high}")


class LocalServer:
    """uvicorn serving `app` on 127.0.0.1 in a thread, for a `with` block."""

    def __init__(self, app):
        import uvicorn

        self.app = app
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    @property
    def scheduler(self):
        return self.app.state.blockpilot.scheduler

    def __enter__(self) -> "LocalServer":
        self.thread.start()
        deadline = time.monotonic() + 60
        while not self.server.started:
            assert self.thread.is_alive() and time.monotonic() < deadline, "the server did not start"
            time.sleep(0.02)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(60)


def start_server(target: Path, drafter: Path, *extra: str) -> LocalServer:
    from blockpilot.commands.serve import load_served_model, server_config
    from blockpilot.serving.app import create_app

    args = serve_args(target, drafter, *extra)
    return LocalServer(create_app(load_served_model(args), server_config(args)))


def reference_text(runner, tokenizer, ids: list[int], max_tokens: int, block_size=None) -> tuple[str, int]:
    """The single-request greedy output of `ids` as (text, number of tokens), ended by the eos."""
    import torch

    out = runner.generate([torch.tensor(ids)], max_new_tokens=max_tokens, end_id=tokenizer.eos_token_id,
                          temperature=0.0, block_size=block_size, return_dict=True)
    length = int(out["sequence_lengths"][0, 0])
    tokens = out["output_ids"][0, 0, len(ids):length].tolist()
    return tokenizer.decode(tokens, skip_special_tokens=True), len(tokens)


def wait_until(predicate, timeout: float = 10.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


def healthy(url: str) -> bool:
    """True when the server at `url` answers /health with 200."""
    import httpx

    try:
        return httpx.get(f"{url}/health", timeout=2).status_code == 200
    except httpx.TransportError:
        return False
