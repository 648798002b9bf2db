"""Greedy acceptance length of a drafter by exact replay of the decode loop.

At temperature 0 speculative decoding commits exactly the target's greedy continuation `y`, so
the acceptance length at any block size can be replayed without target verify passes: one
teacher-forced target pass over prompt + `y` gives every position's taps; then, step by step,
the drafter proposes a block at the current position from the context committed so far, the step
accepts the leading drafts that equal `y`, and the next block starts after the bonus token.
This is the runtime's loop with the verify pass replaced by the known answer, so it measures the
same tau (up to floating-point differences between one long pass and per-block passes).
"""

from __future__ import annotations

import torch

from blockpilot.models.decoder import Decoder, KVCache
from blockpilot.models.dflash import DFlashDrafter


@torch.inference_mode()
def sequence_taps(target: Decoder, ids: list[int], tap_layers) -> torch.Tensor:
    """`(1, L, tH)` taps of one teacher-forced pass over `ids`."""
    n = len(ids)
    cache = KVCache.allocate(target.config, 1, n, torch.float32)
    return target(target.embed_tokens(torch.tensor([ids])), torch.arange(n), cache, n, tuple(tap_layers)).taps


@torch.inference_mode()
def replay_accept_lengths(target: Decoder, drafter: DFlashDrafter, ids: list[int], prompt_len: int,
                          block_size: int, taps: torch.Tensor | None = None) -> list[int]:
    """Tokens committed per step when greedily decoding `ids[prompt_len:]` at `block_size`."""
    taps = sequence_taps(target, ids, drafter.config.target_layer_ids) if taps is None else taps
    y = torch.tensor(ids)
    n = len(ids)
    cache = KVCache.allocate(drafter.config.layers, 1, n + block_size, torch.float32)
    mask_embed = target.embed_tokens.weight[drafter.config.mask_token_id]
    pos, ctx_start, steps = prompt_len, 0, []  # y[pos] is committed; the block starts there
    while pos < n - 1:
        block = drafter.block_embeddings(target.embed_tokens(y[pos:pos + 1])[None], mask_embed, block_size)
        hidden = drafter(block, torch.arange(pos, pos + block_size), taps[:, ctx_start:pos],
                         torch.arange(ctx_start, pos), cache, pos)
        draft = target.lm_head(hidden[0, 1:]).argmax(-1)  # (B - 1,)
        truth = y[pos + 1: pos + block_size]
        matched = int((draft[: len(truth)] == truth).long().cumprod(0).sum())
        accepted = min(matched, n - 1 - pos)
        steps.append(accepted + 1)
        ctx_start = pos
        pos += accepted + 1
    return steps


def mean_tau(per_prompt_steps: list[list[int]]) -> float:
    """tau averaged per prompt, then over prompts (DFlash's convention)."""
    taus = [sum(s) / len(s) for s in per_prompt_steps if s]
    return sum(taus) / len(taus) if taus else float("nan")
