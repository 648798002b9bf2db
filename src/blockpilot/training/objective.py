"""The DFlash training objective: many anchored blocks per sequence in one pass.

For a sequence with cached target taps, `A` anchor positions are drawn inside the answer. Block `a`
is `[token at anchor, MASK x (B - 1)]` at positions `anchor .. anchor + B - 1`; its queries see the
context strictly before the anchor (`key < anchor`) and their whole block, bidirectionally; other
blocks are invisible. Slot `k` (1..B-1) predicts the token at `anchor + k` (same position, not
shifted), weighted by `exp(-(k - 1) / gamma)`; slot 0 has no loss. This mirrors inference exactly:
there the block starts at the first uncommitted position and the context ends just before it.

Shapes: `N` sequences, `L` padded length, `A` anchors per sequence, `B` block size, `H` hidden.
"""

from __future__ import annotations

import dataclasses
import math

import torch
import torch.nn.functional as F

from blockpilot.models.dflash import DFlashDrafter


@dataclasses.dataclass
class Batch:
    ids: torch.Tensor  # (N, L) int64, right-padded
    taps: torch.Tensor  # (N, L, tH) target taps (any float dtype)
    lengths: torch.Tensor  # (N,) true lengths
    anchors: torch.Tensor  # (N, A) anchor positions
    anchor_valid: torch.Tensor  # (N, A) bool: False for padding anchors

    def to(self, device) -> "Batch":
        return Batch(*(getattr(self, f.name).to(device, non_blocking=True) for f in dataclasses.fields(self)))


def default_gamma(block_size: int) -> float:
    """Loss-decay constant of the public recipe: 7 for B = 16, 5 for 10, 4 for 8."""
    return 7.0 if block_size >= 16 else 5.0 if block_size >= 10 else 4.0


def sample_anchors(answer_start: int, length: int, count: int, generator: torch.Generator) -> torch.Tensor:
    """Up to `count` distinct anchors uniformly in `[answer_start, length - 2]` (sorted)."""
    span = length - 1 - answer_start
    if span <= 0:
        return torch.zeros(0, dtype=torch.long)
    pick = torch.randperm(span, generator=generator)[:count]
    return (pick + answer_start).sort().values


def block_forward(drafter: DFlashDrafter, embed_weight: torch.Tensor, batch: Batch,
                  block_size: int | None = None) -> torch.Tensor:
    """Drafter hidden states `(N * A, B, H)` of every anchored block, after the final norm.

    `block_size` defaults to the drafter's training block size."""
    n, a = batch.anchors.shape
    bsz = block_size or drafter.config.block_size
    seq_len, dev = batch.ids.shape[1], batch.ids.device
    offsets = torch.arange(bsz, device=dev)
    block_pos = (batch.anchors[..., None] + offsets).reshape(n * a, bsz)  # (NA, B)
    first = batch.ids.gather(1, batch.anchors).reshape(n * a, 1)  # (NA, 1)
    mask_id = drafter.config.mask_token_id
    x = drafter.block_embeddings(F.embedding(first, embed_weight), embed_weight[mask_id], bsz)

    context = drafter.hidden_norm(drafter.fc(batch.taps.to(x.dtype)))  # (N, L, H)
    ctx_rope = drafter.rope(torch.arange(seq_len, device=dev), x.dtype)
    cos, sin = drafter.rope(block_pos.clamp(max=drafter.rope.cos.shape[0] - 1), x.dtype)
    block_rope = (cos[:, None], sin[:, None])  # (NA, 1, B, hd): per-block positions
    ctx_visible = torch.arange(seq_len, device=dev)[None, :] < batch.anchors.reshape(n * a, 1)  # (NA, L)
    mask = torch.cat((ctx_visible, torch.ones(n * a, bsz, dtype=torch.bool, device=dev)), dim=1)
    mask = mask[:, None, None, :].expand(n * a, 1, bsz, seq_len + bsz)
    for layer in drafter.layers:
        k_ctx, v_ctx = layer.context_kv(context, ctx_rope)  # (N, nkv, L, hd)
        x = layer(x, k_ctx.repeat_interleave(a, 0), v_ctx.repeat_interleave(a, 0), block_rope, mask)
    return drafter.norm(x)


def block_labels(batch: Batch, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Targets `(N * A, B - 1)` (token at anchor + k) and a validity mask of the same shape."""
    n, a = batch.anchors.shape
    pos = batch.anchors[..., None] + torch.arange(1, block_size, device=batch.anchors.device)  # (N, A, B-1)
    valid = (pos < batch.lengths[:, None, None]) & batch.anchor_valid[..., None]
    labels = batch.ids.gather(1, pos.clamp(max=batch.ids.shape[1] - 1).reshape(n, -1)).reshape(n, a, -1)
    return labels.reshape(n * a, -1), valid.reshape(n * a, -1)


def drafter_loss(drafter: DFlashDrafter, embed_weight: torch.Tensor, lm_head_weight: torch.Tensor,
                 batch: Batch, gamma: float) -> tuple[torch.Tensor, dict]:
    """Weighted cross-entropy over slots 1..B-1 and per-slot accuracy statistics.

    `embed_weight` and `lm_head_weight` are the target's, frozen (no gradient is taken for them).
    """
    bsz = drafter.config.block_size
    hidden = block_forward(drafter, embed_weight.detach(), batch)[:, 1:]  # (NA, B-1, H)
    labels, valid = block_labels(batch, bsz)
    logits = F.linear(hidden, lm_head_weight.detach())  # (NA, B-1, V)
    ce = F.cross_entropy(logits.float().flatten(0, 1), labels.flatten(), reduction="none").view_as(labels)
    slot_weight = torch.exp(-torch.arange(bsz - 1, dtype=torch.float32, device=ce.device) / gamma)  # exp(-(k-1)/g)
    w = slot_weight[None, :] * valid
    loss = (ce * w).sum() / w.sum().clamp(min=1e-6)
    with torch.no_grad():
        correct = (logits.argmax(-1) == labels) & valid
    return loss, {"correct": correct, "valid": valid}


def simulated_tau(correct: torch.Tensor, valid: torch.Tensor) -> float:
    """Mean of 1 + leading correct slots per block (blocks with a full valid window only)."""
    full = valid.all(dim=1)
    if not bool(full.any()):
        return math.nan
    leading = correct[full].long().cumprod(dim=1).sum(dim=1)
    return float((1 + leading).float().mean())
