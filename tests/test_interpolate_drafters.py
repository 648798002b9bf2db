"""`scripts/interpolate_drafters.py` (WiSE-FT weight mixing, how the shipped drafter's stage 7 was made):
alpha 0 and 1 give back the two drafters, 0.5 their mean; the draft vocabulary is carried unchanged; the
result loads and drafts; mismatched drafters, a bad alpha or an existing output are one-line errors with
exit status 2 and leave nothing behind."""

from __future__ import annotations

import sys

import pytest
import torch
from safetensors.torch import load_file

from blockpilot.models.checkpoint import DRAFT_VOCAB_KEY, load_drafter, save_drafter

from builder_fixtures import save_char_tokenizer
from fixtures import TINY, load_script, make_drafter, make_hf_target

DRAFT_VOCAB = torch.arange(3, TINY["vocab_size"], 3)


@pytest.fixture(scope="module")
def script():
    yield load_script("interpolate_drafters")
    sys.modules.pop("interpolate_drafters", None)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """A drafter with a draft vocabulary and a 'fine-tune' of it (other weights, same vocabulary)."""
    tmp = tmp_path_factory.mktemp("interpolate")
    target = save_char_tokenizer(make_hf_target(tmp, "llama"))
    dirs = []
    for seed, name in ((1, "a"), (2, "b")):
        drafter = load_drafter(make_drafter(tmp, target, block_size=4, layers=1, seed=seed, name=f"raw-{name}"))
        drafter.set_draft_vocabulary(DRAFT_VOCAB)
        dirs.append(save_drafter(drafter, tmp / name))
    return tmp, target, *dirs


def test_alpha_zero_and_one_give_the_two_drafters_and_a_half_gives_their_mean(script, pair, tmp_path):
    _, _, a, b = pair
    wa, wb = load_file(a / "model.safetensors"), load_file(b / "model.safetensors")
    for alpha, expect in ((0.0, wa), (1.0, wb)):
        out = tmp_path / f"mix-{alpha}"
        assert script.main(["--a", str(a), "--b", str(b), "--alpha", str(alpha), "--out", str(out)]) == 0
        got = load_file(out / "model.safetensors")
        assert set(got) == set(expect) and all(torch.equal(got[k], expect[k]) for k in expect)
    out = tmp_path / "mix-half"
    assert script.main(["--a", str(a), "--b", str(b), "--alpha", "0.5", "--out", str(out)]) == 0
    got = load_file(out / "model.safetensors")
    floats = [k for k in wa if wa[k].is_floating_point()]
    assert floats and any(not torch.equal(wa[k], wb[k]) for k in floats)
    for k in floats:
        assert got[k].dtype == wa[k].dtype
        torch.testing.assert_close(got[k].float(), (wa[k].float() + wb[k].float()) / 2, rtol=1e-3, atol=1e-3)
    assert torch.equal(got[DRAFT_VOCAB_KEY], DRAFT_VOCAB)
    assert torch.equal(load_drafter(out).draft_vocab_ids, DRAFT_VOCAB)


def test_mismatched_drafters_bad_alpha_and_existing_output_are_one_line_errors(script, pair, tmp_path, capsys):
    tmp, target, a, b = pair
    other_vocab = load_drafter(b)
    other_vocab.set_draft_vocabulary(DRAFT_VOCAB - 1)
    other_vocab = save_drafter(other_vocab, tmp_path / "other-vocab")
    deeper = make_drafter(tmp_path, target, block_size=4, layers=2, seed=3, name="two-layers")
    existing = tmp_path / "existing"
    existing.mkdir()
    cases = [([str(a), str(other_vocab), "0.5", "new-1"], "draft vocabulary"),
             ([str(a), str(deeper), "0.5", "new-2"], "config.json"),
             ([str(a), str(b), "1.5", "new-3"], "outside [0, 1]"),
             ([str(a), str(tmp_path / "missing"), "0.5", "new-4"], "not a drafter directory"),
             ([str(a), str(b), "0.5", "existing"], "exists")]
    for (da, db, alpha, out), words in cases:
        code = script.main(["--a", da, "--b", db, "--alpha", alpha, "--out", str(tmp_path / out)])
        err = capsys.readouterr().err
        assert code == 2 and words in err and err.count("\n") == 1, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["existing", "other-vocab", "two-layers"]
