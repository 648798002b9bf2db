"""Step costs: median milliseconds of the backend calls a decode step makes, timed as the loop calls them.

    prefill of `context` tokens, then
    verify(K tokens at that position)          K = 1 is a plain decoding step
    draft(block of K, one new context position) K >= 2

`time_backend` is the instrument (`scripts/bench_steps.py` prints it for every backend and dtype,
`blockpilot build` stores it in the manifest through `measure_step_costs`). `time_decode_loop` times
whole steps of `Runner.generate` at each block size (what the kernels above leave out: acceptance,
cache bookkeeping, Python), which is what the throughput labels use when present. Speculation at block
size K pays when tau(K) / (verify(K) + draft(K)) beats 1 / verify(1), which is what the
throughput labels of `blockpilot label` compare (`blockpilot.builder.manifest.StepCosts`).
"""

from __future__ import annotations

import os
import platform
import statistics
import time
from collections.abc import Iterable
from pathlib import Path

import torch

from blockpilot.builder.manifest import StepCosts

DEFAULT_CONTEXT = 256
DEFAULT_REPEATS = 7


def median_seconds(fn, repeats: int) -> float:
    """Median wall seconds of `repeats` calls of `fn` after one untimed warm-up call."""
    return interleaved_median_seconds({0: fn}, repeats)[0]


def interleaved_median_seconds(fns: dict, repeats: int) -> dict:
    """Median wall seconds of each of `fns` over `repeats` rounds that call every one in turn (after one
    untimed warm-up call each), so that a machine that slows down for a while slows every point alike."""
    for fn in fns.values():
        fn()
    times: dict = {key: [] for key in fns}
    for _ in range(repeats):
        for key, fn in fns.items():
            start = time.perf_counter()
            fn()
            times[key].append(time.perf_counter() - start)
    return {key: statistics.median(values) for key, values in times.items()}


def time_backend(backend, sizes: Iterable[int], context: int, repeats: int) -> tuple[dict, dict, float | None]:
    """Median ms of verify(K) and draft(K) on `backend` at a cache of `context` tokens, all points timed
    in interleaved rounds (`interleaved_median_seconds`).

    Args:
        backend: a `Backend` (with a drafter for the draft timings).
        sizes: K values; those the backend does not support are skipped; draft is timed for K >= 2.
        context: tokens of (random) prompt prefilled before the timed calls.
        repeats: timed calls per point.

    Returns:
        (verify_ms {K: ms}, draft_ms {K: ms}, one_row_ms): the last is an unpadded 1-row step when
        the backend pads plain decoding to `min_rows` rows (else None).
    """
    sizes = [k for k in sorted(set(sizes)) if backend.supports_block_size(k)]
    vocab = backend.target_config.vocab_size
    generator = torch.Generator().manual_seed(0)
    prompt = torch.randint(3, vocab, (1, context), generator=generator)
    device = getattr(backend, "device", "cpu")
    state = backend.new_state(1, context + 2 * max(sizes) + 2)
    prefill = backend.prefill(state, prompt.to(device))
    last, taps = torch.tensor([5], device=device), prefill.taps[:, -1:]
    calls = {}
    for k in sizes:
        block = torch.randint(3, vocab, (1, k), generator=generator).to(device)
        calls[("verify", k)] = lambda block=block: backend.verify(state, block, context)
        if k >= 2 and backend.drafter_config is not None:
            calls[("draft", k)] = lambda k=k: backend.draft(state, last, taps, context - 1, context, k)
    rows = getattr(backend, "min_rows", 1)
    if rows > 1:  # what the padding row of plain decoding costs

        def one_row_step():
            backend.min_rows = 1
            try:
                backend.verify(state, last[:, None], context)
            finally:
                backend.min_rows = rows

        calls[("one_row", 1)] = one_row_step
    seconds = interleaved_median_seconds(calls, repeats)
    ms = {key: 1e3 * value for key, value in seconds.items()}
    verify_ms = {k: v for (kind, k), v in ms.items() if kind == "verify"}
    draft_ms = {k: v for (kind, k), v in ms.items() if kind == "draft"}
    return verify_ms, draft_ms, ms.get(("one_row", 1))


