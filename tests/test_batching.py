"""Batched decoding: every request of a batch gets exactly what it would get alone.

Requests of different prompt lengths decode together, finish at different steps, join a running
batch and leave it; the requests that share a block size share each drafter and target call. Each
row must still be its own single-request output: at T=0 token for token and with the same
acceptance lengths, at T=1 the same samples from the same seed (and a chi-square test of the
batch's draws against the target's distribution).
"""

from __future__ import annotations

import pytest
import torch

from blockpilot.errors import UserError
from blockpilot.runtime.batching import BatchDecoder, GenerationRequest
from blockpilot.runtime.runner import Runner

from builder_fixtures import tiny_engine_dir, tiny_models
from fixtures import CountingBackend
from test_sampling import chi2_critical, chi2_statistic

PROMPTS = [[5, 17, 42, 8, 11, 3, 29], [7, 2], [40, 41, 42, 43, 1, 9, 12, 30, 31, 4, 6], [13, 13, 13]]
MAX_NEW = [12, 9, 6, 14]


def runner_for(tmp_path_factory, path: str) -> Runner:
    if path.startswith("onnxruntime"):
        opset = 18 if path.endswith("opset18") else 24
        return Runner.from_dir(tiny_engine_dir(tmp_path_factory, "llama", opset), backend="onnxruntime")
    target, drafter = tiny_models(tmp_path_factory, "llama")
    dtype = torch.bfloat16 if path == "torch-bf16" else torch.float32
    return Runner.from_dir(target, drafter_dir=drafter, dtype=dtype, max_block_size=8)


def alone(runner: Runner, request: GenerationRequest):
    decoder = BatchDecoder(runner, max_batch=1)
    decoder.add(request)
    events = []
    while len(decoder):
        events += decoder.step()
    return events[-1].result


def run_together(runner: Runner, requests: list[GenerationRequest], max_batch: int = 16):
    decoder = BatchDecoder(runner, max_batch=max_batch)
    ids = [decoder.add(r) for r in requests]
    results = {}
    while len(decoder):
        for event in decoder.step():
            if event.finished:
                results[event.request_id] = event.result
    return [results[i] for i in ids]


PATHS = ["onnxruntime-fp32", "onnxruntime-opset18", "torch-fp32", "torch-bf16"]


@pytest.mark.parametrize("path", PATHS)
def test_each_row_of_a_greedy_batch_equals_its_single_request_output(tmp_path_factory, path):
    runner = runner_for(tmp_path_factory, path)
    for k in (1, 3, 5):
        requests = [GenerationRequest(p, n, block_size=k, end_id=None) for p, n in zip(PROMPTS, MAX_NEW)]
        together = run_together(runner, requests)
        for request, got in zip(requests, together):
            want = alone(runner, request)
            assert got.output_tokens == want.output_tokens, f"{path} block {k}: prompt {request.input_ids}"
            assert got.accept_lengths == want.accept_lengths
            assert len(got.output_tokens) == request.max_new_tokens


def test_generate_batches_mixed_block_sizes_and_matches_one_by_one(tmp_path_factory):
    runner = runner_for(tmp_path_factory, "onnxruntime-fp32")
    prompts = [torch.tensor(p) for p in PROMPTS]
    together = runner.generate(prompts, max_new_tokens=10, block_size=5, return_dict=True)
    one_by_one = runner.generate(prompts, max_new_tokens=10, block_size=5, return_dict=True, max_batch=1)
    assert torch.equal(together["output_ids"], one_by_one["output_ids"])
    assert together["accept_lengths"] == one_by_one["accept_lengths"]


def test_requests_are_grouped_by_block_size_one_target_call_per_group(tmp_path_factory):
    runner = runner_for(tmp_path_factory, "onnxruntime-fp32")
    runner.verify_length = "full"  # every verify carries its whole block, so its width is the group's size
    counting = CountingBackend(runner.backend)
    runner.backend = counting
    decoder = BatchDecoder(runner)
    sizes = [3, 5, 3, 5, 1]
    for prompt, k in zip(PROMPTS + [[9, 9]], sizes):
        decoder.add(GenerationRequest(prompt, 8, block_size=k, end_id=None))
    decoder.step()  # first tokens + the first drafts (alone) + one verify per group
    verifies = sorted((rows, k) for kind, rows, k in counting.calls if kind == "verify")
    assert verifies == [(1, 1), (2, 3), (2, 5)]
    counting.calls.clear()
    decoder.step()
    drafts = sorted((rows, k) for kind, rows, k in counting.calls if kind == "draft")
    assert drafts == [(2, 3), (2, 5)]  # one batched drafter call per drafting group


def test_a_request_joining_a_running_batch_gets_its_single_request_output(tmp_path_factory):
    runner = runner_for(tmp_path_factory, "onnxruntime-fp32")
    requests = [GenerationRequest(p, n, block_size=3, end_id=None) for p, n in zip(PROMPTS, MAX_NEW)]
    decoder = BatchDecoder(runner)
    ids = [decoder.add(requests[0]), decoder.add(requests[1])]
    results = {}
    for step in range(40):
        if step == 2:
            ids.append(decoder.add(requests[2]))
        if step == 4:
            ids.append(decoder.add(requests[3]))
        for event in decoder.step():
            if event.finished:
                results[event.request_id] = event.result
        if not len(decoder) and step > 4:
            break
    for request, request_id in zip(requests, ids):
        assert results[request_id].output_tokens == alone(runner, request).output_tokens


