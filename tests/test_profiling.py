"""`blockpilot profile` on tiny fixture models: complete reports, the T = 0 equality check, Ctrl-C,
bad input, and the statistics behind the tables."""

import dataclasses
import json
import math

import pytest
import torch

from blockpilot.cli import main
from blockpilot.commands.profile import summary
from blockpilot.profiling.measure import greedy_mismatches, oracle_rows
from blockpilot.profiling.session import ProfileOptions, run_profile
from blockpilot.profiling.report import markdown
from blockpilot.profiling.stats import (decode_steps, fastest_plain, speedups, speedups_over_fastest_plain,
                                      summarize)
from blockpilot.profiling.systems import ModelSources, RunnerSystem, default_registry
from blockpilot.profiling.workload import load_requests
from blockpilot.runtime.runner import Runner

from cli_fixtures import BYTE_VOCAB, IM_START, make_chat_target
from fixtures import make_drafter

B_TRAIN = 4
PROMPTS = [
    {"prompt": "def add(a, b):", "category": "code"},
    {"prompt": "Tell me a story.", "category": "chat"},
    {"prompt": "What is 12 * 7?", "category": "math"},
]
ROW_KEYS = {"system", "kind", "dataset", "prompt_id", "category", "temperature", "seed", "order", "prompt_tokens",
            "output_tokens", "ttft_s", "total_s", "decode_s", "tpot_s", "tokens_per_s", "tau", "verify_steps",
            "block_size", "block_size_prob", "block_size_switches", "predictor_ms", "derived_from", "output_ids"}


@dataclasses.dataclass
class Choice:
    block_size: int
    probability: float


class PromptLengthPolicy:
    """A stand-in predictor: block size 3 for odd-length prompts, 5 for even ones."""

    candidates = (3, 5)

    def select(self, hidden, last_logits, temperature=0.0):
        return Choice(3 if hidden.shape[1] % 2 else 5, 0.75)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("profile")
    target = make_chat_target(tmp)  # byte-level tokenizer with a ChatML template
    drafter = make_drafter(tmp, target, block_size=B_TRAIN)
    prompts = tmp / "prompts.jsonl"
    prompts.write_text("".join(json.dumps(p) + "\n" for p in PROMPTS))
    return tmp, target, drafter, prompts


def _options(tiny, out, **overrides):
    tmp, target, drafter, prompts = tiny
    fields = dict(out_dir=out, datasets=[str(prompts)], sources=ModelSources(target, drafter),
                  temperatures=[0.0], baselines=["ar"], max_new_tokens=10, warmup=1, progress=False,
                  command=["blockpilot", "profile", "(test)"])
    return ProfileOptions(**{**fields, **overrides})


def _runner_with_policy(tiny):
    _, target, drafter, _ = tiny
    loaded = Runner.from_dir(target, drafter_dir=drafter)
    return Runner(loaded.backend, policy=PromptLengthPolicy(), end_id=loaded.end_id)


@pytest.fixture(scope="module")
def full_profile(tiny):
    """Every block-size mode and every baseline, at T = 0 and T = 1."""
    out = tiny[0] / "report-full"
    options = _options(tiny, out, block_sizes=[B_TRAIN, "sweep", "oracle", "auto"], temperatures=[0.0, 1.0],
                       baselines=["ar", "hf-ar", "hf-dflash", "hf-prompt-lookup"])
    return run_profile(options, runner=_runner_with_policy(tiny)), out


