"""The compact decoder matches transformers, and drafter checkpoints round-trip unchanged."""

import pytest
import torch

from blockpilot.models.checkpoint import load_drafter, load_target
from blockpilot.models.decoder import KVCache

from fixtures import make_drafter, make_hf_target


def _full_logits(model, ids, cache_len=64):
    cache = KVCache.allocate(model.config, ids.shape[0], cache_len, torch.float32)
    pos = torch.arange(ids.shape[1])
    out = model(model.embed_tokens(ids), pos, cache, kv_len=ids.shape[1])
    return model.lm_head(out.hidden)


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_logits_match_transformers_fp32(tmp_path, family):
    from transformers import AutoModelForCausalLM

    extra = {"attention_bias": True} if family == "llama" else {}
    target_dir = make_hf_target(tmp_path, family, **extra)
    ours = load_target(target_dir)
    ref = AutoModelForCausalLM.from_pretrained(target_dir, torch_dtype=torch.float32).eval()
    ids = torch.randint(0, 97, (2, 23))
    with torch.no_grad():
        expected = ref(ids).logits
        got = _full_logits(ours, ids)
    assert (got - expected).abs().max().item() < 1e-4


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_taps_are_hf_hidden_states_after_layer(tmp_path, family):
    from transformers import AutoModelForCausalLM

    target_dir = make_hf_target(tmp_path, family)
    ours = load_target(target_dir)
    ref = AutoModelForCausalLM.from_pretrained(target_dir, torch_dtype=torch.float32).eval()
    ids = torch.randint(0, 97, (1, 11))
    with torch.no_grad():
        hs = ref(ids, output_hidden_states=True).hidden_states
        cache = KVCache.allocate(ours.config, 1, 32, torch.float32)
        out = ours(ours.embed_tokens(ids), torch.arange(11), cache, 11, tap_layers=(2, 0))
    expected = torch.cat([hs[3], hs[1]], dim=-1)
    assert (out.taps - expected).abs().max().item() < 1e-4


def test_incremental_decoding_with_cache_equals_full_pass(tmp_path):
    model = load_target(make_hf_target(tmp_path, "qwen3"))
    ids = torch.randint(0, 97, (1, 20))
    with torch.no_grad():
        full = _full_logits(model, ids)
        cache = KVCache.allocate(model.config, 1, 64, torch.float32)
        model(model.embed_tokens(ids[:, :12]), torch.arange(12), cache, 12)
        step = model(model.embed_tokens(ids[:, 12:]), torch.arange(12, 20), cache, 20)
    assert (model.lm_head(step.hidden) - full[:, 12:]).abs().max().item() < 1e-5


def test_drafter_checkpoint_round_trips_in_zlab_layout(tmp_path):
    from safetensors.torch import load_file

    target_dir = make_hf_target(tmp_path, "llama")
    drafter_dir = make_drafter(tmp_path, target_dir)
    names = set(load_file(drafter_dir / "model.safetensors"))
    assert "fc.weight" in names and "hidden_norm.weight" in names and "norm.weight" in names
    assert "layers.0.self_attn.q_norm.weight" in names and "layers.0.mlp.gate_proj.weight" in names
    assert not any(n.startswith("model.") or "embed" in n or "lm_head" in n for n in names)
    drafter = load_drafter(drafter_dir)
    assert drafter.config.block_size == 8 and drafter.mask_embedding is None


def test_learned_mask_embedding_round_trips_and_replaces_the_token_lookup(tmp_path):
    from blockpilot.models.checkpoint import save_drafter

    target_dir = make_hf_target(tmp_path, "llama")
    drafter = load_drafter(make_drafter(tmp_path, target_dir))
    learned = torch.randn(32)
    drafter.set_mask_embedding(learned)
    reloaded = load_drafter(save_drafter(drafter, tmp_path / "with-mask"))
    assert torch.equal(reloaded.mask_embedding.detach(), learned)
    first = torch.randn(1, 1, 32)
    block = reloaded.block_embeddings(first, torch.zeros(32), 4)  # the token lookup would give zeros
    assert torch.equal(block[0, 0], first[0, 0]) and torch.equal(block[0, 1:], learned.expand(3, 32))


def test_save_drafter_replaces_a_directory_whole_and_leaves_nothing_after_a_failure(tmp_path, monkeypatch):
    from blockpilot.models import checkpoint

    target_dir = make_hf_target(tmp_path, "llama")
    drafter = load_drafter(make_drafter(tmp_path, target_dir))
    out = checkpoint.save_drafter(drafter, tmp_path / "saved", extra_files={"note.txt": "first"})
    (out / "stale.txt").write_text("from an earlier save")
    checkpoint.save_drafter(drafter, out)  # replaced whole: no file of the earlier directory survives
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]

    def fail(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(checkpoint, "save_file", fail)
    with pytest.raises(OSError, match="disk full"):
        checkpoint.save_drafter(drafter, tmp_path / "never")
    with pytest.raises(OSError, match="disk full"):
        checkpoint.save_drafter(drafter, out)
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith((".never", ".saved", "never"))) == []
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
