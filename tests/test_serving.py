"""`blockpilot serve`: the official `openai` client against the server on localhost (uvicorn in a
thread, a tiny model), streaming and not; T=0 outputs equal single-request outputs; OpenAI-style
errors; a full queue answers 429 at once; a disconnect frees its decoder slot; metrics; SIGTERM
drains; and the pure text/stop-string helpers."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest

from cli_fixtures import byte_tokenizer
from fixtures import load_script
from serving_fixtures import MODEL, free_port, healthy, make_served_dirs, reference_text, start_server, wait_until

from blockpilot.serving.text import CompletionText, held_back

CHATS = ["hello there", "write a haiku", "what is 2+2?", "tell me a story", "sort a list", "why is the sky blue"]


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    return make_served_dirs(tmp_path_factory.mktemp("serve"))


@pytest.fixture(scope="module")
def reference(dirs):
    """A runner and tokenizer of their own (the server's runner belongs to its scheduler thread)."""
    from blockpilot.runtime.runner import Runner
    from blockpilot.text import load_tokenizer

    return Runner.from_dir(dirs[0], drafter_dir=dirs[1]), load_tokenizer(dirs[0])


@pytest.fixture(scope="module")
def server(dirs):
    with start_server(*dirs, "--max-batch", "8", "--max-queue", "8") as running:
        yield running


def client(server, cls=openai.OpenAI):
    return cls(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


def chat_ids(tokenizer, text: str) -> list[int]:
    from blockpilot.text import chat_prompt_ids

    return chat_prompt_ids(tokenizer, text)


# ---------------------------------------------------------------- the OpenAI API


def test_chat_completion_equals_single_request_output_with_usage_and_extension(server, reference):
    runner, tokenizer = reference
    expected, n_tokens = reference_text(runner, tokenizer, chat_ids(tokenizer, CHATS[0]), 40)
    reply = client(server).chat.completions.create(model=MODEL, messages=[{"role": "user", "content": CHATS[0]}],
                                                   max_tokens=40, temperature=0)
    choice = reply.choices[0]
    assert choice.message.role == "assistant" and choice.message.content == expected
    assert choice.finish_reason == ("length" if n_tokens == 40 else "stop")
    prompt_len = len(chat_ids(tokenizer, CHATS[0]))
    assert (reply.usage.prompt_tokens, reply.usage.completion_tokens, reply.usage.total_tokens) == (
        prompt_len, n_tokens, prompt_len + n_tokens)
    assert reply.object == "chat.completion" and reply.model == MODEL
    assert reply.blockpilot["block_size"] == 4 and reply.blockpilot["tau"] >= 1.0  # the drafter's default


def test_streamed_chat_chunks_add_up_to_the_whole_reply_and_end_with_done(server):
    messages = [{"role": "user", "content": CHATS[1]}]
    whole = client(server).chat.completions.create(model=MODEL, messages=messages, max_tokens=30, temperature=0)
    chunks = list(client(server).chat.completions.create(model=MODEL, messages=messages, max_tokens=30,
                                                         temperature=0, stream=True,
                                                         stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    finals = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finals) == 1 and finals[0].choices[0].finish_reason == whole.choices[0].finish_reason
    assert finals[0].blockpilot["block_size"] == whole.blockpilot["block_size"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    with httpx.stream("POST", f"{server.url}/v1/chat/completions", timeout=30,
                      json={"model": MODEL, "messages": messages, "max_tokens": 5, "stream": True}) as raw:
        assert raw.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in raw.iter_lines() if line]
    assert lines[-1] == "data: [DONE]" and all(line.startswith("data: ") for line in lines)


def test_completions_take_text_or_token_ids_and_stream_the_same_text(server, reference):
    runner, tokenizer = reference
    ids = tokenizer("once upon a time")["input_ids"]
    expected, _ = reference_text(runner, tokenizer, ids, 24)
    api = client(server)
    by_text = api.completions.create(model=MODEL, prompt="once upon a time", max_tokens=24, temperature=0)
    by_ids = api.completions.create(model=MODEL, prompt=ids, max_tokens=24, temperature=0)
    streamed = "".join(c.choices[0].text for c in api.completions.create(
        model=MODEL, prompt="once upon a time", max_tokens=24, temperature=0, stream=True) if c.choices)
    assert by_text.choices[0].text == by_ids.choices[0].text == streamed == expected
    assert by_text.object == "text_completion" and by_text.usage.prompt_tokens == len(ids)


def test_stop_string_cuts_the_text_and_finishes_with_stop(server):
    api = client(server)
    full = api.completions.create(model=MODEL, prompt="abc", max_tokens=60, temperature=0,
                                  extra_body={"ignore_eos": True}).choices[0].text
    cut = next(i for i in range(3, len(full)) if full[i] != "\ufffd" and full.index(full[i]) == i)
    for stream in (False, True):
        reply = api.completions.create(model=MODEL, prompt="abc", max_tokens=60, temperature=0, stop=[full[cut]],
                                       stream=stream, extra_body={"ignore_eos": True})
        chunks = list(reply) if stream else [reply]
        assert "".join(c.choices[0].text for c in chunks if c.choices) == full[:cut]
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"


def test_concurrent_requests_at_several_block_sizes_equal_their_single_request_outputs(server, reference):
    runner, tokenizer = reference
    sizes = [2, 3, 4, 2, 3, 4]
    expected = [reference_text(runner, tokenizer, chat_ids(tokenizer, text), 32, block_size=k)[0]
                for text, k in zip(CHATS, sizes)]

    async def ask_all():
        api = client(server, openai.AsyncOpenAI)
        replies = await asyncio.gather(*(
            api.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": text}], max_tokens=32,
                                        temperature=0, extra_body={"block_size": k})
            for text, k in zip(CHATS, sizes)))
        await api.close()
        return replies

    replies = asyncio.run(ask_all())
    assert [r.choices[0].message.content for r in replies] == expected
    assert [r.blockpilot["block_size"] for r in replies] == sizes


def test_models_and_health(server):
    assert [m.id for m in client(server).models.list()] == [MODEL]
    health = httpx.get(f"{server.url}/health").json()
    assert health["status"] == "ok" and health["model"] == MODEL
    assert httpx.get(f"{server.url}/v1/models/other").status_code == 404


# ---------------------------------------------------------------- errors


def _error(response: httpx.Response) -> dict:
    body = response.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    return body["error"]


def _chat(**fields) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], **fields}