def test_full_profile_measures_every_system_on_every_prompt_and_temperature(full_profile):
    outcome, out = full_profile
    results = json.loads((out / "results.json").read_text())
    sweep = [f"bp-b{b}" for b in PromptLengthPolicy.candidates]  # with a predictor, its candidates
    expected = {"ar", f"bp-b{B_TRAIN}", *sweep, "bp-auto", "hf-ar", "hf-dflash", "hf-prompt-lookup", "bp-oracle"}
    assert results["status"] == "complete" and set(results["systems"]) == expected
    assert len(results["rows"]) == len(expected) * len(PROMPTS) * 2
    for row in results["rows"]:
        assert set(row) == ROW_KEYS
        assert 0 < row["ttft_s"] <= row["total_s"] and row["tokens_per_s"] > 0
        assert row["output_tokens"] == len(row["output_ids"]) >= 1
        if row["system"] != "hf-prompt-lookup":
            assert row["tau"] is not None and 1.0 <= row["tau"] <= (row["block_size"] or 1)
    assert results["errors"] == [] and results["workload"]["warmup_runs"] == 1
    assert {"cpu", "cpu_count", "gpu"} <= set(results["machine"])
    assert {"torch", "transformers"} <= set(results["versions"])


def test_full_profile_interleaves_systems_in_rotated_order(full_profile):
    rows = full_profile[0].results["rows"]
    first = {r["prompt_id"]: r["system"] for r in rows if r["order"] == 0 and r["temperature"] == 0}
    assert len(set(first.values())) == len(PROMPTS)  # each prompt starts with a different system


def test_auto_rows_use_the_policy_choice_and_report_predictor_time(full_profile):
    rows = [r for r in full_profile[0].results["rows"] if r["system"] == "bp-auto"]
    for row in rows:
        assert row["block_size"] == (3 if row["prompt_tokens"] % 2 else 5)
        assert row["block_size_prob"] == 0.75 and row["predictor_ms"] >= 0
    fixed = [r for r in full_profile[0].results["rows"] if r["system"] == f"bp-b{B_TRAIN}"]
    assert all(r["predictor_ms"] is None for r in fixed)


def test_oracle_rows_are_the_best_sweep_row_of_each_prompt(full_profile):
    rows = full_profile[0].results["rows"]
    for oracle in (r for r in rows if r["system"] == "bp-oracle"):
        sweep = [r for r in rows if r["system"] in {f"bp-b{b}" for b in PromptLengthPolicy.candidates}
                 and (r["prompt_id"], r["temperature"]) == (oracle["prompt_id"], oracle["temperature"])]
        assert oracle["derived_from"] in {r["system"] for r in sweep}
        assert oracle["tau"] == max(r["tau"] for r in sweep)


def test_full_profile_aggregates_and_speedups_cover_every_system(full_profile):
    results = full_profile[0].results
    categories = {a["category"] for a in results["aggregates"]}
    assert categories == {"all", "code", "chat", "math"}
    for a in results["aggregates"]:
        assert set(a["tokens_per_s"]) == {"mean", "median", "p90", "n"}
    scoped = {(e["system"], e["temperature"]) for e in results["speedups"] if e["dataset"] == "all"}
    assert scoped == {(s, t) for s in results["systems"] for t in (0.0, 1.0)}
    ar = [e for e in results["speedups"] if e["system"] == "ar"]
    assert all(e["with_prefill"] == pytest.approx(1.0) and e["decode_only"] == pytest.approx(1.0) for e in ar)


def test_full_profile_writes_markdown_tables_and_three_pngs(full_profile):
    outcome, out = full_profile
    report = (out / "report.md").read_text()
    for heading in ("## Correctness (T = 0)", "## Speedup vs `ar`", "## Latency per request", "## Per category",
                    "## Block sizes chosen per request", "## Decode steps by block size", "## Plots",
                    "Warm-up: 1 request(s) per system"):
        assert heading in report
    assert "OK: every system produced exactly `ar`'s tokens on all 3 requests." in report
    for name in ("tau_by_block_size.png", "oracle_block_sizes.png", "speedup.png"):
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert f"]({name})" in report
    assert sorted(p.name for p in out.iterdir()) == sorted(p.name for p in outcome.paths)  # no temporary files


def test_sweep_without_predictor_covers_b_train_plus_minus_two_or_the_given_candidates(tiny):
    outcome = run_profile(_options(tiny, tiny[0] / "report-sweep", block_sizes=["sweep"], limit=1, warmup=0))
    assert outcome.results["systems"] == ["ar"] + [f"bp-b{b}" for b in range(B_TRAIN - 2, B_TRAIN + 3)]
    outcome = run_profile(_options(tiny, tiny[0] / "report-sweep", block_sizes=["oracle"], candidates=[7, 3],
                                   limit=1, warmup=0))
    assert outcome.results["systems"] == ["ar", "bp-b3", "bp-b7", "bp-oracle"]


