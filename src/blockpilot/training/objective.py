"""The DFlash training objective: many anchored blocks per sequence in one pass.

For a sequence with cached target taps, `A` anchor positions are drawn inside the answer. Block `a`
is `[token at anchor, MASK x (B - 1)]` at positions `anchor .. anchor + B - 1`; its queries see the
context strictly before the anchor (`key < anchor`) and their whole block, bidirectionally; other
blocks are invisible. Slot `k` (1..B-1) predicts the token at `anchor + k` (same position, not
shifted), weighted by `exp(-(k - 1) / gamma)`; slot 0 has no loss. This mirrors inference exactly:
there the block starts at the first uncommitted position and the context ends just before it.

The loss ranges over the drafter's draft vocabulary when it has one (`draft_vocab_ids`, the only
ids it can ever draft): logits are those `N_v` rows of the target's `lm_head` and each label is
remapped to its row. A slot whose label lies outside the draft vocabulary has weight 0 (it is
dropped from the loss and its normaliser; its draft is counted wrong, as at inference, where that
token can never be drafted). Logits exist only for slots of positive weight, and the cross-entropy
and its gradient are computed chunk by chunk without keeping a `(slots, N_v)` tensor for backward.

Distillation (`distill > 0`): the target of slot `k` becomes `(1 - distill) * onehot(label) + distill * p`,
where `p` is the target's own next-token distribution at the label's position (its `K` most likely ids,
cached with the taps, tempered by `distill_temperature` and renormalised over those inside the draft
vocabulary): a drafter trained towards `p` proposes drafts that rejection sampling at T > 0 accepts more
often (a slot survives with probability `sum min(p, q)`), while the hard term keeps the greedy draft.

Shapes: `N` sequences, `L` padded length, `A` anchors per sequence, `B` block size, `H` hidden,
`V` target vocabulary, `N_v` draft vocabulary (V without one).
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
    soft_ids: torch.Tensor | None = None  # (N, L, K) int64: the target's most likely next tokens at each position
    soft_logprobs: torch.Tensor | None = None  # (N, L, K) their log-probabilities (T = 1)

    def to(self, device) -> "Batch":
        return Batch(*(None if (v := getattr(self, f.name)) is None else v.to(device, non_blocking=True)
                       for f in dataclasses.fields(self)))


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

    The `A` blocks of a sequence run as one row of `A * B` queries over that sequence's context K/V
    (computed once, not once per block) and all block keys, with a mask that shows each block only
    its own keys and the context before its anchor. `block_size` defaults to the training block size."""
    n, a = batch.anchors.shape
    bsz = block_size or drafter.config.block_size
    dev = batch.ids.device
    block_pos = (batch.anchors[..., None] + torch.arange(bsz, device=dev)).reshape(n, a * bsz)  # (N, AB)
    first = batch.ids.gather(1, batch.anchors).reshape(n * a, 1)  # (NA, 1)
    x = drafter.block_embeddings(F.embedding(first, embed_weight), embed_weight[drafter.config.mask_token_id], bsz)
    x = x.reshape(n, a * bsz, -1)  # (N, AB, H)
    context = _context(drafter, batch)  # (N, L, H)
    ctx_rope = drafter.rope(torch.arange(batch.ids.shape[1], device=dev), x.dtype)  # (L, hd) each
    cos, sin = drafter.rope(block_pos.clamp(max=drafter.rope.cos.shape[0] - 1), x.dtype)  # (N, AB, hd)
    block_rope = (cos[:, None], sin[:, None])  # (N, 1, AB, hd): broadcast over heads
    mask = block_sparse_mask(batch.anchors, batch.ids.shape[1], bsz)  # (N, 1, AB, L + AB)
    for layer in drafter.layers:
        k_ctx, v_ctx = layer.context_kv(context, ctx_rope)  # (N, nkv, L, hd)
        x = layer(x, k_ctx, v_ctx, block_rope, mask)
    return drafter.norm(x).reshape(n * a, bsz, -1)


