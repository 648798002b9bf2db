"""The OpenAI-compatible HTTP server: a FastAPI app over one `Runner`.

    POST /v1/completions, /v1/chat/completions   (stream=true: server-sent events, `data: [DONE]` last)
    GET  /v1/models, /v1/models/{id}, /health, /metrics (Prometheus text)

`create_app(model, config)` builds the app; its lifespan starts a `Scheduler` thread that owns the
`BatchDecoder` (startup) and drains it (shutdown). Handlers tokenize, submit a
`GenerationRequest` and turn the decoder's events into text with `CompletionText`. Errors are
answered with OpenAI-style bodies (`protocol.APIError`); a request whose client disconnects is
cancelled at once, which frees its decoder slot. `run_server` serves an app with uvicorn: on
SIGTERM or SIGINT it answers 503 to new requests, lets the requests in flight finish, then exits.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import os
import socket

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from blockpilot.errors import UserError
from blockpilot.serving import protocol
from blockpilot.serving.metrics import CONTENT_TYPE, ServerMetrics
from blockpilot.serving.protocol import APIError, ChatCompletionRequest, CompletionRequest
from blockpilot.serving.scheduler import QueueFull, Scheduler, ShuttingDown
from blockpilot.serving.text import CompletionText
from blockpilot.text import chat_prompt_ids, one_line

log = logging.getLogger("blockpilot.serving")

REPLICA = f"{socket.gethostname()}:{os.getpid()}"
"""This server process (each Ray replica is one), as /health reports it."""
PATHS = ("/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/metrics")


@dataclasses.dataclass(frozen=True)
class ServedModel:
    """What a server serves: `name` (the `model` clients send), a `Runner`, its tokenizer and the
    end-of-sequence id (the tokenizer's, else the runner's)."""

    name: str
    runner: object
    tokenizer: object
    end_id: int | None


@dataclasses.dataclass(frozen=True)
class ServerConfig:
    """Args:
        max_batch: requests decoded together at most (the decoder's slots).
        max_queue: requests waiting for a slot at most; one more is answered 429.
        default_max_tokens: the token budget of a chat request that sets none (capped by the cache).
        drain_timeout_s: on shutdown, how long requests in flight may take to finish.
        disable_speculation_from: requests without a block size of their own that arrive while
            this many are in flight decode plainly (`BatchDecoder`); None: never.
    """

    max_batch: int = 16
    max_queue: int = 64
    default_max_tokens: int = 256
    drain_timeout_s: float = 30.0
    disable_speculation_from: int | None = None


class ClientGone(Exception):
    """The client disconnected before its response was complete."""


class ServingState:
    """What the handlers share: the model, the config, the metrics and (after startup) the scheduler."""

    def __init__(self, model: ServedModel, config: ServerConfig):
        self.model, self.config = model, config
        self.metrics = ServerMetrics()
        self.scheduler: Scheduler | None = None
        self.draining = False

    def check_open(self, model_name: str) -> None:
        if self.draining or self.scheduler is None or self.scheduler.closing:
            raise APIError(503, "the server is shutting down; retry on another replica", type="unavailable")
        if model_name != self.model.name:
            raise APIError(404, f"model {model_name!r} does not exist; this server serves {self.model.name!r} "
                           "(GET /v1/models)", param="model", code="model_not_found")

    def token_budget(self, max_tokens: int | None, prompt_len: int, block_size) -> int:
        """`max_tokens`, checked against the cache (prompt + max_tokens + the largest block the
        request may draft must fit); when None, the default capped by the room left."""
        capacity = self.scheduler.decoder.max_capacity
        try:
            block = self.model.runner.largest_block(block_size)
        except UserError as exc:
            raise APIError(400, str(exc), param="block_size") from None
        room = capacity - prompt_len - block
        if max_tokens is None and room >= 1:
            return min(self.config.default_max_tokens, room)
        if max_tokens is None or max_tokens > room:
            asked = "" if max_tokens is None else f" + max_tokens ({max_tokens})"
            raise APIError(400, f"prompt ({prompt_len} tokens){asked} + block ({block}) exceeds the cache capacity "
                           f"({capacity} positions); shorten the prompt or lower max_tokens",
                           param="max_tokens" if max_tokens is not None else "messages",
                           code="context_length_exceeded")
        return max_tokens


# ---------------------------------------------------------------- one generation on the event loop


class Generation:
    """One request from submission to its last event, on the event loop.

    `start` submits it and waits for its first event (so a rejected request is answered with a
    status code, not an empty stream); `pieces` yields text increments until it ends, setting
    `finish_reason` ("stop": end token or stop string; "length": the token budget). Leaving
    early (client gone) cancels the request in the decoder.
    """

    def __init__(self, state: ServingState, request, stop: list[str]):
        self.state = state
        self.request = request
        self.text = CompletionText(state.model.tokenizer, stop)
        self.queue: asyncio.Queue = asyncio.Queue()
        self.finish_reason: str | None = None
        self.result = None  # the RequestResult of the latest event
        self._first = None
        self._gone: asyncio.Task | None = None
        self._ticket = None

    async def start(self, http_request: Request, watch_disconnect: bool) -> None:
        loop = asyncio.get_running_loop()

        def deliver(item) -> None:  # on the scheduler thread
            with contextlib.suppress(RuntimeError):  # the loop has closed: nobody is waiting
                loop.call_soon_threadsafe(self.queue.put_nowait, item)

        try:
            self._ticket = self.state.scheduler.submit(self.request, deliver)
        except QueueFull as exc:
            raise APIError(429, f"the server is at capacity ({exc}); retry later", type="rate_limit_exceeded",
                           code="rate_limit_exceeded") from None
        except ShuttingDown:
            raise APIError(503, "the server is shutting down; retry on another replica", type="unavailable") from None
        self._gone = asyncio.ensure_future(_disconnected(http_request))
        try:
            self._first = self._checked(await self._next())
        except APIError:  # the decoder refused it (bad input): nothing ran, nothing to count
            self._ticket = None
            self.close()
            raise
        except BaseException:
            self.close()
            raise
        if not watch_disconnect:  # a StreamingResponse listens for the disconnect itself
            self._gone.cancel()
            self._gone = None

    async def pieces(self):
        """Text increments until the generation ends (an async iterator of str)."""
        try:
            while self.finish_reason is None:
                if self._first is not None:
                    event, self._first = self._first, None
                else:
                    event = self._checked(await self._next())
                self.result = event.result
                delta = self.text.add(list(event.new_tokens), final=event.finished)
                if self.text.stopped:
                    self.finish_reason = "stop"
                elif event.finished:
                    self.finish_reason = "stop" if event.result.finished else "length"
                if delta:
                    yield delta
        finally:
            self.close()

    @property
    def completion_tokens(self) -> int:
        return len(self.text.tokens)

    def close(self) -> None:
        """Cancel the request unless it ended by itself; record its metrics. Idempotent."""
        if self._gone is not None:
            self._gone.cancel()
            self._gone = None
        if self._ticket is None:
            return
        ticket, self._ticket = self._ticket, None
        if self.finish_reason is None or self.text.stopped:
            self.state.scheduler.cancel(ticket)
        self.state.metrics.record_generation(self.finish_reason or "cancelled", len(self.request.input_ids),
                                             self.completion_tokens, self.result)

    async def _next(self):
        if self._gone is None:
            return await self.queue.get()
        get = asyncio.ensure_future(self.queue.get())
        done, _ = await asyncio.wait({get, self._gone}, return_when=asyncio.FIRST_COMPLETED)
        if get in done:
            return get.result()
        get.cancel()
        raise ClientGone()

    @staticmethod
    def _checked(item):
        if isinstance(item, UserError):
            raise APIError(400, str(item))
        if isinstance(item, BaseException):
            raise item
        return item


async def _disconnected(http_request: Request) -> None:
    """Returns when the client disconnects (the request body has been read already)."""
    while (await http_request.receive())["type"] != "http.disconnect":
        pass


# ---------------------------------------------------------------- the app


def create_app(model: ServedModel, config: ServerConfig = ServerConfig()) -> FastAPI:
    """The FastAPI app serving `model` (see the module docstring)."""
    state = ServingState(model, config)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        from blockpilot.runtime.batching import BatchDecoder

        decoder = BatchDecoder(model.runner, max_batch=config.max_batch,
                               disable_speculation_from=config.disable_speculation_from)
        state.scheduler = Scheduler(decoder, max_batch=config.max_batch, max_queue=config.max_queue,
                                    metrics=state.metrics)
        state.scheduler.start()
        yield
        state.draining = True
        if not await asyncio.to_thread(state.scheduler.close, config.drain_timeout_s):
            log.warning("requests still running after %.0f s of draining; stopping anyway", config.drain_timeout_s)

    app = FastAPI(title="BlockPilot", summary="OpenAI-compatible speculative decoding server",
                  lifespan=lifespan)
    app.state.blockpilot = state
    app.add_middleware(CountRequests, metrics=state.metrics)
    _add_error_handlers(app)
    _add_routes(app, state)
    return app


def _add_routes(app: FastAPI, state: ServingState) -> None:
    model = state.model

    @app.get("/health")
    async def health():
        if state.draining or state.scheduler is None or state.scheduler.closing:
            return JSONResponse({"status": "draining"}, status_code=503)
        return {"status": "ok", "model": model.name, "active": state.scheduler.active,
                "waiting": state.scheduler.waiting, "replica": REPLICA}

    @app.get("/metrics")
    async def metrics():
        return Response(state.metrics.text(), media_type=CONTENT_TYPE)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [_model_card(model.name)]}

    @app.get("/v1/models/{name:path}")
    async def model_info(name: str):
        if name != model.name:
            raise APIError(404, f"model {name!r} does not exist; this server serves {model.name!r}",
                           param="model", code="model_not_found")
        return _model_card(model.name)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, http_request: Request):
        state.check_open(body.model)
        protocol.check_supported(body)
        ids = completion_prompt_ids(model.tokenizer, body.prompt)
        generation = await _start(state, body, ids, body.max_tokens, http_request)
        if body.stream:
            return _sse(generation, completion_chunks(generation, body, model.name))
        return await _collect_completion(generation, body, model.name, "text_completion")

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, http_request: Request):
        state.check_open(body.model)
        protocol.check_supported(body)
        ids = chat_prompt_ids_of(model.tokenizer, body.messages)
        generation = await _start(state, body, ids, body.token_budget(), http_request)
        if body.stream:
            return _sse(generation, chat_chunks(generation, body, model.name))
        return await _collect_completion(generation, body, model.name, "chat.completion")


def _model_card(name: str) -> dict:
    return {"id": name, "object": "model", "created": 0, "owned_by": "blockpilot"}


async def _start(state: ServingState, body, ids: list[int], max_tokens, http_request: Request) -> Generation:
    from blockpilot.runtime.batching import GenerationRequest

    request = GenerationRequest(
        input_ids=ids, max_new_tokens=state.token_budget(max_tokens, len(ids), body.block_size),
        temperature=body.temperature, top_k=body.top_k, top_p=body.top_p, seed=body.seed,
        block_size=body.block_size, end_id=-1 if body.ignore_eos else state.model.end_id,
    )
    generation = Generation(state, request, body.stop_strings())
    await generation.start(http_request, watch_disconnect=not body.stream)
    return generation


def completion_prompt_ids(tokenizer, prompt) -> list[int]:
    """Token ids of a completions `prompt`: a string (tokenized as it is), one string in a list,
    or token ids."""
    if isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
        if len(prompt) != 1:
            raise APIError(400, f"prompt holds {len(prompt)} strings; send one prompt per request", param="prompt")
        prompt = prompt[0]
    if isinstance(prompt, str):
        if not prompt:
            raise APIError(400, "prompt is empty; send some text", param="prompt")
        return chat_prompt_ids(tokenizer, prompt, use_chat_template=False)
    if not prompt:
        raise APIError(400, "prompt is empty; send some text or token ids", param="prompt")
    return [int(i) for i in prompt]


def chat_prompt_ids_of(tokenizer, messages) -> list[int]:
    """Token ids of chat `messages` through the tokenizer's chat template (with the generation prompt)."""
    if not messages:
        raise APIError(400, "messages is empty; send at least one message", param="messages")
    if not getattr(tokenizer, "chat_template", None):
        raise APIError(400, "this model's tokenizer has no chat template; use /v1/completions", param="messages")
    turns = [{"role": m.role, "content": m.text()} for m in messages]
    try:
        ids = tokenizer.apply_chat_template(turns, add_generation_prompt=True, tokenize=True)
    except Exception as exc:  # noqa: BLE001 - the template rejects the conversation (e.g. role order)
        raise APIError(400, f"the chat template rejects these messages ({one_line(exc)})", param="messages") from None
    return [int(i) for i in (ids["input_ids"] if hasattr(ids, "keys") else ids)]


# ---------------------------------------------------------------- responses


async def _collect_completion(generation: Generation, body, model_name: str, kind: str):
    try:
        text = "".join([piece async for piece in generation.pieces()])
    except ClientGone:
        return Response(status_code=499)
    choice = ({"index": 0, "message": {"role": "assistant", "content": text}} if kind == "chat.completion"
              else {"index": 0, "text": text})
    choice.update(finish_reason=generation.finish_reason, logprobs=None)
    return {
        "id": protocol.new_id("chatcmpl" if kind == "chat.completion" else "cmpl"), "object": kind,
        "created": protocol.now(), "model": model_name, "choices": [choice],
        "usage": protocol.usage(len(generation.request.input_ids), generation.completion_tokens),
        "blockpilot": protocol.extension(generation.result),
    }


def _sse(generation: Generation, chunks) -> StreamingResponse:
    """Server-sent events of `chunks`; however the stream ends (a disconnect cancels it at any
    `yield`), `generation` is closed, so its decoder slot is freed."""
    async def events():
        try:
            async for chunk in chunks:
                yield f"data: {json.dumps(chunk, ensure_ascii=False)}\n\n"
        except APIError as exc:  # the headers are out: report the error in the stream
            yield f"data: {json.dumps(exc.body())}\n\n"
        except Exception as exc:  # noqa: BLE001 - a bug after the headers went out; the traceback is logged
            log.exception("generation failed mid-stream")
            yield f"data: {json.dumps(protocol.error_body(one_line(exc), 'internal_error'))}\n\n"
        finally:
            generation.close()
        yield "data: [DONE]\n\n"

    return StreamingResponse(events(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


def _stream_tail(generation: Generation, body, base: dict, last_choice: dict):
    """The last chunk (finish reason, the blockpilot field) and, if asked, the usage chunk."""
    yield {**base, "choices": [{**last_choice, "finish_reason": generation.finish_reason}],
           "blockpilot": protocol.extension(generation.result)}
    if body.include_usage():
        yield {**base, "choices": [],
               "usage": protocol.usage(len(generation.request.input_ids), generation.completion_tokens)}


async def chat_chunks(generation: Generation, body, model_name: str):
    base = {"id": protocol.new_id("chatcmpl"), "object": "chat.completion.chunk", "created": protocol.now(),
            "model": model_name}
    yield {**base, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}]}
    async for piece in generation.pieces():
        yield {**base, "choices": [{"index": 0, "delta": {"content": piece}, "finish_reason": None}]}
    for chunk in _stream_tail(generation, body, base, {"index": 0, "delta": {}}):
        yield chunk


async def completion_chunks(generation: Generation, body, model_name: str):
    base = {"id": protocol.new_id("cmpl"), "object": "text_completion", "created": protocol.now(),
            "model": model_name}
    async for piece in generation.pieces():
        yield {**base, "choices": [{"index": 0, "text": piece, "finish_reason": None, "logprobs": None}]}
    for chunk in _stream_tail(generation, body, base, {"index": 0, "text": "", "logprobs": None}):
        yield chunk


# ---------------------------------------------------------------- errors and request counts


def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def api_error(_: Request, exc: APIError):
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.exception_handler(RequestValidationError)
    async def invalid_request(_: Request, exc: RequestValidationError):
        return JSONResponse(validation_error_body(exc.errors()), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, exc: StarletteHTTPException):
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return JSONResponse(protocol.error_body(str(exc.detail), kind), status_code=exc.status_code)

    @app.exception_handler(Exception)
    async def internal_error(_: Request, exc: Exception):
        log.exception("request failed")
        return JSONResponse(protocol.error_body(f"internal error: {one_line(exc)}", "internal_error"), status_code=500)


def validation_error_body(errors) -> dict:
    """An OpenAI-style body for pydantic's errors: the first error names the field."""
    first = errors[0] if errors else {"loc": (), "msg": "invalid request", "type": ""}
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    if first.get("type") == "json_invalid":  # its loc is a character position, not a field
        message, loc = f"the request body is not valid JSON ({first.get('msg')}); send a JSON object", []
    else:
        where = ".".join(loc) or "body"
        message = f"{where}: {first.get('msg')}" + (f" (and {len(errors) - 1} more)" if len(errors) > 1 else "")
    return protocol.error_body(message, "invalid_request_error", ".".join(loc) or None)


class CountRequests:
    """ASGI middleware: counts HTTP requests by path and status code (`blockpilot_requests_total`).
    Pure ASGI (not BaseHTTPMiddleware), so streaming and disconnects pass through untouched."""

    def __init__(self, app, metrics: ServerMetrics):
        self.app, self.metrics = app, metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        status = {"code": "disconnected"}

        async def send_counted(message):
            if message["type"] == "http.response.start":
                status["code"] = str(message["status"])
            await send(message)

        try:
            await self.app(scope, receive, send_counted)
        finally:
            path = scope.get("path", "")
            path = path if path in PATHS else ("/v1/models/{id}" if path.startswith("/v1/models/") else "other")
            self.metrics.requests.labels(path, status["code"]).inc()


# ---------------------------------------------------------------- uvicorn


def listening_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to `(host, port)` for `run_server` (port 0: a free one, see `getsockname`).

    `blockpilot serve` binds it before loading the model, so that a port in use, a port out of range or
    an address that is not this machine's ends at once in one line (`UserError`); uvicorn, left to bind
    itself, logged the error and exited 1 after the model had loaded, and took a port above 65535 without
    complaint.

    Raises:
        UserError: the port is outside 0..65535, the host does not resolve, or the address cannot be bound.
    """
    import errno

    if not 0 <= port <= 65535:
        raise UserError(f"--port {port} is not a TCP port; pass one in 1..65535 (0: any free port)")
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                             flags=socket.AI_PASSIVE)[0]
    except (socket.gaierror, UnicodeError) as exc:
        raise UserError(f"--host {host} is not an address ({getattr(exc, 'strerror', None) or exc}); pass one of "
                        "this machine's, e.g. 127.0.0.1, or 0.0.0.0 for every interface") from None
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn does: restart over TIME_WAIT
    try:
        sock.bind(address)
    except OSError as exc:
        sock.close()
        hint = {errno.EADDRINUSE: "pass another --port, or stop the process listening there",
                errno.EACCES: "ports below 1024 need privileges; pass a --port above 1023",
                errno.EADDRNOTAVAIL: "pass one of this machine's addresses with --host, e.g. 127.0.0.1 or 0.0.0.0",
                }.get(exc.errno, "check --host and --port")
        raise UserError(f"cannot listen on {host}:{port} ({(exc.strerror or str(exc)).lower()}); {hint}") from None
    sock.set_inheritable(True)
    return sock


def run_server(app: FastAPI, *, sock: socket.socket, log_level: str = "info") -> None:
    """Serve `app` on the bound socket `sock` (`listening_socket`) until SIGTERM/SIGINT; then answer 503
    to new requests, let those in flight finish (up to the app's `drain_timeout_s`), drain the
    scheduler and return. The socket is closed on return."""
    import signal

    import uvicorn

    state: ServingState = app.state.blockpilot

    class DrainingServer(uvicorn.Server):
        def handle_exit(self, sig, frame):
            state.draining = True
            super().handle_exit(sig, frame)

    host, port = sock.getsockname()[:2]
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level,
                            timeout_graceful_shutdown=int(state.config.drain_timeout_s) or None)
    # uvicorn re-raises the signal it caught once it has shut down; a no-op handler makes a
    # drained shutdown a normal return (exit status 0).
    previous = {sig: signal.signal(sig, lambda *_: None) for sig in (signal.SIGTERM,)}
    try:
        DrainingServer(config).run(sockets=[sock])
    finally:
        sock.close()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