def test_engine_dir_profile_takes_tokenizer_target_and_drafter_from_the_engine(tiny):
    from blockpilot.builder.engine_dir import BuildSpec, build_engine_dir

    tmp, target, drafter, prompts = tiny
    engine = tmp / "engine"
    build_engine_dir(BuildSpec(target, drafter, engine, block_sizes=(B_TRAIN,), max_seq_len=96))
    out = tmp / "report-engine"
    argv = ["profile", "--engine-dir", str(engine), "--dataset", str(prompts), "--block-sizes", str(B_TRAIN),
            "--baselines", "ar,ar-1row,hf-ar,hf-dflash", "--max-new-tokens", "8", "--warmup", "0", "--out", str(out),
            "--no-progress"]
    assert main(argv) == 0
    results = json.loads((out / "results.json").read_text())
    assert results["sources"]["target_dir"] == str(engine / "target")
    assert results["sources"]["drafter_dir"] == str(engine / "drafter")
    assert results["systems"] == ["ar", f"bp-b{B_TRAIN}", "ar-1row", "hf-ar", "hf-dflash"] and results["errors"] == []
    one_row = [r for r in results["rows"] if r["system"] == "ar-1row"]
    assert len(one_row) == len(PROMPTS) and all(r["kind"] == "ar-1row" and r["tau"] == 1.0 for r in one_row)


class OffByOneSystem(RunnerSystem):
    """Our autoregressive path with the last output token changed: a deliberately wrong system."""

    def generate(self, request, temperature, seed, max_new_tokens):
        m = super().generate(request, temperature, seed, max_new_tokens)
        m.output_ids[-1] = (m.output_ids[-1] + 1) % BYTE_VOCAB
        return m


def test_greedy_output_differing_from_ar_is_reported_as_an_error(tiny):
    registry = default_registry()
    registry.add("off-by-one", lambda models: OffByOneSystem("off-by-one", models, 1))
    out = tiny[0] / "report-wrong"
    outcome = run_profile(_options(tiny, out, baselines=["ar", "off-by-one", "hf-ar"]), registry)
    errors = outcome.results["errors"]
    assert {e["system"] for e in errors} == {"off-by-one"} and len(errors) == len(PROMPTS)
    assert all(e["first_difference"] == e["reference_tokens"] - 1 for e in errors)
    assert f"**ERROR: {len(PROMPTS)} output(s) differ from `ar`**" in (out / "report.md").read_text()
    assert json.loads((out / "results.json").read_text())["errors"] == errors
    assert "ERROR: 3 T=0 output(s) differ from ar" in summary(outcome)


class InterruptingSystem(RunnerSystem):
    """Raises KeyboardInterrupt (as Ctrl-C would) on its `calls`-th request."""

    def __init__(self, *args, calls: int):
        super().__init__(*args)
        self.calls = calls

    def generate(self, request, temperature, seed, max_new_tokens):
        self.calls -= 1
        if self.calls == 0:
            raise KeyboardInterrupt
        return super().generate(request, temperature, seed, max_new_tokens)


def test_interrupted_profile_writes_the_rows_measured_so_far_marked_partial(tiny):
    registry = default_registry()
    registry.add("ctrl-c", lambda models: InterruptingSystem("ctrl-c", models, 1, calls=3))  # warm-up is call 1
    out = tiny[0] / "report-interrupted"
    outcome = run_profile(_options(tiny, out, baselines=["ar", "ctrl-c"]), registry)
    results = json.loads((out / "results.json").read_text())
    assert outcome.interrupted and results["status"] == "partial"
    assert 1 <= len(results["rows"]) < 2 * len(PROMPTS)
    assert "**PARTIAL** — interrupted" in (out / "report.md").read_text()


