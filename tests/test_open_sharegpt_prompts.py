"""`scripts/open_sharegpt_prompts.py`: the next prompts file for `blockpilot answer` leaves out answered turns and
evaluation prompts, is the same shuffle for a seed, and with `--shortest-first` puts short conversations first."""

from __future__ import annotations

import json
import sys

import pytest

from blockpilot.assets.prompts import Prompt
from fixtures import load_script


@pytest.fixture(scope="module")
def script():
    yield load_script("open_sharegpt_prompts")
    sys.modules.pop("open_sharegpt_prompts", None)


LATER = [Prompt(f"c{i}/2", f"turn {i} " + "x" * (60 - 5 * i), "sharegpt",
                (("user", "first " + "y" * (10 * i)), ("assistant", "reply")))
         for i in range(8)]


@pytest.fixture
def answers(tmp_path, monkeypatch, script):
    monkeypatch.setattr(script, "load_sharegpt_later_turns", lambda max_chars: LATER)
    monkeypatch.setattr(script, "evaluation_texts", lambda: {LATER[5].text})
    answered = LATER[2]
    row = {"source": "sharegpt", "prompt": answered.text, "answer": "a", "answer_ids": [1],
           "history": [{"role": role, "content": content} for role, content in answered.history]}
    path = tmp_path / "answers.jsonl"
    path.write_text(json.dumps(row) + "\n")
    return [path]


def test_answered_turns_and_evaluation_prompts_are_left_out(script, answers):
    rows = script.open_prompts(answers, later_turns=True)
    assert sorted(row["id"] for row in rows) == sorted(f"sharegpt/c{i}/2" for i in (0, 1, 3, 4, 6, 7))
    assert rows == script.open_prompts(answers, later_turns=True)  # one order for a seed: answering resumes
    assert rows[0]["messages"][-1] == {"role": "user", "content": LATER[int(rows[0]["id"][10])].text}


def test_shortest_first_orders_by_the_whole_conversation(script, answers):
    rows = script.open_prompts(answers, later_turns=True, shortest_first=True)
    lengths = [script.conversation_chars(row) for row in rows]
    assert lengths == sorted(lengths) and len(set(lengths)) == len(lengths)
    # the turn alone shrinks with i while the history grows faster: only the conversation's length orders them so
    assert [row["id"] for row in rows] == [f"sharegpt/c{i}/2" for i in (0, 1, 3, 4, 6, 7)]
