"""`scripts/magpie_prompts.py`: the target's own queries are kept only when finished, of a sensible length, new,
and sharing no 8-word run with an evaluation prompt; the query starts where the chat template's user text does."""

from __future__ import annotations

import json
import sys

import pytest

from fixtures import load_script

EVAL = "Compose an engaging travel blog post about a recent trip to Hawaii, highlighting cultural experiences."


@pytest.fixture(scope="module")
def script():
    yield load_script("magpie_prompts")
    sys.modules.pop("magpie_prompts", None)


def test_finished_new_queries_are_kept_once(script):
    keep = script.Filter({EVAL})
    query = "How do I keep basil alive on a windowsill in winter?"
    assert keep.reason(query, ended=True) is None
    assert keep.reason(query.upper().replace(" ", "  "), ended=True) == "repeat"
    assert keep.reason("Another question about growing tomatoes indoors?", ended=False) == "unfinished"
    assert keep.reason("Hi", ended=True) == "length"
    assert keep.reason("x" * 2001, ended=True) == "length"


def test_queries_that_share_eight_words_with_an_evaluation_prompt_are_left_out(script):
    keep = script.Filter({EVAL})
    assert keep.reason(EVAL, ended=True) == "evaluation"
    assert keep.reason("Please compose an engaging travel blog post about a recent trip to Paris.", ended=True) \
        == "evaluation"  # "compose an engaging travel blog post about a recent" is 8 of its words
    assert keep.reason("Write a travel blog post about Hawaii and its cultural experiences.", ended=True) is None


def test_a_resumed_filter_remembers_the_queries_already_kept(script):
    keep = script.Filter({EVAL}, ["What is the capital of Peru?"])
    assert keep.reason("what is the capital of peru?", ended=True) == "repeat"


class _TemplateTokenizer:
    """A tokenizer whose chat template wraps the user text as ChatML with a system turn; one id per character."""

    chat_template = "(ChatML)"

    def apply_chat_template(self, messages, tokenize=False):
        return "<s>system\nBe kind.</s>\n<s>user\n" + messages[0]["content"] + "</s>\n"

    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": [ord(c) for c in text]}


def test_the_query_prefix_is_the_template_up_to_the_user_text(script):
    ids = script.pre_query_ids(_TemplateTokenizer())
    assert "".join(map(chr, ids)) == "<s>system\nBe kind.</s>\n<s>user\n"


@pytest.mark.parametrize("extra, message", [
    (["--temperature", "0"], "same query every time"),
    (["--count", "0"], "--count must be positive"),
    (["--batch-size", "-1"], "--batch-size must be positive"),
    (["--top-p", "0"], "fix --temperature or --top-p"),
])
def test_bad_options_end_in_one_line_and_exit_2(script, tmp_path, capsys, extra, message):
    out = tmp_path / "magpie.jsonl"
    assert script.main(["--out", str(out), *extra]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1
    assert not out.exists()


def test_resuming_a_file_it_did_not_write_ends_in_one_line(script, tmp_path):
    out = tmp_path / "prompts.jsonl"
    out.write_text(json.dumps({"prompt": "a ShareGPT turn", "source": "sharegpt"}) + "\n")
    from blockpilot.errors import UserError

    with pytest.raises(UserError, match=r"prompts.jsonl:1 is not a row this script writes"):
        script.read_rows(out)
    out.write_text(json.dumps({"prompt": "hi there, how are you?", "source": "magpie", "batch": 0}) + "\n\n")
    assert [r["batch"] for r in script.read_rows(out)] == [0]


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    from builder_fixtures import tiny_engine_dir

    return tiny_engine_dir(tmp_path_factory)


def _rows(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_queries_are_drawn_batch_by_batch_resume_and_repeat_for_a_seed(script, engine, tmp_path, monkeypatch):
    """On the tiny engine (random weights, a character tokenizer): the query prefix is a fixed text, and any
    finished query of 1+ characters is kept."""
    monkeypatch.setattr(script, "pre_query_ids", lambda tokenizer: tokenizer("hi ", add_special_tokens=False)["input_ids"])
    monkeypatch.setattr(script, "MIN_CHARS", 1)
    import blockpilot.assets.prompts as prompts

    monkeypatch.setattr(prompts, "evaluation_texts", lambda: set())
    common = ["--engine-dir", str(engine), "--batch-size", "8", "--max-new-tokens", "30", "--seed", "3"]
    first, again = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    assert script.main(["--out", str(first), "--count", "3", *common]) == 0
    rows = _rows(first)
    assert len(rows) >= 3 and all(r["source"] == "magpie" and r["prompt"] for r in rows)
    assert len({r["prompt"] for r in rows}) == len(rows)
    assert script.main(["--out", str(first), "--count", str(len(rows) + 1), *common]) == 0  # resumes
    more = _rows(first)
    assert more[:len(rows)] == rows and len(more) > len(rows) and more[-1]["batch"] > rows[-1]["batch"]
    assert script.main(["--out", str(again), "--count", str(len(more)), *common]) == 0  # the same draws
    assert _rows(again)[:len(more)] == more
