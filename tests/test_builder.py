"""The exported graphs equal the torch backend at every optimization profile's exact shapes.

Each profile of the manifest (target: prefill, block sizes 1, 3, 5; drafter: block sizes 3, 5)
is run through onnxruntime at its min, opt and max shapes (the shapes a TensorRT engine is built
for) and compared with `TorchBackend` on the same inputs: logits, tapped and final hidden states,
greedy draft tokens, and the whole updated caches. Two builds: Llama at opset 24 (TensorScatter,
Attention) and Qwen3 (QK-norm) at opset 18 (ScatterND, MatMul/Softmax, weights in `.data` files).
"""

import numpy as np
import onnx
import pytest
import torch

from blockpilot.builder.manifest import read_manifest
from blockpilot.builder.profiles import SHAPE_CHOICES, drafter_feed, profile_shapes, target_feed
from blockpilot.models.checkpoint import load_drafter, load_target
from blockpilot.models.decoder import KVCache
from blockpilot.runtime.backend import DecodeState, TorchBackend
from blockpilot.runtime.onnx_backend import make_session

from builder_fixtures import TINY_BLOCK_SIZES, TINY_MAX_SEQ_LEN, tiny_engine_dir

ATOL, RTOL = 1e-4, 1e-4


@pytest.fixture(scope="module", params=[("llama", 24), ("qwen3", 18)], ids=["llama-opset24", "qwen3-opset18"])
def built(request, tmp_path_factory):
    family, opset = request.param
    engine = tiny_engine_dir(tmp_path_factory, family, opset)
    manifest = read_manifest(engine)
    target = load_target(engine / "target", max_positions=manifest.max_seq_len)
    drafter = load_drafter(engine / "drafter", max_positions=manifest.max_seq_len)
    sessions = {name: make_session(engine / f"{name}.onnx", threads=1) for name in ("target", "drafter")}
    return engine, manifest, TorchBackend(target, drafter, max_block_size=max(TINY_BLOCK_SIZES)), sessions


def _caches(feed: dict, names: list[str]) -> KVCache:
    tensors = [torch.from_numpy(feed[n].copy()) for n in names]
    return KVCache(k=tensors[0::2], v=tensors[1::2])


def _close(actual: np.ndarray, expected: torch.Tensor, what: str) -> None:
    np.testing.assert_allclose(actual, expected.numpy(), atol=ATOL, rtol=RTOL, err_msg=what)


def _check_caches(outputs: dict, cache: KVCache, present_names: list[str], what: str) -> None:
    expected = [c for pair in zip(cache.k, cache.v) for c in pair]
    for name, tensor in zip(present_names, expected):
        _close(outputs[name], tensor, f"{what}: {name}")


def test_manifest_lists_one_profile_per_block_size_plus_prefill(built):
    _, manifest, _, _ = built
    assert [p.name for p in manifest.target.profiles] == ["prefill", "block_1", "block_3", "block_5"]
    assert [p.block_size for p in manifest.drafter.profiles] == list(TINY_BLOCK_SIZES)
    assert manifest.target.profile_index(None) == 0 and manifest.target.profile_index(5) == 3
    assert manifest.drafter.profile_index(4) is None
    for entry in (manifest.target, manifest.drafter):
        for profile in entry.profiles:
            for name in entry.inputs:
                low, opt, high = profile.shapes[name]
                if name.startswith("past_"):
                    assert low == opt == high and low[2] == TINY_MAX_SEQ_LEN, (profile.name, name)
                elif profile.block_size is not None and name not in ("context_taps", "context_positions"):
                    assert low == opt == high, (profile.name, name)


def test_onnx_graph_io_names_match_the_manifest_and_external_weights_are_hashed(built):
    engine, manifest, _, _ = built
    for entry in (manifest.target, manifest.drafter):
        if manifest.opset == 18:  # built with external data
            assert f"{entry.onnx}.data" in manifest.files
        model = onnx.load(str(engine / entry.onnx), load_external_data=False)
        assert tuple(i.name for i in model.graph.input) == entry.inputs
        assert tuple(o.name for o in model.graph.output) == entry.outputs
        assert [o.version for o in model.opset_import if o.domain in ("", "ai.onnx")] == [manifest.opset]