def test_cancel_frees_the_slot_at_once_and_the_others_continue_unchanged(tmp_path_factory):
    runner = runner_for(tmp_path_factory, "onnxruntime-fp32")
    requests = [GenerationRequest(p, 12, block_size=5, end_id=None) for p in PROMPTS[:3]]
    decoder = BatchDecoder(runner)
    ids = [decoder.add(r) for r in requests]
    decoder.step()
    decoder.step()
    decoder.cancel(ids[1])
    assert len(decoder) == 2
    results = {}
    while len(decoder):
        for event in decoder.step():
            assert event.request_id != ids[1]
            if event.finished:
                results[event.request_id] = event.result
    assert results[ids[0]].output_tokens == alone(runner, requests[0]).output_tokens
    assert results[ids[2]].output_tokens == alone(runner, requests[2]).output_tokens


def drafter_cache_positions(state) -> int:
    first = state.drafter_cache[0] if isinstance(state.drafter_cache, list) else state.drafter_cache.k[0]
    return (first.shape() if callable(first.shape) else first.shape)[2]  # OrtValue or tensor


@pytest.mark.parametrize("path", ["onnxruntime-fp32", "torch-fp32", "torch-bf16"])
def test_a_group_whose_longest_request_left_shrinks_its_caches_and_keeps_each_output(tmp_path_factory, path):
    runner = runner_for(tmp_path_factory, path)
    long_prompt = [(7 * i) % 60 + 1 for i in range(20)]
    requests = [GenerationRequest(long_prompt, 3, block_size=3, end_id=None),  # leaves within two steps
                GenerationRequest(PROMPTS[1], 14, block_size=3, end_id=None),
                GenerationRequest(PROMPTS[3], 12, block_size=3, end_id=None)]
    room = max(3, getattr(runner.backend, "attention_rows", None) or 1)  # as `BatchDecoder.add` sizes a request
    need = [len(r.input_ids) + r.max_new_tokens + room for r in requests]
    decoder = BatchDecoder(runner)
    ids = [decoder.add(r) for r in requests]
    results, capacities = {}, []
    while len(decoder):
        for event in decoder.step():
            if event.finished:
                results[event.request_id] = event.result
        if decoder._groups:
            state = decoder._groups[0].state
            capacities.append((state.capacity, drafter_cache_positions(state)))
    assert capacities[0] == (need[0], need[0])  # the group holds the long request's cache while it decodes
    assert capacities[-1] == (max(need[1:]),) * 2  # then only what the two short requests need
    for request, request_id in zip(requests, ids):
        assert results[request_id].output_tokens == alone(runner, request).output_tokens, path


def test_sampled_rows_of_a_batch_equal_their_single_request_samples_from_the_same_seed(tmp_path_factory):
    runner = runner_for(tmp_path_factory, "onnxruntime-fp32")
    requests = [GenerationRequest(p, n, temperature=1.0, top_p=0.9, seed=100 + i, block_size=5, end_id=None)
                for i, (p, n) in enumerate(zip(PROMPTS, MAX_NEW))]
    for request, got in zip(requests, run_together(runner, requests)):
        assert got.output_tokens == alone(runner, request).output_tokens


def test_t1_draws_of_a_batch_follow_the_target_distribution(tmp_path_factory):
    """The first sampled token after a prompt, drawn by 600 requests decoded as batches of 16,
    against the target's own softmax (and a wrong temperature as a control)."""
    runner = runner_for(tmp_path_factory, "onnxruntime-fp32")
    prompt = PROMPTS[0]
    be = runner.backend
    state = be.new_state(1, len(prompt) + 8)
    probs = torch.softmax(be.prefill(state, torch.tensor([prompt])).last_logits[0].double(), dim=-1)
    vocab = probs.shape[0]
    counts = torch.zeros(vocab)
    for start in range(0, 600, 16):
        requests = [GenerationRequest(prompt, 2, temperature=1.0, seed=start + i, block_size=3, end_id=None)
                    for i in range(16)]
        for result in run_together(runner, requests):
            counts[result.output_tokens[0]] += 1
    stat, df = chi2_statistic(counts, probs)
    assert stat < chi2_critical(df), f"chi2 {stat:.1f} (df {df})"
    wrong = torch.softmax(torch.log(probs) / 0.5, dim=-1)
    stat, df = chi2_statistic(counts, wrong)
    assert stat > chi2_critical(df)


def test_bad_requests_are_refused_with_one_line(tmp_path_factory):
    runner = runner_for(tmp_path_factory, "onnxruntime-fp32")
    decoder = BatchDecoder(runner)
    for bad, message in (
        (GenerationRequest([], 4), "empty"),
        (GenerationRequest([1, 2], 4, block_size=4), "not supported"),
        (GenerationRequest([1, 2], 4, temperature=-1.0), "temperature"),
        (GenerationRequest([1] * 30, 20), "cache capacity"),
    ):
        with pytest.raises(UserError, match=message):
            decoder.add(bad)
    assert len(decoder) == 0


