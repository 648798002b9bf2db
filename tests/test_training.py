"""Drafter training: the batched objective matches inference, the loss falls, runs resume."""

import argparse

import pytest
import torch

from blockpilot.errors import UserError
from blockpilot.models.checkpoint import load_drafter, load_target
from blockpilot.models.decoder import KVCache
from blockpilot.runtime.backend import TorchBackend
from blockpilot.training.objective import Batch, block_forward

from fixtures import DEVICES, make_drafter, make_hf_target, make_word_corpus


def test_training_blocks_equal_inference_drafts(tmp_path):
    """A training block at anchor t sees exactly what the runtime's drafter sees at position t."""
    target_dir = make_hf_target(tmp_path, "llama")
    target, drafter = load_target(target_dir), load_drafter(make_drafter(tmp_path, target_dir, block_size=6, layers=2))
    ids = torch.randint(0, 97, (1, 30))
    taps = target(target.embed_tokens(ids), torch.arange(30), KVCache.allocate(target.config, 1, 30, torch.float32),
                  30, drafter.config.target_layer_ids).taps
    anchors = torch.tensor([[7, 12, 20]])
    batch = Batch(ids, taps, torch.tensor([30]), anchors, torch.ones(1, 3, dtype=torch.bool))
    with torch.no_grad():
        trained = block_forward(drafter, target.embed_tokens.weight, batch)  # (3, 6, H)
    backend = TorchBackend(target, drafter)
    for j, anchor in enumerate(anchors[0].tolist()):
        state = backend.new_state(1, 64)
        with torch.no_grad():
            block = drafter.block_embeddings(target.embed_tokens(ids[:, anchor:anchor + 1]),
                                             target.embed_tokens.weight[drafter.config.mask_token_id], 6)
            ref = drafter(block, torch.arange(anchor, anchor + 6), taps[:, :anchor], torch.arange(anchor),
                          state.drafter_cache, anchor)
        assert torch.allclose(trained[j], ref[0], atol=1e-5), anchor


def test_budget_run_warms_up_over_the_start_of_the_budget_until_its_schedule_is_fitted(tmp_path):
    """Before the step count is fitted, a budget-only run must not take its warm-up length from the
    step-count placeholder (which kept the learning rate near zero); afterwards it follows the steps."""
    from blockpilot.training.trainer import TrainConfig, TrainData, Trainer, lr_factor

    target_dir = make_hf_target(tmp_path, "llama")
    target, drafter = load_target(target_dir), load_drafter(make_drafter(tmp_path, target_dir, block_size=4, layers=1))
    trainer = Trainer(drafter, target, TrainData([], []), TrainConfig(time_budget_s=1000.0, warmup_frac=0.04),
                      tmp_path / "work")
    trainer.step, trainer.elapsed = 3, 20.0  # half-way through the first 4% (40 s) of the budget
    assert trainer.lr_factor() == pytest.approx(0.5)
    trainer.elapsed = 400.0
    assert trainer.lr_factor() == 1.0
    trainer.total_steps = 1000  # fitted: warm-up + cosine over steps
    assert trainer.lr_factor() == lr_factor(3, 1000, 0.04) == pytest.approx(0.1)


def _args(tmp_path, answers, **kw):
    base = dict(target=None, out=tmp_path / "drafter", block_size=4, layers=1, taps=2, mask_token_id=3,
                answers=[answers], prompts=None, regenerate=0, gen_max_new_tokens=16, max_len=64,
                time_budget=1.0, max_steps=30, sequences_per_step=4, anchors=8, lr=3e-3, gamma=None,
                valid=2, eval_every=100.0, checkpoint_every=100.0, work_dir=tmp_path / "work",
                resume=False, no_autocast=True, seed=0, device="cpu", gen_batch_size=4, init_from=None)
    base.update(kw)
    return argparse.Namespace(**base)


@pytest.fixture
def tiny_corpus(tmp_path):
    """A tiny target with a word-level tokenizer and a file of its 'answers' (a repeated pattern)."""
    return make_word_corpus(tmp_path)


