"""The embedded default's engine directory in the user cache: built once, reused, rebuilt when what it is
built from changes (and the stale one removed), never used half-written."""

import json
import shutil

import pytest

from blockpilot.builder import embedded
from blockpilot.builder.manifest import MANIFEST_NAME

from builder_fixtures import tiny_models


@pytest.fixture
def assets(tmp_path_factory, tmp_path, monkeypatch):
    """The embedded default's assets replaced by tiny models in `tmp_path` (the drafter a private copy)."""
    import blockpilot.assets as assets_module
    import blockpilot.assets.packages as packages
    import blockpilot.assets.smollm2 as smollm2

    target, drafter = tiny_models(tmp_path_factory, "llama")
    drafter = shutil.copytree(drafter, tmp_path / "drafter")
    (target / smollm2.SOURCE_MARKER).write_text("tiny\n")
    monkeypatch.setattr(smollm2, "smollm2_dir", lambda: target)
    monkeypatch.setattr(assets_module, "default_drafter_dir", lambda: drafter)
    monkeypatch.setattr(assets_module, "default_predictor_path", lambda: None)
    monkeypatch.setattr(packages, "cache_dir", lambda: tmp_path / "cache")
    monkeypatch.setattr(embedded, "BLOCK_SIZES", (3,))
    monkeypatch.setattr(embedded, "MAX_SEQ_LEN", 40)
    import blockpilot.builder.engine_dir as engine_dir

    builds, real_build = [], engine_dir.build_engine_dir

    def counted_build(spec, log):
        builds.append(spec.out_dir)
        return real_build(spec, log=log)

    monkeypatch.setattr(engine_dir, "build_engine_dir", counted_build)
    return drafter, builds


def _engines(tmp_path):
    return sorted(p.name for p in (tmp_path / "cache" / "engines").iterdir())


def test_built_once_then_reused(assets, tmp_path):
    _, builds = assets
    first = embedded.embedded_engine_dir(log=lambda line: None)
    assert (first / MANIFEST_NAME).is_file() and (first / "drafter.int4.onnx").is_file()
    assert embedded.embedded_engine_dir(log=lambda line: None) == first
    assert builds == [first] and _engines(tmp_path) == [first.name]


def test_a_changed_drafter_builds_a_new_directory_and_removes_the_old_but_a_model_card_edit_does_not(assets, tmp_path):
    drafter, builds = assets
    first = embedded.embedded_engine_dir(log=lambda line: None)
    (drafter / "MODEL_CARD.md").write_text("edited\n")
    assert embedded.embedded_engine_dir(log=lambda line: None) == first and len(builds) == 1
    weights = next(drafter.glob("*.safetensors"))
    weights.write_bytes(weights.read_bytes())  # same bytes: same key
    assert embedded.embedded_engine_dir(log=lambda line: None) == first and len(builds) == 1
    config = json.loads((drafter / "config.json").read_text())
    (drafter / "config.json").write_text(json.dumps({**config, "note": "retrained"}))
    second = embedded.embedded_engine_dir(log=lambda line: None)
    assert second != first and len(builds) == 2
    assert _engines(tmp_path) == [second.name]  # the stale one is gone


def test_a_directory_without_its_manifest_is_rebuilt_in_place(assets, tmp_path):
    _, builds = assets
    first = embedded.embedded_engine_dir(log=lambda line: None)
    (first / MANIFEST_NAME).unlink()  # what an interrupted copy by hand would leave
    assert embedded.embedded_engine_dir(log=lambda line: None) == first and len(builds) == 2
    assert (first / MANIFEST_NAME).is_file()
