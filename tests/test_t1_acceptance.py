"""`scripts/t1_acceptance.py --candidates`: the acceptance of a slot with several candidates drawn from the
drafter's `q` (a draft tree judged by recursive rejection sampling). One candidate is plain rejection sampling
(`sum min(p, q)`); the exact formula with replacement agrees with a simulation of the rule; without
replacement a second candidate can never repeat a rejected token."""

from __future__ import annotations

import sys

import pytest
import torch

from fixtures import load_script


@pytest.fixture(scope="module")
def script():
    yield load_script("t1_acceptance")
    sys.modules.pop("t1_acceptance", None)


def random_pairs(n: int, vocab: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return (torch.softmax(2 * torch.randn(n, vocab, generator=g, dtype=torch.float64), -1),
            torch.softmax(2 * torch.randn(n, vocab, generator=g, dtype=torch.float64), -1))


def test_one_candidate_is_plain_rejection_sampling(script):
    p, q = random_pairs(5, 7, seed=0)
    kept = script.with_replacement_acceptance(p, q, 3)
    assert torch.allclose(kept[:, 0], torch.minimum(p, q).sum(-1))
    assert (kept[:, 1:] >= kept[:, :-1] - 1e-12).all()  # more candidates never keep less


def test_exact_acceptance_with_replacement_matches_a_simulation_of_the_rule(script):
    """Simulate recursive rejection sampling with i.i.d. candidates on one 4-token pair: the fraction of trials
    that keep a candidate within 1..3 tries agrees with the formula (4 standard errors), and the committed
    token (a kept candidate, else a draw from the last residual) follows p."""
    p, q = random_pairs(1, 4, seed=3)
    p, q = p[0], q[0]
    expected = script.with_replacement_acceptance(p[None], q[None], 3)[0]
    g = torch.Generator().manual_seed(1)
    trials, kept_by, committed = 40_000, torch.zeros(3), torch.zeros(4)
    for _ in range(trials):
        residual, token = p.clone(), None
        for i in range(3):
            x = int(torch.multinomial(q, 1, generator=g))
            if float(torch.rand((), generator=g, dtype=torch.float64)) < min(1.0, float(residual[x] / q[x])):
                token = x
                kept_by[i:] += 1
                break
            residual = (residual - q).clamp(min=0)
            residual = residual / residual.sum()
        if token is None:
            token = int(torch.multinomial(residual, 1, generator=g))
        committed[token] += 1
    se = (expected * (1 - expected) / trials).sqrt()
    assert ((kept_by / trials - expected).abs() <= 4 * se + 1e-9).all(), (kept_by / trials, expected)
    se_p = (p * (1 - p) / trials).sqrt()
    assert ((committed / trials - p).abs() <= 4 * se_p + 1e-9).all(), (committed / trials, p)


def test_without_replacement_a_second_candidate_cannot_repeat_a_rejected_token(script):
    """p puts all its mass on token 0, q half on 0 and half on 1: a repeated 1 is rejected again with
    replacement (3/4 kept after two), never repeated without (always kept after two)."""
    p, q = torch.tensor([[1.0, 0.0, 0.0]]), torch.tensor([[0.5, 0.5, 0.0]])
    assert torch.allclose(script.with_replacement_acceptance(p, q, 2)[0], torch.tensor([0.5, 0.75], dtype=torch.float64))
    kept = script.without_replacement_acceptance(p, q, 2, draws=400, generator=torch.Generator().manual_seed(0))[0]
    assert abs(float(kept[0]) - 0.5) < 0.1
    assert float(kept[1]) == 1.0


def test_top_candidates_keep_the_mass_the_target_puts_on_the_drafters_most_likely_ids(script):
    p = torch.tensor([[0.1, 0.6, 0.3]], dtype=torch.float64)
    q = torch.tensor([[0.2, 0.3, 0.5]], dtype=torch.float64)  # ids by q: 2, 1, 0
    assert torch.allclose(script.top_candidates_acceptance(p, q, 3)[0], torch.tensor([0.3, 0.9, 1.0], dtype=torch.float64))


def test_without_replacement_stops_when_q_has_no_ids_left(script):
    """q with one id of support: the second candidate does not exist, so it keeps nothing more (and draws no
    zero-probability id)."""
    p, q = torch.tensor([[0.5, 0.5]], dtype=torch.float64), torch.tensor([[1.0, 0.0]], dtype=torch.float64)
    kept = script.without_replacement_acceptance(p, q, 2, draws=200, generator=torch.Generator().manual_seed(0))[0]
    assert abs(float(kept[0]) - 0.5) < 0.12 and float(kept[1]) == float(kept[0])


def test_verify_length_model_prices_rows_and_picks_what_pays(script):
    costs = {"verify": {1: 10.0, 2: 11.0, 3: 12.0, 4: 13.0}, "draft": {2: 1.0, 3: 1.0, 4: 1.0}, "plain": 10.0}
    sure = torch.ones(3, 3, dtype=torch.float64)  # every draft survives
    never = torch.zeros(3, 3, dtype=torch.float64)  # none does
    speeds = script.verify_length_speeds(sure, sure, costs, [2, 4])
    assert speeds[4]["full"] == {"speed_vs_plain": round(4 / 14 * 10, 4), "mean_rows": 4.0}
    assert speeds[4]["oracle of expected tokens"] == speeds[4]["full"]  # all rows pay when all drafts survive
    assert speeds[2]["full"]["speed_vs_plain"] == round(2 / 12 * 10, 4)
    speeds = script.verify_length_speeds(never, sure, costs, [4])  # q sure of itself, the target never agrees
    assert speeds[4]["oracle of expected tokens"] == {"speed_vs_plain": round(1 / 11 * 10, 4), "mean_rows": 1.0}
    assert speeds[4]["adaptive on top q"]["mean_rows"] == 4.0  # the rule trusts q and pays for rows that fail
    assert speeds[4]["adaptive on top q"]["speed_vs_plain"] < speeds[4]["oracle of expected tokens"]["speed_vs_plain"]
