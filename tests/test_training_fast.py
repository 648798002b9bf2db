"""The fast CPU trainer: draft-vocabulary loss, fused chunked lm_head, length groups, exact resume."""

import dataclasses
import math

import pytest
import torch
import torch.nn.functional as F

from blockpilot.models.checkpoint import load_drafter, load_target
from blockpilot.models.decoder import KVCache
from blockpilot.training.objective import Batch, DraftHead, block_forward, block_labels, drafter_loss

from fixtures import make_drafter, make_hf_target


def _tiny(tmp_path, block_size=6):
    target_dir = make_hf_target(tmp_path, "llama")
    target = load_target(target_dir)
    drafter = load_drafter(make_drafter(tmp_path, target_dir, block_size=block_size, layers=2))
    return target, drafter


def _batch(target, drafter, lengths=(30, 22), anchors=4, seed=0):
    gen = torch.Generator().manual_seed(seed)
    width = max(lengths)
    ids = torch.randint(0, 97, (len(lengths), width), generator=gen)
    with torch.no_grad():
        taps = target(target.embed_tokens(ids), torch.arange(width),
                      KVCache.allocate(target.config, len(lengths), width, torch.float32), width,
                      drafter.config.target_layer_ids).taps
    anchor_pos = torch.stack([torch.randperm(n - 6, generator=gen)[:anchors].sort().values + 4 for n in lengths])
    valid = torch.ones(len(lengths), anchors, dtype=torch.bool)
    valid[-1, -1] = False  # a padding anchor
    return Batch(ids, taps, torch.tensor(lengths), anchor_pos, valid)


def _reference_loss(drafter, target, batch, vocab_ids, gamma):
    """Full-vocabulary logits restricted to `vocab_ids`, labels remapped to their column; slots whose
    label is outside `vocab_ids` weigh 0; the weighted mean CE over the remaining slots."""
    bsz = drafter.config.block_size
    hidden = block_forward(drafter, target.embed_tokens.weight, batch)[:, 1:]
    labels, valid = block_labels(batch, bsz)
    logits = F.linear(hidden, target.lm_head.weight)[..., vocab_ids]  # (NA, B-1, N_v)
    column = {int(t): j for j, t in enumerate(vocab_ids)}
    inside = torch.tensor([[int(t) in column for t in row] for row in labels])
    remapped = torch.tensor([[column.get(int(t), 0) for t in row] for row in labels])
    ce = F.cross_entropy(logits.flatten(0, 1), remapped.flatten(), reduction="none").view_as(labels)
    w = torch.exp(-torch.arange(bsz - 1, dtype=torch.float32) / gamma)[None, :] * (valid & inside)
    correct = (vocab_ids[logits.argmax(-1)] == labels) & valid
    return (ce * w).sum() / w.sum(), correct, valid, inside


@pytest.mark.parametrize("chunk_rows", [512, 5])
def test_draft_vocabulary_loss_equals_the_full_vocabulary_loss_restricted_to_its_ids(tmp_path, chunk_rows):
    """Same logits restricted to the id subset, labels remapped, out-of-vocabulary slots weighted 0:
    equal loss, equal gradients, equal per-slot correctness (whatever the chunking of the lm_head)."""
    target, drafter = _tiny(tmp_path)
    for p in target.parameters():
        p.requires_grad_(False)
    vocab_ids = torch.arange(0, 97, 2)  # the even ids: about half of all labels fall outside
    drafter.set_draft_vocabulary(vocab_ids)
    batch = _batch(target, drafter)
    head = DraftHead.of(drafter, target.lm_head.weight)

    loss, stats = drafter_loss(drafter, target.embed_tokens.weight, head, batch, gamma=4.0, chunk_rows=chunk_rows)
    grads = torch.autograd.grad(loss, list(drafter.parameters()))
    ref, correct, valid, inside = _reference_loss(drafter, target, batch, vocab_ids, 4.0)
    ref_grads = torch.autograd.grad(ref, list(drafter.parameters()))

    assert 0 < int((valid & ~inside).sum()) and 0 < int((valid & inside).sum())  # both kinds of slot present
    assert torch.allclose(loss, ref, rtol=1e-5, atol=1e-6)
    for g, r in zip(grads, ref_grads):
        assert torch.allclose(g, r, rtol=1e-4, atol=1e-6)
    assert torch.equal(stats["valid"], valid) and torch.equal(stats["correct"], correct)
    assert not bool(stats["correct"][~inside].any())  # an id outside the list can never be drafted