def backend_precision(backend) -> tuple[str, str]:
    """(backend name, dtype name) of a `Backend`: e.g. ("onnxruntime", "fp32"), ("torch", "bf16")."""
    manifest = getattr(backend, "manifest", None)
    if manifest is not None:
        return backend.name, manifest.dtype
    names = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}
    return backend.name, names.get(getattr(backend, "dtype", torch.float32), str(getattr(backend, "dtype", "")))


def machine_class(device: str = "cpu") -> str:
    """What the costs hold for: the CPU model, core count and vector instructions ("AMD EPYC 9B14 x2,
    AVX512+bf16"; see `cpu_vector_isa`), or the CUDA GPU's name."""
    if str(device).startswith("cuda") and torch.cuda.is_available():
        return torch.cuda.get_device_name(torch.device(device))
    model = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{model or platform.processor() or platform.machine()} x{os.cpu_count()}, {cpu_vector_isa()}"


def cpu_vector_isa() -> str:
    """The widest vector instructions torch's CPU kernels use here ("AVX512", "AVX2", ...), plus "+bf16"
    when oneDNN runs bf16 products natively and "+amx" when the CPU has AMX tiles. Two machines sold under
    one CPU name can differ in this, and with it their step costs: a 2-core "AMD EPYC" with AVX-512 and
    AVX512-BF16 streamed weights at 45 GB/s, one without (AVX2) at 19 GB/s, which made every onnxruntime
    forward about 2.4x slower."""
    from blockpilot.models.packed import native_bf16

    amx = getattr(torch.cpu, "_is_amx_tile_supported", lambda: False)()
    return torch.backends.cpu.get_cpu_capability() + ("+bf16" if native_bf16() else "") + ("+amx" if amx else "")


def time_decode_loop(runner, sizes: Iterable[int], context: int, new_tokens: int, rounds: int = 3,
                     prompts: list[torch.Tensor] | None = None) -> dict[int, float]:
    """Wall ms per decode step of `runner.generate` at each block size (prefill and predictor excluded):
    the median over `rounds` rounds, each of which decodes every prompt at every size in turn (the order
    rotated from prompt to prompt), so that the machine's drift over seconds (+-4% between two rounds a
    minute apart on a quiet 2-core VM) falls on every size alike.

    Without `prompts`, a random prompt of `context` tokens is decoded for `new_tokens` tokens (after a
    short warm-up generation) at each size: every draft is rejected, so each step commits one token.
    With `prompts` (1-D id tensors of real requests), each round decodes every prompt at each size and a
    round's step time is its decode time over its steps: the drafts are accepted as they are in use, so
    each step's bookkeeping and the drafter's new context rows are what real requests pay. Every step
    drafts with the drafter (no lookup drafts, `runtime.lookup`) and verifies whole blocks: these are the costs
    of its blocks.
    """
    with runner.settings_set_to(lookup="off", verify_length="full"):
        return _time_decode_loop(runner, sizes, context, new_tokens, rounds, prompts)


def _time_decode_loop(runner, sizes, context, new_tokens, rounds, prompts) -> dict[int, float]:
    if prompts is None:
        vocab = runner.backend.target_config.vocab_size
        prompts = [torch.randint(3, vocab, (context,), generator=torch.Generator().manual_seed(1))]
    sizes = sorted(set(sizes))
    per_step: dict[int, list[float]] = {k: [] for k in sizes}
    for k in sizes:
        runner.generate(prompts[:1], max_new_tokens=4, end_id=-1, block_size=k, return_dict=True)
    for r in range(rounds):
        wall, steps = dict.fromkeys(sizes, 0.0), dict.fromkeys(sizes, 0)
        for i, prompt in enumerate(prompts):  # every size on each prompt in turn, the order rotated
            shift = (r + i) % len(sizes)
            for k in sizes[shift:] + sizes[:shift]:
                start = time.perf_counter()
                out = runner.generate([prompt], max_new_tokens=new_tokens, end_id=-1, block_size=k, return_dict=True)
                timings = out["timings"][0]
                wall[k] += time.perf_counter() - start - timings["prefill_s"] - timings["predictor_s"]
                steps[k] += len(out["accept_lengths"][0])
        for k in sizes:
            per_step[k].append(wall[k] / max(1, steps[k]))
    return {k: round(1e3 * statistics.median(v), 4) for k, v in per_step.items()}


