"""Engine directories: manifest round-trip, checks on load, build-time mistakes, atomic writes."""

import dataclasses
import json
import shutil

import pytest
import torch

from blockpilot.builder.engine_dir import BuildSpec, build_engine_dir, replace_dir_atomically
from blockpilot.builder.manifest import (
    FORMAT_VERSION, MANIFEST_NAME, GraphEntry, Manifest, Profile, read_manifest, write_manifest,
)
from blockpilot.cli import main
from blockpilot.errors import UserError
from blockpilot.runtime.runner import Runner
from blockpilot.runtime.step_costs import cpu_vector_isa

from builder_fixtures import TINY_DRAFTER_BLOCK_SIZE, TINY_MAX_SEQ_LEN, copy_engine_dir, tiny_engine_dir, tiny_models


def _entry(name: str) -> GraphEntry:
    shapes = {"input_ids": ((1, 1), (1, 8), (1, 32)), "past_key_0": ((1, 2, 32, 8),) * 3}
    return GraphEntry(f"{name}.onnx", f"{name}.engine", ("input_ids", "past_key_0"), ("logits", "present_key_0"),
                      1, (Profile("prefill", None, shapes), Profile("block_4", 4, shapes)))


def _manifest(**overrides) -> Manifest:
    fields = dict(dtype="fp16", max_seq_len=32, opset=24, block_sizes=(4,), drafter_block_size=4,
                  tap_layers=(1, 2), mask_token_id=3, target=_entry("target"), drafter=_entry("drafter"),
                  tokenizer_files=("tokenizer.json",), predictor="predictor.onnx", versions={"torch": "2.13.0"})
    return Manifest(**{**fields, **overrides})


def test_manifest_round_trips_through_json_with_file_hashes(tmp_path):
    (tmp_path / "target.onnx").write_bytes(b"graph")
    (tmp_path / "target").mkdir()
    (tmp_path / "target" / "config.json").write_text("{}")
    written = write_manifest(tmp_path, _manifest())
    assert set(written.files) == {"target.onnx", "target/config.json"}
    loaded = read_manifest(tmp_path)
    assert loaded == written
    assert loaded.target.profile_index(4) == 1 and loaded.target.profile_index(None) == 0
    raw = json.loads((tmp_path / MANIFEST_NAME).read_text())
    assert raw["target"]["profile_of_block_size"] == {"prefill": 0, "4": 1}


@pytest.mark.parametrize("damage,needle", [
    (lambda d: (d / "target.onnx").unlink(), "is missing target.onnx"),
    (lambda d: (d / "target" / "config.json").write_text('{"edited": 1}'), "does not match the SHA-256"),
    (lambda d: _edit_manifest(d, format_version=FORMAT_VERSION + 1), "newer than this BlockPilot"),
    (lambda d: _edit_manifest(d, format="something-else"), "not a BlockPilot engine manifest"),
    (lambda d: (d / MANIFEST_NAME).write_text("{not json"), "not a readable engine manifest"),
    (lambda d: (d / MANIFEST_NAME).unlink(), "not an engine directory"),
    (lambda d: shutil.rmtree(d), "does not exist"),
])
def test_damaged_engine_dir_is_a_user_error(tmp_path, damage, needle):
    (tmp_path / "target.onnx").write_bytes(b"graph")
    (tmp_path / "target").mkdir()
    (tmp_path / "target" / "config.json").write_text("{}")
    write_manifest(tmp_path, _manifest())
    damage(tmp_path)
    with pytest.raises(UserError, match=needle):
        read_manifest(tmp_path)


def _edit_manifest(engine_dir, **changes):
    path = engine_dir / MANIFEST_NAME
    path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))


def test_runner_on_modified_engine_dir_is_a_user_error(tmp_path_factory, tmp_path):
    engine = copy_engine_dir(tiny_engine_dir(tmp_path_factory), tmp_path)
    with open(engine / "drafter.onnx", "ab") as stream:
        stream.write(b"\0")
    with pytest.raises(UserError, match="drafter.onnx does not match"):
        Runner.from_dir(engine, backend="onnxruntime")