def test_sigterm_during_profiling_is_handled_like_ctrl_c():
    import os
    import signal

    from blockpilot.commands.profile import _sigterm_as_interrupt

    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(KeyboardInterrupt), _sigterm_as_interrupt():
        os.kill(os.getpid(), signal.SIGTERM)
    assert signal.getsignal(signal.SIGTERM) is before


@pytest.mark.parametrize("args, message", [
    (["--dataset", "nosuchset"], "unknown prompt set 'nosuchset'"),
    (["--dataset", "{empty}"], "has no prompts"),
    (["--dataset", "{malformed}"], "not valid JSON"),
    (["--baselines", "ar,hf-dflash", "--no-drafter"], "hf-dflash needs a DFlash drafter"),
    (["--baselines", "ar,vllm"], "unknown baseline 'vllm'"),
    (["--block-sizes", "auto"], "--block-sizes auto needs a block-size predictor"),
    (["--block-sizes", "64"], "block size 64 is not supported"),
    (["--block-sizes", "6-x"], "'6-x' is not a size"),
    (["--temperature", "0,hot"], "--temperature '0,hot'"),
    (["--max-new-tokens", "300"], "exceeds the model's 256 positions"),
])
def test_bad_input_ends_in_one_line_exit_2_and_writes_nothing(tiny, capsys, args, message):
    tmp, target, drafter, prompts = tiny
    (tmp / "empty.jsonl").write_text("\n")
    (tmp / "malformed.jsonl").write_text('{"prompt": "ok"}\n{"prompt": \n')
    args = [a.format(empty=tmp / "empty.jsonl", malformed=tmp / "malformed.jsonl") for a in args]
    with_drafter = [] if "--no-drafter" in args else ["--drafter", str(drafter)]
    args = [a for a in args if a != "--no-drafter"]
    defaults = {"--dataset": str(prompts), "--baselines": "ar", "--block-sizes": "1"}
    argv = ["profile", "--target", str(target), *with_drafter, "--out", str(tmp / "never"), "--no-progress", *args]
    argv += [x for k, v in defaults.items() if k not in args for x in (k, v)]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and message in err, err
    assert not (tmp / "never").exists()


def test_packaged_prompt_sets_become_chat_template_requests(tiny):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny[1])
    requests = load_requests(["humaneval", "mtbench"], tokenizer, limit=3)
    assert [r.dataset for r in requests] == ["humaneval"] * 3 + ["mtbench"] * 3
    assert {r.category for r in requests[:3]} == {"code"} and requests[3].id == "mtbench/81"
    generation_prompt = tokenizer.encode("<|im_start|>assistant\n")
    for request in requests:
        assert request.input_ids[0] == IM_START
        assert list(request.input_ids[-len(generation_prompt):]) == generation_prompt


def test_a_later_turn_of_a_prompt_file_is_requested_in_its_conversation(tiny, tmp_path):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny[1])
    turns = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}, {"role": "user", "content": "go"}]
    path = tmp_path / "turns.jsonl"
    path.write_text(json.dumps({"id": "t", "messages": turns}) + "\n" + json.dumps({"id": "f", "prompt": "go"}) + "\n")
    later, first = load_requests([str(path)], tokenizer)
    rendered = tokenizer.apply_chat_template(turns, add_generation_prompt=True, tokenize=True)
    assert list(later.input_ids) == list(rendered["input_ids"] if hasattr(rendered, "keys") else rendered)
    assert list(later.input_ids[-len(first.input_ids) + 1:]) == list(first.input_ids[1:])  # same last turn, after more


# ---------------------------------------------------------------- statistics on hand-made rows


def _row(system, prompt, total, ttft, tokens, tau=1.0, temperature=0.0, output=None):
    return {"system": system, "dataset": "d", "prompt_id": prompt, "category": "c", "temperature": temperature,
            "total_s": total, "ttft_s": ttft, "decode_s": total - ttft, "output_tokens": tokens, "tau": tau,
            "derived_from": None, "output_ids": output or [1] * tokens, "decode_per_token": None}


