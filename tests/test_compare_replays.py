"""`scripts/compare_replays.py`: two drafters' evaluation reports compared prompt by prompt, and reports that do not
pair (other prompts, other new-token limits) refused with one line."""

from __future__ import annotations

import json
import sys

import pytest

from fixtures import load_script


@pytest.fixture(scope="module")
def script():
    yield load_script("compare_replays")
    sys.modules.pop("compare_replays", None)


def report(steps_at_3: list[list[int]], t1_at_3: list[float], prompts=("a", "b", "c"), max_new=128, t1_max_new=64
           ) -> dict:
    return {"drafter": "d", "max_new_tokens": max_new, "datasets": {"mtbench": {
        "tau_t0": {"replay": {}, "replay_steps": {"3": steps_at_3}} if steps_at_3 else {},
        "t1_max_new_tokens": t1_max_new,
        "tau_t1": {"mean": {}, "per_prompt": {"3": t1_at_3}, "prompts": list(prompts)}}}}


BASE = report([[1, 1], [2, 2], [3, 1]], [1.0, 1.5, 2.0])
NEW = report([[2, 2], [2, 2], [3, 3]], [1.5, 1.5, 2.0])


def test_paired_difference_is_per_prompt_tau_new_minus_base(script):
    t0, t1 = script.compare(BASE, NEW)
    assert (t0["dataset"], t0["T"], t0["block"], t0["prompts"]) == ("mtbench", "0", 3, 3)
    # per-prompt tau: base 1, 2, 2; new 2, 2, 3 -> diffs 1, 0, 1
    assert t0["base"] == pytest.approx(5 / 3) and t0["new"] == pytest.approx(7 / 3)
    assert t0["diff"] == pytest.approx(2 / 3)
    assert t0["se"] == pytest.approx((1 / 3) ** 0.5 / 3 ** 0.5)
    assert t0["change"] == pytest.approx(7 / 5 - 1)
    assert t1["T"] == "1" and t1["diff"] == pytest.approx(0.5 / 3)


def test_reports_over_other_prompts_or_limits_are_refused(script, tmp_path, capsys):
    base, other = tmp_path / "base.json", tmp_path / "other.json"
    base.write_text(json.dumps(BASE))
    other.write_text(json.dumps(report([[1]], [1.0], prompts=("x",))))
    assert script.main(["--base", str(base), "--new", str(other)]) == 2
    assert capsys.readouterr().err.strip().startswith("error: mtbench: the T = 1 runs sampled different prompts")
    other.write_text(json.dumps(report([[1, 1], [2, 2], [3, 1]], [1.0, 1.5, 2.0], max_new=64)))
    assert script.main(["--base", str(base), "--new", str(other)]) == 2
    assert "--max-new-tokens" in capsys.readouterr().err


def test_table_is_written_where_asked(script, tmp_path, capsys):
    base, new, out = tmp_path / "base.json", tmp_path / "new.json", tmp_path / "cmp.md"
    base.write_text(json.dumps(BASE))
    new.write_text(json.dumps(NEW))
    assert script.main(["--base", str(base), "--new", str(new), "--out", str(out)]) == 0
    assert out.read_text().splitlines()[2] == "| mtbench | 0 | 3 | 3 | 1.667 | 2.333 | +40.0% | +0.667 ± 0.333 |"


def test_sampled_only_runs_pair_whatever_their_greedy_limit_but_not_across_sampled_limits(script):
    t1_only = report([], [1.5, 1.5, 2.0], max_new=256)  # --replay-block-sizes '': no T = 0 section
    (row,) = script.compare(BASE, t1_only)
    assert (row["T"], row["diff"]) == ("1", pytest.approx(0.5 / 3))
    with pytest.raises(ValueError, match="--t1-max-new-tokens"):
        script.compare(BASE, report([], [1.5, 1.5, 2.0], t1_max_new=32))