@pytest.mark.parametrize("backend,block_size", [("onnxruntime", 4), ("onnxruntime", 9), ("torch", 9)])
def test_block_size_without_profile_is_a_user_error(tmp_path_factory, backend, block_size):
    runner = Runner.from_dir(tiny_engine_dir(tmp_path_factory), backend=backend)
    supported = "1, 3, 5" if backend == "onnxruntime" else "1-5"  # the torch backend takes any size up to the largest
    with pytest.raises(UserError, match=f"block size {block_size} is not supported .* supports \\({supported}\\)"):
        runner.generate([torch.tensor([1, 2])], max_new_tokens=4, block_size=block_size)


def test_tensorrt_backend_on_onnx_only_dir_is_a_user_error(tmp_path_factory):
    with pytest.raises(UserError, match="no TensorRT engines|needs a CUDA GPU"):
        Runner.from_dir(tiny_engine_dir(tmp_path_factory), backend="tensorrt", device="cuda")


def test_unknown_backend_and_drafter_dir_with_engine_dir_are_user_errors(tmp_path_factory):
    engine = tiny_engine_dir(tmp_path_factory)
    with pytest.raises(UserError, match="not one of torch, onnxruntime, tensorrt"):
        Runner.from_dir(engine, backend="tvm")
    with pytest.raises(UserError, match="with its own drafter"):
        Runner.from_dir(engine, drafter_dir=engine / "drafter")


def test_engine_dir_carries_the_target_tokenizer(tmp_path_factory):
    from transformers import AutoTokenizer

    engine = tiny_engine_dir(tmp_path_factory)
    target, _ = tiny_models(tmp_path_factory, "llama")
    assert "tokenizer.json" in read_manifest(engine).tokenizer_files
    text = "Hello, engine dir!"
    assert AutoTokenizer.from_pretrained(engine)(text)["input_ids"] == AutoTokenizer.from_pretrained(target)(text)["input_ids"]


@pytest.mark.parametrize("changes,needle", [
    (dict(block_sizes=(1, 4)), "must be >= 2"),
    (dict(max_seq_len=8), "leaves no room"),
    (dict(max_seq_len=100_000), "exceeds the target's max_position_embeddings"),
    (dict(dtype="int8"), "is not one of fp32, fp16, bf16"),
    (dict(predictor="missing.onnx"), "not found"),
])
def test_bad_build_request_is_a_user_error_and_writes_nothing(tmp_path_factory, tmp_path, changes, needle):
    target, drafter = tiny_models(tmp_path_factory, "llama")
    spec = dict(target_dir=target, drafter_dir=drafter, out_dir=tmp_path / "engine", block_sizes=(4,),
                max_seq_len=TINY_MAX_SEQ_LEN)
    with pytest.raises(UserError, match=needle):
        build_engine_dir(BuildSpec(**{**spec, **changes}))
    assert list(tmp_path.iterdir()) == []


def test_build_refuses_to_overwrite_a_directory_that_is_not_an_engine_dir(tmp_path_factory, tmp_path):
    target, drafter = tiny_models(tmp_path_factory, "llama")
    (tmp_path / "precious.txt").write_text("keep me")
    with pytest.raises(UserError, match="is not an engine directory"):
        build_engine_dir(BuildSpec(target, drafter, tmp_path, (4,), TINY_MAX_SEQ_LEN))
    assert (tmp_path / "precious.txt").read_text() == "keep me"


def test_build_with_drafter_of_another_target_is_a_user_error(tmp_path_factory, tmp_path):
    target, _ = tiny_models(tmp_path_factory, "llama")
    from fixtures import make_drafter, make_hf_target

    other = make_hf_target(tmp_path, "qwen3", hidden_size=48, head_dim=12)
    with pytest.raises(UserError, match="does not fit the target"):
        build_engine_dir(BuildSpec(target, make_drafter(tmp_path, other), tmp_path / "engine", (4,), TINY_MAX_SEQ_LEN))
    assert not (tmp_path / "engine").exists()


