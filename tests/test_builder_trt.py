"""TensorRT engines (skipped unless `import tensorrt` works and a CUDA GPU is present).

The engines built with `--trt` must generate the same greedy tokens as the onnxruntime backend on
the same engine directory, and an engine TensorRT cannot deserialize (another GPU or TensorRT
version; here: garbage bytes with a matching manifest) must be a `UserError` saying to rebuild.
"""

import pytest
import torch

from blockpilot.builder.engine_dir import BuildSpec, build_engine_dir
from blockpilot.builder.manifest import read_manifest, write_manifest
from blockpilot.errors import UserError
from blockpilot.runtime.runner import Runner

from builder_fixtures import TINY_BLOCK_SIZES, TINY_MAX_SEQ_LEN, tiny_models

pytestmark = pytest.mark.trt
tensorrt = pytest.importorskip("tensorrt", reason="TensorRT is not installed")
if not torch.cuda.is_available():
    pytest.skip("TensorRT tests need a CUDA GPU", allow_module_level=True)


@pytest.fixture(scope="module", params=[24, 18], ids=["opset24", "opset18"])
def trt_engine_dir(request, tmp_path_factory):
    target, drafter = tiny_models(tmp_path_factory, "llama")
    out = tmp_path_factory.mktemp("trt") / f"engine-opset{request.param}"
    build_engine_dir(BuildSpec(target, drafter, out, TINY_BLOCK_SIZES, TINY_MAX_SEQ_LEN, trt=True,
                               opset=request.param))
    return out


def test_trt_build_records_engines_with_one_profile_per_block_size(trt_engine_dir):
    manifest = read_manifest(trt_engine_dir)
    assert manifest.has_engines and {"target.engine", "drafter.engine"} <= set(manifest.files)
    engine = tensorrt.Runtime(tensorrt.Logger()).deserialize_cuda_engine((trt_engine_dir / "target.engine").read_bytes())
    assert engine.num_optimization_profiles == len(manifest.target.profiles) == 2 + len(TINY_BLOCK_SIZES)


def test_greedy_tensorrt_equals_onnxruntime(trt_engine_dir):
    trt_runner = Runner.from_dir(trt_engine_dir, backend="tensorrt")
    onnx_runner = Runner.from_dir(trt_engine_dir, backend="onnxruntime")
    assert Runner.from_dir(trt_engine_dir).backend.name == "tensorrt"  # the automatic choice with a GPU
    for block_size in (1, *TINY_BLOCK_SIZES):
        for ids in ([5, 17, 42, 8], [60]):
            kwargs = dict(max_new_tokens=16, block_size=block_size, end_id=-1)
            ours = trt_runner.generate([torch.tensor(ids)], **kwargs)
            assert ours.cpu().tolist() == onnx_runner.generate([torch.tensor(ids)], **kwargs).tolist(), block_size


def test_engine_tensorrt_cannot_load_is_a_user_error(trt_engine_dir, tmp_path):
    import shutil

    engine = shutil.copytree(trt_engine_dir, tmp_path / "engine")
    (engine / "target.engine").write_bytes(b"not an engine of this TensorRT version")
    write_manifest(engine, read_manifest(engine, verify_files=False))  # re-hash: only TensorRT can object
    with pytest.raises(UserError, match="rebuild with `blockpilot build --trt` on this machine"):
        Runner.from_dir(engine, backend="tensorrt")
