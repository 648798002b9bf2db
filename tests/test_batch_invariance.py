"""Every row of a verify step rounds exactly like a plain decoding step, on every lossless path.

Speculation is lossless only if the target's logits for a position do not depend on how many
tokens the forward carried: otherwise a near-tie can go one way in a K = 1 step and the other in a
K = 8 verify. The paths offered as lossless are checked bit for bit:

    onnxruntime fp32   every forward runs >= 2 rows (one padding row for plain decoding)
    torch bf16         attention after prefill runs `max_block_size` query rows over the whole cache, and
                       so do the products unless this CPU's round every row alike for any row count

(torch fp16 on the CPU is refused for speculation: its rows differ even at one fixed shape.)

and greedy speculative output is compared with plain decoding at every block size. The T = 1
distribution tests of these paths are in `test_sampling.py`. SmolLM2 (slow) is where the kernels
really differ by shape: without the padding rows its rows differ by ~4e-5.
"""

from __future__ import annotations

import pytest
import torch

from blockpilot.errors import UserError
from blockpilot.runtime.runner import Runner

from builder_fixtures import tiny_engine_dir, tiny_models

PROMPT = [5, 17, 42, 8, 11, 3, 29]
REPEATING = [5, 17, 42, 5, 17, 42, 5, 17]  # fits the tiny engine: 8 + 24 tokens + a block of 5 <= 39


