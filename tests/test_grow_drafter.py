"""`scripts/grow_drafter.py` (the capacity test of the drafter's MODEL_CARD): a drafter deepened with zeroed-output
layers drafts exactly as its source (same accepted lengths at every step), keeps its draft vocabulary, and trains
(its new layers get gradients); bad requests are one-line errors with exit status 2 that leave nothing behind."""

from __future__ import annotations

import sys

import pytest
import torch

from blockpilot.models.checkpoint import load_drafter, save_drafter
from blockpilot.runtime.runner import Runner

from builder_fixtures import save_char_tokenizer
from fixtures import TINY, load_script, make_drafter, make_hf_target

DRAFT_VOCAB = torch.arange(2, TINY["vocab_size"], 2)


@pytest.fixture(scope="module")
def script():
    yield load_script("grow_drafter")
    sys.modules.pop("grow_drafter", None)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("grow")
    target = save_char_tokenizer(make_hf_target(tmp, "llama"))
    drafter = load_drafter(make_drafter(tmp, target, block_size=4, layers=1, seed=5, name="raw"))
    drafter.set_draft_vocabulary(DRAFT_VOCAB)
    return tmp, target, save_drafter(drafter, tmp / "one-layer")


def accepted(target, drafter, prompts):
    runner = Runner.from_dir(target, drafter_dir=drafter)
    out = runner.generate([torch.tensor(p) for p in prompts], max_new_tokens=24, block_size=4, return_dict=True,
                          temperature=0.0)
    return out["accept_lengths"], out["output_ids"]


def test_a_grown_drafter_drafts_exactly_as_its_source_and_keeps_its_draft_vocabulary(script, models, tmp_path):
    _, target, source = models
    out = tmp_path / "three-layers"
    assert script.main(["--drafter", str(source), "--layers", "3", "--out", str(out)]) == 0
    grown = load_drafter(out)
    assert grown.config.layers.num_hidden_layers == 3
    assert torch.equal(grown.draft_vocab_ids, DRAFT_VOCAB)
    for i in (1, 2):
        assert not grown.layers[i].self_attn.o_proj.weight.any() and not grown.layers[i].mlp.down_proj.weight.any()
        assert grown.layers[i].mlp.up_proj.weight.any()
    prompts = [[5, 9, 13, 7, 21], [30, 4, 4, 18], [11, 12, 13, 14, 15, 16]]
    lengths_src, ids_src = accepted(target, source, prompts)
    lengths_grown, ids_grown = accepted(target, out, prompts)
    assert any(max(steps) > 1 for steps in lengths_src)  # the drafts do get accepted, so the comparison bites
    assert lengths_grown == lengths_src and torch.equal(ids_grown, ids_src)


def test_the_new_layers_receive_gradients(script, models, tmp_path):
    _, _, source = models
    out = tmp_path / "two-layers"
    assert script.main(["--drafter", str(source), "--layers", "2", "--out", str(out)]) == 0
    grown = load_drafter(out)
    new = grown.layers[1]
    x = torch.randn(1, 4, grown.config.layers.hidden_size)
    h = new.post_attention_layernorm(x)
    added = new.mlp(h)
    assert not added.any()  # the new layer adds nothing yet
    (added * torch.randn_like(added)).sum().backward()  # any loss that depends on the layer's output
    assert new.mlp.down_proj.weight.grad.abs().sum() > 0


def test_too_few_layers_a_missing_drafter_and_an_existing_output_are_one_line_errors(script, models, tmp_path,
                                                                                     capsys):
    _, _, source = models
    existing = tmp_path / "existing"
    existing.mkdir()
    cases = [(["--drafter", str(source), "--layers", "3", "--out", str(existing)], "exists"),
             (["--drafter", str(source), "--layers", "1", "--out", str(tmp_path / "same")], "already has 1"),
             (["--drafter", str(tmp_path / "missing"), "--layers", "3", "--out", str(tmp_path / "x")], "no drafter")]
    for argv, words in cases:
        assert script.main(argv) == 2
        err = capsys.readouterr().err
        assert words in err and err.count("\n") == 1, err
    assert [p.name for p in tmp_path.iterdir()] == ["existing"] and not any(existing.iterdir())