@pytest.mark.parametrize("path, body, status, param", [
    ("/v1/chat/completions", b'{"model": "tiny", "messages": [', 400, None),
    ("/v1/chat/completions", _chat(temperature="hot"), 400, "temperature"),
    ("/v1/chat/completions", _chat(max_tokens=0), 400, "max_tokens"),
    ("/v1/chat/completions", _chat(model="gpt-4"), 404, "model"),
    ("/v1/chat/completions", {"model": MODEL, "messages": []}, 400, "messages"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "wizard", "content": "hi"}]}, 400,
     "messages.0.role"),
    ("/v1/chat/completions", _chat(max_tokens=100_000), 400, "max_tokens"),
    ("/v1/chat/completions", _chat(n=2), 400, "n"),
    ("/v1/chat/completions", _chat(logprobs=True), 400, "logprobs"),
    ("/v1/chat/completions", _chat(block_size=99), 400, None),
    ("/v1/completions", {"model": MODEL, "prompt": ""}, 400, "prompt"),
    ("/v1/completions", {"model": MODEL, "prompt": [500, 1]}, 400, None),  # ids outside the vocabulary
    ("/v1/completions", {"model": MODEL}, 400, "prompt"),
    ("/v1/completions", {"model": MODEL, "prompt": [65] * 4000, "max_tokens": 94}, 400, "max_tokens"),  # + block 4
])
def test_bad_requests_get_openai_error_bodies_and_4xx(server, path, body, status, param):
    kwargs = {"content": body, "headers": {"content-type": "application/json"}} if isinstance(body, bytes) \
        else {"json": body}
    response = httpx.post(f"{server.url}{path}", timeout=30, **kwargs)
    assert response.status_code == status, response.text
    error = _error(response)
    assert error["message"] and error["type"]
    if param is not None:
        assert error["param"] == param
    if isinstance(body, bytes):  # not JSON: no field to name
        assert error["param"] is None
    if param == "max_tokens" and status == 400 and "max_tokens" in body and body["max_tokens"] > 1:
        assert error["code"] == "context_length_exceeded" and "cache capacity (4096 positions)" in error["message"]


