"""Replay labelling: at T = 0 the same labels as decoding every candidate; at T > 0, on drawn answers, the
acceptance of speculative sampling in distribution; calibrated step times, bad input."""

import argparse
import json

import pytest
import torch

from blockpilot import cli
from blockpilot.predictor.labelling import LabelJob, run_label_job
from blockpilot.predictor.labels import LabelDataset, load_label_dataset
from blockpilot.runtime.runner import Runner

from fixtures import WORDS, make_word_corpus
PROMPTS = [" ".join(WORDS[i:i + 5]) for i in (0, 7, 21, 33, 50)]
MAX_NEW = 24


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """A tiny target with a word-level tokenizer, a drafter trained briefly on a repeated pattern (so
    drafts are sometimes accepted), and an end id that the greedy answer of PROMPTS[1] reaches early."""
    from blockpilot.training.pipeline import train_drafter_from_args

    tmp = tmp_path_factory.mktemp("replay")
    target, corpus = make_word_corpus(tmp)
    train_drafter_from_args(argparse.Namespace(
        target=target, out=tmp / "drafter", block_size=4, layers=1, taps=2, mask_token_id=3,
        answers=[corpus], prompts=None, regenerate=0, gen_max_new_tokens=16, gen_batch_size=4, device="cpu", max_len=64,
        time_budget=1.0, max_steps=60, sequences_per_step=4, anchors=8, lr=1e-2, gamma=None, valid=2,
        eval_every=100.0, checkpoint_every=100.0, work_dir=tmp / "work", resume=False, no_autocast=True, seed=0))
    greedy = _greedy(target, tmp / "drafter", PROMPTS[1], end_id=-1)
    stop = next(i for i in range(6, MAX_NEW - 6) if greedy[i] not in greedy[:i])  # its first occurrence
    (target / "generation_config.json").write_text(json.dumps({"eos_token_id": greedy[stop]}))
    return tmp, target, tmp / "drafter", stop + 1


def _greedy(target, drafter, prompt: str, end_id=None) -> list[int]:
    from blockpilot.text import chat_prompt_ids, load_tokenizer

    ids = chat_prompt_ids(load_tokenizer(target), prompt)
    out = Runner.from_dir(target, drafter_dir=drafter).generate([torch.tensor(ids)], max_new_tokens=MAX_NEW,
                                                                end_id=end_id, return_dict=True)
    return out["output_ids"][0, 0, len(ids):int(out["sequence_lengths"][0, 0])].tolist()


def _write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _answers(target, drafter, path):
    """Answers of every kind a file may hold: exact greedy ids, wrong text, a cut-short answer, an answer
    ending at the tokenizer's end token (not the runtime's end id) and one left to the target."""
    exact = [_greedy(target, drafter, p) for p in PROMPTS]
    rows = [{"answer_ids": exact[0], "finish": "length"},
            {"answer_ids": exact[1], "finish": "stop"},
            {"answer": "w5 w5 w6 w7", "finish": "length"},
            {"answer": " ".join(WORDS[3:9]), "finish": "stop"},
            {"answer_ids": exact[4][:3]}]
    return _write_jsonl(path, [{"id": f"q{i}", "prompt": p, **r} for i, (p, r) in enumerate(zip(PROMPTS, rows))])


