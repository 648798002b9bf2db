"""The DFlash block-diffusion drafter (z-lab checkpoint layout), on the decoder's layer code.

The drafter has no embedding and no LM head: its inputs are the target's token embeddings of
`[last committed token, MASK x (B - 1)]` and its outputs go through the target's `lm_head`.
Context comes from the target's tapped hidden states, projected by `fc` + `hidden_norm`; every
layer turns that context into K/V with its own `k_proj`/`v_proj` and caches them, so each step
only injects the newly committed positions. Attention is non-causal: a block sees all cached
context and all of itself. Block K/V never enter the cache.

Mask token: by default the target's embedding of `mask_token_id`. A checkpoint may instead carry a
learned `mask_embedding` `(H,)` tensor (for targets whose vocabulary has no spare id); when it is
present it replaces that lookup. z-lab checkpoints have no such tensor and load unchanged.

Draft vocabulary: a checkpoint may carry `draft_vocab_ids` `(N,)` int64, sorted unique target ids (the
N most frequent tokens of the target's own outputs, as FR-Spec and EAGLE-3's `draft_vocab_size` do).
Greedy drafting then takes the argmax over those N rows of the target's `lm_head` only and maps the
winner back to its target id (`draft_head_weight`, `greedy_draft_tokens`). Without the tensor the
argmax runs over the full vocabulary. Verification always uses the full vocabulary, so output is
unchanged; only drafts whose best token lies outside the list are lost.
"""

from __future__ import annotations

import torch
from torch import nn

from blockpilot.errors import UserError
from blockpilot.models.config import DrafterConfig
from blockpilot.models.decoder import KVCache
from blockpilot.models.layers import MLP, Attention, RMSNorm, RotaryTable, rope_for_heads, write_cache


class DrafterLayer(nn.Module):
    def __init__(self, drafter: DrafterConfig):
        super().__init__()
        config = drafter.layers
        self.self_attn = Attention(config)
        self.mlp = MLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def context_kv(self, context: torch.Tensor, ctx_rope) -> tuple[torch.Tensor, torch.Tensor]:
        """K/V `(B, nkv, n, hd)` of projected context `(B, n, H)` (not input-normed, as in DFlash)."""
        return self.self_attn.key_value(context, *ctx_rope)

    def forward(self, x, k_ctx, v_ctx, block_rope, mask: torch.Tensor | None = None):
        """`x` `(B, T, H)` block attending over context K/V `(B, nkv, S, hd)` and itself.

        `mask` `(B, 1, T, S + T)` bool (True = visible) restricts the context (training); at
        inference every cached context position and the whole block are visible."""
        attn = self.self_attn
        h = self.input_layernorm(x)
        k_blk, v_blk = attn.key_value(h, *block_rope)
        k = torch.cat((k_ctx, k_blk), dim=2)  # (B, nkv, S + T, hd)
        v = torch.cat((v_ctx, v_blk), dim=2)
        x = x + attn.attend(attn.query(h, *block_rope), k, v, mask)
        return x + self.mlp(self.post_attention_layernorm(x))