def verify_rows_and_steps(backend, prompt: list[int], block: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits `(K, V)` of `block` verified at once, and of the same tokens verified one by one."""
    n, capacity = len(prompt), len(prompt) + 2 * len(block) + 2
    at_once = backend.new_state(1, capacity)
    backend.prefill(at_once, torch.tensor([prompt]))
    rows = backend.verify(at_once, torch.tensor([block]), n).logits[0]
    one_by_one = backend.new_state(1, capacity)
    backend.prefill(one_by_one, torch.tensor([prompt]))
    steps = [backend.verify(one_by_one, torch.tensor([[t]]), n + i).logits[0, 0] for i, t in enumerate(block)]
    return rows, torch.stack(steps)


def tiny_path(tmp_path_factory, path: str):
    if path == "onnxruntime-fp32":
        return Runner.from_dir(tiny_engine_dir(tmp_path_factory, "llama", 24), backend="onnxruntime")
    target, drafter = tiny_models(tmp_path_factory, "llama")
    if path == "torch-bf16-padded":  # every product padded too, as where the products' rows round unlike
        from blockpilot.models.checkpoint import load_drafter, load_target
        from blockpilot.runtime.backend import TorchBackend

        backend = TorchBackend(load_target(target, dtype=torch.bfloat16), load_drafter(drafter, dtype=torch.bfloat16),
                               8, fixed_shape=True, pad_products=True)
        return Runner(backend)
    return Runner.from_dir(target, drafter_dir=drafter, dtype=torch.bfloat16, max_block_size=8)


LOSSLESS_PATHS = ["onnxruntime-fp32", "torch-bf16", "torch-bf16-padded"]


@pytest.mark.parametrize("path", LOSSLESS_PATHS)
def test_verify_rows_equal_plain_decoding_steps_bit_for_bit(tmp_path_factory, path):
    backend = tiny_path(tmp_path_factory, path).backend
    block = [7, 30, 2, 19, 44, 13, 5, 23]
    for k in range(2, 9):
        if not backend.supports_block_size(k):
            continue
        rows, steps = verify_rows_and_steps(backend, PROMPT, block[:k])
        assert torch.equal(rows, steps), f"{path}: K={k} rows differ from K=1 steps by {(rows - steps).abs().max()}"


@pytest.mark.parametrize("path", LOSSLESS_PATHS)
def test_greedy_speculation_equals_plain_decoding_at_every_block_size(tmp_path_factory, path):
    """With and without lookup drafts (`runtime.lookup`), on a prompt that repeats itself so that steps copy."""
    runner = tiny_path(tmp_path_factory, path)
    for prompt in (PROMPT, REPEATING):
        ids = [torch.tensor(prompt)]
        plain = runner.generate(ids, max_new_tokens=24, end_id=-1, block_size=1)
        for lookup in ("greedy", "off"):
            runner.lookup = lookup
            for k in range(2, 9):
                if runner.backend.supports_block_size(k):
                    out = runner.generate(ids, max_new_tokens=24, end_id=-1, block_size=k)
                    assert out.tolist() == plain.tolist(), f"{path}: block size {k}, lookup {lookup}"


def test_padding_rows_leave_no_trace_in_the_committed_cache(tmp_path_factory):
    """A plain decoding step's padding row writes one position past the token; the next step
    overwrites it, so decoding token by token gives the same cache as one prefill of everything."""
    backend = tiny_path(tmp_path_factory, "torch-bf16-padded").backend
    tokens = PROMPT + [7, 30, 2]
    stepped = backend.new_state(1, 16)
    backend.prefill(stepped, torch.tensor([PROMPT]))
    last = None
    for i, t in enumerate(tokens[len(PROMPT):]):
        last = backend.verify(stepped, torch.tensor([[t]]), len(PROMPT) + i).logits[0, 0]
    again = backend.new_state(1, 16)
    backend.prefill(again, torch.tensor([PROMPT]))
    rows = backend.verify(again, torch.tensor([tokens[len(PROMPT):]]), len(PROMPT)).logits[0]
    assert torch.equal(rows[-1], last)


def test_fp16_speculation_on_the_cpu_is_refused_with_one_line(tmp_path_factory):
    target, drafter = tiny_models(tmp_path_factory, "llama")
    with pytest.raises(UserError, match="fp16 on the CPU"):
        Runner.from_dir(target, drafter_dir=drafter, dtype=torch.float16)
    assert Runner.from_dir(target, dtype=torch.float16).backend.drafter_config is None  # plain decoding is fine


def test_bf16_on_a_cpu_without_native_bf16_products_warns_to_use_fp32(tmp_path_factory, monkeypatch):
    import warnings

    from blockpilot.models import packed

    target, drafter = tiny_models(tmp_path_factory, "llama")
    monkeypatch.setattr(packed, "native_bf16", lambda: False)  # as on an AVX2-only CPU
    for dtype, expected in ((torch.bfloat16, 1), (torch.float32, 0)):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            Runner.from_dir(target, drafter_dir=drafter, dtype=dtype)
        assert sum("no native bf16" in str(w.message) for w in caught) == expected, dtype


@pytest.mark.slow
@pytest.mark.parametrize("path", ["onnxruntime-fp32", "torch-bf16"])
def test_smollm2_verify_rows_equal_plain_decoding_steps_bit_for_bit(path):
    from blockpilot.assets import default_drafter_dir
    from blockpilot.assets.smollm2 import smollm2_dir

    if path == "onnxruntime-fp32":
        from blockpilot.builder.embedded import embedded_engine_dir

        backend = Runner.from_dir(embedded_engine_dir(), backend="onnxruntime").backend
    else:
        backend = Runner.from_dir(smollm2_dir(), drafter_dir=default_drafter_dir(), dtype=torch.bfloat16).backend
    generator = torch.Generator().manual_seed(0)
    prompt = torch.randint(3, 49152, (60,), generator=generator).tolist()
    block = torch.randint(3, 49152, (16,), generator=generator).tolist()
    for k in (2, 4, 8, 16):
        rows, steps = verify_rows_and_steps(backend, prompt, block[:k])
        assert torch.equal(rows, steps), f"{path}: K={k} rows differ by {(rows - steps).abs().max()}"


@pytest.mark.parametrize("path", LOSSLESS_PATHS)
def test_one_row_plain_decoding_drops_the_padding_rows_that_plain_decoding_runs(tmp_path_factory, path, monkeypatch):
    """`one_row_plain` (profile baseline ar-1row) runs each plain step as one row; `ar` pads it to the
    rows every verify step has, so that it rounds like them (torch bf16: the attention's query rows, and
    the products' rows too where they do not round alike for every row count)."""
    import torch.nn.functional as F

    runner = tiny_path(tmp_path_factory, path)
    padded, one_row = runner.backend, runner.backend.one_row_plain()
    sdpa = F.scaled_dot_product_attention
    rows_per_call = {}
    for name, backend in (("padded", padded), ("one_row", one_row)):
        state = backend.new_state(1, len(PROMPT) + 4)
        backend.prefill(state, torch.tensor([PROMPT]))
        calls = []
        model = backend.target
        if path == "onnxruntime-fp32":
            run = model.run
            model.run = lambda inputs, caches: calls.append(inputs["input_ids"].shape[1]) or run(inputs, caches)
        else:
            handle = model.register_forward_hook(lambda _m, args, _out: calls.append(args[0].shape[1]))
            monkeypatch.setattr(F, "scaled_dot_product_attention",
                                lambda q, *a, **kw: calls.append(("attention", q.shape[2])) or sdpa(q, *a, **kw))
        try:
            backend.verify(state, torch.tensor([[7]]), len(PROMPT))
        finally:
            if path == "onnxruntime-fp32":
                del model.run
            else:
                handle.remove()
                monkeypatch.setattr(F, "scaled_dot_product_attention", sdpa)
        rows_per_call[name] = calls
    if path == "onnxruntime-fp32":
        assert rows_per_call == {"one_row": [1], "padded": [2]}
        return
    layers = padded.target_config.num_hidden_layers
    assert rows_per_call["one_row"] == [("attention", 1)] * layers + [1]
    assert padded.attention_rows == padded.max_block_size
    assert rows_per_call["padded"] == [("attention", padded.attention_rows)] * layers + [padded.fixed_rows or 1]


def test_bf16_blocks_default_to_the_drafter_training_size(tmp_path_factory):
    """Reduced precision runs every step's attention at the largest block's rows, so unless told the torch
    backend takes blocks up to the drafter's training size there (fp32: twice it) and names the sizes it takes."""
    target, drafter = tiny_models(tmp_path_factory, "llama")  # a drafter trained at block 4
    bf16 = Runner.from_dir(target, drafter_dir=drafter, dtype=torch.bfloat16)
    assert bf16.backend.max_block_size == bf16.backend.attention_rows == 4
    assert Runner.from_dir(target, drafter_dir=drafter).backend.max_block_size == 8
    assert Runner.from_dir(target, drafter_dir=drafter, dtype=torch.bfloat16, max_block_size=12).backend.attention_rows == 12
    with pytest.raises(UserError, match=r"block size 5 is not supported by this torch backend; choose one it supports \(1-4\)"):
        bf16.generate([torch.tensor([1, 2])], max_new_tokens=4, block_size=5)