def measure_step_costs(backend, block_sizes: Iterable[int], *, context: int = DEFAULT_CONTEXT,
                       repeats: int = DEFAULT_REPEATS, runner=None, loop_tokens: int = 32,
                       loop_rounds: int = 3, loop_prompts: list[torch.Tensor] | None = None) -> StepCosts:
    """The step-cost table of `backend` at K = 1 and every size of `block_sizes` (seconds).

    `context` is lowered to what the backend's cache holds beside the largest block. With `runner`
    (a `Runner` over `backend`) whole loop steps are timed too (`time_decode_loop`: `loop_rounds`
    rounds of `loop_tokens` tokens at each size, on `loop_prompts` when given).
    """
    sizes = sorted({1, *block_sizes})
    room = backend.max_capacity - 2 * max(sizes) - 2  # the timed calls' cache beside the largest block
    loop_tokens = max(4, min(loop_tokens, room // 2))
    context = max(1, min(context, room - loop_tokens))
    verify_ms, draft_ms, _ = time_backend(backend, sizes, context, repeats)
    loop_ms = time_decode_loop(runner, sizes, context, loop_tokens, loop_rounds, loop_prompts) if runner is not None else {}
    name, dtype = backend_precision(backend)
    threads = torch.get_num_threads() if name == "torch" else None  # onnxruntime: its shared pool
    return StepCosts(name, dtype, machine_class(getattr(backend, "device", "cpu")), context,
                     {k: round(v, 4) for k, v in verify_ms.items()}, {k: round(v, 4) for k, v in draft_ms.items()},
                     threads, loop_ms)


def measure_engine_dir(engine_dir: Path, *, context: int = DEFAULT_CONTEXT, repeats: int = DEFAULT_REPEATS,
                       backend: str | None = None, block_sizes: Iterable[int] | None = None,
                       loop_tokens: int = 32, loop_rounds: int = 3, loop_prompts: list[str] | None = None) -> StepCosts:
    """`measure_step_costs` (kernels and loop steps) on the graphs of an engine directory, opened as
    `Runner.from_dir` would (its fastest usable backend unless `backend` is given; no predictor: a directory
    whose predictor belongs to an earlier drafter is timed too, as `scripts/make_predictor.sh` needs), at
    every built block size (or those of `block_sizes`); the loop steps on `loop_prompts` (texts, as user
    turns of the chat template) when given, else on a random prompt."""
    from blockpilot.builder.manifest import read_manifest
    from blockpilot.runtime.runner import Runner

    from blockpilot.runtime.ort_session import without_cached_copies

    with without_cached_copies():  # `blockpilot build` times its staged directory, renamed afterwards
        runner = Runner.from_engine_dir(engine_dir, backend=backend, use_predictor=False)  # every size is asked for
    sizes = read_manifest(engine_dir, verify_files=False).block_sizes if block_sizes is None else block_sizes
    ids = None
    if loop_prompts:
        from blockpilot.text import chat_prompt_ids, load_tokenizer

        tokenizer = load_tokenizer(engine_dir)
        ids = [torch.tensor(chat_prompt_ids(tokenizer, text)) for text in loop_prompts]
    return measure_step_costs(runner.backend, sizes, context=context, repeats=repeats, runner=runner,
                              loop_tokens=loop_tokens, loop_rounds=loop_rounds, loop_prompts=ids)