def test_errors_reach_the_openai_client_as_its_exception_types(server):
    api = client(server)
    with pytest.raises(openai.NotFoundError):
        api.chat.completions.create(model="gpt-4", messages=[{"role": "user", "content": "hi"}])
    with pytest.raises(openai.BadRequestError, match="context_length_exceeded|exceeds the cache"):
        api.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=100_000)
    assert _error(httpx.get(f"{server.url}/v1/nowhere"))["type"] == "not_found_error"


# ---------------------------------------------------------------- capacity and disconnects


LONG = {"model": MODEL, "prompt": "a", "max_tokens": 3000, "stream": True, "ignore_eos": True, "temperature": 0}


class StreamInThread:
    """A streaming request on a thread of its own: `first_line` is set once its first event
    arrives (it waited in the queue until then); `hang_up()` closes the connection."""

    def __init__(self, url: str, body: dict):
        self.first_line, self._release = threading.Event(), threading.Event()
        self.thread = threading.Thread(target=self._run, args=(url, body), daemon=True)
        self.thread.start()

    def _run(self, url: str, body: dict) -> None:
        with httpx.Client(timeout=120) as http, http.stream("POST", f"{url}/v1/completions", json=body) as stream:
            lines = stream.iter_lines()  # kept: a dropped iterator closes the response
            next(lines)
            self.first_line.set()
            self._release.wait(120)

    def hang_up(self) -> None:
        self._release.set()
        self.thread.join(60)


def test_full_queue_answers_429_at_once_and_a_disconnect_frees_the_slot(dirs):
    with start_server(*dirs, "--max-batch", "1", "--max-queue", "1") as small, httpx.Client(timeout=60) as http:
        with http.stream("POST", f"{small.url}/v1/completions", json=LONG) as running:
            lines = running.iter_lines()  # kept: a dropped iterator closes the response
            next(lines)  # admitted: the one slot is taken
            assert small.scheduler.active == 1
            queued = StreamInThread(small.url, LONG)
            wait_until(lambda: small.scheduler.waiting == 1, what="the second request to queue")
            began = time.monotonic()
            refused = http.post(f"{small.url}/v1/completions", json={**LONG, "stream": False})
            assert refused.status_code == 429 and time.monotonic() - began < 5
            assert _error(refused)["code"] == "rate_limit_exceeded"
            with pytest.raises(openai.RateLimitError):
                client(small).completions.create(model=MODEL, prompt="a", max_tokens=5)
            assert not queued.first_line.is_set()
        # The first client went away (~3000 tokens early): its slot goes to the queued request.
        assert queued.first_line.wait(30)
        assert small.scheduler.waiting == 0 and small.scheduler.active == 1
        queued.hang_up()
        wait_until(lambda: small.scheduler.active == 0, what="the second disconnect to free its slot")
        metrics = http.get(f"{small.url}/metrics").text
    assert 'blockpilot_generations_total{finish_reason="cancelled"} 2.0' in metrics
    assert 'blockpilot_requests_total{path="/v1/completions",status="429"} 2.0' in metrics


