"""Oracle labelling: tau per candidate, prefill features, label objectives, resuming, bad input."""

import json

import pytest
import torch

from blockpilot import cli
from blockpilot.models.checkpoint import load_drafter, load_target
from blockpilot.models.decoder import KVCache
from blockpilot.predictor.labelling import LabelJob, run_label_job
from blockpilot.predictor.labels import (
    LabelDataset,
    LabelSettings,
    label_prompts,
    load_label_dataset,
    oracle_labels,
    prepare_dataset_dir,
)
from blockpilot.runtime.runner import Runner

from fixtures import make_drafter, make_hf_target, target_continuation_backend

CANDIDATES = (6, 7, 8, 9, 10)
# first prompt token -> the largest block size whose drafts are all right (beyond it all are wrong)
GOOD_UP_TO = {11: 6, 12: 7, 13: 9, 14: 10, 15: 5}


class PatternBackend(target_continuation_backend()):
    """Drafts the target's own greedy continuation when the block size is at most GOOD_UP_TO[first
    prompt token], else only wrong tokens: at T = 0 a block size k commits k tokens a step when
    k <= that limit and 1 otherwise, so the tau-argmax label is the limit itself."""

    def prefill(self, state, input_ids):
        self.good_up_to = GOOD_UP_TO[int(input_ids[0, 0])]
        return super().prefill(state, input_ids)

    def draft(self, state, last_tokens, new_taps, ctx_start, block_start, block_size):
        draft = super().draft(state, last_tokens, new_taps, ctx_start, block_start, block_size)
        return draft if block_size <= self.good_up_to else (draft + 1) % self.target_config.vocab_size


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("labels")
    target = make_hf_target(tmp, "llama")
    save_char_tokenizer(target)
    drafter = make_drafter(tmp, target, block_size=8)
    return tmp, target, drafter


