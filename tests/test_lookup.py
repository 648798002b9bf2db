"""Drafting by lookup: the copied drafts, and decoding with them stays lossless."""

import random

import pytest
import torch

from blockpilot.runtime.lookup import PromptLookup
from blockpilot.runtime.runner import Runner

from fixtures import CountingBackend, make_drafter, make_hf_target


def brute_force_proposal(tokens, count, min_ngram=3, max_ngram=4):
    """The reference: scan back for the most recent earlier occurrence of the longest suffix."""
    last = len(tokens) - 1
    for n in range(max_ngram, min_ngram - 1, -1):
        suffix = tokens[last - n + 1:]
        if len(suffix) < n:
            continue
        for end in range(last - 1, n - 2, -1):
            if tokens[end - n + 1: end + 1] == suffix:
                copied = tokens[end + 1:]  # runs up to the present, then repeats
                return [copied[k % len(copied)] for k in range(count)]
    return None


def test_lookup_copies_what_followed_the_most_recent_earlier_occurrence():
    tokens = [1, 2, 3, 4, 9, 1, 2, 3, 5, 7, 7, 1, 2, 3]
    # "1 2 3" occurred twice before; the later one was followed by 5 7 7 1 2 3 ...
    assert PromptLookup(tokens).propose(4) == [5, 7, 7, 1]


def test_lookup_prefers_the_longest_matching_suffix():
    tokens = [8, 2, 3, 4, 6, 1, 2, 3, 4, 5, 0, 8, 2, 3, 4]
    # the 3-gram "2 3 4" last occurred before 5; the 4-gram "8 2 3 4" only before 6
    assert PromptLookup(tokens).propose(2) == [6, 1]


def test_a_copy_that_reaches_the_present_continues_the_loop():
    assert PromptLookup([4, 5, 6, 4, 5, 6]).propose(7) == [4, 5, 6, 4, 5, 6, 4]
    assert PromptLookup([7, 7, 7, 7]).propose(3) == [7, 7, 7]


def test_no_proposal_without_an_earlier_occurrence_of_min_ngram_tokens():
    assert PromptLookup([1, 2, 3, 4, 5]).propose(3) is None
    assert PromptLookup([1, 2, 9, 1, 2]).propose(3) is None  # a 2-gram match is too short
    assert PromptLookup([1, 2, 9, 1, 2], min_ngram=2).propose(2) == [9, 1]
    assert PromptLookup([3]).propose(2) is None


def test_incremental_index_equals_a_fresh_scan_at_every_length():
    rng = random.Random(0)
    tokens = [rng.randrange(6) for _ in range(12)]
    lookup = PromptLookup(tokens)
    for _ in range(150):
        assert lookup.propose(5) == brute_force_proposal(tokens, 5)
        new = [rng.randrange(6) for _ in range(rng.randrange(1, 4))]
        tokens += new
        lookup.extend(new)


def test_bad_ngram_bounds_are_refused():
    with pytest.raises(ValueError, match="min_ngram"):
        PromptLookup([1, 2], min_ngram=4, max_ngram=3)


# ------------------------------------------------------------------ in the decode loop

REPEATING = [[5, 17, 42, 8, 5, 17, 42, 8, 5, 17, 42], [1, 2, 3, 4, 5, 1, 2, 3, 4, 5, 1, 2, 3], [60, 61, 62, 60, 61, 62]]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("tiny-lookup")
    target = make_hf_target(tmp, "llama")
    return target, make_drafter(tmp, target, block_size=8)