def test_speedup_is_the_ratio_of_pooled_time_per_output_token():
    rows = [_row("ar", "p1", 2.0, 0.2, 10), _row("ar", "p2", 4.0, 0.4, 20),
            _row("bp", "p1", 1.0, 0.2, 10, tau=3.0), _row("bp", "p2", 1.0, 0.4, 20, tau=5.0)]
    entry = next(e for e in speedups(rows, "ar") if e["system"] == "bp" and e["dataset"] == "d")
    assert entry["with_prefill"] == pytest.approx((6.0 / 30) / (2.0 / 30))
    assert entry["decode_only"] == pytest.approx((5.4 / 28) / (1.4 / 28))
    assert entry["tau"] == pytest.approx(4.0) and entry["requests"] == 2


def test_speedups_are_also_taken_over_the_fastest_plain_decoding_of_each_temperature():
    # ar-1row beats ar at T = 0 (pooled over both prompts although ar wins p2), ar wins at T = 1
    rows = [_row("ar", "p1", 2.0, 0.1, 10), _row("ar", "p2", 2.0, 0.1, 10),
            _row("ar-1row", "p1", 1.0, 0.1, 10), _row("ar-1row", "p2", 2.5, 0.1, 10),
            _row("bp", "p1", 0.5, 0.1, 10, tau=2.0), _row("bp", "p2", 1.0, 0.1, 10, tau=3.0)]
    rows += [{**r, "temperature": 1.0, "total_s": r["total_s"] * (2 if r["system"] == "ar-1row" else 1)}
             for r in rows]
    assert fastest_plain(rows) == {0.0: "ar-1row", 1.0: "ar"}
    entries = {(e["system"], e["temperature"]): e for e in speedups_over_fastest_plain(rows, fastest_plain(rows))
               if e["dataset"] == "all"}
    assert {(s, t): e["reference"] for (s, t), e in entries.items() if s == "bp"} == {("bp", 0.0): "ar-1row",
                                                                                   ("bp", 1.0): "ar"}
    assert entries[("bp", 0.0)]["with_prefill"] == pytest.approx(3.5 / 1.5)
    assert entries[("bp", 1.0)]["with_prefill"] == pytest.approx(4.0 / 1.5)
    assert entries[("bp", 0.0)]["tokens_per_s"] == pytest.approx(20 / 1.5)
    assert entries[("ar-1row", 0.0)]["with_prefill"] == pytest.approx(1.0)
    assert fastest_plain([r for r in rows if r["system"] == "bp"]) == {}  # no plain decoding ran: no bar


def test_report_and_summary_name_the_fastest_plain_decoding_only_when_it_is_not_ar(tmp_path):
    rows = [_row("ar", "p1", 2.0, 0.1, 10), _row("ar-1row", "p1", 1.6, 0.1, 10), _row("bp", "p1", 0.8, 0.1, 10)]
    results = {"status": "complete", "command": ["blockpilot", "profile"], "reference": "ar",
               "systems": ["ar", "bp", "ar-1row"], "oracle_by": None, "errors": [], "rows": rows,
               "sources": {"target_dir": "t", "drafter_dir": "d", "backend": "onnxruntime", "dtype": "float32"},
               "workload": {"datasets": {"d": 1}, "max_new_tokens": 10, "temperatures": [0.0], "warmup_runs": 1,
                            "planned_runs": 3},
               "machine": {"cpu": "cpu", "cpu_count": 2, "torch_threads": 2, "device": "cpu"}, "timing": "clock",
               "versions": {}, "speedups": speedups(rows, "ar"), "aggregates": [],
               "fastest_plain": [{"temperature": 0.0, "system": "ar-1row"}],
               "speedups_over_fastest_plain": speedups_over_fastest_plain(rows, {0.0: "ar-1row"})}
    report = markdown(results, [])
    assert "## Speedup vs the fastest plain decoding (`ar-1row` at T = 0.0) (same run;" in report
    assert "| bp | d | 0.0 | 1 | 1.00 | 12.5 | 2.00x |" in report
    outcome = type("Outcome", (), {"results": results, "interrupted": False, "paths": [tmp_path / "results.json"]})
    assert "vs ar-1row (the fastest plain decoding): 2.00x" in summary(outcome)
    results["fastest_plain"] = [{"temperature": 0.0, "system": "ar"}]
    results["speedups_over_fastest_plain"] = [{**e, "reference": "ar"} for e in results["speedups"]]
    assert "fastest plain" not in markdown(results, []) and "fastest plain" not in summary(outcome)


