"""`blockpilot serve`: the OpenAI-compatible HTTP server (FastAPI + uvicorn), or N replicas of it
on Ray Serve (`--ray --replicas N`).

The models come from `commands.common.open_runner` like `generate`'s: without `--target` or
`--engine-dir` the embedded SmolLM2-135M-Instruct with its shipped drafter and predictor. The
server's pieces are in `blockpilot.serving`; this module only parses options and loads the model
(in each Ray replica's own process, through the picklable `load_served_model`).
"""

from __future__ import annotations

import argparse
import functools
import sys

from blockpilot.commands.common import (add_lookup_arg, add_model_args, add_verify_length_arg, finite_float,
                                        open_runner)
from blockpilot.errors import UserError


def add_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "serve",
        help="serve an OpenAI-compatible HTTP API (batched speculative decoding; Ray Serve replicas)",
        description="Serve /v1/completions and /v1/chat/completions (streaming too), /v1/models, /health and "
        "/metrics over HTTP. Requests are decoded together, grouped by the block size chosen for each; a "
        "full waiting queue answers 429; SIGTERM drains the requests in flight, then exits.",
    )
    add_model_args(p)
    add_lookup_arg(p)
    add_verify_length_arg(p)
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0: every interface)")
    p.add_argument("--port", type=int, default=8000,
                   help="TCP port (0: any free one, printed at start; not with --ray)")
    p.add_argument("--served-model-name", help="the model id clients send (default: the target's directory "
                   "name, SmolLM2-135M-Instruct for the embedded default)")
    p.add_argument("--max-batch", type=int, default=16, help="requests decoded together at most (per replica)")
    p.add_argument("--max-queue", type=int, default=64,
                   help="requests waiting for a decoder slot at most; one more is answered 429 (per replica)")
    p.add_argument("--speculative-disable-by-batch-size", type=int, default=4, metavar="N",
                   help="a request without a block size of its own that arrives while N or more are in flight "
                   "decodes plainly (block size 1): with many rows a verify is compute-bound and plain batched "
                   "decoding gives more tokens/s (measured on 2 CPU cores: 16 slots, 215 vs 156 tok/s); 0: never")
    p.add_argument("--default-max-tokens", type=int, default=256,
                   help="token budget of a chat request that sets no max_tokens (capped by the cache)")
    p.add_argument("--drain-seconds", type=finite_float, default=30.0,
                   help="on SIGTERM, how long the requests in flight may take to finish")
    p.add_argument("--log-level", default="info", choices=("critical", "error", "warning", "info", "debug"),
                   help="uvicorn's log level")
    ray = p.add_argument_group("Ray Serve")
    ray.add_argument("--ray", action="store_true", help="serve N replicas on Ray Serve instead of one uvicorn")
    ray.add_argument("--replicas", type=int, default=1, help="replicas, each loading its own model (with --ray)")
    ray.add_argument("--ray-address", help="a running Ray cluster to deploy to (e.g. auto); default: start a "
                     "local one on this machine")
    ray.add_argument("--replica-cpus", type=finite_float, default=1.0, help="CPUs Ray reserves per replica")
    ray.add_argument("--replica-gpus", type=finite_float, default=0.0, help="GPUs Ray reserves per replica")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    config = server_config(args)
    if not args.ray and (args.replicas != 1 or args.ray_address):
        raise UserError("--replicas and --ray-address need --ray")
    _check_installed("ray" if args.ray else None)
    from blockpilot.serving.app import create_app, listening_socket, run_server

    if args.ray:
        if args.port == 0:
            raise UserError("--ray needs a fixed --port (Ray Serve's proxy listens on it); pass one in 1..65535")
        listening_socket(args.host, args.port).close()  # a port in use or a bad --host fails now, in one line
        from blockpilot.serving.ray_deployment import RayOptions, serve_until_signal

        options = RayOptions(replicas=args.replicas, replica_cpus=args.replica_cpus,
                             replica_gpus=args.replica_gpus, address=args.ray_address)
        print(f"blockpilot serve: {args.replicas} Ray Serve replicas on http://{_url_host(args.host)}:{args.port}/v1 "
              "(loading the model in each)", file=sys.stderr, flush=True)
        serve_until_signal(functools.partial(load_served_model, args), config, options, host=args.host,
                           port=args.port)
        return 0
    sock = listening_socket(args.host, args.port)  # a port in use fails now, not after the model has loaded
    try:
        model = load_served_model(args)
    except BaseException:
        sock.close()
        raise
    port = sock.getsockname()[1]
    print(f"blockpilot serve: {model.name} on http://{_url_host(args.host)}:{port}/v1 (max batch {config.max_batch}, "
          f"queue {config.max_queue})", file=sys.stderr, flush=True)
    run_server(create_app(model, config), sock=sock, log_level=args.log_level)
    return 0


def _url_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host


def server_config(args: argparse.Namespace):
    from blockpilot.serving.app import ServerConfig

    for flag, value, low in (("--max-batch", args.max_batch, 1), ("--max-queue", args.max_queue, 0),
                             ("--default-max-tokens", args.default_max_tokens, 1), ("--replicas", args.replicas, 1)):
        if value < low:
            raise UserError(f"{flag} must be >= {low} (got {value})")
    if args.speculative_disable_by_batch_size < 0:
        raise UserError(f"--speculative-disable-by-batch-size must be >= 0 (got {args.speculative_disable_by_batch_size})")
    if args.drain_seconds < 0:
        raise UserError(f"--drain-seconds must be >= 0 (got {args.drain_seconds})")
    return ServerConfig(max_batch=args.max_batch, max_queue=args.max_queue,
                        default_max_tokens=args.default_max_tokens, drain_timeout_s=args.drain_seconds,
                        disable_speculation_from=args.speculative_disable_by_batch_size or None)


def load_served_model(args: argparse.Namespace):
    """The `ServedModel` for the model options of `args` (a Runner, its tokenizer, its name)."""
    from blockpilot.serving.app import ServedModel
    from blockpilot.text import load_tokenizer

    opened = open_runner(args)
    if opened.note:
        print(f"note: {opened.note}", file=sys.stderr)
    tokenizer = load_tokenizer(opened.choice.tokenizer)
    end_id = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else opened.runner.end_id
    return ServedModel(args.served_model_name or default_model_name(opened.choice), opened.runner, tokenizer, end_id)


def default_model_name(choice) -> str:
    """The embedded model's name, else the engine directory's or the target directory's."""
    from blockpilot.assets.smollm2 import SMOLLM2_DIR_NAME

    if choice.embedded_engine:
        return SMOLLM2_DIR_NAME
    return (choice.engine_dir or choice.target).name


def _check_installed(extra_module: str | None) -> None:
    import importlib.util

    missing = [m for m in ("fastapi", "uvicorn", "prometheus_client", extra_module)
               if m and importlib.util.find_spec(m) is None]
    if missing:
        raise UserError(f"blockpilot serve needs {', '.join(missing)}; install them with "
                        "pip install 'blockpilot[serve]'")
