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

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, rows_hint: int = 16,
                 max_in: int | None = None):
        super().__init__()
        if not can_pack(weight):
            raise ValueError(f"cannot pack a {weight.dtype} weight on {weight.device} (needs bf16 on a oneDNN CPU)")
        self.weight = weight.detach()
        self.bias = None if bias is None else bias.detach()
        self.in_features, self.out_features = weight.shape[1], weight.shape[0]
        self.rows_hint = rows_hint
        # `max_in`: products over at most that many input features each, the first one's result added into
        # the next by oneDNN's fused "add" (one more bf16 rounding a chunk); see `split_long_products`
        count = 1 if max_in is None else -(-self.in_features // max_in)
        edges = [round(i * self.in_features / count) for i in range(count + 1)]
        self.chunks = list(zip(edges, edges[1:]))
        self.packed = [torch.ops.mkldnn._reorder_linear_weight(self.weight[:, a:b].contiguous(), rows_hint)
                       for a, b in self.chunks]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features)
        if flat.dtype != torch.bfloat16:
            flat = flat.to(torch.bfloat16)
        (a, b), *rest = self.chunks  # one chunk, (0, in_features), unless `max_in` split the product
        out = torch.ops.mkldnn._linear_pointwise(flat[:, a:b].contiguous(), self.packed[0], self.bias, "none", [], "")
        for (a, b), packed in zip(rest, self.packed[1:]):
            out = torch.ops.mkldnn._linear_pointwise.binary(flat[:, a:b].contiguous(), out, packed, None, "add")
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


ROW_ALIKE_MAX_IN = 1024
"""oneDNN's bf16 products over more input features than this split their reduction in a way that rounds some
rows of a multi-row call unlike the same row alone (on a 2-core Intel Xeon with AVX512-BF16: 1,152 and more,
e.g. SmolLM2's 1,536-wide down projection, rows 2, 5, ... of a call of 3+ rows); up to 1,024 every row
rounds alike."""


def split_long_products(module: nn.Module, max_in: int = ROW_ALIKE_MAX_IN) -> list[tuple[nn.Module, str, PackedLinear]]:
    """Replace every `PackedLinear` under `module` over more than `max_in` input features by one computed in
    chunks of at most `max_in` (`PackedLinear`'s `max_in`), in place. Returns `(parent, name, replaced layer)`
    of each, so that `setattr` can put them back."""
    replaced = []
    for parent in list(module.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, PackedLinear) and len(child.chunks) == 1 and child.in_features > max_in:
                setattr(parent, name, PackedLinear(child.weight, child.bias, child.rows_hint, max_in))
                replaced.append((parent, name, child))
    return replaced


def rows_round_alike(module: nn.Module, row_counts: list[int], seed: int = 0) -> bool:
    """True when every `PackedLinear` under `module` gives each row of a call the bits it gives that row
    alone, for calls of every count of rows in `row_counts` (checked on random inputs, once per weight
    shape). oneDNN picks its bf16 kernel by shape; where this holds, a speculative step's products need no
    padding rows to round like plain decoding's."""
    generator = torch.Generator().manual_seed(seed)
    largest, seen = max(row_counts), set()
    for layer in module.modules():
        key = (layer.in_features, layer.out_features, len(layer.chunks)) if isinstance(layer, PackedLinear) else None
        if key is None or key in seen:
            continue
        seen.add(key)
        x = torch.randn(largest, layer.in_features, generator=generator).to(torch.bfloat16)
        alone = torch.cat([layer(x[i: i + 1]) for i in range(largest)])
        if not all(torch.equal(layer(x[:m]), alone[:m]) for m in row_counts):
            return False
    return True
