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


@needs_onednn_bf16
def test_a_product_split_into_chunks_of_inputs_gives_the_same_numbers_within_bf16_rounding():
    from blockpilot.models.packed import split_long_products

    generator = torch.Generator().manual_seed(0)
    weight = (torch.randn(64, 1536, generator=generator) * 0.05).bfloat16()
    x = torch.randn(5, 1536, generator=generator).bfloat16()
    layer = torch.nn.Sequential(PackedLinear(weight))
    whole = layer(x)
    assert [name for _, name, _ in split_long_products(layer)] == ["0"]
    assert layer[0].chunks == [(0, 768), (768, 1536)]
    exact = x.float() @ weight.float().T
    assert (layer(x).float() - exact).abs().max() <= 4 * (whole.float() - exact).abs().max() + 1e-2
    assert split_long_products(layer) == []  # products already split, or short enough, are left alone


@needs_onednn_bf16
def test_rows_round_alike_catches_a_product_whose_rows_depend_on_the_row_count():
    from blockpilot.models.packed import rows_round_alike

    layer = torch.nn.Sequential(PackedLinear((torch.randn(32, 48) * 0.1).bfloat16()))
    assert rows_round_alike(layer, [1, 2, 3, 8])  # 48 input features: one kernel for every row count
    product = layer[0].forward
    layer[0].forward = lambda x: product(x) + (x.reshape(-1, 48).shape[0] > 2)  # rows of calls of 3+ rows differ
    assert not rows_round_alike(layer, [1, 2, 3, 8])
    assert rows_round_alike(layer, [1, 2])


@needs_onednn_bf16
@pytest.mark.parametrize("alike", [True, False])
def test_bf16_backend_pads_products_only_where_their_rows_round_unlike(tmp_path_factory, monkeypatch, alike):
    from blockpilot.runtime import backend as backend_module

    monkeypatch.setattr(backend_module, "rows_round_alike", lambda module, counts: alike)
    target, drafter = tiny_models(tmp_path_factory, "llama")
    backend = Runner.from_dir(target, drafter_dir=drafter, dtype=torch.bfloat16, max_block_size=8).backend
    assert backend.attention_rows == 8  # attention always runs the fixed shape over the whole cache
    assert backend.fixed_rows == (None if alike else 8)
    assert backend.pad_rows == (0 if alike else 7)
    assert backend.max_batch == (backend_module.PRODUCT_ROWS // 8 if alike else 1 << 16)  # 4 blocks of 8 rows
