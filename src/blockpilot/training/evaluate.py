"""Greedy acceptance length of a drafter by exact replay of the decode loop.

At temperature 0 speculative decoding commits exactly the target's greedy continuation `y`, so
the acceptance length at any block size can be replayed without target verify passes: one
teacher-forced target pass over prompt + `y` gives every position's taps; then, step by step,
the drafter proposes a block at the current position from the context committed so far, the step
accepts the leading drafts that equal `y`, and the next block starts after the bonus token.
This is the runtime's loop with the verify pass replaced by the known answer, so it measures the
same tau (up to floating-point differences between one long pass and per-block passes). Drafts are
the runtime's: argmax over the drafter's draft vocabulary when it has one.
"""

from __future__ import annotations

import dataclasses

import torch

from blockpilot.models.decoder import Decoder, KVCache
from blockpilot.models.dflash import DFlashDrafter, draft_logits, greedy_draft_tokens, logits_draft_tokens
from blockpilot.runtime.lookup import PromptLookup
from blockpilot.training.objective import Batch, block_forward, block_labels, simulated_tau


@torch.inference_mode()
def sequence_taps(target: Decoder, ids: list[int], tap_layers) -> torch.Tensor:
    """`(1, L, tH)` taps of one teacher-forced pass over `ids`."""
    n = len(ids)
    cache = KVCache.allocate(target.config, 1, n, torch.float32)
    return target(target.embed_tokens(torch.tensor([ids])), torch.arange(n), cache, n, tuple(tap_layers)).taps


@dataclasses.dataclass(frozen=True)
class SampledReplay:
    """What replaying drafts *drawn* from the drafter (rejection sampling, `runtime.sampling`) needs at T > 0.

    Given the committed token `y_i` (one draw of the target's continuation), rejection sampling accepted
    the slot that proposed it with probability `min(p_i(y_i), q(y_i)) / p_i(y_i)`: accepted drafts commit
    `y_i` with probability `min(p, q)(y_i)`, residual draws with `p(y_i) - min(p, q)(y_i)`. Replaying that
    conditional acceptance slot by slot over `y` gives every step's acceptance length with exactly the
    distribution decoding gives it."""

    temperature: float
    token_probs: torch.Tensor  # (len(ids),) float64: p_i(ids[i]) under the target's sampling (prompt entries unused)
    uniform: torch.Tensor  # (len(ids),) float64 in [0, 1): one draw per position, shared by every block size


@dataclasses.dataclass
class ReplayRun:
    """One block size's replay: `ids[pos]` is committed and is the next block's first token; `steps` the
    tokens each step committed, `drafted` how many steps called the drafter (the others copied their
    draft by lookup), `lookup` the run's n-gram index (None: drafter only)."""

    size: int
    pos: int
    steps: list[int] = dataclasses.field(default_factory=list)
    drafted: int = 0
    lookup: PromptLookup | None = None


def replay_block_sizes(target: Decoder, drafter: DFlashDrafter, ids: list[int], prompt_len: int,
                       block_sizes, taps: torch.Tensor, stop_at: int | None = None,
                       sampled: SampledReplay | None = None) -> list[list[int]]:
    """Tokens committed per step, for each block size, when greedily decoding `ids[prompt_len:]` with the
    drafter's blocks only (`replay_runs` without lookup)."""
    return [run.steps for run in replay_runs(target, drafter, ids, prompt_len, block_sizes, taps, stop_at, sampled)]