def test_requests_arriving_under_load_decode_plainly_when_asked_to(tmp_path_factory):
    runner = runner_for(tmp_path_factory, "onnxruntime-fp32")
    decoder = BatchDecoder(runner, disable_speculation_from=2)
    first = [decoder.add(GenerationRequest(p, 6, end_id=None)) for p in PROMPTS[:2]]
    late = decoder.add(GenerationRequest(PROMPTS[2], 6, end_id=None))
    pinned = decoder.add(GenerationRequest(PROMPTS[3], 6, block_size=5, end_id=None))
    results = {}
    while len(decoder):
        for event in decoder.step():
            if event.finished:
                results[event.request_id] = event.result
    default = runner.default_block_size
    assert [results[i].block_size for i in first] == [default, default]
    assert results[late].block_size == 1  # arrived with 2 in flight and no block size of its own
    assert results[pinned].block_size == 5  # asked for one: kept
    assert results[late].output_tokens == alone(runner, GenerationRequest(PROMPTS[2], 6, end_id=None)).output_tokens


class RevisingPolicy:
    """A stand-in predictor: block size 5, revised to 3 after 2 steps there, then to 1 after 3 more."""

    candidates = (1, 3, 5)

    def __init__(self):
        self.calls = []

    def select(self, hidden, last_logits, temperature=0.0):
        from blockpilot.runtime.policy import BlockSizeChoice

        return BlockSizeChoice(5, 1.0)

    def revise(self, block_size, accept_lengths, steps_at_size, supported):
        self.calls.append((block_size, len(accept_lengths), steps_at_size))
        assert supported(3)
        if block_size == 5 and steps_at_size >= 2:
            return 3
        if block_size == 3 and steps_at_size >= 3:
            return 1
        return block_size


@pytest.mark.parametrize("path", ["onnxruntime-fp32", "torch-fp32"])
def test_requests_moved_to_smaller_blocks_while_decoding_keep_the_greedy_output(tmp_path_factory, path):
    runner = runner_for(tmp_path_factory, path)
    runner.policy = RevisingPolicy()
    prompts, max_new = PROMPTS, [14, 9, 12, 14]
    requests = [GenerationRequest(p, n, end_id=None) for p, n in zip(prompts, max_new)]  # auto: the policy's
    pinned = GenerationRequest(PROMPTS[0], 14, block_size=5, end_id=None)  # a size of its own: never revised
    got = run_together(runner, requests + [pinned], max_batch=3)
    for result, p, n in zip(got, prompts, max_new):
        plain = alone(runner, GenerationRequest(p, n, block_size=1, end_id=None))
        assert result.output_tokens == plain.output_tokens
        assert result.block_size == 5
        steps = len(result.accept_lengths)
        expected = [(2, 3), (5, 1)][: (steps > 2) + (steps > 5)]
        assert result.block_size_switches == expected
        assert result.final_block_size == (expected[-1][1] if expected else 5)
        assert all(a <= 3 for a in result.accept_lengths[2:5]) and all(a == 1 for a in result.accept_lengths[5:])
    assert got[-1].block_size_switches == [] and got[-1].output_tokens == got[0].output_tokens


def test_revise_block_size_moves_down_only_to_a_size_that_pays_by_the_margin():
    from blockpilot.runtime.policy import revise_block_size

    step_ms = {1: 10.0, 2: 12.0, 4: 13.0, 8: 16.0}.__getitem__
    sizes = [1, 2, 4, 8]
    # every step accepted 1 draft: tau 2 at any size >= 2, so the cheapest of them wins
    assert revise_block_size(8, [2] * 6, 6, sizes, step_ms, 4, 0.05) == 2
    # every draft accepted: block 8 commits 8 tokens a step, nothing smaller comes close
    assert revise_block_size(8, [8] * 6, 6, sizes, step_ms, 4, 0.05) == 8
    # nothing accepted: plain decoding
    assert revise_block_size(8, [1] * 6, 6, sizes, step_ms, 4, 0.05) == 1
    # too few steps at this size yet, or plain decoding already
    assert revise_block_size(8, [1] * 3, 3, sizes, step_ms, 4, 0.05) == 8
    assert revise_block_size(1, [1] * 9, 9, sizes, step_ms, 4, 0.05) == 1
    # 3 drafts accepted a step: 4 tokens per 13 ms at block 4 against 4 per 16 ms at 8 (+23%)
    assert revise_block_size(8, [4] * 6, 6, sizes, step_ms, 4, 0.05) == 4
    assert revise_block_size(8, [4] * 6, 6, sizes, step_ms, 4, 0.3) == 8
    # two long steps: 1 + mean(a) = 5 tokens per 16 ms at 8 beats 4 per 13 ms at block 4
    assert revise_block_size(8, [4] * 6 + [8, 8], 8, sizes, step_ms, 4, 0.05) == 8