class DFlashDrafter(nn.Module):
    """Parameter names equal the z-lab checkpoint's (`fc.weight`, `layers.{i}...`, `norm.weight`)."""

    def __init__(self, config: DrafterConfig, max_positions: int | None = None):
        super().__init__()
        self.config = config
        c = config.layers
        self.fc = nn.Linear(len(config.target_layer_ids) * c.hidden_size, c.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.layers = nn.ModuleList(DrafterLayer(config) for _ in range(c.num_hidden_layers))
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.mask_embedding: nn.Parameter | None = None
        self.register_buffer("draft_vocab_ids", None, persistent=False)  # (N,) int64 or None: full vocab
        self.rope = RotaryTable(c, max_positions or c.max_position_embeddings)

    def set_mask_embedding(self, value: torch.Tensor | None) -> None:
        self.mask_embedding = None if value is None else nn.Parameter(value.clone())

    def set_draft_vocabulary(self, ids: torch.Tensor | None, source: str = "draft vocabulary") -> None:
        """Restrict greedy drafting to the target ids `ids` `(N,)` (None: the full vocabulary).

        Raises:
            UserError: `ids` are not sorted unique int64 ids of the target's vocabulary.
        """
        if ids is not None:
            check_draft_vocab_ids(ids, self.config.layers.vocab_size, source)
            ids = ids.to(self.fc.weight.device)
        self.draft_vocab_ids = ids

    def draft_head_weight(self, lm_head_weight: torch.Tensor) -> torch.Tensor:
        """`(N, H)` rows of the target's `lm_head` weight `(V, H)` for the draft vocabulary (the
        weight itself without one). Gather it once per loaded model, not per step."""
        return lm_head_weight if self.draft_vocab_ids is None else lm_head_weight.detach()[self.draft_vocab_ids]

    def block_embeddings(self, first_token_embed: torch.Tensor, mask_embed: torch.Tensor, block_size: int):
        """`(B, block_size, H)`: the last committed token's embedding, then the mask embedding."""
        if self.mask_embedding is not None:
            mask_embed = self.mask_embedding.to(first_token_embed.dtype)
        b, _, h = first_token_embed.shape
        masks = mask_embed.reshape(1, 1, h).expand(b, block_size - 1, h)
        return torch.cat((first_token_embed, masks), dim=1)

    def forward(
        self,
        block_embeds: torch.Tensor,
        block_positions: torch.Tensor,
        target_taps: torch.Tensor,
        ctx_positions: torch.Tensor,
        cache: KVCache,
        kv_len: int,
        context_lengths: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Draft hidden states `(B, T, H)` (after the final norm) for a block.

        Args:
            block_embeds: `(B, T, H)` target embeddings of the block tokens.
            block_positions: `(T,)` absolute positions of the block, or `(B, T)` one row per sequence.
            target_taps: `(B, n, taps * H)` target hidden states of newly committed positions
                (n may be 0 when nothing new was committed).
            ctx_positions: `(n,)` (or `(B, n)`) their absolute positions; their K/V are written into `cache`.
            cache: the drafter's context cache.
            kv_len: number of cached context positions to attend over, new ones included.
            context_lengths: `(B,)` per-sequence number of visible context positions (<= kv_len);
                None: all `kv_len`. A batch whose sequences committed different numbers of tokens
                passes the longest count in `target_taps` and masks the rest out here.
        """
        context = self.hidden_norm(self.fc(target_taps))
        ctx_rope = rope_for_heads(self.rope(ctx_positions, block_embeds.dtype))
        block_rope = rope_for_heads(self.rope(block_positions, block_embeds.dtype))
        mask = None
        if context_lengths is not None:
            b, t = block_embeds.shape[:2]
            visible = torch.arange(kv_len, device=block_embeds.device)[None, :] < context_lengths[:, None]  # (B, S)
            visible = torch.cat((visible, visible.new_ones(b, t)), dim=1)
            mask = visible[:, None, None, :].expand(b, 1, t, kv_len + t)
        x = block_embeds
        for i, layer in enumerate(self.layers):
            k_new, v_new = layer.context_kv(context, ctx_rope)
            k_ctx = write_cache(cache.k[i], ctx_positions, k_new)[:, :, :kv_len]
            v_ctx = write_cache(cache.v[i], ctx_positions, v_new)[:, :, :kv_len]
            x = layer(x, k_ctx, v_ctx, block_rope, mask)
        return self.norm(x)


def greedy_draft_tokens(hidden: torch.Tensor, head_weight: torch.Tensor | nn.Module,
                        vocab_ids: torch.Tensor | None) -> torch.Tensor:
    """Greedy draft tokens as target ids: argmax of `hidden @ head_weight.T`, mapped through `vocab_ids`.

    Args:
        hidden: `(..., H)` drafter outputs (after the final norm).
        head_weight: `(N, H)` from `DFlashDrafter.draft_head_weight` (N = V without a draft vocabulary),
            or a module computing that product (a `PackedLinear` of it).
        vocab_ids: `(N,)` target id of each row of `head_weight`, or None when the rows are all V ids.

    Returns:
        `(...)` int64 target token ids.
    """
    return logits_draft_tokens(draft_logits(hidden, head_weight), vocab_ids)


def logits_draft_tokens(logits: torch.Tensor, vocab_ids: torch.Tensor | None) -> torch.Tensor:
    """Greedy draft tokens `(...)` as target ids from drafter logits `(..., N)`: the argmax row, mapped
    through `vocab_ids` (see `greedy_draft_tokens`)."""
    best = logits.argmax(-1)  # (...) row of the head
    return best if vocab_ids is None else vocab_ids[best]


def draft_logits(hidden: torch.Tensor, head_weight: torch.Tensor | nn.Module) -> torch.Tensor:
    """`(..., N)` drafter logits over the rows of `head_weight` (see `greedy_draft_tokens`)."""
    return head_weight(hidden) if isinstance(head_weight, nn.Module) else nn.functional.linear(hidden, head_weight)


def check_draft_vocab_ids(ids: torch.Tensor, vocab_size: int, source: str = "draft vocabulary") -> None:
    """Raise `UserError` unless `ids` is a non-empty `(N,)` int64 tensor of sorted unique ids in [0, vocab_size)."""
    fix = "write it with scripts/draft_vocab.py, or remove the tensor to draft over the full vocabulary"
    if not isinstance(ids, torch.Tensor) or ids.dtype != torch.int64:
        kind = ids.dtype if isinstance(ids, torch.Tensor) else type(ids).__name__
        raise UserError(f"{source}: draft_vocab_ids has dtype {kind}, expected int64 token ids; {fix}")
    if ids.dim() != 1:
        raise UserError(f"{source}: draft_vocab_ids has shape {tuple(ids.shape)}, expected (N,); {fix}")
    if ids.numel() == 0:
        raise UserError(f"{source}: draft_vocab_ids is empty; {fix}")
    outside = ids[(ids < 0) | (ids >= vocab_size)]
    if outside.numel():
        raise UserError(f"{source}: draft_vocab_ids holds id {int(outside[0])} outside the target's vocabulary "
                        f"[0, {vocab_size}); {fix}")
    steps = ids[1:] - ids[:-1]
    if (steps == 0).any():
        raise UserError(f"{source}: draft_vocab_ids repeats id {int(ids[1:][steps == 0][0])}; store each id once; {fix}")
    if (steps < 0).any():
        raise UserError(f"{source}: draft_vocab_ids is not sorted ascending (id {int(ids[1:][steps < 0][0])} comes "
                        f"after a larger id); sort the ids; {fix}")