def test_greedy_output_with_lookup_equals_plain_decoding_and_skips_drafter_calls(tiny):
    plain = Runner.from_dir(tiny[0], drafter_dir=tiny[1])
    counting = CountingBackend(plain.backend)
    runner = Runner(counting)
    assert runner.lookup == "all"
    n = 40
    steps = 0
    for ids in REPEATING:
        expected = plain.generate([torch.tensor(ids)], max_new_tokens=n, block_size=1, end_id=-1)
        for k in (2, 4, 8):
            out = runner.generate([torch.tensor(ids)], max_new_tokens=n, block_size=k, end_id=-1, return_dict=True)
            assert torch.equal(out["output_ids"], expected), (ids, k)
            steps += len(out["accept_lengths"][0])
    assert 0 < counting.count("draft") < steps  # some steps copied their drafts instead of calling the drafter


def test_lookup_off_calls_the_drafter_every_step(tiny):
    counting = CountingBackend(Runner.from_dir(tiny[0], drafter_dir=tiny[1]).backend)
    runner = Runner(counting, lookup="off")
    out = runner.generate([torch.tensor(REPEATING[0])], max_new_tokens=30, block_size=4, end_id=-1,
                          return_dict=True)
    assert counting.count("draft") == len(out["accept_lengths"][0]) == out["drafter_calls"][0]


def test_batched_requests_with_lookup_equal_their_single_outputs(tiny):
    runner = Runner.from_dir(tiny[0], drafter_dir=tiny[1])
    prompts = [torch.tensor(ids) for ids in [*REPEATING, [9, 10, 11, 12]]]
    together = runner.generate(prompts, max_new_tokens=30, block_size=4, end_id=-1)
    for i, ids in enumerate(prompts):
        alone = runner.generate([ids], max_new_tokens=30, block_size=1, end_id=-1)
        assert together[i, 0, : alone.shape[-1]].tolist() == alone[0, 0].tolist()


def test_unknown_lookup_setting_is_refused(tiny):
    from blockpilot.errors import UserError

    with pytest.raises(UserError, match="unknown lookup 'sometimes'"):
        Runner(Runner.from_dir(tiny[0], drafter_dir=tiny[1]).backend, lookup="sometimes")


def test_sampling_with_copied_and_drawn_drafts_matches_the_target_distribution(tmp_path, monkeypatch):
    """lookup="all" at T = 1: steps whose context repeats copy a deterministic draft (judged by "sample,
    then match"), the others draw from the drafter and are judged by block verification; the first 3
    tokens still follow the target's exact joint distribution."""
    from test_sampling import VOCAB, chi2_critical, chi2_statistic, exact_joint

    target = make_hf_target(tmp_path, "llama", vocab_size=VOCAB)
    prompt = [5, 0, 7, 5, 0, 7]  # a first token 5 repeats "0 7 5": the next step copies "0 7"
    joint = exact_joint(target, prompt)
    runner = Runner(Runner.from_dir(target, drafter_dir=make_drafter(tmp_path, target, block_size=8)).backend,
                    lookup="all")
    copies = []
    propose = PromptLookup.propose
    monkeypatch.setattr(PromptLookup, "propose", lambda self, count: copies.append(propose(self, count)) or copies[-1])
    counts = torch.zeros(VOCAB, VOCAB, VOCAB)
    steps, n_samples = 0, 2000
    for i in range(n_samples):
        out = runner.generate([torch.tensor(prompt)], max_new_tokens=3, end_id=-1, temperature=1.0, random_seed=i,
                              block_size=4, return_dict=True)
        counts[tuple(out["output_ids"][0, 0, len(prompt):].tolist())] += 1
        steps += len(out["accept_lengths"][0])
    stat, df = chi2_statistic(counts, joint)
    assert stat < chi2_critical(df), f"chi2 {stat:.1f} > {chi2_critical(df):.1f} (df {df})"
    copied = sum(c is not None for c in copies)
    assert copied > n_samples * float(joint[5].sum()) / 2 and copied < steps  # both kinds of draft were judged


