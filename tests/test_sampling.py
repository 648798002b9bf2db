"""Sampling and acceptance math on hand-checkable tensors, and the lossless property at T = 1:
the first tokens of speculative sampling are distributed exactly as the target's own."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from blockpilot.runtime.backend import TorchBackend
from blockpilot.runtime.runner import Runner
from blockpilot.runtime.sampling import (
    SamplingParams,
    accepted_draft_counts,
    block_verify_block,
    committed_tokens,
    draft_distribution,
    greedy_tokens,
    logits_to_probs,
    rejection_sample_block,
    sample_tokens,
)

from fixtures import make_drafter, make_hf_target

# ------------------------------------------------------------------ acceptance


def test_accepted_draft_counts_full_zero_and_partial_rows():
    draft = torch.tensor([[4, 5, 6, 7],  # all match
                          [9, 5, 6, 7],  # first differs: nothing accepted
                          [4, 5, 0, 7]])  # third differs; the later match does not count
    posterior = torch.tensor([[4, 5, 6, 7, 8],
                              [4, 5, 6, 7, 8],
                              [4, 5, 6, 7, 8]])
    assert accepted_draft_counts(draft, posterior).tolist() == [4, 0, 2]


def test_accepted_draft_counts_with_an_empty_draft_is_zero():
    assert accepted_draft_counts(torch.zeros((2, 0), dtype=torch.long), torch.tensor([[3], [1]])).tolist() == [0, 0]


def test_committed_tokens_are_the_accepted_drafts_then_the_bonus_token():
    draft = torch.tensor([[4, 5, 6], [9, 5, 6], [4, 5, 0]])
    posterior = torch.tensor([[4, 5, 6, 1], [2, 5, 6, 1], [4, 5, 3, 1]])
    accepted = accepted_draft_counts(draft, posterior)
    assert accepted.tolist() == [3, 0, 2]
    committed = committed_tokens(draft, posterior, accepted)
    assert committed.shape == (3, 4)
    assert committed[0].tolist() == [4, 5, 6, 1]  # full accept: bonus is the last posterior token
    assert committed[1, :1].tolist() == [2]  # no accept: only the posterior's first token
    assert committed[2, :3].tolist() == [4, 5, 3]  # two drafts, then the posterior at the mismatch


# ------------------------------------------------------------------ temperature, top-k, top-p


def probs_from(values: list[float]) -> torch.Tensor:
    """Logits whose softmax at temperature 1 is `values`."""
    return torch.tensor(values, dtype=torch.float64).log()


def test_temperature_divides_logits_before_the_softmax():
    logits = torch.tensor([0.0, math.log(2), math.log(4)])
    hot = logits_to_probs(logits, SamplingParams(temperature=2.0))
    cold = logits_to_probs(logits, SamplingParams(temperature=0.5))
    assert torch.allclose(hot, torch.tensor([1, 2**0.5, 2]) / (3 + 2**0.5), atol=1e-6)
    assert torch.allclose(cold, torch.tensor([1.0, 4, 16]) / 21, atol=1e-6)


def test_top_k_keeps_exactly_the_k_most_likely_tokens():
    probs = logits_to_probs(torch.tensor([1.0, 3.0, 2.0, 0.0]), SamplingParams(temperature=1.0, top_k=2))
    e = math.e
    assert torch.allclose(probs, torch.tensor([0.0, e / (e + 1), 1 / (e + 1), 0.0]), atol=1e-6)
    everything = logits_to_probs(torch.tensor([1.0, 3.0, 2.0, 0.0]), SamplingParams(temperature=1.0, top_k=4))
    assert (everything > 0).all()


@pytest.mark.parametrize("top_p,kept", [
    (0.3, [0, 0.5, 0, 0]),  # the top token alone already reaches 0.3
    (0.6, [0, 0.5, 0, 0.25]),
    (0.7, [0, 0.5, 0, 0.25]),  # 0.5 + 0.25 = 0.75 reaches 0.7: 0.15 is dropped
    (0.8, [0, 0.5, 0.15, 0.25]),
    (1.0, [0.1, 0.5, 0.15, 0.25]),
])
def test_top_p_keeps_the_smallest_most_likely_set_reaching_p(top_p, kept):
    probs = logits_to_probs(probs_from([0.1, 0.5, 0.15, 0.25]), SamplingParams(temperature=1.0, top_p=top_p))
    expected = torch.tensor(kept) / sum(kept)
    assert torch.allclose(probs.float(), expected, atol=1e-6), probs


def test_top_p_applies_to_the_top_k_renormalized_distribution():
    # top-k 3 leaves 0.5, 0.25, 0.15 -> /0.9 = 0.556, 0.278, 0.167; top-p 0.8 then drops 0.167
    probs = logits_to_probs(probs_from([0.1, 0.5, 0.15, 0.25]), SamplingParams(temperature=1.0, top_k=3, top_p=0.8))
    assert torch.allclose(probs.float(), torch.tensor([0, 2 / 3, 0, 1 / 3]), atol=1e-6)


def test_filtering_is_per_row_of_a_batch():
    logits = torch.stack((probs_from([0.1, 0.5, 0.15, 0.25]), probs_from([0.7, 0.1, 0.1, 0.1])))
    probs = logits_to_probs(logits, SamplingParams(temperature=1.0, top_p=0.6))
    assert torch.allclose(probs.float(), torch.tensor([[0, 2 / 3, 0, 1 / 3], [1.0, 0, 0, 0]]), atol=1e-6)


def test_temperature_zero_is_argmax_per_position():
    logits = torch.randn(2, 3, 11, generator=torch.Generator().manual_seed(0))
    assert torch.equal(sample_tokens(logits, SamplingParams()), logits.argmax(-1))


def test_greedy_tokens_equal_torch_argmax_on_ties_views_1d_rows_and_bf16():
    logits = torch.randn(3, 5, 49152, generator=torch.Generator().manual_seed(0))
    logits[0, 1, [7, 300, 40000]] = 100.0  # a three-way tie: the first index wins, as in torch
    for x in (logits, logits[:, 1:4], logits[1, 2], logits.transpose(0, 1), logits.bfloat16(),
              logits.half()):
        assert torch.equal(greedy_tokens(x), x.argmax(-1))
    assert int(greedy_tokens(logits)[0, 1]) == 7


def test_sampling_draws_follow_the_filtered_distribution_and_repeat_with_the_seed():
    params = SamplingParams(temperature=1.0, top_k=3)
    logits = probs_from([0.1, 0.5, 0.15, 0.25]).float().expand(4000, 4)  # 4000 rows, one draw each
    draws = sample_tokens(logits, params, torch.Generator().manual_seed(3))
    again = sample_tokens(logits, params, torch.Generator().manual_seed(3))
    assert draws.shape == (4000,) and torch.equal(draws, again)
    freq = torch.bincount(draws, minlength=4).double() / 4000
    expected = torch.tensor([0.0, 0.5, 0.15, 0.25], dtype=torch.float64) / 0.9
    assert freq[0] == 0  # filtered out: never drawn
    assert ((freq - expected).abs() <= 4 * (expected * (1 - expected) / 4000).sqrt() + 1e-12).all(), freq


@pytest.mark.parametrize("kwargs", [dict(temperature=-0.1), dict(top_k=-1), dict(top_p=0.0), dict(top_p=1.5)])
def test_invalid_sampling_parameters_are_refused(kwargs):
    with pytest.raises(ValueError):
        SamplingParams(**kwargs)


# ------------------------------------------------------------------ chi-square machinery

CHI2_P = 0.001
Z_999 = 3.090232306167813  # standard normal quantile at 1 - CHI2_P


def chi2_critical(df: int) -> float:
    """Upper `CHI2_P` critical value of chi-square with `df` degrees (Wilson-Hilferty)."""
    a = 2.0 / (9.0 * df)
    return df * (1.0 - a + Z_999 * math.sqrt(a)) ** 3


@pytest.mark.parametrize("df,table", [(10, 29.588), (50, 86.661), (100, 149.449), (200, 267.541)])
def test_wilson_hilferty_matches_chi_square_tables(df, table):
    assert abs(chi2_critical(df) - table) / table < 0.01


def chi2_statistic(counts: torch.Tensor, probs: torch.Tensor, min_expected: float = 5.0) -> tuple[float, int]:
    """Pearson's statistic and degrees of freedom of `counts` against exact `probs` (same shape).

    Cells expected to hold fewer than `min_expected` samples are pooled into one cell (merged with
    the next-smallest cell if the pool is still below `min_expected`)."""
    n = counts.sum().item()
    expected, observed = (probs.flatten() * n).double(), counts.flatten().double()
    order = expected.argsort()
    expected, observed = expected[order], observed[order]
    small = int((expected < min_expected).sum())
    while small < len(expected) and 0 < expected[:small].sum() < min_expected:
        small += 1
    if small:
        expected = torch.cat((expected[:small].sum()[None], expected[small:]))
        observed = torch.cat((observed[:small].sum()[None], observed[small:]))
    return float(((observed - expected) ** 2 / expected).sum()), len(expected) - 1


# ------------------------------------------------------------------ T = 1 losslessness

VOCAB, N_TOKENS, N_SAMPLES = 8, 3, 2000
PROMPT = [5, 0, 7]


class LookupDraftBackend(TorchBackend):
    """Drafts from a table keyed by (block start, last token): a deterministic drafter, so
    speculative sampling must stay exact. The tables hold the target's greedy continuation, so at
    T = 1 a third to half of the drafts are accepted and the test exercises acceptance, bonus tokens
    and rollback (and costs no drafter forward)."""

    def __init__(self, target, drafter, tables: dict[int, dict[int, list[int]]], fixed_shape: bool = False):
        super().__init__(target, drafter, fixed_shape=fixed_shape)
        self.tables = tables
        self.draft_logits = False  # greedy drafts only: the runtime accepts by "sample, then match"

    def draft(self, state, last_tokens, new_taps, ctx_start, block_start, block_size):
        proposal = self.tables.get(block_start, {}).get(int(last_tokens[0]), [0])
        return torch.tensor([(proposal * block_size)[: block_size - 1]])  # (1, block_size - 1)


def greedy_tables(joint: torch.Tensor) -> dict[int, dict[int, list[int]]]:
    """Draft tables from the exact joint `(V, V, V)` of the first 3 tokens: after token 1 (block
    start P) the greedy tokens 2 and 3; after token 2 alone (block start P + 1) the most likely
    token 3 given token 2."""
    n = len(PROMPT)
    first = {}
    for t1 in range(VOCAB):
        g2 = int(joint[t1].sum(-1).argmax())
        first[t1] = [g2, int(joint[t1, g2].argmax())]
    second = {t2: [int(joint[:, t2].sum(0).argmax())] for t2 in range(VOCAB)}
    return {n: first, n + 1: second}


@pytest.fixture(scope="module")
def tiny_vocab(tmp_path_factory):
    """The backend and the exact joint distribution `(V, V, V)` of the first 3 tokens at T = 1."""
    from blockpilot.models.checkpoint import load_drafter, load_target

    tmp = tmp_path_factory.mktemp("tiny-vocab")
    target = make_hf_target(tmp, "llama", vocab_size=VOCAB)
    drafter = make_drafter(tmp, target, block_size=8)
    joint = exact_joint(target, PROMPT)
    return LookupDraftBackend(load_target(target), load_drafter(drafter), greedy_tables(joint)), joint


def exact_joint(target_dir, prompt: list[int]) -> torch.Tensor:
    """`p[t1, t2, t3]` from the transformers model, enumerating all V^2 two-token prefixes."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    pairs = torch.tensor(list(itertools.product(range(VOCAB), repeat=2)))  # (V^2, 2)
    ids = torch.cat((torch.tensor(prompt).expand(len(pairs), -1), pairs), dim=1)
    with torch.no_grad():
        probs = model(ids).logits.double().softmax(-1)  # (V^2, P + 2, V)
    n = len(prompt)
    p1 = probs[0, n - 1]  # (V,)
    p2 = probs[::VOCAB, n]  # (V, V): row t1
    p3 = probs[:, n + 1].reshape(VOCAB, VOCAB, VOCAB)  # [t1, t2, t3]
    return p1[:, None, None] * p2[:, :, None] * p3


