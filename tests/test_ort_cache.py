"""What opening an engine directory keeps in the user cache: file digests remembered by stat, and
optimized onnxruntime graphs with their prepacked weights (`runtime/ort_session.open_session`).

Neither may change a result or hide a damaged file: a file written after it was checked is hashed
again, a cached graph runs bit-identically to the graph it was made from, and a cached copy that
was modified, or made from other files, is made again.
"""

import os
from pathlib import Path

import numpy as np
import pytest
import torch

from blockpilot.builder.manifest import read_manifest
from blockpilot.errors import UserError
from blockpilot.files import remembered_digest
from blockpilot.runtime import ort_session
from blockpilot.runtime.runner import Runner

from builder_fixtures import TINY_BLOCK_SIZES, copy_engine_dir, tiny_engine_dir

PROMPT = [5, 17, 42, 8, 3, 29]


@pytest.fixture
def cache(tmp_path, monkeypatch):
    root = tmp_path / "cache"
    monkeypatch.setenv("BLOCKPILOT_CACHE", str(root))
    monkeypatch.delenv(ort_session.CACHE_ENV, raising=False)
    return root


def _overwrite_same_size(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def test_a_remembered_digest_is_computed_again_only_when_a_file_changes(cache, tmp_path):
    path = tmp_path / "weights.bin"
    path.write_bytes(b"a" * 1000)
    calls = []

    def digest():
        calls.append(1)
        return path.read_bytes().hex()[:8] + str(len(calls))

    first = remembered_digest("test", [path], digest)
    assert remembered_digest("test", [path], digest) == first and len(calls) == 1
    assert remembered_digest("other kind", [path], digest) != first and len(calls) == 2

    stat = path.stat()
    _overwrite_same_size(path)
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))  # same size and mtime: the ctime still moved
    assert remembered_digest("test", [path], digest) != first and len(calls) == 3


