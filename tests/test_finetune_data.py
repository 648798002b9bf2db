"""`scripts/finetune_data.py`: the drafter fine-tunes' training answers. Label-set prompts, and later turns
of conversations that open with one, never reach the training data; `--focus` puts every row of the new
files first and follows them with a seeded sample of the rest, without repeating a row."""

from __future__ import annotations

import json
import sys

import pytest

from fixtures import load_script


@pytest.fixture(scope="module")
def script():
    yield load_script("finetune_data")
    sys.modules.pop("finetune_data", None)


def _row(prompt, history=(), source="sharegpt"):
    row = {"source": source, "prompt": prompt, "answer": f"answer to {prompt}", "answer_ids": [1, 2]}
    if history:
        row["history"] = [{"role": role, "content": content} for role, content in history]
    return row


def _write(path, rows):
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path.name


def test_label_set_prompts_and_conversations_opening_with_them_are_left_out(script, tmp_path, monkeypatch):
    monkeypatch.setattr(script, "ROOT", tmp_path)
    rows = [_row("kept"), _row("held back"), _row("follow-up", history=[("user", "held back"), ("assistant", "x")]),
            _row("other follow-up", history=[("user", "kept"), ("assistant", "y")])]
    name = _write(tmp_path / "answers.jsonl", rows)
    kept = script.training_rows([name], excluded={"held back"}, opening={"held back"})
    assert [row["prompt"] for row in kept] == ["kept", "other follow-up"]


def test_focus_rows_come_first_and_the_replay_sample_repeats_none_of_them(script):
    focus = [_row(f"new {i}") for i in range(5)]
    rest = [_row(f"old {i}") for i in range(20)] + [_row("new 3")]
    mixed = script.focused(focus, rest, replay=7, seed=0)
    assert mixed[:5] == focus and len(mixed) == 12
    replayed = [row["prompt"] for row in mixed[5:]]
    assert all(p.startswith("old ") for p in replayed) and len(set(replayed)) == 7
    assert replayed == [row["prompt"] for row in script.focused(focus, rest, replay=7, seed=0)[5:]]
    assert replayed != [row["prompt"] for row in script.focused(focus, rest, replay=7, seed=1)[5:]]


def test_templated_math_is_thinned_to_the_kept_count(script, monkeypatch):
    monkeypatch.setattr(script, "MATH_KEPT", 3)
    rows = [_row(f"math {i}", source="synthetic-math") for i in range(10)] + [_row(f"chat {i}") for i in range(4)]
    kept = script.thin_math(rows, seed=0)
    assert sum(row["source"] == "synthetic-math" for row in kept) == 3 and len(kept) == 7


def test_a_small_focus_set_is_topped_up_with_replay_rows_to_the_mix_size(script):
    focus = [_row(f"new {i}") for i in range(5)]
    rest = [_row(f"old {i}") for i in range(30)]
    assert len(script.focused(focus, rest, replay=7, seed=0, mix_size=20)) == 20
    assert len(script.focused(focus, rest, replay=7, seed=0, mix_size=10)) == 12  # --replay already exceeds it
    assert script.focused(focus, rest, replay=7, seed=0, mix_size=20)[:12] == script.focused(focus, rest, 7, 0)


def test_every_answer_file_in_data_is_training_data_or_a_label_set(script):
    listed = set(script.ANSWERS + script.LATER_TURNS + script.PACKAGE_CODE + script.MAGPIE + script.LABEL_SETS)
    held = {f"data/{path.name}" for path in (script.ROOT / "data").glob("*.jsonl.gz")}
    assert held - listed == set(), "a new answers file in data/ that scripts/finetune_data.py does not read"
    assert {path for path in listed if path.startswith("data/")} <= held