def test_trt_build_without_tensorrt_is_a_user_error(tmp_path_factory, tmp_path):
    pytest.importorskip("polygraphy")
    try:
        import tensorrt  # noqa: F401

        pytest.skip("tensorrt is installed here")
    except ImportError:
        pass
    target, drafter = tiny_models(tmp_path_factory, "llama")
    with pytest.raises(UserError, match="--trt needs TensorRT"):
        build_engine_dir(BuildSpec(target, drafter, tmp_path / "engine", (4,), TINY_MAX_SEQ_LEN, trt=True))
    assert not (tmp_path / "engine").exists()


def test_failed_fill_leaves_no_directory_and_keeps_the_previous_one(tmp_path):
    def broken(directory):
        (directory / "half.onnx").write_bytes(b"half written")
        raise RuntimeError("export crashed")

    with pytest.raises(RuntimeError):
        replace_dir_atomically(tmp_path / "new", broken)
    assert list(tmp_path.iterdir()) == []
    old = tmp_path / "old"
    replace_dir_atomically(old, lambda d: (d / "v1.txt").write_text("1"))
    with pytest.raises(RuntimeError):
        replace_dir_atomically(old, broken)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["old"] and (old / "v1.txt").read_text() == "1"
    replace_dir_atomically(old, lambda d: (d / "v2.txt").write_text("2"))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["old"] and [p.name for p in old.iterdir()] == ["v2.txt"]


def test_cli_build_mistake_exits_2_with_one_line(tmp_path_factory, tmp_path, capsys):
    target, drafter = tiny_models(tmp_path_factory, "llama")
    code = main(["build", "--target", str(target), "--drafter", str(drafter), "--block-sizes", "4",
                 "--max-seq-len", "6", "--out", str(tmp_path / "engine")])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and "leaves no room" in err
    assert not (tmp_path / "engine").exists()


def _predictor(path, target, drafter, candidates: tuple[int, ...], prefer: int):
    """A predictor for the tiny models that always prefers block size `prefer`."""
    from blockpilot.predictor.export import export_predictor
    from blockpilot.predictor.model import BlockSizeMLP
    from blockpilot.runtime.policy import PredictorInfo, model_files_sha256

    info = PredictorInfo(candidates=candidates, feature_kind="pooled", input_width=32, objective="tau",
                         b_train=TINY_DRAFTER_BLOCK_SIZE, with_temperature=False, threshold=0.0,
                         target_sha256=model_files_sha256(target), drafter_sha256=model_files_sha256(drafter))
    mlp = BlockSizeMLP(32, len(candidates), hidden=8, dropout=0.0)
    with torch.no_grad():
        for parameter in mlp.parameters():
            parameter.zero_()
        mlp.head.bias[candidates.index(prefer)] = 5.0
    export_predictor(mlp, path, info.to_metadata(), torch.randn(3, 32))
    return path


def test_engine_dir_predictor_chooses_the_block_size_by_default(tmp_path_factory, tmp_path):
    engine = copy_engine_dir(tiny_engine_dir(tmp_path_factory), tmp_path)
    target, drafter = tiny_models(tmp_path_factory, "llama")
    _predictor(engine / "predictor.onnx", target, drafter, (3, 5), prefer=5)
    write_manifest(engine, dataclasses.replace(read_manifest(engine, verify_files=False), predictor="predictor.onnx"))
    result = Runner.from_dir(engine).generate([torch.tensor([5, 6, 7])], max_new_tokens=6, end_id=-1, return_dict=True)
    assert result["block_sizes"] == [5] and result["block_size_probs"][0] > 0.9


def test_predictor_that_may_choose_an_unbuilt_block_size_is_rejected_before_building(tmp_path_factory, tmp_path,
                                                                                      capsys):
    target, drafter = tiny_models(tmp_path_factory, "llama")
    predictor = _predictor(tmp_path / "predictor.onnx", target, drafter, (3, 4, 5), prefer=5)
    code = main(["build", "--target", str(target), "--drafter", str(drafter), "--block-sizes", "3,5",
                 "--max-seq-len", str(TINY_MAX_SEQ_LEN), "--predictor", str(predictor), "--out", str(tmp_path / "engine")])
    err = capsys.readouterr().err.strip()
    assert code == 2 and "may choose block size 4" in err and len(err.splitlines()) == 1
    assert not (tmp_path / "engine").exists()