@pytest.mark.parametrize("device", DEVICES)
def test_training_lowers_the_loss_and_resumes(tmp_path, tiny_corpus, device):
    import json

    from blockpilot.training.pipeline import train_drafter_from_args

    target_dir, answers = tiny_corpus
    train_drafter_from_args(_args(tmp_path, answers, target=target_dir, max_steps=30, device=device))
    log = json.loads((tmp_path / "drafter" / "training_log.json").read_text())
    assert log["steps"] == 30
    state = torch.load(tmp_path / "work" / "checkpoint" / "train_state.pt", weights_only=True)
    assert state["step"] == 30
    train_drafter_from_args(_args(tmp_path, answers, target=target_dir, max_steps=45, resume=True, device=device))
    resumed = json.loads((tmp_path / "drafter" / "training_log.json").read_text())
    assert resumed["steps"] == 45  # continued from step 30, not from scratch
    assert resumed["log"][-1]["train_loss"] < log["log"][-1]["train_loss"]  # steps 30-45 vs 0-30


def test_distillation_trains_on_cached_soft_labels_and_logs_the_sampled_acceptance(tmp_path, tiny_corpus):
    """--distill caches the target's top-K next tokens with the taps, trains towards them (the loss falls),
    logs the held-out expected tau of drafts drawn at T = 1, and its cache serves a later hard-label run."""
    import json

    from blockpilot.training import features
    from blockpilot.training.pipeline import train_drafter_from_args

    target_dir, answers = tiny_corpus
    train_drafter_from_args(_args(tmp_path, answers, target=target_dir, max_steps=40, distill=0.5, distill_top_k=4,
                                  distill_temperature=1.0, eval_every=0.0))
    log = json.loads((tmp_path / "drafter" / "training_log.json").read_text())
    assert log["config"]["distill"] == 0.5
    evals = [entry for entry in log["log"] if entry["train_loss"] is not None]
    assert evals[-1]["train_loss"] < evals[0]["train_loss"]
    assert all(1.0 <= entry["sim_tau_t1"] <= 4.0 for entry in log["log"])
    assert log["log"][-1]["sim_tau_t1"] > log["log"][0]["sim_tau_t1"]
    assert (tmp_path / "work" / "features" / features.SOFT_IDS_FILE).is_file()
    extracted = []
    real = features._tap_batches
    features._tap_batches = lambda *a, **k: (extracted.append(1), real(*a, **k))[1]
    try:
        train_drafter_from_args(_args(tmp_path, answers, target=target_dir, max_steps=5, out=tmp_path / "hard"))
    finally:
        features._tap_batches = real
    assert not extracted  # the cache made with soft labels served the hard-label run
    hard = json.loads((tmp_path / "hard" / "training_log.json").read_text())
    assert hard["config"]["distill"] == 0.0 and "sim_tau_t1" in hard["log"][-1]


def test_a_run_bounded_only_by_its_time_budget_trains_and_stops(tmp_path, tiny_corpus):
    import json

    from blockpilot.training.pipeline import train_drafter_from_args

    target_dir, answers = tiny_corpus
    train_drafter_from_args(_args(tmp_path, answers, target=target_dir, max_steps=None, time_budget=0.05))
    log = json.loads((tmp_path / "drafter" / "training_log.json").read_text())
    assert log["steps"] > 0 and log["log"][-1]["train_loss"] is not None


def test_replayed_greedy_steps_equal_the_runtime_steps(tmp_path, tiny_corpus):
    """The T=0 replay evaluator reproduces the runner's per-step acceptance lengths exactly."""
    from blockpilot.runtime.runner import Runner
    from blockpilot.training.evaluate import replay_accept_lengths
    from blockpilot.training.pipeline import train_drafter_from_args

    target_dir, answers = tiny_corpus
    train_drafter_from_args(_args(tmp_path, answers, target=target_dir, max_steps=60, lr=1e-2))
    runner = Runner.from_dir(target_dir, drafter_dir=tmp_path / "drafter")
    runner.lookup = "off"  # every step drafts with the drafter, as the replay does
    target, drafter = load_target(target_dir), load_drafter(tmp_path / "drafter")
    accepted_any = False
    for prompt in ([5, 9, 13, 17], [40, 41, 42, 43, 44, 45]):
        for k in (2, 4, 6):
            out = runner.generate([torch.tensor(prompt)], max_new_tokens=30, block_size=k, end_id=-1,
                                  return_dict=True)
            ids = out["output_ids"][0, 0, : len(prompt) + 30].tolist()
            steps = replay_accept_lengths(target, drafter, ids, len(prompt), k)
            assert steps[:-1] == out["accept_lengths"][0][: len(steps) - 1]
            accepted_any |= max(steps) > 1
    assert accepted_any  # the comparison exercised accepted drafts, not only rejections


