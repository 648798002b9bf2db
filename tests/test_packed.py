"""Prepacked bf16 products (`models.packed`): same numbers as eager products, used by the bf16 torch path."""

from __future__ import annotations

import pytest
import torch

from blockpilot.models.packed import PackedLinear, can_pack, pack_linears
from blockpilot.runtime.runner import Runner

from builder_fixtures import tiny_models

needs_onednn_bf16 = pytest.mark.skipif(not can_pack(torch.zeros(1, dtype=torch.bfloat16)),
                                       reason="this CPU has no oneDNN bf16 products")


@needs_onednn_bf16
@pytest.mark.parametrize("rows", [1, 2, 5, 16])
def test_packed_product_equals_eager_product_bit_for_bit(rows):
    generator = torch.Generator().manual_seed(0)
    weight = (torch.randn(96, 80, generator=generator) * 0.1).bfloat16()
    bias = torch.randn(96, generator=generator).bfloat16()
    x = torch.randn(2, rows, 80, generator=generator).bfloat16()
    packed = PackedLinear(weight, bias)
    assert torch.equal(packed(x), torch.nn.functional.linear(x, weight, bias))
    assert packed(x).shape == (2, rows, 96)


@needs_onednn_bf16
def test_packed_decoder_gives_the_eager_fused_decoders_hidden_states(tmp_path_factory):
    from blockpilot.models.checkpoint import load_target
    from blockpilot.models.decoder import KVCache

    target_dir, _ = tiny_models(tmp_path_factory, "llama")
    eager = load_target(target_dir, dtype=torch.bfloat16).fuse_projections()
    packed = load_target(target_dir, dtype=torch.bfloat16).fuse_projections()
    assert pack_linears(packed) == 4 * len(packed.layers) + 1  # q/k/v, o, gate/up and down per layer, lm_head
    ids = torch.tensor([[5, 17, 42, 8, 11, 3, 29, 7]])
    outs = []
    for model in (eager, packed):
        cache = KVCache.allocate(model.config, 1, 16, torch.bfloat16)
        with torch.inference_mode():
            out = model(model.embed_tokens(ids), torch.arange(8), cache, 8)
            outs.append(model.lm_head(out.hidden))
    assert torch.equal(outs[0], outs[1])


def test_linears_of_other_dtypes_are_left_alone():
    layer = torch.nn.Sequential(torch.nn.Linear(8, 4))
    assert pack_linears(layer) == 0
    assert isinstance(layer[0], torch.nn.Linear)
    with pytest.raises(ValueError, match="cannot pack"):
        PackedLinear(torch.zeros(4, 8))


@needs_onednn_bf16
def test_bf16_runner_packs_its_weights_and_an_fp32_runner_does_not(tmp_path_factory):
    target, drafter = tiny_models(tmp_path_factory, "llama")
    bf16 = Runner.from_dir(target, drafter_dir=drafter, dtype=torch.bfloat16, max_block_size=8).backend
    fp32 = Runner.from_dir(target, drafter_dir=drafter, max_block_size=8).backend
    assert bf16.packed and isinstance(bf16.target.lm_head, PackedLinear) and isinstance(bf16.draft_head, PackedLinear)
    assert not fp32.packed and isinstance(fp32.target.lm_head, torch.nn.Linear)