def _context(drafter: DFlashDrafter, batch: Batch) -> torch.Tensor:
    """`(N, L, H)` projected context; `fc` runs on the real positions only (padding stays zero)."""
    n, seq_len = batch.ids.shape
    real = torch.arange(seq_len, device=batch.ids.device)[None, :] < batch.lengths[:, None]  # (N, L)
    taps = batch.taps[real]  # (sum L_i, tH)
    if not torch.is_autocast_enabled(taps.device.type):  # autocast multiplies bf16 taps as they are
        taps = taps.to(drafter.fc.weight.dtype)
    projected = drafter.hidden_norm(drafter.fc(taps))  # (sum L_i, H)
    return projected.new_zeros(n, seq_len, projected.shape[-1]).masked_scatter(real[..., None], projected)


def block_sparse_mask(anchors: torch.Tensor, seq_len: int, block_size: int) -> torch.Tensor:
    """`(N, 1, A * B, L + A * B)` bool, True = visible: block `a`'s queries see context keys at
    positions `< anchors[:, a]` and the `B` keys of block `a` (bidirectionally), nothing else."""
    n, a = anchors.shape
    dev = anchors.device
    ctx = torch.arange(seq_len, device=dev)[None, None, :] < anchors[..., None]  # (N, A, L)
    ctx = ctx.repeat_interleave(block_size, dim=1)  # (N, AB, L)
    block_of = torch.arange(a * block_size, device=dev) // block_size  # (AB,)
    own = (block_of[:, None] == block_of[None, :]).expand(n, -1, -1)  # (N, AB, AB)
    return torch.cat((ctx, own), dim=2)[:, None]