def runner_first_tokens(backend, block_size: int, temperature: float = 1.0, seed: int = 0,
                        verification: str = "block"):
    """Counts `(V, V, V)` of the first 3 tokens over N_SAMPLES runs, and the accept lengths."""
    runner = Runner(backend, verification=verification)
    counts = torch.zeros(VOCAB**N_TOKENS, dtype=torch.long)
    accept_lengths = []
    prompt = [torch.tensor(PROMPT)]
    for i in range(N_SAMPLES):
        out = runner.generate(prompt, max_new_tokens=N_TOKENS, end_id=-1, temperature=temperature,
                              random_seed=seed * N_SAMPLES + i, block_size=block_size, return_dict=True)
        t1, t2, t3 = out["output_ids"][0, 0, len(PROMPT):].tolist()
        counts[(t1 * VOCAB + t2) * VOCAB + t3] += 1
        accept_lengths += out["accept_lengths"][0]
    return counts.reshape(VOCAB, VOCAB, VOCAB), accept_lengths


@pytest.mark.parametrize("block_size", [1, 2, 4, 8])
def test_speculative_sampling_at_t1_matches_the_exact_target_distribution(tiny_vocab, block_size):
    backend, joint = tiny_vocab
    counts, accept_lengths = runner_first_tokens(backend, block_size, seed=block_size)
    stat, df = chi2_statistic(counts, joint)
    assert stat < chi2_critical(df), f"chi2 {stat:.1f} > {chi2_critical(df):.1f} (df {df})"
    # the test exercised acceptance: one draft (a >= 2) and two drafts + bonus (a >= 3) accepted
    assert (sum(a >= 2 for a in accept_lengths) > N_SAMPLES // 5) == (block_size >= 2)
    assert (sum(a >= 3 for a in accept_lengths) > N_SAMPLES // 20) == (block_size >= 3)


def test_sampling_at_the_wrong_temperature_fails_the_same_test(tiny_vocab):
    backend, joint = tiny_vocab
    counts, _ = runner_first_tokens(backend, block_size=4, temperature=0.7, seed=99)
    stat, df = chi2_statistic(counts, joint)
    assert stat > chi2_critical(df)


def test_acceptance_without_the_residual_distribution_fails_the_same_test(tiny_vocab):
    """A classic speculative-sampling bug: accept a draft token with probability p(draft), and on
    rejection sample from p itself instead of p without the draft token. Drafts are then
    over-represented; the chi-square test must see it."""
    backend, joint = tiny_vocab
    generator = torch.Generator().manual_seed(5)
    counts = torch.zeros(VOCAB**N_TOKENS, dtype=torch.long)
    for _ in range(N_SAMPLES):
        t1, t2, t3 = biased_first_tokens(backend, block_size=4, generator=generator)
        counts[(t1 * VOCAB + t2) * VOCAB + t3] += 1
    stat, df = chi2_statistic(counts.reshape(VOCAB, VOCAB, VOCAB), joint)
    assert stat > chi2_critical(df)


def biased_first_tokens(backend, block_size: int, generator: torch.Generator) -> list[int]:
    """The first 3 tokens from the biased rule above (one request, same backend calls as the runner)."""
    params = SamplingParams(temperature=1.0)
    state = backend.new_state(1, 32)
    prefill = backend.prefill(state, torch.tensor([PROMPT]))
    tokens = [int(sample_tokens(prefill.last_logits, params, generator))]
    taps, ctx_start = prefill.taps, 0
    while len(tokens) < N_TOKENS:
        pos, last = len(PROMPT) + len(tokens) - 1, torch.tensor([tokens[-1]])
        draft = backend.draft(state, last, taps, ctx_start, pos, block_size)  # (1, K - 1)
        ctx_start += taps.shape[1]
        verify = backend.verify(state, torch.cat((last[:, None], draft), dim=1), pos)
        probs = logits_to_probs(verify.logits[0], params)  # (K, V)
        kept = 0
        for i, d in enumerate(draft[0].tolist()):
            if torch.rand((), generator=generator) >= probs[i, d]:
                break
            tokens.append(d)
            kept += 1
        tokens.append(int(torch.multinomial(probs[kept], 1, generator=generator)))  # wrong: not the residual
        taps = verify.taps[:, : kept + 1]
    return tokens[:N_TOKENS]


# ------------------------------------------------------------------ T = 1 on every path offered

class LookupDraftOnnxBackend:
    """The onnxruntime backend of an engine dir with `LookupDraftBackend`'s drafts."""

    draft_logits = False

    def __init__(self, inner, tables):
        self.inner, self.tables = inner, tables

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def draft(self, state, last_tokens, new_taps, ctx_start, block_start, block_size):
        proposal = self.tables.get(block_start, {}).get(int(last_tokens[0]), [0])
        return torch.tensor([(proposal * block_size)[: block_size - 1]])


def backend_joint(backend) -> torch.Tensor:
    """`p[t1, t2, t3]` as `backend` itself computes the target (plain decoding steps, float64 softmax)."""
    n = len(PROMPT)
    state = backend.new_state(1, 16)
    p1 = backend.prefill(state, torch.tensor([PROMPT])).last_logits[0].double().softmax(-1)
    joint = torch.zeros(VOCAB, VOCAB, VOCAB, dtype=torch.float64)
    for t1 in range(VOCAB):
        p2 = backend.verify(state, torch.tensor([[t1]]), n).logits[0, 0].double().softmax(-1)
        for t2 in range(VOCAB):
            p3 = backend.verify(state, torch.tensor([[t2]]), n + 1).logits[0, 0].double().softmax(-1)
            joint[t1, t2] = p1[t1] * p2[t2] * p3
    return joint


@pytest.fixture(scope="module")
def offered_paths(tmp_path_factory):
    """The onnxruntime fp32 and torch bf16 backends of the tiny-vocabulary target, with lookup drafts."""
    from blockpilot.builder.engine_dir import BuildSpec, build_engine_dir
    from blockpilot.models.checkpoint import load_drafter, load_target
    from blockpilot.runtime.engine_dir import open_engine_dir

    tmp = tmp_path_factory.mktemp("tiny-vocab-paths")
    target = make_hf_target(tmp, "llama", vocab_size=VOCAB)
    drafter = make_drafter(tmp, target, block_size=8)
    tables = greedy_tables(exact_joint(target, PROMPT))
    build_engine_dir(BuildSpec(target, drafter, tmp / "engine", (2, 4, 8), 32))
    ort = LookupDraftOnnxBackend(open_engine_dir(tmp / "engine", backend="onnxruntime").backend, tables)
    bf16 = LookupDraftBackend(load_target(target, dtype=torch.bfloat16),
                              load_drafter(drafter, dtype=torch.bfloat16), tables, fixed_shape=True)
    return {"onnxruntime-fp32": ort, "torch-bf16": bf16}


@pytest.mark.parametrize("path", ["onnxruntime-fp32", "torch-bf16"])
@pytest.mark.parametrize("block_size", [2, 8])
def test_speculative_sampling_at_t1_matches_the_target_distribution_on_every_offered_path(
        offered_paths, path, block_size):
    backend = offered_paths[path]
    joint = backend_joint(backend)
    counts, accept_lengths = runner_first_tokens(backend, block_size, seed=10 + block_size)
    stat, df = chi2_statistic(counts, joint)
    assert stat < chi2_critical(df), f"{path}: chi2 {stat:.1f} > {chi2_critical(df):.1f} (df {df})"
    assert sum(a >= 2 for a in accept_lengths) > N_SAMPLES // 5  # drafts were accepted
    wrong, _ = runner_first_tokens(backend, block_size, temperature=0.7, seed=20 + block_size)
    assert chi2_statistic(wrong, joint)[0] > chi2_critical(df)  # and the test can tell


def test_categorical_draws_follow_each_rows_probabilities_and_never_a_zero_one():
    from blockpilot.runtime.sampling import draw_categorical

    probs = torch.tensor([[0.0, 0.1, 0.0, 0.6, 0.3, 0.0], [0.5, 0.0, 0.0, 0.0, 0.0, 0.5], [0.0] * 5 + [2.0]])
    generator = torch.Generator().manual_seed(1)
    draws = torch.stack([draw_categorical(probs, generator) for _ in range(6000)])  # (6000, 3)
    counts = torch.stack([torch.bincount(draws[:, r], minlength=6) for r in range(3)]).double()
    expected = probs / probs.sum(dim=1, keepdim=True) * len(draws)
    assert (counts[expected == 0] == 0).all()  # zero-probability indices are never drawn
    chi2 = ((counts - expected)[expected > 0] ** 2 / expected[expected > 0]).sum()
    assert chi2 < 20  # 4 degrees of freedom: P(chi2 > 20) < 0.001
    again = torch.stack([draw_categorical(probs, torch.Generator().manual_seed(1)) for _ in range(3)])
    assert torch.equal(again[0], draws[0]) and torch.equal(again[0], again[2])  # the seed fixes the draw


# ------------------------------------------------------------------ rejection sampling (drafts drawn from q)

def test_rejection_sampling_commits_tokens_distributed_as_the_target_and_accepts_sum_min_p_q():
    """One slot, exactly: the committed token follows p (accepted drafts and residual draws together),
    and the draft survives with probability sum_x min(p(x), q(x)); q lives on a draft vocabulary
    that misses some ids of p."""
    p = torch.tensor([[0.05, 0.30, 0.10, 0.25, 0.20, 0.10], [1 / 6] * 6], dtype=torch.float64)  # (K=2, V=6)
    vocab_ids = torch.tensor([1, 2, 3, 5])  # ids 0 and 4 can never be drafted
    q = torch.tensor([[0.55, 0.05, 0.20, 0.20]], dtype=torch.float64)  # (K-1=1, N=4)
    generator = torch.Generator().manual_seed(0)
    n, counts, accepted = 20000, torch.zeros(6), 0
    for _ in range(n):
        column = torch.multinomial(q[0], 1, generator=generator)
        tokens, a = rejection_sample_block(column, q, vocab_ids, p, generator)
        assert len(tokens) == a + 1 and (a == 0 or tokens[0] == int(vocab_ids[column]))
        counts[tokens[0]] += 1
        accepted += a
    stat, df = chi2_statistic(counts, p[0])
    assert stat < chi2_critical(df), f"chi2 {stat:.1f} > {chi2_critical(df):.1f}"
    expected = float(torch.minimum(p[0, vocab_ids], q[0]).sum())  # 0.30 + 0.05 + 0.20 + 0.10 = 0.65
    assert abs(accepted / n - expected) < 4 * math.sqrt(expected * (1 - expected) / n)


@pytest.mark.parametrize("verify", [rejection_sample_block, block_verify_block], ids=["token", "block"])
def test_both_rules_with_q_equal_to_p_keep_every_draft_and_draw_the_bonus(verify):
    p = torch.tensor([[0.2, 0.8], [0.6, 0.4], [0.5, 0.5]], dtype=torch.float64)  # (K=3, V=2)
    generator = torch.Generator().manual_seed(1)
    for _ in range(200):
        columns = torch.multinomial(p[:2], 1, generator=generator)[:, 0]
        tokens, a = verify(columns, p[:2], None, p, generator)
        assert a == 2 and len(tokens) == 3 and tokens[:2] == columns.tolist()


class ToyChain:
    """A 3-token autoregressive target `p(. | context)` and a drafter `q(. | context)` that ignores the
    drafted tokens before the slot (as a DFlash block does), both fixed random tables."""

    def __init__(self, seed: int, vocab: int = 3):
        self.vocab, self.seed = vocab, seed

    def _table(self, context: tuple, salt: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(hash((self.seed, salt, context)) % 2**31)  # ints hash alike every run
        return torch.rand(self.vocab, generator=g, dtype=torch.float64).pow(3) + 1e-3  # skewed, all positive

    def p(self, context: tuple) -> torch.Tensor:
        t = self._table(context, 1)
        return t / t.sum()

    def q(self, context: tuple, slot: int) -> torch.Tensor:
        t = self._table((len(context), slot), 2)
        return t / t.sum()

    def joint(self, n: int) -> torch.Tensor:
        out = torch.zeros((self.vocab,) * n, dtype=torch.float64)
        for seq in itertools.product(range(self.vocab), repeat=n):
            out[seq] = math.prod(float(self.p(seq[:i])[t]) for i, t in enumerate(seq))
        return out


def toy_generate(chain: ToyChain, verify, drafts: int, n: int, generator: torch.Generator) -> tuple[tuple, list[int]]:
    """`n` tokens from `chain` by repeated steps of `verify` with `drafts` drafts a step; the tokens and
    the number committed at each step."""
    out, per_step = (), []
    while len(out) < n:
        q = torch.stack([chain.q(out, k) for k in range(drafts)])  # (drafts, V)
        columns = torch.multinomial(q, 1, generator=generator)[:, 0]
        drafted = tuple(columns.tolist())
        probs = torch.stack([chain.p(out + drafted[:k]) for k in range(drafts + 1)])  # (drafts + 1, V)
        tokens, a = verify(columns, q, None, probs, generator)
        assert len(tokens) == a + 1 and tuple(tokens[:a]) == drafted[:a]
        out += tuple(tokens)
        per_step.append(len(tokens))
    return out[:n], per_step


@pytest.mark.parametrize("verify", [block_verify_block, rejection_sample_block], ids=["block", "token"])
def test_verified_steps_produce_the_targets_joint_distribution_of_three_tokens(verify):
    """Repeated steps with 3 drafts each: the first 3 tokens follow the exact joint of the toy target."""
    chain, n_samples = ToyChain(seed=0), 12000
    generator = torch.Generator().manual_seed(11)
    counts = torch.zeros((3, 3, 3))
    for _ in range(n_samples):
        seq, _ = toy_generate(chain, verify, drafts=3, n=3, generator=generator)
        counts[seq] += 1
    stat, df = chi2_statistic(counts, chain.joint(3))
    assert stat < chi2_critical(df), f"chi2 {stat:.1f} > {chi2_critical(df):.1f} (df {df})"
    skewed = ToyChain(seed=1).joint(3)  # and the test can tell another distribution
    assert chi2_statistic(counts, skewed)[0] > chi2_critical(df)


def test_block_verification_commits_more_tokens_per_step_than_token_verification():
    """Same drafts, same target: block verification keeps more per step (never fewer in expectation;
    on this chain exactly 1.809 against 1.506 tokens a step with 4 drafts, by enumeration)."""
    chain = ToyChain(seed=2)
    means = {}
    for name, verify in (("block", block_verify_block), ("token", rejection_sample_block)):
        generator = torch.Generator().manual_seed(5)
        steps = [toy_generate(chain, verify, drafts=4, n=1, generator=generator)[1][0] for _ in range(4000)]  # 1 step
        mean = sum(steps) / len(steps)
        var = sum((x - mean) ** 2 for x in steps) / (len(steps) - 1)
        means[name] = (mean, math.sqrt(var / len(steps)))
    (block, se_b), (token, se_t) = means["block"], means["token"]
    assert block - token > 4 * math.hypot(se_b, se_t), means


def test_block_verification_on_a_draft_vocabulary_never_commits_an_impossible_token():
    """q over a draft vocabulary (ids 1, 2, 3, 5 of 6): committed tokens are drafts or ids p allows."""
    p = torch.tensor([[0.05, 0.30, 0.10, 0.25, 0.20, 0.10], [0.0, 0.5, 0.0, 0.0, 0.5, 0.0],
                      [1 / 6] * 6], dtype=torch.float64)
    vocab_ids = torch.tensor([1, 2, 3, 5])
    q = torch.tensor([[0.55, 0.05, 0.20, 0.20], [0.25, 0.25, 0.25, 0.25]], dtype=torch.float64)
    generator = torch.Generator().manual_seed(2)
    for _ in range(2000):
        columns = torch.multinomial(q, 1, generator=generator)[:, 0]
        tokens, a = block_verify_block(columns, q, vocab_ids, p, generator)
        for k, token in enumerate(tokens):
            assert p[k, token] > 0, (tokens, a)


def test_an_unknown_verification_rule_is_a_user_error(drafting_paths):
    from blockpilot.errors import UserError
    with pytest.raises(UserError, match="unknown verification 'tree'"):
        Runner(drafting_paths["torch-fp32"], verification="tree")
    runner = Runner(drafting_paths["torch-fp32"])
    with pytest.raises(UserError, match="choose one of block, token"):
        runner.verification = "Block"
    assert runner.verification == "block"


def test_the_draft_distribution_is_the_softmax_of_the_logits_at_the_requests_temperature():
    logits = torch.tensor([[1.0, 2.0, 0.5]])
    assert torch.allclose(draft_distribution(logits, 0.5), torch.softmax(logits.double() / 0.5, -1))


class CountingDraftBackend(TorchBackend):
    """The tiny target and drafter as they are (drafts from the drafter's own logits), counting how
    often the decode loop asked for them."""

    calls_with_logits = 0

    def draft(self, *args, with_logits=False, **kwargs):
        self.calls_with_logits += with_logits
        return super().draft(*args, with_logits=with_logits, **kwargs)


@pytest.fixture(scope="module")
def drafting_paths(tmp_path_factory):
    """Backends whose drafter returns its logits, so that T = 1 drafts are drawn from it: torch fp32,
    torch bf16 (fixed shape) and onnxruntime fp32 (an engine dir, whose drafter graph outputs them)."""
    from blockpilot.builder.engine_dir import BuildSpec, build_engine_dir
    from blockpilot.models.checkpoint import load_drafter, load_target
    from blockpilot.runtime.engine_dir import open_engine_dir

    tmp = tmp_path_factory.mktemp("tiny-vocab-drafting")
    target = make_hf_target(tmp, "llama", vocab_size=VOCAB)
    drafter = make_drafter(tmp, target, block_size=8)
    build_engine_dir(BuildSpec(target, drafter, tmp / "engine", (2, 4, 8), 32))
    return {
        "torch-fp32": CountingDraftBackend(load_target(target), load_drafter(drafter)),
        "torch-bf16": CountingDraftBackend(load_target(target, dtype=torch.bfloat16),
                                           load_drafter(drafter, dtype=torch.bfloat16), fixed_shape=True),
        "onnxruntime-fp32": open_engine_dir(tmp / "engine", backend="onnxruntime").backend,
    }


@pytest.mark.parametrize("path,verification", [("torch-fp32", "block"), ("torch-bf16", "block"),
                                               ("onnxruntime-fp32", "block"), ("torch-fp32", "token")])
@pytest.mark.parametrize("block_size", [2, 8])
def test_drafts_drawn_from_the_drafter_keep_the_target_distribution_on_every_path(drafting_paths, path, block_size,
                                                                                  verification):
    backend = drafting_paths[path]
    assert backend.draft_logits
    joint = backend_joint(backend)
    counts, accept_lengths = runner_first_tokens(backend, block_size, seed=30 + block_size, verification=verification)
    stat, df = chi2_statistic(counts, joint)
    assert stat < chi2_critical(df), f"{path}: chi2 {stat:.1f} > {chi2_critical(df):.1f} (df {df})"
    assert sum(a >= 2 for a in accept_lengths) > N_SAMPLES // 10  # sampled drafts were accepted
    if isinstance(backend, CountingDraftBackend):
        assert backend.calls_with_logits > 0
    wrong, _ = runner_first_tokens(backend, block_size, temperature=0.7, seed=40 + block_size)
    assert chi2_statistic(wrong, joint)[0] > chi2_critical(df)  # and the test can tell


def test_sampled_drafts_accept_more_than_greedy_drafts_on_the_same_model(drafting_paths):
    """The reason for rejection sampling: with the same drafter, a slot survives with probability
    sum min(p, q) instead of p(argmax q)."""
    backend = drafting_paths["torch-fp32"]
    runner = Runner(backend)
    taus = {}
    for sampled in (True, False):
        runner.sampled_drafts = sampled
        out = runner.generate([torch.tensor(PROMPT)] * 64, max_new_tokens=24, end_id=-1, temperature=1.0,
                              random_seed=7, block_size=4, return_dict=True)
        lengths = [a for row in out["accept_lengths"] for a in row]
        taus[sampled] = sum(lengths) / len(lengths)
    assert taus[True] > taus[False], taus


def test_greedy_requests_keep_greedy_drafts_when_batched_with_sampled_ones(drafting_paths):
    backend = drafting_paths["onnxruntime-fp32"]
    from blockpilot.runtime.batching import BatchDecoder, GenerationRequest

    alone = Runner(backend).generate([torch.tensor(PROMPT)], max_new_tokens=12, end_id=-1, block_size=4,
                                     return_dict=True)["output_ids"][0, 0, len(PROMPT):].tolist()
    decoder = BatchDecoder(Runner(backend), max_batch=4)
    ids = [decoder.add(GenerationRequest(PROMPT, 12, temperature=t, seed=3, block_size=4, end_id=-1))
           for t in (0.0, 1.0, 0.0)]
    tokens = {i: [] for i in ids}
    while decoder:
        for event in decoder.step():
            tokens[event.request_id] += event.new_tokens
    assert tokens[ids[0]] == alone and tokens[ids[2]] == alone