def _with_soft_labels(target, batch, top_k=5):
    """`batch` with the target's own top-`top_k` next-token log-probabilities at every position."""
    from blockpilot.training.features import extract_features
    from blockpilot.training.data import Sequence

    sequences = [Sequence(tuple(row[:n].tolist()), 0) for row, n in zip(batch.ids, batch.lengths.tolist())]
    _, soft = extract_features(target, sequences, (0,), top_k=top_k, autocast=False)
    pad = torch.nn.utils.rnn.pad_sequence
    return dataclasses.replace(batch, soft_ids=pad([s.ids.long() for s in soft], batch_first=True),
                               soft_logprobs=pad([s.logprobs for s in soft], batch_first=True))


@pytest.mark.parametrize("distill,temperature,chunk_rows", [(0.5, 1.0, 512), (1.0, 0.7, 5), (0.3, 1.3, 7)])
def test_distillation_loss_is_the_cross_entropy_against_the_mixed_target_distribution(tmp_path, distill, temperature,
                                                                                        chunk_rows):
    """Slot target = (1 - a) onehot(label) + a * (target's top-K tempered, renormalised inside the draft
    vocabulary); loss, gradients and the acceptance estimate `sum min(p, q)` equal an explicit computation."""
    target, drafter = _tiny(tmp_path)
    for p in target.parameters():
        p.requires_grad_(False)
    vocab_ids = torch.arange(0, 97, 2)
    drafter.set_draft_vocabulary(vocab_ids)
    batch = _with_soft_labels(target, _batch(target, drafter))
    head = DraftHead.of(drafter, target.lm_head.weight)
    loss, stats = drafter_loss(drafter, target.embed_tokens.weight, head, batch, gamma=4.0, chunk_rows=chunk_rows,
                               distill=distill, distill_temperature=temperature)
    grads = torch.autograd.grad(loss, list(drafter.parameters()))

    bsz = drafter.config.block_size
    hidden = block_forward(drafter, target.embed_tokens.weight, batch)[:, 1:]
    labels, valid = block_labels(batch, bsz)
    logq = F.linear(hidden, target.lm_head.weight)[..., vocab_ids].log_softmax(-1)  # (NA, B-1, N_v)
    column = torch.full((97,), -1)
    column[vocab_ids] = torch.arange(len(vocab_ids))
    rows = column[labels]
    n, a = batch.anchors.shape
    pos = (batch.anchors[..., None] + torch.arange(bsz - 1)).reshape(n, -1)  # the position that predicted each label
    pos = pos.clamp(max=batch.ids.shape[1] - 1)
    full_logp = F.linear(target(target.embed_tokens(batch.ids), torch.arange(batch.ids.shape[1]),
                                KVCache.allocate(target.config, n, batch.ids.shape[1], torch.float32),
                                batch.ids.shape[1]).hidden, target.lm_head.weight).log_softmax(-1)  # (N, L, V)
    topk = full_logp.topk(5, dim=-1)
    ids = topk.indices.gather(1, pos[..., None].expand(-1, -1, 5)).reshape(n * a, bsz - 1, 5)
    lp = topk.values.gather(1, pos[..., None].expand(-1, -1, 5)).reshape(n * a, bsz - 1, 5)
    inside = column[ids] >= 0
    soft = torch.zeros_like(logq)
    tempered = (lp / temperature).masked_fill(~inside, -math.inf).softmax(-1).nan_to_num(0.0)
    soft.scatter_add_(-1, column[ids].clamp(min=0), tempered)
    t = distill * soft
    t.scatter_add_(-1, rows.clamp(min=0)[..., None], (1 - distill * tempered.sum(-1, keepdim=True)))
    w = torch.exp(-torch.arange(bsz - 1, dtype=torch.float32) / 4.0)[None, :] * (valid & (rows >= 0))
    ref = (-(t * logq).sum(-1) * w).sum() / w.sum()
    ref_grads = torch.autograd.grad(ref, list(drafter.parameters()))
    q_at = logq.exp().gather(-1, column[ids].clamp(min=0))
    accept = (torch.minimum(lp.exp() * inside, q_at).sum(-1) * (w > 0)).detach()

    assert torch.allclose(loss, ref, rtol=1e-5, atol=1e-6)
    for g, r in zip(grads, ref_grads):
        assert torch.allclose(g, r, rtol=1e-4, atol=1e-6)
    assert torch.allclose(stats["accept"], accept, atol=1e-6) and float(accept.max()) > 0