def test_clients_that_disconnect_before_the_end_free_their_slots_at_once(dirs):
    with start_server(*dirs, "--max-batch", "2") as running_server:
        url = running_server.url
        with pytest.raises(httpx.ReadTimeout), httpx.Client(timeout=httpx.Timeout(60, read=1.0)) as http:
            http.post(f"{url}/v1/completions", json={**LONG, "stream": False})
        # The client hung up after 1 s of a whole reply; the request had thousands of tokens left.
        wait_until(lambda: running_server.scheduler.active == 0, timeout=10, what="the slot to be freed")
        chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3000,
                "ignore_eos": True, "stream": True}
        with httpx.Client(timeout=60) as http, http.stream("POST", f"{url}/v1/chat/completions", json=chat) as stream:
            lines = stream.iter_lines()
            assert '"role": "assistant"' in next(lines)  # only the opening chunk has been read
            assert running_server.scheduler.active == 1
        wait_until(lambda: running_server.scheduler.active == 0, timeout=10, what="the stream's slot to be freed")
        assert running_server.scheduler.waiting == 0
        metrics = httpx.get(f"{url}/metrics").text
    assert 'blockpilot_generations_total{finish_reason="cancelled"} 2.0' in metrics


# ---------------------------------------------------------------- metrics


def test_metrics_text_has_every_metric_family_with_the_requests_counted(dirs):
    with start_server(*dirs) as fresh:
        reply = client(fresh).completions.create(model=MODEL, prompt="count me", max_tokens=12, temperature=0,
                                                 extra_body={"block_size": 2})
        text = httpx.get(f"{fresh.url}/metrics").text
    for family in ("blockpilot_requests_total", "blockpilot_prompt_tokens_total", "blockpilot_completion_tokens_total",
                   "blockpilot_tau_bucket", "blockpilot_block_size_chosen_total", "blockpilot_queue_length",
                   "blockpilot_active_requests", "blockpilot_step_seconds_bucket", "blockpilot_step_requests_bucket",
                   "blockpilot_generations_total"):
        assert family in text, family
    assert 'blockpilot_requests_total{path="/v1/completions",status="200"} 1.0' in text
    assert f"blockpilot_completion_tokens_total {float(reply.usage.completion_tokens)}" in text
    assert f"blockpilot_prompt_tokens_total {float(reply.usage.prompt_tokens)}" in text
    assert 'blockpilot_block_size_chosen_total{block_size="2"} 1.0' in text
    assert "blockpilot_tau_count 1.0" in text


# ---------------------------------------------------------------- SIGTERM


def test_sigterm_refuses_new_requests_drains_the_one_in_flight_and_exits_0(dirs):
    port = free_port()
    command = [sys.executable, "-m", "blockpilot", "serve", "--target", str(dirs[0]), "--drafter", str(dirs[1]),
               "--served-model-name", MODEL, "--port", str(port), "--log-level", "warning", "--drain-seconds", "60"]
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until(lambda: healthy(url) or proc.poll() is not None, timeout=120, what="the server to start")
        assert proc.poll() is None, proc.stdout.read()
        request = {**LONG, "max_tokens": 800}
        with httpx.Client(timeout=120) as http, http.stream("POST", f"{url}/v1/completions", json=request) as stream:
            lines = stream.iter_lines()
            next(lines)
            proc.send_signal(signal.SIGTERM)
            time.sleep(0.5)
            try:  # a new request: refused (503) or no longer connected at all
                assert httpx.get(f"{url}/health", timeout=5).status_code == 503
            except httpx.TransportError:
                pass
            events = [json.loads(line[6:]) for line in lines if line.startswith("data: {")]
        assert events[-1]["choices"][0]["finish_reason"] == "length"  # the request ran to its end
        assert proc.wait(timeout=90) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()



# ---------------------------------------------------------------- command line


