"""Generation through the onnxruntime backend is token-identical to the torch backend.

Both backends open the same engine directory (`Runner.from_dir(engine_dir, backend=...)`); the
torch one runs the original weights kept in it. Tiny Llama (opset 24, with the 4-bit drafter copy
onnxruntime drafts with: other drafts, the same tokens) and Qwen3 (opset 18, fp32 drafter graph:
the same drafts too) builds; SmolLM2-135M (slow) when its converted folder exists.
"""

import numpy as np
import pytest
import torch

from blockpilot.runtime.runner import Runner

from builder_fixtures import TINY_BLOCK_SIZES, tiny_engine_dir

PROMPTS = [[5, 17, 42, 8], [60], list(range(1, 14))]


@pytest.fixture(scope="module", params=[("llama", 24), ("qwen3", 18)], ids=["llama-opset24", "qwen3-opset18"])
def runners(request, tmp_path_factory):
    engine = tiny_engine_dir(tmp_path_factory, *request.param)
    return Runner.from_dir(engine, backend="onnxruntime"), Runner.from_dir(engine, backend="torch")


def _generate(runner, ids, **kwargs):
    return runner.generate([torch.tensor(ids)], max_new_tokens=20, end_id=-1, return_dict=True, **kwargs)


def test_greedy_onnxruntime_equals_torch_for_every_built_block_size(runners):
    onnx_runner, torch_runner = runners
    assert onnx_runner.backend.name == "onnxruntime" and torch_runner.backend.name == "torch"
    same_drafts = onnx_runner.backend.manifest.ort_drafter is None  # the fp32 drafter graph drafts as torch does
    for block_size in (1, *TINY_BLOCK_SIZES):
        for ids in PROMPTS:
            ours = _generate(onnx_runner, ids, block_size=block_size)
            reference = _generate(torch_runner, ids, block_size=block_size)
            what = f"block size {block_size}, prompt {ids}"
            assert ours["output_ids"].tolist() == reference["output_ids"].tolist(), what
            if same_drafts:
                assert ours["accept_lengths"] == reference["accept_lengths"], what


def test_sampling_onnxruntime_equals_torch_with_the_same_seed(runners):
    onnx_runner, torch_runner = runners
    if onnx_runner.backend.manifest.ort_drafter is not None:
        pytest.skip("4-bit drafts differ from torch's, so do the draws; their distribution: test_batching")
    kwargs = dict(block_size=TINY_BLOCK_SIZES[-1], temperature=0.8, top_k=20, top_p=0.9, random_seed=7)
    ours, reference = _generate(onnx_runner, PROMPTS[0], **kwargs), _generate(torch_runner, PROMPTS[0], **kwargs)
    assert ours["output_ids"].tolist() == reference["output_ids"].tolist()


def test_onnxruntime_drafts_with_the_4bit_drafter_copy_of_the_engine_dir_and_its_outputs_equal_plain_decoding(
        tmp_path_factory):
    import onnx

    engine = tiny_engine_dir(tmp_path_factory, "llama", 24)
    runner = Runner.from_dir(engine, backend="onnxruntime")
    manifest = runner.backend.manifest
    assert manifest.ort_drafter == "drafter.int4.onnx" and manifest.ort_drafter in manifest.files  # hashed
    assert runner.backend.drafter.path == engine / "drafter.int4.onnx"
    graph = onnx.load(str(engine / manifest.ort_drafter)).graph
    weights = {i.name for i in graph.initializer}
    assert "MatMulNBits" in {n.op_type for n in graph.node}
    assert not [n.name for n in graph.node if n.op_type == "MatMul" and n.input[1] in weights]  # all 4-bit
    for block_size in TINY_BLOCK_SIZES:
        for ids in PROMPTS:
            plain = _generate(runner, ids, block_size=1)["output_ids"].tolist()
            assert _generate(runner, ids, block_size=block_size)["output_ids"].tolist() == plain


def test_writing_the_4bit_drafter_prints_nothing(tmp_path_factory, tmp_path):
    import subprocess
    import sys

    engine = tiny_engine_dir(tmp_path_factory, "llama", 24)
    code = ("import sys; from pathlib import Path; from blockpilot.builder.quantize import write_int4_drafter; "
            "write_int4_drafter(Path(sys.argv[1]), Path(sys.argv[2])); import logging; logging.getLogger('x').info('y')")
    done = subprocess.run([sys.executable, "-c", code, str(engine / "drafter.onnx"), str(tmp_path / "q.onnx")],
                          capture_output=True, text=True, check=True)
    assert done.stderr == "" and done.stdout == "" and (tmp_path / "q.onnx").is_file()