def test_with_soft_labels_and_no_distillation_the_loss_is_the_hard_label_loss(tmp_path):
    target, drafter = _tiny(tmp_path)
    batch = _batch(target, drafter)
    head = DraftHead.of(drafter, target.lm_head.weight)
    with torch.no_grad():
        hard, stats = drafter_loss(drafter, target.embed_tokens.weight, head, batch, gamma=4.0)
        with_soft, soft_stats = drafter_loss(drafter, target.embed_tokens.weight, head,
                                             _with_soft_labels(target, batch), gamma=4.0)
    assert torch.equal(hard, with_soft) and torch.equal(stats["correct"], soft_stats["correct"])
    assert "accept" in soft_stats and "accept" not in stats
    with pytest.raises(ValueError, match="soft labels"):
        drafter_loss(drafter, target.embed_tokens.weight, head, batch, gamma=4.0, distill=0.5)


def test_slots_whose_label_is_outside_the_draft_vocabulary_do_not_move_the_loss(tmp_path):
    """Such slots weigh 0: a list covering none of the labels gives loss 0 and no gradient."""
    target, drafter = _tiny(tmp_path)
    batch = _batch(target, drafter)
    labels, _ = block_labels(batch, drafter.config.block_size)
    unused = sorted(set(range(97)) - set(labels.flatten().tolist()))
    drafter.set_draft_vocabulary(torch.tensor(unused))
    loss, stats = drafter_loss(drafter, target.embed_tokens.weight, DraftHead.of(drafter, target.lm_head.weight),
                               batch, gamma=4.0)
    loss.backward()
    assert float(loss.detach()) == 0.0 and not bool(stats["correct"].any())
    assert all(p.grad is None or float(p.grad.abs().max()) == 0.0 for p in drafter.parameters())


def test_without_a_draft_vocabulary_the_loss_is_the_full_vocabulary_cross_entropy(tmp_path):
    target, drafter = _tiny(tmp_path)
    batch = _batch(target, drafter)
    with torch.no_grad():
        loss, _ = drafter_loss(drafter, target.embed_tokens.weight, DraftHead.of(drafter, target.lm_head.weight),
                               batch, gamma=4.0, chunk_rows=7)
        ref, *_ = _reference_loss(drafter, target, batch, torch.arange(97), 4.0)
    assert torch.allclose(loss, ref, rtol=1e-5, atol=1e-6)


def test_length_groups_give_the_loss_of_one_padded_batch(tmp_path):
    """Sequences cut into length-sorted sub-batches (each padded to its own longest) train the same
    blocks: the loss equals that of one batch padded to the longest sequence."""
    from blockpilot.training.data import Sequence
    from blockpilot.training.trainer import make_batch, make_length_groups

    target, drafter = _tiny(tmp_path)
    gen = torch.Generator().manual_seed(3)
    items = []
    for n in (40, 12, 33, 18, 25):
        ids = torch.randint(0, 97, (1, n), generator=gen)
        with torch.no_grad():
            taps = target(target.embed_tokens(ids), torch.arange(n), KVCache.allocate(target.config, 1, n, torch.float32),
                          n, drafter.config.target_layer_ids).taps[0]
        items.append((Sequence(tuple(ids[0].tolist()), 4), taps))
    head = DraftHead.of(drafter, target.lm_head.weight)
    ordered = sorted(items, key=lambda item: len(item[0].ids))
    with torch.no_grad():
        one, _ = drafter_loss(drafter, target.embed_tokens.weight, head,
                              make_batch(ordered, 6, torch.Generator().manual_seed(0)), 4.0)
        grouped, _ = drafter_loss(drafter, target.embed_tokens.weight, head,
                                  make_length_groups(items, 6, torch.Generator().manual_seed(0), group_size=2), 4.0)
    assert torch.allclose(one, grouped, rtol=1e-5)


def _trainer(tmp_path, target, drafter_dir, work, max_steps=20):
    from blockpilot.training.data import Sequence
    from blockpilot.training.trainer import TrainConfig, TrainData, Trainer

    gen = torch.Generator().manual_seed(5)
    items = []
    for n in (30, 24, 28, 20, 26, 22):
        ids = torch.randint(0, 97, (n,), generator=gen)
        taps = torch.randn(n, 2 * 32, generator=gen).to(torch.bfloat16)
        items.append((Sequence(tuple(ids.tolist()), 5), taps))
    torch.manual_seed(0)
    config = TrainConfig(time_budget_s=1e9, max_steps=max_steps, sequences_per_step=3, anchors_per_sequence=4,
                         lr=3e-3, autocast=False)
    return Trainer(load_drafter(drafter_dir), target, TrainData(items, []), config, work)