@pytest.mark.parametrize("device", DEVICES)
def test_answer_command_writes_the_targets_greedy_answers_and_resumes(tmp_path, tiny_corpus, device):
    """`blockpilot answer` rows equal unbatched greedy generation; a rerun answers only new prompts."""
    import json

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from blockpilot.cli import main

    target_dir, _ = tiny_corpus
    from fixtures import WORDS

    texts = [" ".join(WORDS[i:i + n]) for i, n in ((0, 3), (5, 7), (9, 2), (20, 5), (30, 4))]
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": t, "source": "unit"}) + "\n" for t in texts))
    out = tmp_path / "regenerated.jsonl"
    common = ["answer", "--target", str(target_dir), "--prompts", str(prompts), "--out", str(out),
              "--max-new-tokens", "6", "--batch-size", "2", "--device", device]
    assert main([*common, "--limit", "3"]) == 0
    assert len(out.read_text().splitlines()) == 3
    assert main(common) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert sorted(r["prompt"] for r in rows) == sorted(texts)  # 3 kept, 2 added, none twice
    tokenizer = AutoTokenizer.from_pretrained(target_dir)
    model = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    for row in rows:
        ids = torch.tensor([tokenizer(row["prompt"])["input_ids"]])
        ref = model.generate(ids, max_new_tokens=6, do_sample=False, eos_token_id=tokenizer.eos_token_id,
                             pad_token_id=tokenizer.eos_token_id)[0, ids.shape[1]:].tolist()
        eos = tokenizer.eos_token_id
        expected = ref[: ref.index(eos)] if eos in ref else ref
        assert row["answer_ids"] == expected, row["prompt"]
        assert row["finish"] == ("stop" if eos in ref else "length")
        assert row["source"] == "unit"


def test_answer_command_rejects_bad_input_with_one_line(tmp_path, tiny_corpus, capsys):
    from blockpilot.cli import main

    target_dir, _ = tiny_corpus
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    good = tmp_path / "p.jsonl"
    good.write_text('{"prompt": "a b"}\n')
    cases = [
        (["--target", str(target_dir), "--prompts", str(empty), "--out", str(tmp_path / "o.jsonl")], "no prompts"),
        (["--target", str(target_dir), "--prompts", str(tmp_path / "nope.jsonl"), "--out", str(tmp_path / "o.jsonl")],
         "cannot read"),
        (["--target", str(tmp_path), "--prompts", str(good), "--out", str(tmp_path / "o.jsonl")], "config.json"),
        (["--target", str(target_dir), "--prompts", str(good), "--out", str(tmp_path)], "is a folder"),
        (["--target", str(target_dir), "--prompts", str(good), "--out", str(tmp_path / "o.jsonl"),
          "--batch-size", "0"], "--batch-size must be positive"),
        (["--target", str(target_dir), "--prompts", str(good), "--out", str(tmp_path / "o.jsonl"),
          "--device", "tpu"], "--device"),
        (["--target", str(target_dir), "--prompts", "mtbench", "--out", str(tmp_path / "o.jsonl")],
         "mtbench is an evaluation set"),
    ]
    for argv, expected in cases:
        assert main(["answer", *argv]) == 2, argv
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and expected in err, err
    assert not (tmp_path / "o.jsonl").exists()


