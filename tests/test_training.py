"""Drafter training: the batched objective matches inference, the loss falls, runs resume."""

import argparse

import pytest
import torch

from blockpilot.models.checkpoint import load_drafter, load_target
from blockpilot.models.decoder import KVCache
from blockpilot.runtime.backend import TorchBackend
from blockpilot.training.objective import Batch, block_forward

from fixtures import make_drafter, make_hf_target, make_word_corpus


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


def _args(tmp_path, answers, **kw):
    base = dict(target=None, out=tmp_path / "drafter", block_size=4, layers=1, taps=2, mask_token_id=3,
                answers=[answers], prompts=None, regenerate=0, gen_max_new_tokens=16, max_len=64,
                time_budget=1.0, max_steps=30, sequences_per_step=4, anchors=8, lr=3e-3, gamma=None,
                valid=2, eval_every=100.0, checkpoint_every=100.0, work_dir=tmp_path / "work",
                resume=False, no_autocast=True, seed=0)
    base.update(kw)
    return argparse.Namespace(**base)


@pytest.fixture
def tiny_corpus(tmp_path):
    """A tiny target with a word-level tokenizer and a file of its 'answers' (a repeated pattern)."""
    return make_word_corpus(tmp_path)


def test_training_lowers_the_loss_and_resumes(tmp_path, tiny_corpus):
    import json

    from blockpilot.training.pipeline import train_drafter_from_args

    target_dir, answers = tiny_corpus
    train_drafter_from_args(_args(tmp_path, answers, target=target_dir, max_steps=30))
    log = json.loads((tmp_path / "drafter" / "training_log.json").read_text())
    assert log["steps"] == 30
    state = torch.load(tmp_path / "work" / "checkpoint" / "train_state.pt", weights_only=True)
    assert state["step"] == 30
    train_drafter_from_args(_args(tmp_path, answers, target=target_dir, max_steps=45, resume=True))
    resumed = json.loads((tmp_path / "drafter" / "training_log.json").read_text())
    assert resumed["steps"] == 45  # continued from step 30, not from scratch
    assert resumed["log"][-1]["train_loss"] < log["log"][-1]["train_loss"]  # steps 30-45 vs 0-30


def test_replayed_greedy_steps_equal_the_runtime_steps(tmp_path, tiny_corpus):
    """The T=0 replay evaluator reproduces the runner's per-step acceptance lengths exactly."""
    from blockpilot.runtime.runner import Runner
    from blockpilot.training.evaluate import replay_accept_lengths
    from blockpilot.training.pipeline import train_drafter_from_args

    target_dir, answers = tiny_corpus
    train_drafter_from_args(_args(tmp_path, answers, target=target_dir, max_steps=60, lr=1e-2))
    runner = Runner.from_dir(target_dir, drafter_dir=tmp_path / "drafter")
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