def test_lookup_replay_script_replays_the_runtime_steps_exactly(tiny):
    """scripts/lookup_replay.py's drafter-only and lookup-else-drafter replays give the accept lengths the
    runtime gives with lookup off and on (T = 0, torch fp32, one request)."""
    from blockpilot.models.checkpoint import load_drafter, load_target

    from fixtures import load_script

    script = load_script("lookup_replay")
    runner = Runner.from_dir(tiny[0], drafter_dir=tiny[1])
    target, drafter = load_target(tiny[0]), load_drafter(tiny[1])
    checked = 0
    for ids in REPEATING:
        for b in (3, 6):
            runs = {}
            for mode in ("off", "greedy"):
                runner.lookup = mode
                out = runner.generate([torch.tensor(ids)], max_new_tokens=30, block_size=b, end_id=-1, return_dict=True)
                runs[mode] = out["accept_lengths"][0]
            answer = out["output_ids"][0, 0].tolist()[: len(ids) + 30]
            drafter_acc, lookup_acc, _ = script.accepted_per_position(target, drafter, answer, len(ids), b, [3])
            # the last step may keep drafts beyond the 30 tokens, which the replay of 30 tokens cannot see
            assert script.replay(lambda i: drafter_acc[i], len(drafter_acc))[:-1] == runs["off"][:-1]
            combined = script.replay(lambda i: drafter_acc[i] if lookup_acc[3][i] is None else lookup_acc[3][i],
                                     len(drafter_acc))
            assert combined[:-1] == runs["greedy"][:-1]
            checked += runs["off"] != runs["greedy"]
    assert checked  # lookup changed some request's steps


def test_replay_with_lookup_gives_the_runtimes_steps_and_drafter_calls(tiny):
    """`training.evaluate.replay_runs(lookup=True)` (what predictor labels replay) commits the tokens a
    step the runtime commits with lookup on, and counts the drafter calls it makes (T = 0, one request)."""
    from blockpilot.models.checkpoint import load_drafter, load_target
    from blockpilot.training.evaluate import replay_runs, sequence_taps

    counting = CountingBackend(Runner.from_dir(tiny[0], drafter_dir=tiny[1]).backend)
    runner = Runner(counting)
    target, drafter = load_target(tiny[0]), load_drafter(tiny[1])
    n, copied = 30, 0
    for ids in REPEATING:
        long = runner.generate([torch.tensor(ids)], max_new_tokens=n + 8, block_size=1, end_id=-1)[0, 0].tolist()
        taps = sequence_taps(target, long, drafter.config.target_layer_ids)
        sizes = (2, 3, 6)
        runs = replay_runs(target, drafter, long, len(ids), sizes, taps, stop_at=len(ids) + n - 1, lookup=True)
        for b, run in zip(sizes, runs):
            counting.calls.clear()
            out = runner.generate([torch.tensor(ids)], max_new_tokens=n, block_size=b, end_id=-1, return_dict=True)
            assert run.steps == out["accept_lengths"][0], (ids, b)
            assert run.drafted == counting.count("draft") == out["drafter_calls"][0], (ids, b)  # as the result reports
            copied += len(run.steps) - run.drafted
    assert copied  # some steps copied their drafts