def test_an_engine_file_modified_after_a_checked_open_is_still_caught(cache, tmp_path_factory, tmp_path):
    engine = copy_engine_dir(tiny_engine_dir(tmp_path_factory), tmp_path)
    read_manifest(engine)  # checked, and remembered
    target = engine / read_manifest(engine, verify_files=False).target.onnx
    stat = target.stat()
    _overwrite_same_size(target)
    os.utime(target, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    with pytest.raises(UserError, match="does not match the SHA-256"):
        read_manifest(engine)


def _logits_and_greedy(engine: Path) -> tuple[torch.Tensor, list[list[int]]]:
    runner = Runner.from_dir(engine, backend="onnxruntime")
    backend = runner.backend
    logits = backend.prefill(backend.new_state(1, 16), torch.tensor([PROMPT])).last_logits
    outputs = [runner.generate([torch.tensor(PROMPT)], max_new_tokens=12, end_id=-1, block_size=size,
                               return_dict=True)["output_ids"].tolist() for size in (1, *TINY_BLOCK_SIZES)]
    return logits, outputs


def _entries(cache: Path) -> list[Path]:
    root = cache / "ort-optimized"
    return sorted(p for p in root.iterdir() if not p.name.startswith(".")) if root.is_dir() else []


def test_cached_optimized_graphs_run_bit_identically_and_are_reused(cache, tmp_path_factory, tmp_path, monkeypatch):
    engine = copy_engine_dir(tiny_engine_dir(tmp_path_factory), tmp_path)
    monkeypatch.setenv(ort_session.CACHE_ENV, "0")
    plain_logits, plain_outputs = _logits_and_greedy(engine)
    assert _entries(cache) == []
    monkeypatch.delenv(ort_session.CACHE_ENV)
    monkeypatch.setattr(ort_session, "CACHE_MIN_BYTES", 0)  # the tiny graphs are far below the real threshold

    logits, outputs = _logits_and_greedy(engine)  # writes a copy of each graph
    entries = _entries(cache)
    assert len(entries) == 2 and all((e / "meta.json").is_file() and (e / "model.onnx").is_file() for e in entries)
    assert torch.equal(logits, plain_logits) and outputs == plain_outputs
    assert outputs[1:] == [outputs[0]] * len(TINY_BLOCK_SIZES)  # speculative = plain decoding, every block size

    def no_rebuild(*args, **kwargs):
        raise AssertionError("an intact cached graph was made again")

    with monkeypatch.context() as patch:
        patch.setattr(ort_session, "_session_saving_copy", no_rebuild)
        logits, outputs = _logits_and_greedy(engine)  # from the copies
    assert torch.equal(logits, plain_logits) and outputs == plain_outputs


def test_a_modified_cached_graph_is_made_again(cache, tmp_path_factory, tmp_path, monkeypatch):
    engine = copy_engine_dir(tiny_engine_dir(tmp_path_factory), tmp_path)
    monkeypatch.setenv(ort_session.CACHE_ENV, "0")
    plain_logits, _ = _logits_and_greedy(engine)
    monkeypatch.delenv(ort_session.CACHE_ENV)
    monkeypatch.setattr(ort_session, "CACHE_MIN_BYTES", 0)
    _logits_and_greedy(engine)
    for entry in _entries(cache):
        _overwrite_same_size(entry / "model.data")
    rebuilt = []
    original = ort_session._session_saving_copy
    monkeypatch.setattr(ort_session, "_session_saving_copy", lambda *a: rebuilt.append(1) or original(*a))
    logits, _ = _logits_and_greedy(engine)
    assert len(rebuilt) == 2 and torch.equal(logits, plain_logits)


def test_a_copy_made_from_other_files_is_replaced_and_copies_of_deleted_graphs_are_pruned(cache, tmp_path,
                                                                                          monkeypatch):
    monkeypatch.setattr(ort_session, "CACHE_MIN_BYTES", 0)
    graph = _tiny_graph(tmp_path / "graph.onnx", 1.0)
    ort_session.open_session(graph, source_digest="a")
    (entry,) = _entries(cache)
    _tiny_graph(graph, 2.0)  # the same path, other weights: another digest of the engine's files
    session = ort_session.open_session(graph, source_digest="b")
    assert _entries(cache) == [entry] and '"b"' in (entry / "meta.json").read_text().replace(" ", "")
    assert session.run(None, {"x": np.ones((1, 2), np.float32)})[0].tolist() == [[4.0]]

    other = _tiny_graph(tmp_path / "other.onnx", 1.0)
    ort_session.open_session(other, source_digest="c")
    assert len(_entries(cache)) == 2
    graph.unlink()
    ort_session.open_session(_tiny_graph(tmp_path / "third.onnx", 1.0), source_digest="d")
    assert entry not in _entries(cache) and len(_entries(cache)) == 2


def test_an_unwritable_cache_or_the_switch_leaves_plain_sessions(tmp_path, monkeypatch):
    monkeypatch.setattr(ort_session, "CACHE_MIN_BYTES", 0)
    graph = _tiny_graph(tmp_path / "graph.onnx", 1.0)
    (tmp_path / "not-a-dir").write_text("")
    monkeypatch.setenv("BLOCKPILOT_CACHE", str(tmp_path / "not-a-dir"))
    assert ort_session.open_session(graph, source_digest="a").run(None, {"x": np.array([[1.0, 2.0]], np.float32)})[0].tolist() == [[3.0]]

    monkeypatch.setenv("BLOCKPILOT_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv(ort_session.CACHE_ENV, "0")
    ort_session.open_session(graph, source_digest="a")
    assert not (tmp_path / "cache").exists()


def _tiny_graph(path: Path, scale: float) -> Path:
    """y = x @ W with W = scale * ones(2, 1): a graph whose weights can change while its path does not."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    weight = numpy_helper.from_array(np.full((2, 1), scale, np.float32), "W")
    graph = helper.make_graph([helper.make_node("MatMul", ["x", "W"], ["y"])], "tiny",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 2])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 1])], [weight])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(path))
    return path


def test_remembered_digests_of_files_that_are_gone_are_pruned(cache, tmp_path, monkeypatch):
    from blockpilot import files

    monkeypatch.setattr(files, "DIGESTS_KEPT", 3)
    paths = [tmp_path / f"f{i}" for i in range(5)]
    for path in paths:
        path.write_text(path.name)
    for path in paths[:3]:
        remembered_digest("test", [path], lambda: "x")
    paths[0].unlink()
    paths[1].write_text("changed")
    remembered_digest("test", [paths[3]], lambda: "x")  # the fourth entry: over the limit
    assert len(list((cache / "digests").iterdir())) == 2  # paths[2] and paths[3]
    calls = []
    remembered_digest("test", [paths[2]], lambda: calls.append(1) or "x")
    assert calls == []


def test_sessions_opened_without_cached_copies_save_none(cache, tmp_path, monkeypatch):
    monkeypatch.setattr(ort_session, "CACHE_MIN_BYTES", 0)
    graph = _tiny_graph(tmp_path / "graph.onnx", 1.0)
    with ort_session.without_cached_copies():
        ort_session.open_session(graph, source_digest="a")
    assert _entries(cache) == []
    ort_session.open_session(graph, source_digest="a")
    assert len(_entries(cache)) == 1
