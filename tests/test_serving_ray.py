"""`blockpilot serve --ray`: a local Ray cluster on this machine, 2 replicas of the server (each
loading the tiny model in its own process through the command's loader), concurrent requests
through Ray Serve's router. Skipped, with the reason, only when Ray cannot start here."""

from __future__ import annotations

import asyncio
import functools
import os

import httpx
import openai
import pytest

from serving_fixtures import MODEL, free_port_for_ray, healthy, make_served_dirs, reference_text, serve_args

ray = pytest.importorskip("ray", reason="ray[serve] is not installed; pip install 'blockpilot[serve]'")

PROMPTS = ["hello", "write a haiku", "what is 2+2?", "tell me a story", "sort a list", "why", "count to ten", "hi"]


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    return make_served_dirs(tmp_path_factory.mktemp("ray"), positions=512)


@pytest.fixture(scope="module")
def ray_url(dirs):
    from blockpilot.commands.serve import load_served_model, server_config
    from blockpilot.serving import ray_deployment
    from blockpilot.text import one_line

    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    try:
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    except Exception as exc:  # noqa: BLE001 - whatever stops Ray here is the reason to skip
        pytest.skip(f"Ray cannot start a local cluster on this machine: {one_line(exc)}")
    args = serve_args(*dirs, "--max-batch", "4", "--max-queue", "8")
    port = free_port_for_ray()
    try:
        ray_deployment.start(functools.partial(load_served_model, args), server_config(args),
                             ray_deployment.RayOptions(replicas=2, replica_cpus=0.5), host="127.0.0.1", port=port)
        yield f"http://127.0.0.1:{port}"
    finally:
        if ray.is_initialized():  # the last test stops it early
            ray_deployment.stop()


def test_two_replicas_behind_the_ray_router_serve_concurrent_requests_losslessly(ray_url, dirs):
    from ray import serve

    from blockpilot.runtime.runner import Runner
    from blockpilot.text import chat_prompt_ids, load_tokenizer

    tokenizer = load_tokenizer(dirs[0])
    runner = Runner.from_dir(dirs[0], drafter_dir=dirs[1])
    expected = [reference_text(runner, tokenizer, chat_prompt_ids(tokenizer, p), 24)[0] for p in PROMPTS]

    async def ask_all():
        api = openai.AsyncOpenAI(base_url=f"{ray_url}/v1", api_key="unused", max_retries=0)
        replies = await asyncio.gather(*(
            api.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": p}], max_tokens=24,
                                        temperature=0) for p in PROMPTS))
        await api.close()
        return replies

    replies = asyncio.run(ask_all())
    assert [r.choices[0].message.content for r in replies] == expected
    status = serve.status().applications["blockpilot"].deployments["BlockPilot"]
    assert status.replica_states.get("RUNNING") == 2
    replicas = {httpx.get(f"{ray_url}/health", timeout=30).json()["replica"] for _ in range(40)}
    assert len(replicas) == 2  # the router spreads requests over both processes


def test_errors_keep_their_status_codes_through_the_ray_proxy(ray_url):
    api = openai.OpenAI(base_url=f"{ray_url}/v1", api_key="unused", max_retries=0)
    with pytest.raises(openai.NotFoundError):
        api.chat.completions.create(model="gpt-4", messages=[{"role": "user", "content": "hi"}])
    with pytest.raises(openai.BadRequestError):
        api.chat.completions.create(model=MODEL, messages=[], max_tokens=4)
    chunks = list(api.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                              max_tokens=8, temperature=0, stream=True))
    assert chunks[-1].choices[0].finish_reason in ("stop", "length")


def test_serve_ray_command_answers_and_exits_0_on_sigterm(ray_url, dirs):
    """The command line's path (its own local cluster, in a subprocess): Ray installs a SIGTERM
    handler of its own that aborts the process; the command's must win and shut Serve down."""
    import signal
    import subprocess
    import sys
    import time

    from serving_fixtures import wait_until

    from blockpilot.serving import ray_deployment

    ray_deployment.stop()  # the module's cluster is not needed beyond this point; free the 2 CPUs
    port = free_port_for_ray()
    command = [sys.executable, "-m", "blockpilot", "serve", "--ray", "--replicas", "1", "--replica-cpus", "0.5",
               "--target", str(dirs[0]), "--drafter", str(dirs[1]), "--served-model-name", MODEL,
               "--port", str(port)]
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "RAY_USAGE_STATS_ENABLED": "0"})
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until(lambda: healthy(url) or proc.poll() is not None, timeout=150, what="serve --ray to start")
        assert proc.poll() is None, proc.stdout.read()[-3000:]
        reply = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0).chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4, temperature=0)
        assert reply.choices[0].finish_reason in ("stop", "length")
        time.sleep(2)  # past the deployment's last status poll
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=90) == 0, proc.stdout.read()[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