def test_fine_tuning_starts_from_the_given_drafter_and_keeps_its_draft_vocabulary(tmp_path, tiny_corpus):
    """--init-from: step 0 is the given drafter (its held-out tau is the first log entry), the written
    drafter keeps its draft vocabulary, and gzip-compressed answer files are read as they are."""
    import gzip
    import json

    from blockpilot.training.pipeline import train_drafter_from_args

    target_dir, answers = tiny_corpus
    train_drafter_from_args(_args(tmp_path, answers, target=target_dir, max_steps=20, lr=1e-2))
    base = load_drafter(tmp_path / "drafter")
    base.set_draft_vocabulary(torch.arange(0, 92))  # every id of the word-level tokenizer
    from blockpilot.models.checkpoint import save_drafter

    save_drafter(base, tmp_path / "base")
    packed = tmp_path / "answers.jsonl.gz"
    packed.write_bytes(gzip.compress(answers.read_bytes()))
    train_drafter_from_args(_args(tmp_path, packed, target=target_dir, max_steps=10, init_from=tmp_path / "base",
                                  out=tmp_path / "tuned", work_dir=tmp_path / "work-tuned"))
    tuned = load_drafter(tmp_path / "tuned")
    assert torch.equal(tuned.draft_vocab_ids, torch.arange(0, 92))
    log = json.loads((tmp_path / "tuned" / "training_log.json").read_text())
    assert log["log"][0]["step"] == 0 and log["steps"] == 10
    first = json.loads((tmp_path / "drafter" / "training_log.json").read_text())["log"][-1]
    assert log["log"][0]["sim_tau"] > 1.0 and log["log"][0]["sim_tau"] == pytest.approx(first["sim_tau"], abs=0.1)
    with pytest.raises(UserError, match="has block-size 4, not 6"):
        train_drafter_from_args(_args(tmp_path, packed, target=target_dir, max_steps=2, init_from=tmp_path / "base",
                                      block_size=6, out=tmp_path / "x", work_dir=tmp_path / "work-x"))


def test_resume_without_a_checkpoint_stops_before_extracting_features_and_leaves_no_work_dir(
        tmp_path, tiny_corpus, monkeypatch):
    from blockpilot.training import pipeline

    def never(*args, **kwargs):
        raise AssertionError("the target's features were computed before --resume was checked")

    monkeypatch.setattr(pipeline, "_features", never)
    target_dir, answers = tiny_corpus
    with pytest.raises(UserError, match=r"--resume: no checkpoint in .*work; run without --resume first"):
        pipeline.train_drafter_from_args(_args(tmp_path, answers, target=target_dir, resume=True))
    assert not (tmp_path / "work").exists()


@pytest.mark.parametrize("extra, message", [
    (["--lr", "-1"], "--lr must be > 0 (got -1.0)"), (["--lr", "0"], "--lr must be > 0"),
    (["--gamma", "-2"], "--gamma must be > 0"), (["--eval-every", "-1"], "--eval-every must be >= 0 minutes"),
    (["--checkpoint-every", "-1"], "--checkpoint-every must be >= 0 minutes"),
    (["--sequences-per-step", "0"], "--sequences-per-step must be >= 1"), (["--anchors", "0"], "--anchors must be >= 1"),
    (["--valid", "-1"], "--valid must be >= 0"), (["--max-len", "4"], "--max-len must be >= 9"),
    (["--max-steps", "0"], "--max-steps must be >= 1"),
])
def test_train_drafter_options_out_of_range_are_one_line_before_any_work(extra, message, tmp_path, tiny_corpus, capsys,
                                                                          monkeypatch):
    from blockpilot.cli import main
    from blockpilot.training import pipeline

    monkeypatch.setattr(pipeline, "load_target", lambda *a, **k: pytest.fail("the target was loaded"))
    target_dir, answers = tiny_corpus
    code = main(["train-drafter", "--target", str(target_dir), "--mask-token-id", "3", "--answers", str(answers),
                 "--out", str(tmp_path / "d"), "--time-budget", "1", "--block-size", "8", *extra])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and message in err[0], err
    assert not (tmp_path / "d").exists() and not (tmp_path / "d.work").exists()