@pytest.mark.parametrize("lookup", ["greedy", "off"])
def test_replayed_labels_equal_the_labels_of_decoding_every_candidate(models, tmp_path, lookup):
    """With lookup drafts (the runtime's default at T = 0) and without: the same steps, tokens and steps
    that copied their drafts."""
    _, target, drafter, stops_after = models
    prompts = _write_jsonl(tmp_path / "prompts.jsonl", [{"id": f"q{i}", "prompt": p} for i, p in enumerate(PROMPTS)])
    answers = _answers(target, drafter, tmp_path / "answers.jsonl")
    common = dict(target=target, drafter=drafter, max_new_tokens=MAX_NEW, progress=False, clock="cpu", lookup=lookup)
    run_label_job(LabelJob(prompts=prompts, out=tmp_path / "decoded", **common))
    run_label_job(LabelJob(prompts=None, replay_answers=answers, out=tmp_path / "replayed", calibration_prompts=2,
                           calibration_reps=2, **common))
    decoded, replayed = load_label_dataset(tmp_path / "decoded"), load_label_dataset(tmp_path / "replayed")
    assert replayed.ids == decoded.ids == [f"q{i}" for i in range(len(PROMPTS))]
    assert replayed.candidates == decoded.candidates == (1, 2, 3, 4, 5, 6)  # plain decoding and B_train 4 +- 2
    for key in ("steps", "accepted", "new_tokens", "tau", "prompt_tokens", "pooled", "logits", "lookup_steps"):
        assert torch.equal(replayed.rows[key], decoded.rows[key]), key
    assert torch.equal(replayed.labels("tau"), decoded.labels("tau"))
    assert replayed.meta["lookup"] == decoded.meta["lookup"] == (lookup == "greedy")
    assert (decoded.rows["lookup_steps"] > 0).any() == (lookup == "greedy")
    assert (decoded.rows["tau"] > 1).any()  # drafts were accepted: the comparison is not all rejections
    assert (decoded.rows["new_tokens"][1] == stops_after).all()  # PROMPTS[1] stops at the end id
    assert (decoded.rows["new_tokens"] == MAX_NEW).any()  # others stop at the budget


def test_replay_step_times_come_from_the_stored_calibration_and_survive_a_resume(models, tmp_path, capsys):
    _, target, drafter, _ = models
    answers = _answers(target, drafter, tmp_path / "answers.jsonl")
    out = tmp_path / "ds"
    args = ["label", "--target", str(target), "--drafter", str(drafter), "--replay-answers", str(answers),
            "--max-new-tokens", str(MAX_NEW), "--out", str(out), "--calibration-prompts", "2",
            "--calibration-reps", "3", "--note", "prompts also trained the drafter", "--lookup", "off"]
    assert cli.main(args + ["--limit", "2"]) == 0
    meta = json.loads((out / "meta.json").read_text())
    calibration = meta["calibration"]
    assert meta["step_time_source"] == "calibrated" and meta["note"] == "prompts also trained the drafter"
    assert calibration["prompts"] == 2 and all(len(v) == 6 for v in calibration["raw"]["verify_s"].values())
    assert cli.main(args) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["labelled_now"] == 3
    assert json.loads((out / "meta.json").read_text())["calibration"] == calibration  # not timed again
    ds = load_label_dataset(out)
    per_call = torch.tensor([calibration["draft_s"][str(c)] + calibration["verify_s"][str(c)]
                             for c in ds.candidates], dtype=torch.float64)
    assert ds.step_cost()[0].tolist() == [ds.step_costs.step_ms(c) / 1e3 for c in ds.candidates]  # the table scores
    assert torch.allclose(ds.rows["step_s"][ds.rows["steps"] > 0], per_call.expand(len(ds), -1)[ds.rows["steps"] > 0])


def test_replay_bad_inputs_end_in_one_line_and_exit_2(models, tmp_path, capsys):
    _, target, drafter, _ = models
    answers = _answers(target, drafter, tmp_path / "answers.jsonl")
    no_answer = _write_jsonl(tmp_path / "bare.jsonl", [{"prompt": PROMPTS[0]}])
    base = ["label", "--target", str(target), "--drafter", str(drafter), "--max-new-tokens", "4"]

    def fails(extra, message):
        assert cli.main(base + extra) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and message in err, err

    fails(["--replay-answers", str(answers), "--temperature", "1", "--out", str(tmp_path / "a")],
          "answer greedy, labels at temperature 1, top-k 0, top-p 1: replay is exact only on answers made at")
    drawn = _write_jsonl(tmp_path / "drawn.jsonl", [{"prompt": PROMPTS[0], "answer_ids": [5, 6], "temperature": 0.7,
                                                    "top_k": 0, "top_p": 1.0, "seed": 3}])
    fails(["--replay-answers", str(drawn), "--out", str(tmp_path / "a2")], "drawn.jsonl:1: answer temperature 0.7")
    fails(["--replay-answers", str(drawn), "--temperature", "0.7", "--top-p", "0.9", "--out", str(tmp_path / "a3")],
          "labels at temperature 0.7, top-k 0, top-p 0.9")
    assert not (tmp_path / "a").exists() and not (tmp_path / "a2").exists()
    fails(["--replay-answers", str(answers), "--prompts", str(answers), "--out", str(tmp_path / "b")],
          "argument --prompts: not allowed with argument --replay-answers")
    fails(["--out", str(tmp_path / "c")], "one of the arguments --prompts --replay-answers is required")
    fails(["--replay-answers", str(no_answer), "--out", str(tmp_path / "d")], "needs \"answer_ids\"")
    assert cli.main(base + ["--prompts", str(answers), "--out", str(tmp_path / "e")]) == 0
    capsys.readouterr()
    fails(["--replay-answers", str(answers), "--out", str(tmp_path / "e")], "other settings (step_time_source")


