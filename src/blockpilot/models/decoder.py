"""One compact decoder for Llama, Qwen2 and Qwen3 checkpoints, with a static KV cache.

The decoder knows nothing about tokenization or decoding policy: it maps token embeddings at given
absolute positions to final hidden states (and tapped intermediate hidden states), writing K/V
into a caller-owned `KVCache` at those positions. Rolling back rejected tokens is the caller's
business: it only has to attend over fewer cached positions next time (`kv_len`); stale entries
beyond it are overwritten later.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from blockpilot.models.config import DecoderConfig
from blockpilot.models.layers import MLP, Attention, RMSNorm, RotaryTable, rope_for_heads, write_cache


@dataclasses.dataclass
class KVCache:
    """Preallocated per-layer keys and values, each `(B, nkv, capacity, hd)`."""

    k: list[torch.Tensor]
    v: list[torch.Tensor]

    @classmethod
    def allocate(
        cls, config: DecoderConfig, batch: int, capacity: int, dtype: torch.dtype, device="cpu"
    ) -> "KVCache":
        shape = (batch, config.num_key_value_heads, capacity, config.head_dim)
        n = config.num_hidden_layers
        return cls(
            k=[torch.zeros(shape, dtype=dtype, device=device) for _ in range(n)],
            v=[torch.zeros(shape, dtype=dtype, device=device) for _ in range(n)],
        )

    @property
    def capacity(self) -> int:
        return self.k[0].shape[2]


@dataclasses.dataclass
class DecoderOutput:
    hidden: torch.Tensor  # (B, T, H) after the final norm: what lm_head reads
    taps: torch.Tensor | None  # (B, T, len(tap_layers) * H) outputs of the tapped layers


def causal_mask(positions: torch.Tensor, kv_len: int) -> torch.Tensor:
    """`(1, 1, T, kv_len)` bool for `(T,)` positions, `(B, 1, T, kv_len)` for `(B, T)`: the query at
    a position sees every key at a cache index <= it.

    4-D, so that the exported ONNX Attention gets the mask rank TensorRT's parser requires."""
    keys = torch.arange(kv_len, device=positions.device)
    if positions.dim() == 1:
        return (keys[None, :] <= positions[:, None])[None, None]
    return (keys[None, None, :] <= positions[:, :, None])[:, None]


def padded_positions(positions: torch.Tensor, rows: int | None) -> torch.Tensor:
    """`positions` `(T,)` or `(B, T)` extended to `rows` along T by repeating the last one (None or
    `rows <= T`: as they are)."""
    t = positions.shape[-1]
    if rows is None or rows <= t:
        return positions
    return torch.cat((positions, positions[..., -1:].expand(*positions.shape[:-1], rows - t)), dim=-1)


class DecoderLayer(nn.Module):
    def __init__(self, config: DecoderConfig):
        super().__init__()
        self.self_attn = Attention(config)
        self.mlp = MLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, x, cos, sin, positions, k_cache, v_cache, kv_len: int, mask, attention_rows: int | None = None):
        attn = self.self_attn
        h = self.input_layernorm(x)
        q, k, v = attn.query_key_value(h, cos, sin)
        k_all = write_cache(k_cache, positions, k)[:, :, :kv_len]
        v_all = write_cache(v_cache, positions, v)[:, :, :kv_len]
        x = x + attn.attend(q, k_all, v_all, mask, attention_rows)
        return x + self.mlp(self.post_attention_layernorm(x))


class Decoder(nn.Module):
    """A causal LM. Parameter names equal the Hugging Face ones without the `model.` prefix."""

    def __init__(self, config: DecoderConfig, max_positions: int | None = None):
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config) for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.rope = RotaryTable(config, max_positions or config.max_position_embeddings)

    def fuse_projections(self) -> "Decoder":
        """One matrix product for q/k/v and one for gate/up in every layer (inference only: the
        fused copies do not follow later weight updates). Returns self."""
        for layer in self.layers:
            layer.self_attn.fuse_projections()
            layer.mlp.fuse_projections()
        return self

    @property
    def max_positions(self) -> int:
        return self.rope.cos.shape[0]

    def forward(
        self,
        embeds: torch.Tensor,
        positions: torch.Tensor,
        cache: KVCache,
        kv_len: int,
        tap_layers: tuple[int, ...] = (),
        attention_rows: int | None = None,
    ) -> DecoderOutput:
        """Run `embeds` `(B, T, H)` at `positions` `(T,)` (or `(B, T)`, one row of positions per
        sequence), attending over cache `[0, kv_len)`.

        K/V of the new tokens are written into `cache` at `positions` first, so `kv_len` must
        cover them. Tapped outputs are those of layers `tap_layers` (HF `hidden_states[l + 1]`).
        `attention_rows` (>= T): the attention kernels run that many query rows (`Attention.attend`);
        the padding rows see what the last real row sees and write nothing.
        """
        cos, sin = rope_for_heads(self.rope(positions, embeds.dtype))
        mask = causal_mask(padded_positions(positions, attention_rows), kv_len)
        taps, x = [], embeds
        for i, layer in enumerate(self.layers):
            x = layer(x, cos, sin, positions, cache.k[i], cache.v[i], kv_len, mask, attention_rows)
            if i in tap_layers:
                taps.append(x)
        ordered = [taps[sorted(tap_layers).index(t)] for t in tap_layers] if taps else None
        return DecoderOutput(
            hidden=self.norm(x), taps=torch.cat(ordered, dim=-1) if ordered else None
        )
