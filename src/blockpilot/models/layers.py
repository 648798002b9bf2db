"""Building blocks shared by the target decoder and the DFlash drafter.

Shapes: `B` batch, `T` query tokens, `S` key tokens, `H` hidden size, `nh`/`nkv` query/key-value
heads, `hd` head dim. Positions are absolute token indices; RoPE tables are indexed by them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from blockpilot.models.config import DecoderConfig


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # One op (ONNX RMSNormalization from opset 23, which onnxruntime runs fused); in fp32 it is
        # bit-identical to weight * (x * rsqrt(mean(x^2) + eps)). Other dtypes normalise in fp32.
        if x.dtype == torch.float32 and self.weight.dtype == torch.float32:
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


class RotaryTable(nn.Module):
    """cos/sin of every position up to `max_positions`, looked up by absolute position."""

    def __init__(self, config: DecoderConfig, max_positions: int):
        super().__init__()
        inv_freq, scaling = config.rope_inv_freq()
        freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)  # (P, hd)
        self.register_buffer("cos", emb.cos() * scaling, persistent=False)
        self.register_buffer("sin", emb.sin() * scaling, persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        return self.cos[positions].to(dtype), self.sin[positions].to(dtype)  # (T, hd) each


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate `x` `(B, n, T, hd)` by the per-position tables `(T, hd)`."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class MLP(nn.Module):
    def __init__(self, config: DecoderConfig):
        super().__init__()
        h, i = config.hidden_size, config.intermediate_size
        self.gate_proj = nn.Linear(h, i, bias=False)
        self.up_proj = nn.Linear(h, i, bias=False)
        self.down_proj = nn.Linear(i, h, bias=False)

        # (2 i, h) [gate; up] weight, set by `fuse_projections`; a `PackedLinear` once packed (`models.packed`)
        self.gate_up: torch.Tensor | nn.Module | None = None

    def fuse_projections(self) -> None:
        """Compute gate and up projections with one matrix product (same values, fewer calls)."""
        self.gate_up = torch.cat((self.gate_proj.weight, self.up_proj.weight)).detach()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_up is not None:
            fused = self.gate_up(x) if isinstance(self.gate_up, nn.Module) else F.linear(x, self.gate_up)
            gate, up = fused.chunk(2, dim=-1)
            return self.down_proj(F.silu(gate) * up)
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Attention(nn.Module):
    """Grouped-query attention whose K/V projections can also be applied to other inputs.

    The module holds weights only; caches are passed in by the caller.
    """

    def __init__(self, config: DecoderConfig):
        super().__init__()
        c = config
        self.n_heads, self.n_kv, self.head_dim = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        self.q_proj = nn.Linear(c.hidden_size, c.num_attention_heads * c.head_dim, bias=c.attention_bias)
        self.k_proj = nn.Linear(c.hidden_size, c.num_key_value_heads * c.head_dim, bias=c.attention_bias)
        self.v_proj = nn.Linear(c.hidden_size, c.num_key_value_heads * c.head_dim, bias=c.attention_bias)
        o_bias = c.attention_bias and c.family != "qwen2"  # Qwen2 biases q/k/v only
        self.o_proj = nn.Linear(c.num_attention_heads * c.head_dim, c.hidden_size, bias=o_bias)
        self.q_norm = RMSNorm(c.head_dim, c.rms_norm_eps) if c.qk_norm else None
        self.k_norm = RMSNorm(c.head_dim, c.rms_norm_eps) if c.qk_norm else None
        # (weight, bias) of q, k and v stacked, set by `fuse_projections`; a `PackedLinear` once packed
        self.qkv: tuple[torch.Tensor, torch.Tensor | None] | nn.Module | None = None

    def fuse_projections(self) -> None:
        """Compute q, k and v with one matrix product (same values, fewer calls)."""
        projs = (self.q_proj, self.k_proj, self.v_proj)
        bias = torch.cat([p.bias for p in projs]).detach() if self.q_proj.bias is not None else None
        self.qkv = (torch.cat([p.weight for p in projs]).detach(), bias)

    def query_key_value(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """Rotated queries `(B, nh, T, hd)`, rotated keys and values `(B, nkv, T, hd)` of `x`."""
        if self.qkv is None:
            return (self.query(x, cos, sin), *self.key_value(x, cos, sin))
        b, t, _ = x.shape
        fused = self.qkv(x) if isinstance(self.qkv, nn.Module) else F.linear(x, *self.qkv)
        q, k, v = fused.split((self.n_heads * self.head_dim, self.n_kv * self.head_dim, self.n_kv * self.head_dim), -1)
        q, k = q.view(b, t, self.n_heads, self.head_dim), k.view(b, t, self.n_kv, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q = apply_rope(q.transpose(1, 2), cos, sin)
        k = apply_rope(k.transpose(1, 2), cos, sin)
        return q, k, v.view(b, t, self.n_kv, self.head_dim).transpose(1, 2)

    def _heads(self, x: torch.Tensor, proj: nn.Linear, n: int, norm: RMSNorm | None) -> torch.Tensor:
        out = proj(x).view(x.shape[0], x.shape[1], n, self.head_dim)  # (B, T, n, hd)
        if norm is not None:
            out = norm(out)
        return out.transpose(1, 2)  # (B, n, T, hd)

    def query(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        return apply_rope(self._heads(x, self.q_proj, self.n_heads, self.q_norm), cos, sin)

    def key_value(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotated keys and values of `x` `(B, T, H)`, each `(B, nkv, T, hd)`."""
        k = apply_rope(self._heads(x, self.k_proj, self.n_kv, self.k_norm), cos, sin)
        return k, self._heads(x, self.v_proj, self.n_kv, None)

    def attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, rows: int | None = None
    ) -> torch.Tensor:
        """Output projection of softmax attention; `mask` `(T, S)` bool, True = visible (or `(rows, S)`).

        `rows`: run the attention kernel on that many query rows, `q` padded with zero rows that `mask`
        must also cover, and keep the first T: the kernel then rounds every real row alike whatever T is
        (the projections around it round each row alike by themselves; see `TorchBackend`)."""
        t = q.shape[2]
        if rows is not None and rows > t:
            q = F.pad(q, (0, 0, 0, rows - t))
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, enable_gqa=self.n_kv != self.n_heads
        )[:, :, :t]  # (B, nh, T, hd)
        b = out.shape[0]
        return self.o_proj(out.transpose(1, 2).reshape(b, t, self.n_heads * self.head_dim))


def write_cache(cache: torch.Tensor, positions: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """Write `values` `(B, nkv, T, hd)` into `cache` `(B, nkv, cap, hd)` at `positions`.

    `positions` is `(T,)` (every row at the same positions) or `(B, T)` (each row at its own, as a
    batch of requests at different lengths needs). In place, and the same tensor is returned so
    that exported graphs carry it as an output.
    """
    values = values.to(cache.dtype)
    if positions.dim() == 1:
        return cache.index_copy_(2, positions, values)
    index = positions[:, None, :, None].expand(-1, values.shape[1], -1, values.shape[3])  # (B, nkv, T, hd)
    return cache.scatter_(2, index, values)


def rope_for_heads(table: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """RoPE tables looked up at `(T,)` positions (returned as they are, `(T, hd)`) or at `(B, T)`
    positions (`(B, T, hd)` -> `(B, 1, T, hd)`, so that they broadcast over the heads)."""
    cos, sin = table
    return (cos[:, None], sin[:, None]) if cos.dim() == 3 else (cos, sin)