def test_lookup_replay_script_prices_copies_of_other_lengths(tmp_path, monkeypatch):
    """`--lookup-lengths` replays copies longer than the block (a copy of the block's own length is the
    runtime's rule) and `--step-costs` prices each rule from a bench_steps table."""
    import json
    import sys

    from blockpilot.text import load_tokenizer

    from fixtures import load_script, make_word_corpus

    target, corpus = make_word_corpus(tmp_path)
    drafter = make_drafter(tmp_path, target, block_size=4)
    tokenizer = load_tokenizer(target)
    rows = [json.loads(line) for line in corpus.read_text().splitlines()[:3]]
    answers = tmp_path / "answers.jsonl"  # answers that loop with period 5: copies of 6 keep more than copies of 3
    loop = [" ".join(r["prompt"].split()[j % 5] for j in range(40)) for r in rows]
    answers.write_text("".join(json.dumps({"prompt": r["prompt"], "answer": a, "finish": "length",
                                           "answer_ids": tokenizer(a, add_special_tokens=False)["input_ids"]})
                               + "\n" for r, a in zip(rows, loop)))
    costs = tmp_path / "steps.json"
    costs.write_text(json.dumps({"paths": [{"verify_ms": {str(k): 10.0 + k for k in range(1, 9)},
                                            "draft_ms": {str(k): 2.0 for k in range(2, 9)}, "one_row_ms": 10.0}]}))
    out = tmp_path / "report.json"
    monkeypatch.setattr(sys, "argv", ["lookup_replay", "--answers", str(answers), "--target", str(target), "--drafter",
                                      str(drafter), "--block-sizes", "3", "--min-ngram", "3", "--lookup-lengths",
                                      "3,6", "--step-costs", str(costs), "--out", str(out)])
    load_script("lookup_replay").main()
    assert torch.is_grad_enabled()  # the script leaves no global torch state behind for the tests after it
    report = json.loads(out.read_text())["sets"]["answers.jsonl"]
    tau, speed = report["tau"], report["speed_vs_plain"]
    assert tau["b3 lookup n>=3 copying 3, else drafter"] == tau["b3 lookup n>=3, else drafter"]
    assert speed["b3 lookup n>=3 copying 3, else drafter"] == speed["b3 lookup n>=3, else drafter"]
    assert tau["b3 lookup n>=3 copying 6, else drafter"] > tau["b3 lookup n>=3, else drafter"]  # the answers loop
    # a copying step costs 13 ms, a drafting one 15: plain decoding makes 1 token in 10 ms
    assert speed["b3 drafter"] < 10 * tau["b3 drafter"] / 13 and speed["b3 drafter"] > 10 / 15
    # verifying exactly the rows that will be accepted keeps every token for less
    rule, oracle = "b3 lookup n>=3, else drafter", "b3 lookup n>=3, else drafter, oracle verify"
    assert tau[oracle] == tau[rule] and speed[oracle] >= speed[rule]
    assert f"{rule}, adaptive verify" in tau
    # where verify rows cost nothing, adaptive verify lengths verify every row: the runtime's rule itself
    costs.write_text(json.dumps({"paths": [{"verify_ms": {str(k): 10.0 for k in range(1, 9)},
                                            "draft_ms": {str(k): 2.0 for k in range(2, 9)}, "one_row_ms": 10.0}]}))
    load_script("lookup_replay").main()
    report = json.loads(out.read_text())["sets"]["answers.jsonl"]
    assert report["tau"][f"{rule}, adaptive verify"] == report["tau"][rule]
    assert report["speed_vs_plain"][f"{rule}, adaptive verify"] == report["speed_vs_plain"][rule]


def test_copies_that_are_always_wrong_leave_outputs_unchanged_and_the_drafter_only_drafts_first_blocks(
        tiny, monkeypatch):
    """With a lookup that always proposes the same wrong tokens, every step copies: outputs still equal
    plain decoding's, and the drafter runs once per request (its first draft, which consumes the prompt's
    context before the request joins a batch group)."""
    plain = Runner.from_dir(tiny[0], drafter_dir=tiny[1])
    monkeypatch.setattr(PromptLookup, "propose", lambda self, count: [0] * count)
    counting = CountingBackend(plain.backend)
    runner = Runner(counting)
    prompts = [torch.tensor(ids) for ids in REPEATING]
    expected = [plain.generate([ids], max_new_tokens=20, block_size=1, end_id=-1) for ids in prompts]
    together = runner.generate(prompts, max_new_tokens=20, block_size=4, end_id=-1, return_dict=True)
    for i, alone in enumerate(expected):
        assert together["output_ids"][i, 0, : alone.shape[-1]].tolist() == alone[0, 0].tolist()
    assert counting.count("draft") == len(prompts)
