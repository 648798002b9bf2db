"""Adaptive verify lengths: a greedy step verifies only the drafts that pay for their target rows."""

import pytest
import torch

from blockpilot.builder.manifest import StepCosts
from blockpilot.errors import UserError
from blockpilot.runtime.policy import verify_rows
from blockpilot.runtime.runner import Runner

from fixtures import CountingBackend, make_drafter, make_hf_target


def linear(base: float, per_row: float):
    return lambda rows: base + per_row * rows


def verify_widths(recording: CountingBackend) -> list[int]:
    """The rows of every verify call the backend made."""
    return [width for kind, _, width in recording.calls if kind == "verify"]


def test_confident_drafts_are_verified_whole():
    assert verify_rows([0.99] * 7, linear(20.0, 1.0), 3.0) == 8


def test_an_unlikely_first_draft_verifies_only_the_committed_token():
    assert verify_rows([0.02, 0.99, 0.99], linear(20.0, 1.0), 3.0) == 1


def test_rows_stop_where_the_drafts_stop_paying():
    # expected tokens 1, 1.9, 2.71, 2.73 (the third draft is unlikely), each row 1 ms on a 23 ms step
    assert verify_rows([0.9, 0.9, 0.01, 0.9], linear(20.0, 1.0), 3.0) == 3


def test_free_rows_are_always_verified():
    assert verify_rows([0.05, 0.05, 0.05], linear(20.0, 0.0), 3.0) == 4


def test_step_costs_interpolate_between_measured_row_counts():
    costs = StepCosts("onnxruntime", "fp32", "cpu", 256, {1: 20.0, 2: 22.0, 4: 24.0, 8: 32.0}, {2: 2.0, 8: 5.0})
    assert costs.target_ms_at(4) == 24.0
    assert costs.target_ms_at(3) == pytest.approx(23.0)
    assert costs.target_ms_at(6) == pytest.approx(28.0)
    assert costs.target_ms_at(10) == pytest.approx(36.0)  # beyond the table: the last segment's line
    assert costs.drafter_ms_at(4) == pytest.approx(3.0)


# ------------------------------------------------------------------ in the decode loop

PROMPTS = [[5, 17, 42, 8, 5, 17, 42, 8, 5], [1, 2, 3, 4, 5, 6], [60, 61, 62, 60, 61, 62], [9, 10, 11, 12, 13]]
STEEP = StepCosts("torch", "fp32", "test", 64, {1: 10.0, 16: 40.0}, {2: 1.0, 16: 3.0})  # 2 ms a row


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("tiny-verify-length")
    target = make_hf_target(tmp, "llama")
    return target, make_drafter(tmp, target, block_size=8)


@pytest.mark.parametrize("lookup", ["greedy", "off"])
def test_adaptive_verify_lengths_leave_greedy_output_equal_to_plain_decoding(tiny, lookup):
    plain = Runner.from_dir(tiny[0], drafter_dir=tiny[1])
    recording = CountingBackend(plain.backend)
    runner = Runner(recording, lookup=lookup)
    runner.step_costs = STEEP
    assert runner.verify_length == "adaptive"
    widths = {}
    for ids in PROMPTS:
        expected = plain.generate([torch.tensor(ids)], max_new_tokens=30, block_size=1, end_id=-1)
        for k in (2, 4, 8):
            recording.calls.clear()
            out = runner.generate([torch.tensor(ids)], max_new_tokens=30, block_size=k, end_id=-1)
            assert torch.equal(out, expected), (ids, k)
            widths.setdefault(k, []).extend(verify_widths(recording))
    assert all(1 <= w <= k for k, ws in widths.items() for w in ws)
    assert any(w < 8 for w in widths[8])  # the random tiny drafter is rarely sure: steps verify fewer rows


def test_full_verify_length_or_no_step_costs_verifies_every_row(tiny):
    base = Runner.from_dir(tiny[0], drafter_dir=tiny[1]).backend
    for setup in ({"verify_length": "full", "step_costs": STEEP}, {"verify_length": "adaptive", "step_costs": None}):
        recording = CountingBackend(base)
        runner = Runner(recording, lookup="off", verify_length=setup["verify_length"])
        runner.step_costs = setup["step_costs"]
        runner.generate([torch.tensor(PROMPTS[1])], max_new_tokens=20, block_size=4, end_id=-1)
        assert set(verify_widths(recording)) == {4}, setup


def test_batched_requests_with_adaptive_verify_lengths_equal_their_single_outputs(tiny):
    runner = Runner.from_dir(tiny[0], drafter_dir=tiny[1])
    runner.step_costs = STEEP
    prompts = [torch.tensor(ids) for ids in PROMPTS]
    together = runner.generate(prompts, max_new_tokens=30, block_size=6, end_id=-1)
    for i, ids in enumerate(prompts):
        alone = runner.generate([ids], max_new_tokens=30, block_size=1, end_id=-1)
        assert together[i, 0, : alone.shape[-1]].tolist() == alone[0, 0].tolist()


def test_sampled_requests_verify_whole_blocks(tiny):
    base = Runner.from_dir(tiny[0], drafter_dir=tiny[1]).backend
    recording = CountingBackend(base)
    runner = Runner(recording, lookup="off")
    runner.step_costs = STEEP
    runner.generate([torch.tensor(PROMPTS[0])], max_new_tokens=20, block_size=4, end_id=-1, temperature=1.0,
                    random_seed=3)
    assert set(verify_widths(recording)) == {4}


def test_unknown_verify_length_is_refused(tiny):
    with pytest.raises(UserError, match="unknown verify length 'sometimes'"):
        Runner(Runner.from_dir(tiny[0], drafter_dir=tiny[1]).backend, verify_length="sometimes")
