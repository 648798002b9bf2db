"""`scripts/magpie_prompts.py`: the target's own queries are kept only when finished, of a sensible length, new,
and sharing no 8-word run with an evaluation prompt; the query starts where the chat template's user text does."""

from __future__ import annotations

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

    def apply_chat_template(self, messages, tokenize=False):
        return "<s>system\nBe kind.</s>\n<s>user\n" + messages[0]["content"] + "</s>\n"

    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": [ord(c) for c in text]}


def test_the_query_prefix_is_the_template_up_to_the_user_text(script):
    ids = script.pre_query_ids(_TemplateTokenizer())
    assert "".join(map(chr, ids)) == "<s>system\nBe kind.</s>\n<s>user\n"