@torch.inference_mode()
def replay_runs(target: Decoder, drafter: DFlashDrafter, ids: list[int], prompt_len: int,
                block_sizes, taps: torch.Tensor, stop_at: int | None = None,
                sampled: SampledReplay | None = None, lookup: bool = False) -> list[ReplayRun]:
    """The decode loop's steps, for each block size, when decoding `ids[prompt_len:]`.

    The block sizes run in lockstep: each round is one drafter pass over the blocks of every size
    still running (a block sees the context before its first position and itself, as in decoding)
    and one `lm_head` call. Context K/V are position-wise, so they are computed once for the whole
    sequence. `stop_at`: stop after the step that commits `ids[stop_at]` (default: the last id), as
    the runtime stops at its token budget or end id; every step sees its whole block when
    `len(ids) >= stop_at + block_size - 1`. `taps`: `(1, >= stop_at, tH)` target taps of `ids`.
    `sampled`: replay drafts drawn from the drafter at T > 0 (`SampledReplay`); default: greedy drafts,
    accepted while they equal `ids` (exact at T = 0, and at T > 0 for "sample, then match").
    `lookup`: as the runtime with lookup drafts (`runtime.lookup`): a step whose context's last tokens
    occurred before copies its draft (accepted while it equals `ids`: "sample, then match") and makes no
    drafter call, except a request's first step, which calls the drafter in any case.
    """
    y = torch.tensor(ids)
    end = len(ids) - 1 if stop_at is None else min(stop_at, len(ids) - 1)
    embed = target.embed_tokens.weight
    mask_embed = embed[drafter.config.mask_token_id]
    head = drafter.draft_head_weight(target.lm_head.weight)  # (N, H)
    runs = [ReplayRun(size, prompt_len, lookup=PromptLookup(ids[:prompt_len + 1]) if lookup else None)
            for size in block_sizes]
    if end <= prompt_len:
        return runs
    context = drafter.hidden_norm(drafter.fc(taps[:, :end].to(embed.dtype)))  # (1, S, H): positions < end
    ctx_rope = drafter.rope(torch.arange(end), embed.dtype)
    context_kv = [layer.context_kv(context, ctx_rope) for layer in drafter.layers]
    while running := [r for r in runs if r.pos < end]:
        active = []  # the runs whose step drafts with the drafter
        for r in running:
            copy = r.lookup.propose(r.size - 1) if r.lookup is not None else None
            if copy is None:
                active.append(r)
                continue
            truth = y[r.pos + 1: r.pos + r.size]
            ok = torch.tensor(copy[:len(truth)]) == truth
            r.drafted += not r.steps  # a first step calls the drafter anyway
            _advance(r, min(int(ok.long().cumprod(0).sum()), len(ids) - 1 - r.pos), ids)
        if not active:
            continue
        sizes = torch.tensor([r.size for r in active])
        starts = torch.tensor([r.pos for r in active])
        x = torch.cat([drafter.block_embeddings(embed[y[r.pos]].reshape(1, 1, -1), mask_embed, r.size)
                       for r in active], dim=1)  # (1, T, H)
        block_of = torch.repeat_interleave(torch.arange(len(active)), sizes)  # (T,) block of each query row
        offsets = torch.arange(len(block_of)) - (sizes.cumsum(0) - sizes)[block_of]  # (T,) slot within its block
        positions = starts[block_of] + offsets
        mask = torch.cat((torch.arange(end)[None, :] < starts[block_of][:, None],  # context before the block
                          block_of[:, None] == block_of[None, :]), dim=1)[None, None]  # (1, 1, T, S + T)
        block_rope = drafter.rope(positions, embed.dtype)
        for layer, (k_ctx, v_ctx) in zip(drafter.layers, context_kv):
            x = layer(x, k_ctx, v_ctx, block_rope, mask)
        hidden = drafter.norm(x)[0, offsets > 0]  # (sum(size - 1), H): the mask slots
        if sampled is None:
            drafts = greedy_draft_tokens(hidden, head, drafter.draft_vocab_ids).split((sizes - 1).tolist())
        else:
            q = torch.softmax(draft_logits(hidden, head).double() / sampled.temperature, -1)  # (sum(size - 1), N)
            drafts = q.split((sizes - 1).tolist())
        for r, draft in zip(active, drafts):
            truth = y[r.pos + 1: r.pos + r.size]
            if sampled is None:
                ok = draft[:len(truth)] == truth
            else:  # accepted with probability min(p, q) / p of the committed token
                q_y = _column_probs(draft[:len(truth)], truth, drafter.draft_vocab_ids)
                p_y = sampled.token_probs[r.pos + 1: r.pos + 1 + len(truth)]
                ok = sampled.uniform[r.pos + 1: r.pos + 1 + len(truth)] * p_y < torch.minimum(p_y, q_y)
            r.drafted += 1
            _advance(r, min(int(ok.long().cumprod(0).sum()), len(ids) - 1 - r.pos), ids)
    return runs