def test_decode_steps_pool_time_over_steps_per_system_temperature_and_block_size():
    rows = [{**_row("bp", "p1", 1.1, 0.1, 11), "block_size": 4, "verify_steps": 4},
            {**_row("bp", "p2", 2.2, 0.2, 21), "block_size": 4, "verify_steps": 6},
            {**_row("bp", "p3", 1.0, 0.1, 5), "block_size": 6, "verify_steps": 3},
            {**_row("bp", "p4", 9.0, 0.1, 5), "block_size": 6, "verify_steps": 3, "derived_from": "sweep"},
            {**_row("ar", "p1", 1.1, 0.1, 11), "block_size": 1, "verify_steps": 10}]
    entries = {(e["system"], e["block_size"]): e for e in decode_steps(rows)}
    assert sorted(entries) == [("ar", 1), ("bp", 4), ("bp", 6)]  # the derived row is not a measurement
    assert entries[("bp", 4)]["ms_per_step"] == pytest.approx(1e3 * 3.0 / 10)
    assert entries[("bp", 4)]["tokens_per_step"] == pytest.approx(30 / 10) and entries[("bp", 4)]["requests"] == 2
    assert entries[("bp", 6)]["ms_per_step"] == pytest.approx(1e3 * 0.9 / 3)
    assert entries[("ar", 1)]["ms_per_step"] == pytest.approx(100.0)


def test_summary_p90_matches_numpy_linear_interpolation():
    import numpy as np

    values = [3.0, 1.0, 4.0, 1.5, 9.0, 2.6, None]
    s = summarize(values)
    xs = [v for v in values if v is not None]
    assert s["mean"] == pytest.approx(np.mean(xs)) and s["median"] == pytest.approx(np.median(xs))
    assert s["p90"] == pytest.approx(np.percentile(xs, 90)) and s["n"] == 6
    assert summarize([None]) is None


def test_greedy_check_locates_the_first_difference_and_ignores_sampling():
    rows = [_row("ar", "p", 1, 0.1, 4, output=[5, 6, 7, 8]), _row("x", "p", 1, 0.1, 3, output=[5, 6, 7]),
            _row("y", "p", 1, 0.1, 4, output=[5, 9, 7, 8]), _row("z", "p", 1, 0.1, 4, output=[5, 6, 7, 8]),
            _row("x", "p", 1, 0.1, 4, temperature=1.0, output=[0, 0, 0, 0])]
    rows.append(_row("w", "p", 1, 0.1, 4, output=[5, 9, 7, 8]))
    found = {e["system"]: e for e in greedy_mismatches(rows)}
    assert set(found) == {"x", "y", "w"} and found["y"]["same_as"] == ["w"] and found["x"]["same_as"] == []
    assert (found["x"]["first_difference"], found["x"]["system_token"]) == (3, None)
    assert (found["y"]["first_difference"], found["y"]["reference_token"], found["y"]["system_token"]) == (1, 6, 9)


def test_oracle_by_time_picks_the_fastest_and_skips_incomplete_prompts():
    rows = [_row("b2", "p", 2.0, 0.0, 11, tau=2.0), _row("b3", "p", 1.0, 0.0, 11, tau=1.5),
            _row("b2", "q", 1.0, 0.0, 11, tau=2.0)]
    by_time = oracle_rows(rows, ["b2", "b3"], by="time")
    by_tau = oracle_rows(rows, ["b2", "b3"], by="tau")
    assert [r["derived_from"] for r in by_time] == ["b3"] and [r["derived_from"] for r in by_tau] == ["b2"]
    assert all(r["system"] == "bp-oracle" and not math.isnan(r["tau"]) for r in by_time + by_tau)