def test_a_resumed_run_continues_the_schedule_where_it_stopped(tmp_path):
    """Stopped after 8 of 20 steps and resumed from its checkpoint, a run has the step count, the
    learning rate at every later step and the final weights of a run that was never interrupted."""
    target_dir = make_hf_target(tmp_path, "llama")
    target = load_target(target_dir)
    drafter_dir = make_drafter(tmp_path, target_dir, block_size=4, layers=1)
    assert len(load_drafter(drafter_dir).config.target_layer_ids) == 2  # the taps `_trainer` makes: 2 x 32

    def lrs(trainer, steps):
        out = []
        for _ in range(steps):
            trainer.train_step()
            out.append((trainer.step, trainer.optimizer.param_groups[0]["lr"]))
        return out

    straight = _trainer(tmp_path, target, drafter_dir, tmp_path / "straight")
    expected = lrs(straight, 20)

    first = _trainer(tmp_path, target, drafter_dir, tmp_path / "resumed")
    before = lrs(first, 8)
    first.save_checkpoint()
    resumed = _trainer(tmp_path, target, drafter_dir, tmp_path / "resumed")
    assert resumed.load_checkpoint()
    assert (resumed.step, resumed.total_steps) == (8, 20)
    after = lrs(resumed, 12)
    assert before + after == expected
    assert not math.isclose(expected[3][1], expected[15][1])  # the schedule does move over these steps
    for name, value in straight.drafter.state_dict().items():
        assert torch.allclose(value, resumed.drafter.state_dict()[name], atol=1e-6), name


def test_a_resumed_budget_run_keeps_its_fitted_step_count(tmp_path):
    """A run whose step count was fitted to its time budget resumes with that count, not the placeholder."""
    from blockpilot.training.trainer import MAX_STEPS_UNSET

    target_dir = make_hf_target(tmp_path, "llama")
    target = load_target(target_dir)
    drafter_dir = make_drafter(tmp_path, target_dir, block_size=4, layers=1)
    first = _trainer(tmp_path, target, drafter_dir, tmp_path / "work", max_steps=MAX_STEPS_UNSET)
    first.total_steps = 50  # as `_fit_schedule_to_budget` sets it
    for _ in range(6):
        first.train_step()
    first.save_checkpoint()
    resumed = _trainer(tmp_path, target, drafter_dir, tmp_path / "work", max_steps=MAX_STEPS_UNSET)
    assert resumed.load_checkpoint()
    assert (resumed.step, resumed.total_steps) == (6, 50)
    assert resumed.lr_factor() == first.lr_factor()


def _sequences(count=7, seed=1):
    gen = torch.Generator().manual_seed(seed)
    from blockpilot.training.data import Sequence

    return [Sequence(tuple(torch.randint(0, 97, (int(n),), generator=gen).tolist()), 3)
            for n in torch.randint(8, 40, (count,), generator=gen)]


def test_taps_cached_on_disk_equal_the_taps_computed_in_memory(tmp_path):
    from blockpilot.training.features import cached_taps, extract_taps, load_cached_taps

    target, drafter = _tiny(tmp_path)
    sequences, layers = _sequences(), drafter.config.target_layer_ids
    expected = extract_taps(target, sequences, layers, tokens_per_batch=64)
    on_disk, soft = cached_taps(tmp_path / "cache", target, sequences, layers, "key-a", tokens_per_batch=64)
    loaded = load_cached_taps(tmp_path / "cache", "key-a")
    assert loaded is not None and loaded[0] == sequences and soft is None and loaded[2] is None
    for want, got, again in zip(expected, on_disk, loaded[1]):
        assert got.dtype == torch.bfloat16 and torch.equal(want, got) and torch.equal(want, again)
    assert load_cached_taps(tmp_path / "cache", "key-b") is None  # other answers: not this cache