def test_candidate_1_is_plain_decoding_in_replay_and_decoding(models, tmp_path):
    _, target, drafter, _ = models
    prompts = _write_jsonl(tmp_path / "prompts.jsonl", [{"id": f"q{i}", "prompt": p} for i, p in enumerate(PROMPTS)])
    answers = _answers(target, drafter, tmp_path / "answers.jsonl")
    common = dict(target=target, drafter=drafter, max_new_tokens=MAX_NEW, progress=False, clock="cpu",
                  candidates=(1, 2, 4))
    run_label_job(LabelJob(prompts=prompts, out=tmp_path / "decoded", **common))
    run_label_job(LabelJob(prompts=None, replay_answers=answers, out=tmp_path / "replayed", calibration_prompts=2,
                           calibration_reps=2, **common))
    decoded, replayed = load_label_dataset(tmp_path / "decoded"), load_label_dataset(tmp_path / "replayed")
    assert replayed.candidates == decoded.candidates == (1, 2, 4)
    for key in ("steps", "accepted", "new_tokens", "tau"):
        assert torch.equal(replayed.rows[key], decoded.rows[key]), key
    assert (decoded.rows["tau"][:, 0] == 1).all() and (decoded.rows["tau"][:, 1:] > 1).any()
    assert (replayed.rows["draft_s"][:, 0] == 0).all()  # plain decoding: no drafter call
    assert replayed.step_costs.step_ms(1) == replayed.step_costs.target_ms[1]  # measured on the labelling backend


def test_throughput_labels_use_the_given_step_cost_table_and_the_predictor_records_its_backend(models, tmp_path):
    from blockpilot.builder.manifest import StepCosts
    from blockpilot.predictor.train import TrainSettings, train_predictor
    from blockpilot.runtime.policy import OnnxBlockSizePolicy

    _, target, drafter, _ = models
    answers = _answers(target, drafter, tmp_path / "answers.jsonl")
    # plain decoding costs 10 ms a step, block 4 costs 1000 ms: only plain decoding pays
    table = StepCosts("onnxruntime", "fp32", "test machine x2", 16, {1: 10.0, 4: 900.0}, {4: 100.0})
    (tmp_path / "costs.json").write_text(json.dumps(table.to_dict()))
    assert cli.main(["label", "--target", str(target), "--drafter", str(drafter), "--replay-answers", str(answers),
                     "--block-sizes", "1,4", "--step-costs", str(tmp_path / "costs.json"), "--max-new-tokens",
                     str(MAX_NEW), "--out", str(tmp_path / "ds"), "--calibration-prompts", "1",
                     "--calibration-reps", "1"]) == 0
    ds = load_label_dataset(tmp_path / "ds")
    share = ds.rows["lookup_steps"][:, 1].double() / ds.rows["steps"][:, 1]  # steps that copied: no 100 ms draft
    assert ds.step_costs == table and torch.allclose(ds.step_cost(), torch.stack(
        (torch.full_like(share, 0.01), 1.0 - 0.1 * share), dim=1))
    assert (ds.rows["tau"][:, 1] > 1).any()  # block 4 has the higher tau on some prompts ...
    assert (ds.labels("throughput") == 0).all()  # ... but never pays at 100x the plain step
    cheap = ds.with_step_costs(StepCosts("torch", "bf16", "m", 16, {1: 10.0, 4: 10.0}, {4: 0.0}))
    assert torch.equal(cheap.labels("throughput"), cheap.labels("tau"))  # equal costs: the tau labels
    many = LabelDataset([f"{i}/{row}" for i in range(4) for row in ds.ids],
                        {key: value.repeat(4, *([1] * (value.dim() - 1))) for key, value in ds.rows.items()}, ds.meta)
    train_predictor([many], TrainSettings(objective="throughput", hidden=8, max_epochs=2), tmp_path / "p.onnx")
    info = OnnxBlockSizePolicy(tmp_path / "p.onnx").info
    assert (info.cost_backend, info.cost_dtype, info.cost_machine) == ("onnxruntime", "fp32", "test machine x2")
    assert info.candidates == (1, 4)
    import onnx

    props = {p.key: p.value for p in onnx.load(str(tmp_path / "p.onnx")).metadata_props}
    assert json.loads(props["lookup_temperatures"]) == [0.0]  # T = 0 labels copied drafts as the runtime does