def _advance(run: ReplayRun, accepted: int, ids: list[int]) -> None:
    """Commit a step of `run` that accepted `accepted` drafts (and the bonus token)."""
    run.steps.append(accepted + 1)
    if run.lookup is not None:
        run.lookup.extend(ids[run.pos + 1: run.pos + accepted + 2])
    run.pos += accepted + 1


def _column_probs(q: torch.Tensor, tokens: torch.Tensor, vocab_ids: torch.Tensor | None) -> torch.Tensor:
    """`q[j, column of tokens[j]]` `(len(tokens),)`; 0 for a token outside the draft vocabulary."""
    if vocab_ids is None:
        return q.gather(1, tokens[:, None])[:, 0]
    column = torch.searchsorted(vocab_ids, tokens).clamp(max=len(vocab_ids) - 1)  # the ids are sorted
    return torch.where(vocab_ids[column] == tokens, q.gather(1, column[:, None])[:, 0], 0.0)


def replay_accept_lengths(target: Decoder, drafter: DFlashDrafter, ids: list[int], prompt_len: int,
                          block_size: int, taps: torch.Tensor | None = None,
                          stop_at: int | None = None) -> list[int]:
    """Tokens committed per step when greedily decoding `ids[prompt_len:]` at `block_size`."""
    taps = sequence_taps(target, ids, drafter.config.target_layer_ids) if taps is None else taps
    return replay_block_sizes(target, drafter, ids, prompt_len, [block_size], taps, stop_at)[0]


def mean_tau(per_prompt_steps: list[list[int]]) -> float:
    """tau averaged per prompt, then over prompts (DFlash's convention)."""
    taus = [sum(s) / len(s) for s in per_prompt_steps if s]
    return sum(taus) / len(taus) if taus else float("nan")


@torch.inference_mode()
def anchored_tau(target: Decoder, drafter: DFlashDrafter, ids: list[int], prompt_len: int, block_size: int,
                 taps: torch.Tensor, stride: int = 1) -> float:
    """Simulated greedy tau: a block anchored at every `stride`-th answer position, in one batched pass.

    Each block's acceptance is 1 + its leading correct drafts (blocks whose whole window lies inside
    the answer). It averages over all start positions, where decoding visits only the step starts;
    `replay_accept_lengths` gives the exact trajectory and costs one drafter pass per step."""
    anchors = torch.arange(prompt_len, len(ids) - block_size + 1, stride)
    if len(anchors) == 0:
        return float("nan")
    correct, valid = anchored_correct(target, drafter, ids, anchors, block_size, taps)
    return simulated_tau(correct, valid)


@torch.inference_mode()
def anchored_correct(target: Decoder, drafter: DFlashDrafter, ids: list[int], anchors: torch.Tensor, block_size: int,
                     taps: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Which greedy drafts are right `(A, block_size - 1)` for a block anchored at each of `anchors` (`ids[a]` is
    the block's first token), and which slots lie inside `ids`, in one batched drafter pass."""
    correct, valid, _ = anchored_drafts(target, drafter, ids, anchors, block_size, taps)
    return correct, valid


@torch.inference_mode()
def anchored_drafts(target: Decoder, drafter: DFlashDrafter, ids: list[int], anchors: torch.Tensor, block_size: int,
                    taps: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`anchored_correct`'s two tensors and the drafter's top probability at every slot `(A, block_size - 1)`
    (`runtime.policy.top_probability`: what adaptive verify lengths read)."""
    from blockpilot.runtime.policy import top_probability

    batch = Batch(torch.tensor([ids]), taps, torch.tensor([len(ids)]), anchors[None],
                  torch.ones(1, len(anchors), dtype=torch.bool))
    hidden = block_forward(drafter, target.embed_tokens.weight, batch, block_size)[:, 1:]
    labels, valid = block_labels(batch, block_size)
    logits = draft_logits(hidden, drafter.draft_head_weight(target.lm_head.weight))
    drafts = logits_draft_tokens(logits, drafter.draft_vocab_ids)
    return (drafts == labels) & valid, valid, top_probability(logits)