def test_4bit_drafter_copy_of_a_graph_with_external_weights_keeps_them_beside_it(tmp_path_factory, tmp_path):
    from blockpilot.builder.engine_dir import BuildSpec, build_engine_dir

    from builder_fixtures import TINY_MAX_SEQ_LEN, tiny_models

    target, drafter = tiny_models(tmp_path_factory, "llama")
    out = tmp_path / "engine"
    build_engine_dir(BuildSpec(target, drafter, out, (3,), TINY_MAX_SEQ_LEN, external_data_bytes=0))
    runner = Runner.from_dir(out, backend="onnxruntime")
    hashed = runner.backend.manifest.files
    assert "drafter.int4.onnx" in hashed and [n for n in hashed if n.startswith("drafter.int4.onnx.")]  # its .data
    assert _generate(runner, PROMPTS[2], block_size=3)["output_ids"].tolist() == \
        _generate(runner, PROMPTS[2], block_size=1)["output_ids"].tolist()


def test_build_without_the_4bit_drafter_writes_none_and_onnxruntime_drafts_with_drafter_onnx(tmp_path_factory):
    engine = tiny_engine_dir(tmp_path_factory, "qwen3", 18)  # built with int4_drafter=False
    runner = Runner.from_dir(engine, backend="onnxruntime")
    assert runner.backend.manifest.ort_drafter is None and not (engine / "drafter.int4.onnx").exists()
    assert runner.backend.drafter.path == engine / "drafter.onnx"


def test_engine_dir_without_backend_opens_onnxruntime_with_the_closest_built_default_block_size(tmp_path_factory):
    runner = Runner.from_dir(tiny_engine_dir(tmp_path_factory, "llama", 24))
    assert runner.backend.name == "onnxruntime"
    assert runner.default_block_size == 3  # drafter trained at 4; 3 and 5 are built, ties go to the smaller


def test_opset24_caches_are_updated_in_place(tmp_path_factory):
    backend = Runner.from_dir(tiny_engine_dir(tmp_path_factory, "llama", 24), backend="onnxruntime").backend
    state = backend.new_state(1, 16)
    before = list(state.target_cache)
    backend.prefill(state, torch.tensor([[5, 6, 7]]))
    assert all(a is b for a, b in zip(state.target_cache, before))
    written = state.target_cache[0].numpy()  # (1, nkv, 16, hd): positions 0..2 written, the rest untouched
    assert np.abs(written[:, :, :3]).min() > 0 and not written[:, :, 3:].any()


@pytest.mark.slow
def test_smollm2_greedy_onnxruntime_equals_torch(tmp_path_factory, monkeypatch):
    from blockpilot.assets import smollm2
    from blockpilot.runtime.ort_session import CACHE_ENV

    monkeypatch.setenv(CACHE_ENV, "0")  # no 1.2 GB copy in the user cache for a temporary engine dir

    folder = smollm2.cache_dir() / smollm2.SMOLLM2_DIR_NAME
    if not (folder / smollm2.SOURCE_MARKER).is_file():
        pytest.skip("SmolLM2 has not been converted on this machine (run blockpilot demo once)")
    from blockpilot.builder.engine_dir import BuildSpec, build_engine_dir

    tmp = tmp_path_factory.mktemp("smollm2")
    drafter = _smollm2_drafter(tmp, smollm2.smollm2_dir())
    engine = tmp / "engine"
    build_engine_dir(BuildSpec(smollm2.smollm2_dir(), drafter, engine, (16,), 96))
    onnx_runner, torch_runner = Runner.from_dir(engine, backend="onnxruntime"), Runner.from_dir(engine, backend="torch")
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(engine)  # the tokenizer files copied into the engine dir
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "Write a haiku about rivers."}],
                                           add_generation_prompt=True, tokenize=True, return_dict=False)
    for block_size in (1, 16):
        ours = onnx_runner.generate([torch.tensor(prompt)], max_new_tokens=24, end_id=-1, block_size=block_size)
        reference = torch_runner.generate([torch.tensor(prompt)], max_new_tokens=24, end_id=-1, block_size=block_size)
        assert ours.tolist() == reference.tolist(), f"block size {block_size}"


def _smollm2_drafter(tmp, target_dir):
    """The shipped SmolLM2 drafter when installed, else a random one of the shape it would have."""
    from blockpilot.assets import default_drafter_dir
    from blockpilot.errors import UserError

    try:
        return default_drafter_dir()
    except UserError:
        from fixtures import make_drafter

        return make_drafter(tmp, target_dir, block_size=16, layers=1, mask_token_id=16)
