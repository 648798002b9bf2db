"""`blockpilot answer`: the target's greedy answers, through onnxruntime's batched plain decoding or
transformers `generate`, resumable; sampled answers with their draw recorded."""

from __future__ import annotations

import json

import pytest
import torch

from blockpilot.cli import main

from builder_fixtures import tiny_engine_dir, tiny_models

PROMPTS = ["hello there", "abc", "The cat sat.", "x y z", "Hi!", "what is 2 plus 2?", "ok"]


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    return tiny_engine_dir(tmp_path_factory)


@pytest.fixture(scope="module")
def target(tmp_path_factory, engine):
    return tiny_models(tmp_path_factory, "llama")[0]


def _prompts_file(tmp_path, prompts=PROMPTS):
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps({"prompt": p, "source": "chat"}) + "\n" for p in prompts))
    return path


def _rows(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_onnxruntime_batched_answers_equal_transformers_greedy_answers(engine, target, tmp_path):
    prompts = _prompts_file(tmp_path)
    ort_out, hf_out = tmp_path / "ort.jsonl", tmp_path / "hf.jsonl"
    assert main(["answer", "--engine-dir", str(engine), "--prompts", str(prompts), "--out", str(ort_out),
                 "--max-new-tokens", "9", "--batch-size", "3"]) == 0
    assert main(["answer", "--backend", "torch", "--target", str(target), "--prompts", str(prompts),
                 "--out", str(hf_out), "--max-new-tokens", "9", "--batch-size", "3", "--device", "cpu"]) == 0
    ort_rows = {r["prompt"]: r for r in _rows(ort_out)}
    hf_rows = {r["prompt"]: r for r in _rows(hf_out)}
    assert set(ort_rows) == set(PROMPTS) == set(hf_rows)
    for prompt in PROMPTS:
        assert ort_rows[prompt]["answer_ids"] == hf_rows[prompt]["answer_ids"], prompt
        assert ort_rows[prompt]["finish"] == hf_rows[prompt]["finish"]
        assert ort_rows[prompt]["source"] == "chat"
        assert 1 <= len(ort_rows[prompt]["answer_ids"]) <= 9


def test_answering_again_resumes_and_answers_each_prompt_once(engine, tmp_path):
    prompts = _prompts_file(tmp_path)
    out = tmp_path / "answers.jsonl"
    assert main(["answer", "--engine-dir", str(engine), "--prompts", str(prompts), "--out", str(out),
                 "--max-new-tokens", "5", "--limit", "3"]) == 0
    first = _rows(out)
    assert sorted(r["prompt"] for r in first) == sorted(PROMPTS[:3])
    assert main(["answer", "--engine-dir", str(engine), "--prompts", str(prompts), "--out", str(out),
                 "--max-new-tokens", "5"]) == 0
    rows = _rows(out)
    assert sorted(r["prompt"] for r in rows) == sorted(PROMPTS)
    assert rows[:3] == first  # the earlier answers are kept as they were


def test_answers_go_into_a_new_folder_as_every_other_command_s_output_does(engine, tmp_path):
    prompts = _prompts_file(tmp_path)
    out = tmp_path / "runs" / "new" / "answers.jsonl"
    assert main(["answer", "--engine-dir", str(engine), "--prompts", str(prompts), "--out", str(out),
                 "--max-new-tokens", "4", "--limit", "2"]) == 0
    assert sorted(r["prompt"] for r in _rows(out)) == sorted(PROMPTS[:2])


def test_an_existing_folder_as_out_ends_in_one_line_and_exit_2(engine, tmp_path, capsys):
    prompts = _prompts_file(tmp_path)
    (tmp_path / "runs").mkdir()
    assert main(["answer", "--engine-dir", str(engine), "--prompts", str(prompts), "--out", str(tmp_path / "runs"),
                 "--max-new-tokens", "4"]) == 2
    err = capsys.readouterr().err.strip()
    assert "is a folder" in err and len(err.splitlines()) == 1
    assert list((tmp_path / "runs").iterdir()) == []


def test_prompts_too_long_for_the_engine_cache_are_skipped(engine, tmp_path, capsys):
    prompts = _prompts_file(tmp_path, ["short", "a much longer prompt than the tiny cache holds " * 2])
    out = tmp_path / "answers.jsonl"
    assert main(["answer", "--engine-dir", str(engine), "--prompts", str(prompts), "--out", str(out),
                 "--max-new-tokens", "5"]) == 0
    assert [r["prompt"] for r in _rows(out)] == ["short"]
    captured = capsys.readouterr()
    assert "1 prompts skipped" in captured.out + captured.err


def test_sampled_answers_record_their_draw_and_resume_to_the_same_draws(engine, target, tmp_path):
    prompts = _prompts_file(tmp_path)
    sampled = ["--temperature", "1.5", "--top-p", "0.9", "--max-new-tokens", "8"]
    resumed, whole, other_seed = tmp_path / "resumed.jsonl", tmp_path / "whole.jsonl", tmp_path / "other.jsonl"
    base = ["answer", "--engine-dir", str(engine), "--prompts", str(prompts), "--batch-size", "2"]
    assert main(base + ["--out", str(resumed), "--limit", "3", "--seed", "5", *sampled]) == 0
    assert main(base + ["--out", str(resumed), "--seed", "5", *sampled]) == 0  # resumes: 4 more, same seeds
    assert main(base + ["--out", str(whole), "--seed", "5", "--batch-size", "5", *sampled]) == 0
    assert main(base + ["--out", str(other_seed), "--seed", "6", *sampled]) == 0
    by_prompt = lambda path: {r["prompt"]: r for r in _rows(path)}
    resumed_rows, whole_rows, other_rows = by_prompt(resumed), by_prompt(whole), by_prompt(other_seed)
    assert set(resumed_rows) == set(PROMPTS) and resumed_rows == whole_rows  # a draw depends on seed and prompt only
    assert any(other_rows[p]["answer_ids"] != whole_rows[p]["answer_ids"] for p in PROMPTS)
    row = whole_rows[PROMPTS[0]]
    assert (row["temperature"], row["top_k"], row["top_p"]) == (1.5, 0, 0.9) and isinstance(row["seed"], int)
    assert len({r["seed"] for r in whole_rows.values()}) == len(PROMPTS)
    torch_out = tmp_path / "torch.jsonl"  # the torch backend draws with the runtime's sampler too
    assert main(["answer", "--backend", "torch", "--target", str(target), "--prompts", str(prompts), "--out",
                 str(torch_out), "--device", "cpu", "--seed", "5", *sampled]) == 0
    assert {r["temperature"] for r in _rows(torch_out)} == {1.5} and len(_rows(torch_out)) == len(PROMPTS)


TURN_TEMPLATE = ("{% for m in messages %}{{ m['role'][0] }} {{ m['content'] }}.{% endfor %}"
                 "{% if add_generation_prompt %}a{% endif %}")  # only characters of the tiny tokenizer


def test_later_turns_are_answered_in_their_conversation_and_resume_by_conversation(engine, tmp_path):
    from transformers import AutoTokenizer

    from blockpilot.runtime.runner import Runner
    from blockpilot.text import chat_prompt_ids
    from blockpilot.training.data import answer_with_runner, read_answer_rows, tokenize_rows

    tokenizer = AutoTokenizer.from_pretrained(engine)
    tokenizer.chat_template = TURN_TEMPLATE
    runner = Runner.from_engine_dir(engine, backend="onnxruntime", use_predictor=False)
    history = (("user", "hi"), ("assistant", "ok"))
    out = tmp_path / "answers.jsonl"
    answer = lambda: answer_with_runner(runner, tokenizer, ["x", "x", "hi"], max_new_tokens=5, batch_size=2,
                                        out_path=out, sources=["chat"] * 3, histories=[(), history, ()])
    answer()
    rows = read_answer_rows(out)
    assert len(rows) == 3  # "x" alone and "x" after the exchange are two prompts
    later = next(r for r in rows if r.get("history"))
    assert (later["prompt"], later["history"]) == ("x", [{"role": "user", "content": "hi"},
                                                         {"role": "assistant", "content": "ok"}])
    ids = chat_prompt_ids(tokenizer, "x", history=history)
    assert ids != chat_prompt_ids(tokenizer, "x")
    alone = runner.generate([torch.tensor(ids)], max_new_tokens=5, block_size=1, return_dict=True)
    expected = alone["output_ids"][0, 0, len(ids): len(ids) + 5].tolist()
    end = runner.end_id
    assert later["answer_ids"] == (expected[: expected.index(end)] if end in expected else expected)
    answer()  # resumes: every conversation is answered already
    assert read_answer_rows(out) == rows
    sequence = next(q for q, r in zip(tokenize_rows(rows, tokenizer, 40), rows) if r.get("history"))
    assert list(sequence.ids[: sequence.answer_start]) == ids  # trained in its conversation


def test_later_turns_without_a_chat_template_end_in_one_line_and_write_nothing(engine, tmp_path, capsys):
    prompts = tmp_path / "later.jsonl"
    prompts.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "ok"},
                                                {"role": "user", "content": "x"}]}) + "\n")
    out = tmp_path / "answers.jsonl"
    assert main(["answer", "--engine-dir", str(engine), "--prompts", str(prompts), "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert "needs the tokenizer's chat template" in err and len(err.splitlines()) == 1
    assert not out.exists()


@pytest.mark.parametrize("extra, message", [
    (["--backend", "onnxruntime", "--target", "TARGET"], "needs --engine-dir"),
    (["--backend", "torch", "--engine-dir", "ENGINE"], "--engine-dir is for --backend onnxruntime"),
    (["--backend", "onnxruntime", "--device", "cuda", "--engine-dir", "ENGINE"], "runs on the CPU"),
    (["--engine-dir", "NOWHERE"], "NOWHERE"),
    (["--engine-dir", "ENGINE", "--threads", "0"], "--threads must be positive"),
    (["--backend", "tensorrt"], "drop --backend tensorrt"),
    (["--engine-dir", "ENGINE", "--temperature", "-1"], "need a finite temperature >= 0"),
    (["--engine-dir", "ENGINE", "--temperature", "1", "--top-p", "0"], "fix --temperature, --top-k or --top-p"),
])
def test_bad_answer_options_end_in_one_line_and_exit_2(engine, target, tmp_path, capsys, extra, message):
    prompts = _prompts_file(tmp_path)
    out = tmp_path / "answers.jsonl"
    extra = [str(target) if a == "TARGET" else str(engine) if a == "ENGINE" else
             str(tmp_path / "nowhere") if a == "NOWHERE" else a for a in extra]
    assert main(["answer", "--prompts", str(prompts), "--out", str(out), *extra]) == 2
    err = capsys.readouterr().err.strip()
    assert message.replace("NOWHERE", "nowhere") in err and len(err.splitlines()) == 1
    assert not out.exists() or not out.read_text()


def test_plain_decoding_runners_load_no_predictor_even_one_for_another_drafter(engine, tmp_path):
    """`answer` decodes plainly, so it opens engine dirs without their predictor: it keeps working while a
    new drafter's predictor is being labelled (the old one no longer fits the drafter)."""
    from test_policy import _constant_predictor, _info

    from blockpilot.errors import UserError
    from blockpilot.runtime.runner import Runner

    stale = _constant_predictor(tmp_path / "stale.onnx", _info(engine / "target", engine / "drafter",
                                                                drafter_sha256="0" * 64, candidates=(3, 5)), [0.5, 0.5])
    with pytest.raises(UserError, match="another drafter"):
        Runner.from_engine_dir(engine, backend="onnxruntime", predictor=stale)
    runner = Runner.from_engine_dir(engine, backend="onnxruntime", predictor=stale, use_predictor=False)
    assert runner.policy is None
    out = main(["answer", "--engine-dir", str(engine), "--prompts", str(_prompts_file(tmp_path, PROMPTS[:2])),
                "--out", str(tmp_path / "a.jsonl"), "--max-new-tokens", "4"])
    assert out == 0 and len(_rows(tmp_path / "a.jsonl")) == 2


def test_prompts_start_shortest_first_within_each_window_of_the_list(engine, tmp_path, monkeypatch):
    """A batch's cache is as long as its longest member needs; prompts of similar length start together,
    while the list's order holds from window to window (a time-budgeted run answers a prefix of it)."""
    from transformers import AutoTokenizer

    from blockpilot.runtime.runner import Runner
    from blockpilot.training import data

    monkeypatch.setattr(data, "LENGTH_WINDOW_BATCHES", 2)  # batch size 1: windows of 2 prompts
    tokenizer = AutoTokenizer.from_pretrained(engine)
    runner = Runner.from_engine_dir(engine, backend="onnxruntime", use_predictor=False)
    prompts = ["the cat sat on the mat", "ok", "what is 2 plus 2", "x y", "hi"]
    out = tmp_path / "answers.jsonl"
    data.answer_with_runner(runner, tokenizer, prompts, max_new_tokens=3, batch_size=1, out_path=out,
                            sources=["chat"] * len(prompts))
    assert [r["prompt"] for r in _rows(out)] == ["ok", "the cat sat on the mat", "x y", "what is 2 plus 2", "hi"]
    assert data.by_length_in_windows([5, 3, 4, 1, 2], lambda n: n, 2) == [3, 5, 1, 4, 2]