def block_labels(batch: Batch, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Targets `(N * A, B - 1)` (token at anchor + k) and a validity mask of the same shape."""
    n, a = batch.anchors.shape
    pos = batch.anchors[..., None] + torch.arange(1, block_size, device=batch.anchors.device)  # (N, A, B-1)
    valid = (pos < batch.lengths[:, None, None]) & batch.anchor_valid[..., None]
    labels = batch.ids.gather(1, pos.clamp(max=batch.ids.shape[1] - 1).reshape(n, -1)).reshape(n, a, -1)
    return labels.reshape(n * a, -1), valid.reshape(n * a, -1)


def block_soft_labels(batch: Batch, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The target's distribution for the label of every slot: ids and log-probabilities `(N * A, B - 1, K)`
    (slot `k` of a block predicts the token at `anchor + k`, which the target predicted at `anchor + k - 1`)."""
    n, a = batch.anchors.shape
    pos = batch.anchors[..., None] + torch.arange(block_size - 1, device=batch.anchors.device)  # (N, A, B-1)
    pos = pos.clamp(max=batch.ids.shape[1] - 1).reshape(n, -1, 1)
    k = batch.soft_ids.shape[-1]
    ids = batch.soft_ids.gather(1, pos.expand(-1, -1, k)).reshape(n * a, block_size - 1, k)
    logprobs = batch.soft_logprobs.gather(1, pos.expand(-1, -1, k)).reshape(n * a, block_size - 1, k)
    return ids.long(), logprobs.float()


@dataclasses.dataclass(frozen=True)
class DraftHead:
    """The frozen rows of the target's `lm_head` that the loss and the drafts range over."""

    weight: torch.Tensor  # (N_v, H), no gradient, in the dtype the loss multiplies in
    vocab_ids: torch.Tensor | None  # (N_v,) target id of each row; None: the rows are all V ids
    row_of: torch.Tensor | None  # (V,) row of each target id, -1 outside the draft vocabulary

    @classmethod
    def of(cls, drafter: DFlashDrafter, lm_head_weight: torch.Tensor, dtype: torch.dtype | None = None) -> "DraftHead":
        """The drafter's draft-vocabulary rows of `lm_head_weight` `(V, H)` (all rows without one),
        cast once to `dtype` (bf16 for autocast training; default: the weight's own)."""
        weight = drafter.draft_head_weight(lm_head_weight).detach().to(dtype or lm_head_weight.dtype).contiguous()
        ids = drafter.draft_vocab_ids
        if ids is None:
            return cls(weight, None, None)
        row_of = torch.full((lm_head_weight.shape[0],), -1, dtype=torch.long, device=ids.device)
        row_of[ids] = torch.arange(len(ids), device=ids.device)
        return cls(weight, ids, row_of)

    def rows(self, labels: torch.Tensor) -> torch.Tensor:
        """Row of each target id in `labels` (any shape), -1 for ids outside the draft vocabulary."""
        return labels if self.row_of is None else self.row_of[labels]


LOSS_CHUNK_ROWS = 512
"""Slots per chunk of the fused lm_head + cross-entropy (a `(512, N_v)` fp32 block at a time)."""


class _ChunkedHeadCrossEntropy(torch.autograd.Function):
    """`sum_i w_i * CE(hidden_i @ weight.T, t_i)` for sparse target distributions `t_i` (probabilities
    `probs_i` on rows `targets_i`), the argmax rows and the softmax at the target rows, chunk by chunk.

    The gradient w.r.t. `hidden` is computed in the same pass (`(softmax - t) * w @ weight`), so no
    logits are kept for backward; `weight` is frozen and gets no gradient."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, probs, weights, chunk_rows):  # (M, H), (N_v, H), (M, J), (M, J), (M,)
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        best = torch.empty(hidden.shape[0], dtype=torch.long, device=hidden.device)
        q_at = torch.empty(targets.shape, dtype=torch.float32, device=hidden.device)
        need_grad = ctx.needs_input_grad[0]
        grad = torch.empty_like(hidden) if need_grad else None
        rows = min(chunk_rows, hidden.shape[0])  # one set of buffers for every chunk: no page faults
        products = torch.empty(rows, weight.shape[0], dtype=weight.dtype, device=hidden.device)
        buffer = torch.empty(rows, weight.shape[0], dtype=torch.float32, device=hidden.device)
        for s in range(0, hidden.shape[0], chunk_rows):
            h, t, p, w = (x[s:s + chunk_rows] for x in (hidden, targets, probs, weights))
            c = h.shape[0]
            torch.mm(h.to(weight.dtype), weight.T, out=products[:c])
            logits = buffer[:c].copy_(products[:c])  # (c, N_v) fp32
            top, best[s:s + chunk_rows] = logits.max(dim=-1)  # (c,) each
            picked = logits.gather(1, t) - top[:, None]  # (c, J) target logits - max
            exps = logits.sub_(top[:, None]).exp_()  # in place: exp(logit - max)
            sums = exps.sum(dim=-1)  # (c,)
            total += ((sums.log() - (picked * p).sum(dim=1)) * w).sum()
            q_at[s:s + chunk_rows] = picked.exp() / sums[:, None]
            if need_grad:
                exps.mul_((w / sums)[:, None])  # w * softmax
                exps.scatter_add_(1, t, -(w[:, None] * p))
                grad[s:s + chunk_rows] = (products[:c].copy_(exps) @ weight).to(grad.dtype)
        ctx.mark_non_differentiable(best, q_at)
        if need_grad:
            ctx.save_for_backward(grad)
        return total, best, q_at

    @staticmethod
    def backward(ctx, grad_total, _grad_best, _grad_q):
        (grad,) = ctx.saved_tensors
        return grad * grad_total.to(grad.dtype), None, None, None, None, None


def drafter_loss(drafter: DFlashDrafter, embed_weight: torch.Tensor, head: DraftHead, batches: Batch | list[Batch],
                 gamma: float, chunk_rows: int = LOSS_CHUNK_ROWS, distill: float = 0.0,
                 distill_temperature: float = 1.0) -> tuple[torch.Tensor, dict]:
    """Weighted cross-entropy over slots 1..B-1 (draft vocabulary only) and per-slot accuracy.

    `batches`: one batch, or several (sequences grouped by length, each padded only to its own
    longest) whose blocks form one loss. `embed_weight` and `head` are the target's, frozen (no
    gradient is taken for them). Returns the loss (weighted mean over slots of positive weight) and
    `{"correct", "valid"}` `(NA, B-1)` bool over all blocks, `correct` meaning the greedy draft
    (argmax over `head`'s rows) equals the label. When the batches carry the target's soft labels, also
    `"accept"` `(NA, B-1)`: `sum min(p, q)` over the cached ids at T = 1, the probability that rejection
    sampling keeps a draft drawn from the drafter's `q` (a lower bound: mass beyond the `K` ids is left
    out). `distill` in [0, 1] mixes the target's tempered distribution into every slot's target
    (it needs soft labels).
    """
    bsz = drafter.config.block_size
    batches = [batches] if isinstance(batches, Batch) else batches
    hidden = torch.cat([block_forward(drafter, embed_weight.detach(), b)[:, 1:] for b in batches])  # (NA, B-1, H)
    labels, valid = (torch.cat(parts) for parts in zip(*(block_labels(b, bsz) for b in batches)))
    rows = head.rows(labels)  # (NA, B-1), -1 outside the draft vocabulary
    slot_weight = torch.exp(-torch.arange(bsz - 1, dtype=torch.float32, device=labels.device) / gamma)  # exp(-(k-1)/g)
    weight = slot_weight[None, :] * (valid & (rows >= 0))  # (NA, B-1)
    picked = (weight > 0).flatten()
    cols = rows.clamp(min=0)[..., None]  # (NA, B-1, 1)
    probs = torch.ones(cols.shape, dtype=torch.float32, device=cols.device)
    soft = all(b.soft_ids is not None for b in batches)
    if distill and not soft:
        raise ValueError("distillation needs the target's soft labels in every batch")
    if soft:
        ids, logprobs = (torch.cat(parts) for parts in zip(*(block_soft_labels(b, bsz) for b in batches)))
        soft_rows = head.rows(ids)  # (NA, B-1, K)
        inside = soft_rows >= 0
        target_p = logprobs.exp() * inside  # T = 1, for the acceptance estimate
        cols = torch.cat((cols, soft_rows.clamp(min=0)), dim=-1)
        if distill:  # p tempered and renormalised inside the draft vocabulary; with no soft id inside, the label
            tempered = (logprobs / distill_temperature).masked_fill(~inside, -math.inf).softmax(-1).nan_to_num(0.0)
            label_share = (1.0 - distill) + distill * (1.0 - tempered.sum(-1, keepdim=True))  # takes its share
            probs = torch.cat((label_share, distill * tempered), -1)
        else:  # the soft columns only feed the acceptance estimate
            probs = torch.cat((probs, torch.zeros_like(target_p)), -1)
    total, best, q_at = _ChunkedHeadCrossEntropy.apply(hidden.flatten(0, 1)[picked], head.weight,
                                                       cols.flatten(0, 1)[picked], probs.flatten(0, 1)[picked],
                                                       weight.flatten()[picked], chunk_rows)
    loss = total / weight.sum().clamp(min=1e-6)
    correct = torch.zeros_like(picked)
    correct[picked] = best == rows.flatten()[picked]
    stats = {"correct": correct.view_as(valid), "valid": valid}
    if soft:
        accept = torch.zeros(picked.shape, dtype=torch.float32, device=picked.device)
        accept[picked] = torch.minimum(target_p.flatten(0, 1)[picked], q_at[:, 1:]).sum(dim=1)
        stats["accept"] = accept.view_as(valid)
    return loss, stats


def simulated_tau(correct: torch.Tensor, valid: torch.Tensor) -> float:
    """Mean of 1 + leading correct slots per block (blocks with a full valid window only); `correct` may
    also be per-slot acceptance probabilities, giving the expected `1 + sum_k prod_{j<=k} a_j`."""
    full = valid.all(dim=1)
    if not bool(full.any()):
        return math.nan
    leading = correct[full].double().cumprod(dim=1).sum(dim=1)
    return float((1 + leading).mean())