def save_char_tokenizer(target_dir):
    """A character-level tokenizer (97 ids) with a tiny chat template, saved into the target dir."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{chr(32 + i): 3 + i for i in range(94)}}
    core = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    tokenizer.chat_template = ("{% for m in messages %}[{{ m['content'] }}]{% endfor %}"
                               "{% if add_generation_prompt %}:{% endif %}")
    tokenizer.save_pretrained(target_dir)


def _prompts_file(path, n):
    path.write_text("".join(json.dumps({"prompt": f"question {i}: what is {i} + {i}?"}) + "\n" for i in range(n)))
    return path


def test_labels_of_a_known_acceptance_pattern_are_the_largest_good_block(models, tmp_path):
    _, target, drafter = models
    runner = Runner(PatternBackend(load_target(target), load_drafter(drafter)), end_id=None)
    prompts = [(i, f"p{first}", [first, 40, 50, 60 + i]) for i, first in enumerate(GOOD_UP_TO)]
    settings = LabelSettings(candidates=CANDIDATES, b_train=8, max_new_tokens=30)
    prepare_dataset_dir(tmp_path / "ds", {"format": "blockpilot-labels", "candidates": list(CANDIDATES), "b_train": 8,
                                          "temperature": 0.0})
    assert label_prompts(runner, prompts, settings, tmp_path / "ds", progress=False) == len(GOOD_UP_TO)
    ds = load_label_dataset(tmp_path / "ds")
    n, k = len(GOOD_UP_TO), len(CANDIDATES)
    assert ds.ids == [f"p{first}" for first in GOOD_UP_TO]
    assert ds.rows["pooled"].shape == (n, 32) and ds.rows["logits"].shape == (n, 97)
    for key in ("tau", "steps", "accepted", "new_tokens", "draft_s", "verify_s", "step_s"):
        assert ds.rows[key].shape == (n, k)
    steps = ds.rows["steps"].double()
    assert torch.allclose(ds.rows["step_s"] * steps, ds.rows["draft_s"] + ds.rows["verify_s"])
    assert torch.equal(ds.rows["tau"], ds.rows["accepted"] / steps)
    expected_tau = torch.tensor([[float(c) if c <= limit else 1.0 for c in CANDIDATES]
                                 for limit in GOOD_UP_TO.values()])
    assert torch.equal(ds.rows["tau"].float(), expected_tau)
    assert (ds.rows["new_tokens"] == 30).all()
    # the limit itself; limit 5 is below every candidate: all tie at tau 1 -> B_train
    assert [CANDIDATES[i] for i in ds.labels("tau")] == [6, 7, 9, 10, 8]
    target_model = load_target(target)
    with torch.no_grad():
        hidden = target_model(target_model.embed_tokens(torch.tensor([prompts[2][2]])), torch.arange(4),
                              KVCache.allocate(target_model.config, 1, 4, torch.float32), 4).hidden
    assert torch.allclose(ds.rows["pooled"][2], hidden[0].mean(0), atol=1e-5)
    assert torch.allclose(ds.rows["logits"][2], target_model.lm_head(hidden[0, -1]), atol=1e-4)


def test_tau_ties_go_to_the_candidate_nearest_b_train_then_the_smaller():
    scores = torch.tensor([[2.0, 3.0, 3.0, 3.0, 1.0], [3.0, 3.0, 1.0, 2.0, 2.0], [1.0, 1.0, 1.0, 3.0, 3.0],
                           [1.0, 3.0, 1.0, 3.0, 1.0]])
    assert oracle_labels(scores, torch.tensor(CANDIDATES), b_train=8).tolist() == [2, 1, 3, 1]


def test_throughput_objective_divides_tau_by_each_candidates_mean_step_time():
    ones = torch.ones(2, 2, dtype=torch.int64)
    rows = {"tau": torch.tensor([[3.0, 3.3], [2.0, 3.0]], dtype=torch.float64), "steps": ones * 10,
            # candidate 8 costs 1.0 s a step over the dataset, candidate 9 costs 1.2 s
            "draft_s": torch.tensor([[4.0, 5.0], [4.0, 7.0]], dtype=torch.float64),
            "verify_s": torch.tensor([[6.0, 7.0], [6.0, 5.0]], dtype=torch.float64)}
    ds = LabelDataset(["a", "b"], rows, {"candidates": [8, 9], "b_train": 8})
    assert torch.allclose(ds.step_cost(), torch.tensor([[1.0, 1.2]] * 2, dtype=torch.float64))
    assert ds.labels("tau").tolist() == [1, 1]
    assert ds.labels("throughput").tolist() == [0, 1]  # 3.0 > 3.3 / 1.2; 2.0 < 3.0 / 1.2


def test_throughput_objective_prices_steps_that_copied_their_drafts_without_the_drafter_call():
    from blockpilot.builder.manifest import StepCosts

    table = StepCosts("onnxruntime", "fp32", "m", 256, {1: 20.0, 6: 26.0}, {6: 4.0}, loop_ms={6: 30.0})
    assert table.step_ms(6) == 30.0 and table.copy_step_ms(6) == 26.0 and table.copy_step_ms(1) == 20.0
    rows = {"tau": torch.tensor([[1.0, 1.4], [1.0, 1.4]], dtype=torch.float64),
            "steps": torch.tensor([[40, 40], [40, 40]]), "lookup_steps": torch.tensor([[0, 0], [0, 40]])}
    ds = LabelDataset(["a", "b"], rows, {"candidates": [1, 6], "b_train": 6, "step_costs": table.to_dict()})
    assert torch.allclose(ds.step_cost(), torch.tensor([[0.020, 0.030], [0.020, 0.026]], dtype=torch.float64))
    # 1.4 tokens in 30 ms lose to plain decoding's 1 in 20; in 26 ms (every draft copied) they win
    assert ds.labels("throughput").tolist() == [0, 1]


def test_label_cli_writes_a_dataset_and_resumes_without_redoing_prompts(models, tmp_path, capsys):
    _, target, drafter = models
    prompts = _prompts_file(tmp_path / "prompts.jsonl", 3)
    out = tmp_path / "ds"
    args = ["label", "--target", str(target), "--drafter", str(drafter), "--prompts", str(prompts),
            "--max-new-tokens", "12", "--out", str(out), "--clock", "cpu"]
    assert cli.main(args + ["--limit", "2"]) == 0
    first = load_label_dataset(out)
    assert first.candidates == (1, 6, 7, 8, 9, 10)  # plain decoding and B_train 8 +- 2 by default
    assert cli.main(args) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["rows"] == 3 and summary["labelled_now"] == 1
    both = load_label_dataset(out)
    assert both.ids == ["prompts/1", "prompts/2", "prompts/3"]
    assert torch.equal(both.rows["draft_s"][:2], first.rows["draft_s"])  # timings kept: not decoded again
    assert not (out / "parts").exists()
    meta = json.loads((out / "meta.json").read_text())
    assert meta["chat_template"] and meta["feature_widths"] == {"pooled": 32, "logits": 97} and meta["clock"] == "cpu"


def test_label_bad_inputs_end_in_one_line_and_exit_2(models, tmp_path, capsys):
    tmp, target, drafter = models
    prompts = _prompts_file(tmp_path / "prompts.jsonl", 1)
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    base = ["label", "--target", str(target), "--drafter", str(drafter), "--max-new-tokens", "4"]

    def fails(extra, message):
        assert cli.main(base + extra) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and message in err, err

    fails(["--prompts", str(empty), "--out", str(tmp_path / "a")], "has no prompts")
    fails(["--prompts", str(prompts), "--out", str(tmp_path / "b"), "--block-sizes", "9-x"], "'9-x' is not a size")
    fails(["--prompts", str(prompts), "--out", str(tmp_path / "b"), "--block-sizes", "8"], "at least two")
    fails(["--prompts", str(prompts), "--out", str(tmp_path / "b"), "--block-sizes", "8"], "at least two")
    fails(["--prompts", str(prompts), "--out", str(tmp_path / "e"), "--temperature", "-1"], "fix --temperature")
    assert not (tmp_path / "e").exists()
    assert cli.main(base + ["--prompts", str(prompts), "--out", str(tmp_path / "c")]) == 0
    other_target = make_hf_target(tmp, "llama", seed=5)
    save_char_tokenizer(other_target)
    assert cli.main(["label", "--target", str(other_target), "--drafter", str(drafter), "--max-new-tokens", "4",
                     "--prompts", str(prompts), "--out", str(tmp_path / "c")]) == 2
    assert "labelled with another model (target_sha256" in capsys.readouterr().err
    fails(["--prompts", str(prompts), "--out", str(tmp_path / "c"), "--temperature", "1"],
          "other settings (temperature")
    fails(["--prompts", str(prompts), "--out", str(tmp_path / "c"), "--block-sizes", "6-11"],  # 11: not in its table
          "other settings (candidates [1, 6, 7, 8, 9, 10], now [6, 7, 8, 9, 10, 11])")
    bare = make_hf_target(tmp, "llama", seed=6)  # no tokenizer files
    assert cli.main(["label", "--target", str(bare), "--drafter", str(drafter), "--prompts", str(prompts),
                     "--out", str(tmp_path / "d")]) == 2
    assert "has no tokenizer files" in capsys.readouterr().err


def test_label_job_skips_prompts_too_long_for_the_cache(models, tmp_path):
    _, target, drafter = models
    prompts = tmp_path / "long.jsonl"
    prompts.write_text(json.dumps({"prompt": "x" * 400}) + "\n" + json.dumps({"prompt": "short"}) + "\n")
    summary = run_label_job(LabelJob(target=target, drafter=drafter, prompts=prompts, out=tmp_path / "ds",
                                     max_new_tokens=4, progress=False))
    assert summary["rows"] == 1 and summary["skipped_too_long"] == 1