def test_cached_soft_labels_are_the_targets_most_likely_next_tokens(tmp_path):
    """With top_k the cache also holds, per position, the target's K most likely next ids and their
    log-probabilities; a cache without them is rebuilt when they are asked for, and serves runs without
    (which see its soft labels too)."""
    from blockpilot.training.features import cached_taps, load_cached_taps

    target, drafter = _tiny(tmp_path)
    sequences, layers = _sequences(), drafter.config.target_layer_ids
    cached_taps(tmp_path / "cache", target, sequences, layers, "k", tokens_per_batch=64)
    assert load_cached_taps(tmp_path / "cache", "k", top_k=4) is None  # made without soft labels
    taps, soft = cached_taps(tmp_path / "cache", target, sequences, layers, "k", tokens_per_batch=64, top_k=4,
                             autocast=False)
    loaded = load_cached_taps(tmp_path / "cache", "k", top_k=4)
    assert loaded is not None and load_cached_taps(tmp_path / "cache", "k")[2] is not None  # also for hard labels
    assert load_cached_taps(tmp_path / "cache", "k", top_k=3) is None  # another K: not this cache
    for seq, labels, again in zip(sequences, soft, loaded[2]):
        n = len(seq.ids)
        with torch.no_grad():
            out = target(target.embed_tokens(torch.tensor([seq.ids])), torch.arange(n),
                         KVCache.allocate(target.config, 1, n, torch.float32), n)
        want = target.lm_head(out.hidden)[0].log_softmax(-1).topk(4, dim=-1)
        assert labels.ids.shape == (n, 4) and labels.ids.dtype == torch.int32
        assert torch.equal(labels.ids.long(), want.indices)
        assert torch.allclose(labels.logprobs, want.values, atol=1e-5)
        assert torch.equal(again.ids, labels.ids) and torch.equal(again.logprobs, labels.logprobs)


def test_an_interrupted_feature_extraction_resumes_at_its_last_finished_batch(tmp_path, monkeypatch):
    from blockpilot.training import features

    target, drafter = _tiny(tmp_path)
    sequences, layers = _sequences(), drafter.config.target_layer_ids
    expected = features.extract_taps(target, sequences, layers, tokens_per_batch=64)
    batches = len(features._length_groups([len(s.ids) for s in sequences], 64))
    real, calls = target.forward, []

    def dies_after_two_batches(*args, **kwargs):
        calls.append(1)
        if len(calls) > 2:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(target, "forward", dies_after_two_batches)
    with pytest.raises(KeyboardInterrupt):
        features.cached_taps(tmp_path / "cache", target, sequences, layers, "k", tokens_per_batch=64)
    assert features.load_cached_taps(tmp_path / "cache", "k") is None  # incomplete: not usable yet
    calls.clear()
    monkeypatch.setattr(target, "forward", lambda *a, **k: (calls.append(1), real(*a, **k))[1])
    resumed, _ = features.cached_taps(tmp_path / "cache", target, sequences, layers, "k", tokens_per_batch=64)
    assert len(calls) == batches - 2
    assert all(torch.equal(a, b) for a, b in zip(expected, resumed))


def test_features_can_be_kept_on_another_device_than_the_target_batch_by_batch(tmp_path):
    from blockpilot.training.features import extract_features, feature_bytes

    target, drafter = _tiny(tmp_path)
    sequences, layers = _sequences(), drafter.config.target_layer_ids
    taps, soft = extract_features(target, sequences, layers, top_k=3, tokens_per_batch=64)
    moved, moved_soft = extract_features(target, sequences, layers, top_k=3, tokens_per_batch=64,
                                         out_device=torch.device("meta"))
    for want, got, want_soft, got_soft in zip(taps, moved, soft, moved_soft):
        assert got.device.type == "meta" and got.shape == want.shape and got.dtype == want.dtype
        assert got_soft.ids.device.type == "meta" and got_soft.logprobs.shape == want_soft.logprobs.shape
    width = taps[0].shape[1]
    assert feature_bytes(sequences, width, 3) == sum(t.numel() * 2 + s.ids.numel() * 8 for t, s in zip(taps, soft))


def test_a_gpu_run_keeps_features_in_host_memory_when_they_would_take_over_half_its_free_memory():
    from blockpilot.errors import UserError
    from blockpilot.training.pipeline import features_device

    gb = 10**9
    assert features_device(30 * gb, 70 * gb, 120 * gb, "cuda:0") == torch.device("cuda:0")
    assert features_device(40 * gb, 70 * gb, 120 * gb, "cuda:0") == torch.device("cpu")  # an H100 with all the data
    assert features_device(40 * gb, None, None, "cuda") == torch.device("cuda")  # free memory unknown: as before
    assert features_device(40 * gb, 70 * gb, None, "cuda") == torch.device("cpu")
    with pytest.raises(UserError, match="train on fewer answers"):
        features_device(120 * gb, 70 * gb, 120 * gb, "cuda")