@pytest.mark.parametrize("sampled_drafts", [True, False], ids=["drafts-drawn", "greedy-drafts"])
def test_sampled_replay_accepts_as_speculative_sampling_does(models, tmp_path, sampled_drafts):
    """At T > 0, replaying answers drawn by plain sampling gives the number of verify steps that
    speculative sampling takes, in distribution (mean within 4 standard errors, over 160 draws each),
    and differs from the greedy replay (the check can tell the two apart); with drafts drawn from the
    drafter (rejection sampling) and with greedy drafts ("sample, then match")."""
    from blockpilot.text import chat_prompt_ids, load_tokenizer

    _, target, drafter, _ = models
    temperature, draws, block = 0.5, 160, 4
    ids = torch.tensor(chat_prompt_ids(load_tokenizer(target), PROMPTS[0]))
    runner = Runner.from_dir(target, drafter_dir=drafter)
    runner.sampled_drafts = sampled_drafts
    runner.verification = "token"  # the rule the replay models (block verification keeps at least as many)
    common = dict(max_new_tokens=MAX_NEW, temperature=temperature, return_dict=True)  # the runner's end id
    decoded = runner.generate([ids] * draws, block_size=block, random_seed=0, **common)
    decoded_steps = torch.tensor([len(steps) for steps in decoded["accept_lengths"]], dtype=torch.float64)
    plain = runner.generate([ids] * draws, block_size=1, random_seed=10_000, **common)
    answers = [plain["output_ids"][i, 0, len(ids):int(plain["sequence_lengths"][i, 0])].tolist() for i in range(draws)]
    rows = [{"id": f"d{i}", "prompt": PROMPTS[0], "answer_ids": a, "finish": "length", "temperature": temperature,
             "top_k": 0, "top_p": 1.0, "seed": 10_000 + i} for i, a in enumerate(answers)]
    assert len({tuple(a) for a in answers}) > draws // 2  # real draws, not one answer repeated
    job = dict(target=target, drafter=drafter, max_new_tokens=MAX_NEW, progress=False, clock="cpu",
               candidates=(1, block), calibration_prompts=1, calibration_reps=1, sampled_drafts=sampled_drafts)
    run_label_job(LabelJob(prompts=None, replay_answers=_write_jsonl(tmp_path / "drawn.jsonl", rows),
                           out=tmp_path / "sampled", temperature=temperature, **job))
    replayed = load_label_dataset(tmp_path / "sampled")
    assert replayed.meta["temperature"] == temperature and len(replayed) == draws
    replayed_steps = replayed.rows["steps"][:, 1].double()
    assert (replayed.rows["new_tokens"][:, 1] < MAX_NEW).any() and (replayed.rows["new_tokens"][:, 1] == MAX_NEW).any()
    error = (decoded_steps.var() / draws + replayed_steps.var() / draws).sqrt()
    assert 1.2 < MAX_NEW / decoded_steps.mean() < block - 0.5  # drafts are accepted, and not always
    assert abs(decoded_steps.mean() - replayed_steps.mean()) < 4 * error
    greedy = _greedy(target, drafter, PROMPTS[0])
    greedy_rows = [{"id": "g", "prompt": PROMPTS[0], "answer_ids": greedy, "finish": "length"}]
    run_label_job(LabelJob(prompts=None, replay_answers=_write_jsonl(tmp_path / "greedy.jsonl", greedy_rows),
                           out=tmp_path / "greedy", lookup="off", **job))  # drafter blocks, as sampled
    greedy_steps = float(load_label_dataset(tmp_path / "greedy").rows["steps"][0, 1])
    assert abs(greedy_steps - replayed_steps.mean()) > 4 * error