def test_target_graph_equals_torch_backend_at_every_profile_shape(built):
    _, manifest, reference, sessions = built
    entry, rng = manifest.target, np.random.default_rng(0)
    past, present = entry.past_names, entry.present_names
    for profile in entry.profiles:
        for choice in SHAPE_CHOICES:
            what = f"target {profile.name} {choice}"
            prefill = profile.block_size is None
            feed = target_feed(profile_shapes(profile, choice), past, reference.target_config.vocab_size,
                               manifest.dtype, rng, prefill=prefill)
            outputs = dict(zip(entry.outputs, sessions["target"].run(None, feed)))
            state = DecodeState(_caches(feed, past), None, feed[past[0]].shape[2])
            ids = torch.from_numpy(feed["input_ids"])
            if prefill:
                expected = reference.prefill(state, ids)
                _close(outputs["logits"][:, 0], expected.last_logits, f"{what}: logits")
                _close(outputs["hidden"], expected.hidden, f"{what}: hidden")
            else:
                expected = reference.verify(state, ids, int(feed["positions"][0, 0]))
                _close(outputs["logits"], expected.logits, f"{what}: logits")
            _close(outputs["taps"], expected.taps, f"{what}: taps")
            _check_caches(outputs, state.target_cache, present, what)


def test_drafter_graph_equals_torch_backend_at_every_profile_shape(built):
    _, manifest, reference, sessions = built
    entry, rng = manifest.drafter, np.random.default_rng(1)
    past, present = entry.past_names, entry.present_names
    for profile in entry.profiles:
        for choice in SHAPE_CHOICES:
            what = f"drafter {profile.name} {choice}"
            feed = drafter_feed(profile_shapes(profile, choice), past, reference.target_config.vocab_size,
                                manifest.dtype, rng)
            outputs = dict(zip(entry.outputs, sessions["drafter"].run(None, feed)))
            state = DecodeState(None, _caches(feed, past), feed[past[0]].shape[2])
            expected = reference.draft(
                state, torch.from_numpy(feed["last_token"][:, 0]), torch.from_numpy(feed["context_taps"]),
                int(feed["context_positions"][0, 0]), int(feed["block_positions"][0, 0]), profile.block_size,
                with_logits=True)
            assert outputs["draft_ids"].tolist() == expected.ids.tolist(), what
            _close(outputs["draft_logits"], expected.logits, f"{what}: draft logits")  # sampled drafts' proposal
            _check_caches(outputs, state.drafter_cache, present, what)


def test_graphs_carry_rows_at_different_positions_like_the_torch_backend(built):
    """A batch of 3 rows, each at its own start and context length, in one call of each graph."""
    _, manifest, reference, sessions = built
    rng, k, capacity = np.random.default_rng(2), 3, manifest.max_seq_len
    starts = np.array([4, 11, 7])
    target, drafter = manifest.target, manifest.drafter
    feed = {"input_ids": rng.integers(0, reference.target_config.vocab_size, (3, k)).astype(np.int64),
            "positions": (starts[:, None] + np.arange(k)).astype(np.int64), "logits_index": np.arange(k)}
    shape = (3, reference.target_config.num_key_value_heads, capacity, reference.target_config.head_dim)
    feed.update({n: rng.standard_normal(shape).astype(np.float32) for n in target.past_names})
    outputs = dict(zip(target.outputs, sessions["target"].run(None, feed)))
    state = DecodeState(_caches(feed, target.past_names), None, capacity)
    expected = reference.verify(state, torch.from_numpy(feed["input_ids"]), torch.from_numpy(starts))
    _close(outputs["logits"], expected.logits, "batched target: logits")
    _check_caches(outputs, state.target_cache, target.present_names, "batched target")

    counts, n = np.array([1, 3, 2]), 3  # rows committed 1, 3 and 2 tokens: n = 3 context columns each
    dc = reference.drafter_config
    taps = rng.standard_normal((3, n, len(dc.target_layer_ids) * dc.layers.hidden_size)).astype(np.float32)
    feed = {"last_token": rng.integers(0, reference.target_config.vocab_size, (3, 1)).astype(np.int64),
            "block_positions": ((starts + counts)[:, None] + np.arange(k)).astype(np.int64),
            "context_taps": taps, "context_positions": (starts[:, None] + np.arange(n)).astype(np.int64),
            "context_length": (starts + counts)[:, None].astype(np.int64)}
    shape = (3, dc.layers.num_key_value_heads, capacity, dc.layers.head_dim)
    feed.update({name: rng.standard_normal(shape).astype(np.float32) for name in drafter.past_names})
    outputs = dict(zip(drafter.outputs, sessions["drafter"].run(None, feed)))
    state = DecodeState(None, _caches(feed, drafter.past_names), capacity)
    expected = reference.draft(state, torch.from_numpy(feed["last_token"][:, 0]), torch.from_numpy(taps),
                               torch.from_numpy(starts), torch.from_numpy(starts + counts), k,
                               new_counts=torch.from_numpy(counts))
    assert outputs["draft_ids"].tolist() == expected.tolist()
    _check_caches(outputs, state.drafter_cache, drafter.present_names, "batched drafter")
