"""Prepacked bf16 matrix products on the CPU (oneDNN), for inference.

Eager `F.linear` in bf16 hands oneDNN a row-major weight, which it reorders into its blocked
layout on every call. `torch.ops.mkldnn._reorder_linear_weight` does that once per weight and
`torch.ops.mkldnn._linear_pointwise` multiplies with the packed copy (the pair torch.compile's CPU
backend emits for frozen bf16 linears). Measured on SmolLM2-135M's 30 layers (2-core AMD EPYC with
AVX512-BF16, 2 threads): the products took 13.8 -> 8.3 ms for 1 row and 15.5 -> 11.6 ms for 16 rows,
and the whole bf16 drafter call 11.4 -> ~3.5 ms. The packed product rounds like the eager one
(`tests/test_packed.py` checks it bit for bit), so packing changes speed, not outputs.

Inference only: a packed layer holds no trainable parameter.
"""

from __future__ import annotations

import functools

import torch
from torch import nn


@functools.cache
def native_bf16() -> bool:
    """True when this CPU runs oneDNN's bf16 products natively (AVX512-BF16 or AMX); without, torch emulates them."""
    return torch.backends.mkldnn.is_available() and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def can_pack(weight: torch.Tensor) -> bool:
    """True when `weight` is a bf16 CPU tensor and this CPU runs oneDNN's bf16 products."""
    return weight.device.type == "cpu" and weight.dtype == torch.bfloat16 and native_bf16()


class PackedLinear(nn.Module):
    """`y = x @ weight.T + bias` with `weight` `(out, in)` prepacked for oneDNN.

    `weight` stays readable (a plain attribute, not a parameter) for code that reads a layer's
    weight, such as a tied LM head; the packed copy is what the product uses.
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, rows_hint: int = 16):
        super().__init__()
        if not can_pack(weight):
            raise ValueError(f"cannot pack a {weight.dtype} weight on {weight.device} (needs bf16 on a oneDNN CPU)")
        self.weight = weight.detach()
        self.bias = None if bias is None else bias.detach()
        self.in_features, self.out_features = weight.shape[1], weight.shape[0]
        self.packed = torch.ops.mkldnn._reorder_linear_weight(self.weight, rows_hint)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features)
        if flat.dtype != torch.bfloat16:
            flat = flat.to(torch.bfloat16)
        out = torch.ops.mkldnn._linear_pointwise(flat.contiguous(), self.packed, self.bias, "none", [], "")
        return out.reshape(*x.shape[:-1], self.out_features)


def pack_linears(module: nn.Module, rows_hint: int = 16) -> int:
    """Replace every bf16 `nn.Linear` under `module` (and the fused q/k/v and gate/up products of
    `layers.Attention` / `layers.MLP`) by a `PackedLinear`, in place. Returns how many were packed."""
    from blockpilot.models.layers import MLP, Attention

    count = 0
    for parent in list(module.modules()):
        superseded = set()  # projections a fused product replaces: left as they are, unused
        if isinstance(parent, Attention) and parent.qkv is not None:
            superseded = {"q_proj", "k_proj", "v_proj"}
        if isinstance(parent, MLP) and parent.gate_up is not None:
            superseded = {"gate_proj", "up_proj"}
        for name, child in list(parent.named_children()):
            if name not in superseded and isinstance(child, nn.Linear) and can_pack(child.weight):
                setattr(parent, name, PackedLinear(child.weight, child.bias, rows_hint))
                count += 1
        if isinstance(parent, Attention) and isinstance(parent.qkv, tuple) and can_pack(parent.qkv[0]):
            parent.qkv = PackedLinear(*parent.qkv, rows_hint)
            count += 1
        if isinstance(parent, MLP) and isinstance(parent.gate_up, torch.Tensor) and can_pack(parent.gate_up):
            parent.gate_up = PackedLinear(parent.gate_up, None, rows_hint)
            count += 1
    return count