def test_step_costs_round_trip_through_the_manifest_and_older_manifests_read_without_them(tmp_path):
    from blockpilot.builder.manifest import StepCosts

    (tmp_path / "target.onnx").write_bytes(b"graph")
    costs = StepCosts("onnxruntime", "fp32", "AMD EPYC 9B14 x2", 256, {1: 15.1, 4: 16.5}, {4: 2.3})
    written = write_manifest(tmp_path, _manifest(step_costs=costs))
    loaded = read_manifest(tmp_path)
    assert loaded == written and loaded.step_costs == costs
    assert loaded.step_costs.step_ms(1) == 15.1 and loaded.step_costs.step_ms(4) == pytest.approx(18.8)
    with pytest.raises(UserError, match="has no block size 8"):
        loaded.step_costs.step_ms(8)
    raw = json.loads((tmp_path / MANIFEST_NAME).read_text())
    del raw["step_costs"]  # as written before the field existed
    (tmp_path / MANIFEST_NAME).write_text(json.dumps(raw))
    assert read_manifest(tmp_path).step_costs is None


def test_step_costs_are_measured_at_the_sizes_asked_for_on_real_prompts_with_the_rounds_asked_for(
        tmp_path_factory, monkeypatch):
    from blockpilot.runtime import step_costs

    engine_dir = tiny_engine_dir(tmp_path_factory)  # built (and timed) before the count starts
    calls, generations = [], []
    real_loop, real_generate = step_costs.time_decode_loop, Runner.generate

    def counting_loop(runner, sizes, context, new_tokens, rounds=3, prompts=None):
        calls.append((sorted(sizes), new_tokens, rounds, [len(p) for p in prompts]))
        return real_loop(runner, sizes, context, new_tokens, rounds, prompts)

    def counting_generate(self, batch_input_ids, **kwargs):
        generations.append((len(batch_input_ids[0]), kwargs["block_size"], kwargs["max_new_tokens"]))
        return real_generate(self, batch_input_ids, **kwargs)

    monkeypatch.setattr(step_costs, "time_decode_loop", counting_loop)
    monkeypatch.setattr(Runner, "generate", counting_generate)
    costs = step_costs.measure_engine_dir(engine_dir, block_sizes=[3], loop_tokens=6, loop_rounds=2,
                                          loop_prompts=["Hi", "a longer prompt"])
    [(sizes, tokens, rounds, lengths)] = calls
    assert (sizes, tokens, rounds) == ([1, 3], 6, 2) and len(lengths) == 2 and lengths[0] < lengths[1]
    timed = [g for g in generations if g[2] == 6]  # after one short warm-up generation per size
    assert sorted(timed) == sorted([(n, k, 6) for n in lengths for k in (1, 3)] * 2)  # every prompt, size, round
    assert sorted(costs.target_ms) == sorted(costs.loop_ms) == [1, 3] and sorted(costs.drafter_ms) == [3]


def test_cpu_vector_isa_names_amx_tiles_when_the_cpu_has_them(monkeypatch):
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: True, raising=False)
    assert cpu_vector_isa().endswith("+amx")
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False, raising=False)
    assert "amx" not in cpu_vector_isa()


def test_build_measures_step_costs_on_the_built_graphs(tmp_path_factory):
    manifest = read_manifest(tiny_engine_dir(tmp_path_factory))  # built with `blockpilot build`
    costs = manifest.step_costs
    assert (costs.backend, costs.dtype) == ("onnxruntime", "fp32")
    assert costs.machine.endswith(", " + cpu_vector_isa())  # one CPU name covers machines with unlike kernels
    assert sorted(costs.target_ms) == sorted(costs.loop_ms) == [1, 3, 5] and sorted(costs.drafter_ms) == [3, 5]
    assert all(ms > 0 for ms in [*costs.target_ms.values(), *costs.drafter_ms.values(), *costs.loop_ms.values()])
    assert costs.step_ms(3) == costs.loop_ms[3]  # whole loop steps, when measured, are the cost of a step
    assert 0 < costs.context < TINY_MAX_SEQ_LEN
