"""Our DFlash drafter weights as a transformers DFlash assistant (`speculation_type="dflash"`).

transformers' `DFlashTokenCandidateGenerator` (5.17+) reads `assistant.config.{target_layer_ids,
block_size, mask_token_id}` and `assistant.device`, keeps a `DFlashCache` built from
`assistant.config`, and calls the assistant once per step as

    assistant(noise_embeds=(1, B, H), context_hidden_states=(1, n, taps*H),
              position_ids=(1, n + B), attention_mask=(1, S) or None, cache=DFlashCache)

where `noise_embeds` are the target's embeddings of `[last token, MASK x (B-1)]`, the context is
the `n` target positions committed since the last call (HF `hidden_states[l + 1]` of every tap
layer `l`, concatenated), and `position_ids` are the positions of those `n` then of the block. It
expects `.last_hidden_state` `(1, B, H)` (after the final norm); the target's `lm_head` of
positions 1..B-1 gives the candidates. The cache keeps the K/V of context and block; the generator
crops the block's `B` entries before the next call.

`DFlashAssistant` runs exactly the layers of `blockpilot.models.dflash.DFlashDrafter` (same
modules, same weights) under that calling convention; `tests/test_profiling_hf_dflash.py` checks
that its proposals equal `TorchBackend.draft`'s. The generator applies the target's full `lm_head`,
so a drafter's draft vocabulary (`draft_vocab_ids`) does not reach this peer: it drafts over the full
vocabulary, as transformers' DFlash does.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from blockpilot.models.dflash import DFlashDrafter


class DFlashAssistant(nn.Module):
    """A `DFlashDrafter` callable by transformers' DFlash assisted generation.

    Args:
        drafter: the drafter whose modules (and weights) are used, not copied.
        block_size: block size the generator drafts with (default: the drafter's training size).
    """

    def __init__(self, drafter: DFlashDrafter, block_size: int | None = None):
        super().__init__()
        self.drafter = drafter
        self.config = _transformers_config(drafter, block_size or drafter.config.block_size)

    @property
    def device(self) -> torch.device:
        return self.drafter.fc.weight.device

    @torch.inference_mode()
    def forward(self, noise_embeds: torch.Tensor, context_hidden_states: torch.Tensor,
                position_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, cache=None, **_):
        """Draft hidden states for one block.

        Args:
            noise_embeds: `(1, B, H)` target embeddings of `[last token, MASK x (B-1)]`.
            context_hidden_states: `(1, n, taps*H)` tapped target states of the new positions.
            position_ids: `(1, n + B)` positions of the `n` context states, then of the block.
            attention_mask: `(1, S)` over every cached position plus the block (1 = visible), or None.
            cache: a transformers `DFlashCache`/`DynamicCache` holding earlier context K/V.

        Returns:
            An object with `last_hidden_state` `(1, B, H)`.
        """
        from transformers.modeling_outputs import BaseModelOutputWithPast

        d = self.drafter
        n = context_hidden_states.shape[1]
        x = self._block_inputs(noise_embeds)
        context = d.hidden_norm(d.fc(context_hidden_states.to(x.dtype)))  # (1, n, H)
        cos, sin = d.rope(position_ids[0], x.dtype)  # (n + B, hd) each
        for i, layer in enumerate(d.layers):
            attn = layer.self_attn
            h = layer.input_layernorm(x)
            # context K/V are not input-normed (DFlash); block K/V are
            k, v = attn.key_value(torch.cat((context, h), dim=1), cos, sin)  # (1, nkv, n + B, hd)
            if cache is not None:
                k, v = cache.update(k, v, i)  # (1, nkv, S, hd): all context so far + this block
            x = x + attn.attend(attn.query(h, cos[n:], sin[n:]), k, v, _visible(attention_mask, k.shape[2]))
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        return BaseModelOutputWithPast(last_hidden_state=d.norm(x))

    def _block_inputs(self, noise_embeds: torch.Tensor) -> torch.Tensor:
        """`noise_embeds` with the drafter's learned mask embedding in slots 1.. when it has one."""
        d = self.drafter
        if d.mask_embedding is None:
            return noise_embeds.to(d.fc.weight.dtype)
        first = noise_embeds[:, :1].to(d.fc.weight.dtype)
        return d.block_embeddings(first, d.mask_embedding, noise_embeds.shape[1])


def _visible(attention_mask: torch.Tensor | None, kv_len: int) -> torch.Tensor | None:
    """`(1, 1, 1, S)` bool key mask from a `(1, S)` 0/1 mask; None when everything is visible."""
    if attention_mask is None or bool(attention_mask.all()):
        return None
    if attention_mask.shape[-1] != kv_len:
        raise ValueError(f"attention_mask covers {attention_mask.shape[-1]} positions, the cache {kv_len}")
    return attention_mask.bool()[:, None, None, :]


def _transformers_config(drafter: DFlashDrafter, block_size: int):
    """A transformers Qwen3 config of the drafter's layers plus the DFlash fields the generator reads."""
    from transformers import Qwen3Config

    c, dc = drafter.config.layers, drafter.config
    config = Qwen3Config(
        vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
        num_hidden_layers=c.num_hidden_layers, num_attention_heads=c.num_attention_heads,
        num_key_value_heads=c.num_key_value_heads, head_dim=c.head_dim, rms_norm_eps=c.rms_norm_eps,
        max_position_embeddings=c.max_position_embeddings,
    )
    config.block_size = block_size
    config.mask_token_id = dc.mask_token_id
    config.target_layer_ids = list(dc.target_layer_ids)
    return config


def assistant_from_dir(drafter_dir: str | Path, *, block_size: int | None = None,
                       device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32) -> DFlashAssistant:
    """Load a z-lab-format drafter directory as a `DFlashAssistant`.

    Args:
        drafter_dir: drafter checkpoint (config.json + model.safetensors).
        block_size: block size to draft with (default: the drafter's).
        device, dtype: where and in which precision to hold the weights.

    Returns:
        The assistant, in eval mode.
    """
    from blockpilot.models.checkpoint import load_drafter

    drafter = load_drafter(drafter_dir, dtype=dtype).to(device).eval()
    return DFlashAssistant(drafter, block_size).eval()
