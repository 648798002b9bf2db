"""Speculative decoding is lossless: greedy equals autoregressive equals transformers."""

import pytest
import torch

from blockpilot.runtime.backend import TorchBackend
from blockpilot.runtime.runner import Runner

from fixtures import make_drafter, make_hf_target, target_continuation_backend

PROMPTS = [[5, 17, 42, 8], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11], [60], [33, 33, 33, 12, 90, 2]]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("tiny")
    target = make_hf_target(tmp, "llama")
    drafter = make_drafter(tmp, target, block_size=8)
    return target, drafter


TargetContinuationBackend = target_continuation_backend()


def _hf_greedy(target_dir, ids, n):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(target_dir, torch_dtype=torch.float32).eval()
    out = model.generate(torch.tensor([ids]), max_new_tokens=n, min_new_tokens=n, do_sample=False,
                         eos_token_id=None, pad_token_id=0)
    return out[0, len(ids):].tolist()


def test_greedy_speculative_equals_autoregressive_and_transformers(tiny):
    target_dir, drafter_dir = tiny
    runner = Runner.from_dir(target_dir, drafter_dir=drafter_dir)
    n = 24
    for ids in PROMPTS:
        expected = _hf_greedy(target_dir, ids, n)
        ar = runner.generate([torch.tensor(ids)], max_new_tokens=n, block_size=1, end_id=-1)
        assert ar[0, 0, len(ids):len(ids) + n].tolist() == expected
        for k in range(2, 17):
            spec = runner.generate([torch.tensor(ids)], max_new_tokens=n, block_size=k, end_id=-1)
            assert spec[0, 0, len(ids):len(ids) + n].tolist() == expected, f"block size {k}"


def test_full_block_accepts_and_bonus_token_with_oracle_drafter(tiny):
    from blockpilot.models.checkpoint import load_drafter, load_target

    target_dir, drafter_dir = tiny
    backend = TargetContinuationBackend(load_target(target_dir), load_drafter(drafter_dir))
    runner = Runner(backend, lookup="off")  # every draft from the oracle, none copied from the context
    n = 40
    for ids in PROMPTS[:2]:
        expected = _hf_greedy(target_dir, ids, n)
        for k in (2, 5, 8, 16):
            out = runner.generate([torch.tensor(ids)], max_new_tokens=n, block_size=k, end_id=-1,
                                  return_dict=True)
            assert out["output_ids"][0, 0, len(ids):len(ids) + n].tolist() == expected
            steps = out["accept_lengths"][0]
            assert all(s == k for s in steps[:-1]), steps  # every block fully accepted + bonus


def test_rollback_after_partial_accept_equals_fresh_prefill(tiny):
    """After a rejected suffix, next-step logits equal a fresh prefill of the committed tokens."""
    from blockpilot.models.checkpoint import load_target

    target = load_target(tiny[0])
    backend = TorchBackend(target, None)
    prompt = torch.tensor([[5, 17, 42, 8, 9]])
    state = backend.new_state(1, 64)
    backend.prefill(state, prompt)
    block = torch.tensor([[11, 12, 13, 14, 15, 16]])  # verify 6, keep only the first 2
    backend.verify(state, block, 5)
    committed = torch.cat((prompt, block[:, :2]), dim=1)
    nxt = torch.tensor([[77]])
    stepped = backend.verify(state, nxt, 7).logits
    fresh_state = backend.new_state(1, 64)
    backend.prefill(fresh_state, committed)
    fresh = backend.verify(fresh_state, nxt, 7).logits
    assert torch.allclose(stepped, fresh, atol=1e-6)


def test_streaming_yields_growing_outputs_ending_in_the_final_result(tiny):
    runner = Runner.from_dir(*[tiny[0]], drafter_dir=tiny[1])
    ids = [torch.tensor(PROMPTS[1])]
    final = runner.generate(ids, max_new_tokens=20, block_size=4, end_id=-1, return_dict=True)
    lengths = []
    last = None
    for last in runner.generate(ids, max_new_tokens=20, block_size=4, end_id=-1, streaming=True,
                                return_dict=True):
        lengths.append(int(last["sequence_lengths"][0, 0]))
    assert lengths == sorted(lengths) and len(lengths) > 2
    assert torch.equal(last["output_ids"], final["output_ids"])


def test_batch_output_is_padded_with_end_id_and_stops_at_it(tiny):
    runner = Runner.from_dir(tiny[0], drafter_dir=tiny[1])
    free = runner.generate([torch.tensor(PROMPTS[0])], max_new_tokens=12, block_size=1, end_id=-1)
    stop_token = int(free[0, 0, len(PROMPTS[0]) + 3])
    out = runner.generate([torch.tensor(p) for p in PROMPTS[:2]], max_new_tokens=12, block_size=4,
                          end_id=stop_token, return_dict=True)
    ids = out["output_ids"]
    assert ids.shape == (2, 1, 11 + 12)
    length = int(out["sequence_lengths"][0, 0])
    first_stop = free[0, 0, len(PROMPTS[0]):].tolist().index(stop_token)
    assert length == len(PROMPTS[0]) + first_stop + 1
    assert (ids[0, 0, length:] == stop_token).all()