def test_serve_without_ray_refuses_replicas_in_one_line(capsys):
    from blockpilot.cli import main

    assert main(["serve", "--replicas", "2"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["blockpilot serve: error: --replicas and --ray-address need --ray"]


@pytest.mark.parametrize("where, message", [
    (["--port", "70000"], "--port 70000 is not a TCP port; pass one in 1..65535 (0: any free port)"),
    (["--port", "-1"], "--port -1 is not a TCP port; pass one in 1..65535 (0: any free port)"),
    (["--host", "999.1.1.1"], "--host 999.1.1.1 is not an address"),
    (["--host", "192.0.2.1"], "cannot listen on 192.0.2.1:"),  # TEST-NET-1: no machine's own address
    (["--port", "in-use"], "(address already in use); pass another --port, or stop the process listening there"),
])
def test_serve_refuses_an_address_it_cannot_listen_on_in_one_line_before_loading_the_model(
        where, message, dirs, monkeypatch, capsys):
    import socket

    from blockpilot.cli import main
    from blockpilot.commands import serve

    def never(args):
        raise AssertionError("the model was loaded before the address was checked")

    monkeypatch.setattr(serve, "load_served_model", never)
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        where = [str(busy.getsockname()[1]) if w == "in-use" else w for w in where]
        code = main(["serve", "--target", str(dirs[0]), "--drafter", str(dirs[1]), *where])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2
    assert len(err) == 1 and err[0].startswith("blockpilot serve: error: ") and message in err[0], err


def test_serve_on_port_0_listens_on_a_free_port_and_prints_it(dirs):
    command = [sys.executable, "-m", "blockpilot", "serve", "--target", str(dirs[0]), "--drafter", str(dirs[1]),
               "--served-model-name", MODEL, "--port", "0", "--log-level", "warning"]
    proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        line = next(line for line in proc.stderr if line.startswith("blockpilot serve: "))
        url = line.split(" on ", 1)[1].split("/v1", 1)[0]
        port = int(url.rsplit(":", 1)[1])
        assert url == f"http://127.0.0.1:{port}" and port > 0, line
        wait_until(lambda: healthy(url) or proc.poll() is not None, timeout=60, what="the server to start")
        assert healthy(url)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


# ---------------------------------------------------------------- text and stop strings


def _byte_ids(text: str) -> list[int]:
    return list(text.encode("utf-8"))


def test_text_holds_back_an_incomplete_character_and_a_possible_stop_string():
    text = CompletionText(byte_tokenizer(), stop=["END"])
    euro = _byte_ids("€")
    assert text.add(_byte_ids("price ") + euro[:2]) == "price "  # half a character waits
    assert text.add(euro[2:] + _byte_ids(" E")) == "€ "  # "E" may start "END"
    assert text.add(_byte_ids("x")) == "Ex"  # it did not
    assert text.add(_byte_ids("EN")) == ""
    assert text.add(_byte_ids("D and more")) == "" and text.stopped
    assert text.sent == "price € Ex"


def test_a_stop_string_inside_one_token_batch_cuts_there_and_final_releases_the_rest():
    text = CompletionText(byte_tokenizer(), stop=["\n\n", "###"])
    assert text.add(_byte_ids("one\ntwo##")) == "one\ntwo"
    assert text.add(_byte_ids("#three")) == "" and text.stopped and text.sent == "one\ntwo"
    plain = CompletionText(byte_tokenizer(), stop=["###"])
    assert plain.add(_byte_ids("tail #"), final=False) == "tail "
    assert plain.add([], final=True) == "#"


def test_held_back_is_the_longest_tail_that_starts_a_stop_string():
    assert held_back("abcEN", ("END",)) == 2
    assert held_back("abc", ("END",)) == 0
    assert held_back("ab##", ("###", "#x")) == 2
    assert held_back("x", ()) == 0


# ---------------------------------------------------------------- scripts/load_test.py


def test_load_test_script_starts_a_server_and_reports_every_level_with_nothing_lost(dirs, tmp_path, capsys):
    load_test = load_script("load_test")
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in CHATS[:3]))
    out = tmp_path / "load.json"
    code = load_test.main(["--serve-args", f"--target {dirs[0]} --drafter {dirs[1]} --max-batch 4",
                           "--prompts", str(prompts), "--requests", "5", "--concurrency", "1,3",
                           "--max-tokens", "16", "--json", str(out)])
    assert code == 0
    report = json.loads(out.read_text())
    assert [level["concurrency"] for level in report["levels"]] == [1, 3]
    for level in report["levels"]:
        assert (level["requests"], level["lost"], level["wrong"]) == (5, 0, 0)
        assert level["tokens_per_s"] > 0 and level["ttft_p50_s"] <= level["latency_p50_s"]
        assert level["block_sizes"] == {"4": 5}
    assert "| 3 | 5 | 0 | 0 |" in capsys.readouterr().out
    assert load_test.percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5
