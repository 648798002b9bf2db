"""The embedded default: real SmolLM2-135M-Instruct + the shipped drafter, lossless at B_train."""

import pytest
import torch

from blockpilot.assets import default_drafter_dir
from blockpilot.assets.smollm2 import smollm2_dir
from blockpilot.runtime.runner import Runner
from blockpilot.text import chat_prompt_ids, load_tokenizer

PROMPTS = [
    "Write a Python function that returns the sum of a list of numbers.",
    "What is the capital of France? Answer in one sentence.",
    "Sam has 7 pencils and buys 5 more. How many pencils does he have?",
]


@pytest.mark.slow
def test_shipped_drafter_is_lossless_on_smollm2_at_b_train():
    from transformers import AutoModelForCausalLM

    target_dir, drafter_dir = smollm2_dir(), default_drafter_dir()
    runner = Runner.from_dir(target_dir, drafter_dir=drafter_dir)
    b_train = runner.backend.drafter_config.block_size
    tokenizer = load_tokenizer(target_dir)
    reference = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    n = 32
    for text in PROMPTS:
        ids = chat_prompt_ids(tokenizer, text)
        expected = reference.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False,
                                      eos_token_id=None, pad_token_id=tokenizer.pad_token_id)[0, len(ids):]
        out = runner.generate([torch.tensor(ids)], max_new_tokens=n, block_size=b_train, end_id=-1,
                              return_dict=True)
        ar = runner.generate([torch.tensor(ids)], max_new_tokens=n, block_size=1, end_id=-1)
        spec = out["output_ids"][0, 0, len(ids):len(ids) + n].tolist()
        assert spec == ar[0, 0, len(ids):len(ids) + n].tolist(), text  # exactly lossless
        assert out["block_sizes"][0] == b_train
        _assert_equal_up_to_near_tie(reference, ids, spec, expected.tolist())


def _assert_equal_up_to_near_tie(reference, ids, ours, theirs, max_gap=0.2):
    """Equal to transformers' greedy output, except after a position where transformers' own two
    best logits are within `max_gap` (fp32 cached vs uncached decoding may break such ties either way)."""
    if ours == theirs:
        return
    first = next(i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b)
    with torch.no_grad():
        logits = reference(torch.tensor([ids + theirs[:first]])).logits[0, -1]
    top2 = logits.topk(2)
    assert {ours[first], theirs[first]} == set(top2.indices.tolist())
    assert float(top2.values[0] - top2.values[1]) < max_gap, f"diverged at {first} without a near-tie"


def _train_args(tmp_path, **overrides):
    argv = ["train-drafter", "--out", str(tmp_path / "d"), "--answers", str(tmp_path / "a.jsonl"),
            "--time-budget", "1"]
    for key, value in overrides.items():
        argv += [f"--{key}", str(value)]
    return argv


def test_train_drafter_rejects_bad_input_with_one_line(tmp_path, capsys):
    import json

    from blockpilot.cli import main

    (tmp_path / "a.jsonl").write_text(json.dumps({"prompt": "p", "answer": "a"}) + "\n")
    cases = [
        (_train_args(tmp_path, **{"time-budget": 0}), "--time-budget"),
        (["train-drafter", "--out", str(tmp_path / "d"), "--answers", str(tmp_path / "missing.jsonl"),
          "--time-budget", "1"], "missing.jsonl"),
        (["train-drafter", "--out", str(tmp_path / "d"), "--prompts", str(tmp_path / "nope.jsonl"),
          "--regenerate", "5", "--time-budget", "1"], "nope.jsonl"),
        (["train-drafter", "--out", str(tmp_path / "d"), "--prompts", "humaneval",
          "--regenerate", "5", "--time-budget", "1"], "humaneval is an evaluation set"),
        (_train_args(tmp_path, distill=1.5), "--distill must be between 0 and 1"),
        (_train_args(tmp_path, distill=0.5, **{"distill-top-k": 0}), "--distill-top-k"),
        (_train_args(tmp_path, distill=0.5, **{"distill-temperature": 0}), "--distill-temperature"),
    ]
    for argv, needle in cases:
        assert main(argv) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and needle in err[0], err
    assert not (tmp_path / "d").exists()


def test_resuming_with_a_target_the_drafter_was_not_trained_for_fails_cleanly(tmp_path, capsys):
    import json

    from blockpilot.cli import main
    from blockpilot.training.pipeline import drafter_config_for

    from fixtures import make_hf_target

    small = make_hf_target(tmp_path, "llama")
    other = make_hf_target(tmp_path, "llama", seed=3, hidden_size=48, num_hidden_layers=6)
    from blockpilot.models.config import DecoderConfig

    saved = drafter_config_for(DecoderConfig.from_dict(json.loads((small / "config.json").read_text())),
                               block_size=4, layers=1, taps=2, mask_token_id=3)
    ckpt = tmp_path / "work" / "checkpoint"
    ckpt.mkdir(parents=True)
    (ckpt / "config.json").write_text(json.dumps(saved.to_dict()))
    (tmp_path / "a.jsonl").write_text(json.dumps({"prompt": "p", "answer": "a"}) + "\n")
    argv = ["train-drafter", "--target", str(other), "--out", str(tmp_path / "d"), "--answers",
            str(tmp_path / "a.jsonl"), "--time-budget", "1", "--mask-token-id", "3", "--work-dir",
            str(tmp_path / "work"), "--resume"]
    capsys.readouterr()  # drop the fixture's progress output
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "does not fit the target" in err[0], err
