"""BlockPilot's TensorRT code against the real TensorRT 11.4 Python API (bindings wheel + stand-in libraries).

The package's modules that import tensorrt or polygraphy are found by walking the source tree, and
`trt_api.py` checks every TensorRT/polygraphy name and call in them against the real bindings, in a
subprocess where they import (`trt_bindings.py`). Skipped only when gcc/binutils or the bindings
wheel are missing.
"""

import json
import re
from pathlib import Path

import pytest

from trt_api import imports_tracked, parse_signature_line
from trt_bindings import BINDINGS_WHEEL, build_stand_in_libraries, run_with_bindings, unavailable_reason

ROOT = Path(__file__).resolve().parents[1]
CHECKER = Path(__file__).with_name("trt_api.py")
MISUSE = Path(__file__).parent / "data" / "trt_api_misuse.py"


@pytest.fixture(scope="session")
def stand_ins(tmp_path_factory):
    reason = unavailable_reason()
    if reason is not None:
        pytest.skip(reason)
    return build_stand_in_libraries(tmp_path_factory.mktemp("tensorrt-stand-ins"))


def tensorrt_modules() -> list[Path]:
    """Every module of the package and its scripts that imports tensorrt or polygraphy."""
    files = sorted([*(ROOT / "src" / "blockpilot").rglob("*.py"), *(ROOT / "scripts").rglob("*.py")])
    return [path for path in files if imports_tracked(path)]


def check(stand_ins, paths) -> dict:
    result = run_with_bindings(stand_ins, [str(CHECKER), *map(str, paths)], cwd=ROOT)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout)


def test_real_bindings_import_and_refuse_to_build_native_objects(stand_ins):
    code = ("import tensorrt_bindings as trt\n"
            "try:\n    trt.Builder(trt.Logger())\nexcept TypeError as exc:\n    print(trt.__version__, exc)\n")
    result = run_with_bindings(stand_ins, ["-c", code], cwd=ROOT)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.split()[0] == BINDINGS_WHEEL.split("==")[1]
    assert "factory function returned nullptr" in result.stdout


def test_package_tensorrt_code_matches_the_real_tensorrt_api(stand_ins):
    modules = tensorrt_modules()
    names = {p.relative_to(ROOT).as_posix() for p in modules}
    assert {"src/blockpilot/builder/trt.py", "src/blockpilot/runtime/trt_backend.py", "scripts/check_trt.py"} <= names
    result = check(stand_ins, modules)
    problems = [f"{Path(f['file']).relative_to(ROOT)}:{f['line']}: {f['message']}" for f in result["findings"]]
    assert not problems, "TensorRT API mismatches:\n" + "\n".join(problems)
    checked = {Path(k).relative_to(ROOT).as_posix(): v for k, v in result["checked"].items()}
    # the walk follows engines and contexts into the backend's methods, not only module attributes
    assert any(name.startswith("IExecutionContext.") for name in checked["src/blockpilot/runtime/trt_backend.py"])
    assert all(checked[name] for name in names), "a module importing tensorrt/polygraphy had nothing checked"


def test_every_wrong_tensorrt_call_of_the_fixture_fails_the_api_check(stand_ins):
    expected = {}
    for number, line in enumerate(MISUSE.read_text().splitlines(), start=1):
        match = re.search(r"# wrong: (.+)$", line)
        if match:
            expected[number] = match.group(1)
    result = check(stand_ins, [MISUSE])
    reported = {}
    for finding in result["findings"]:
        reported.setdefault(finding["line"], []).append(finding["message"])
    assert sorted(reported) == sorted(expected), {"reported": reported, "expected": expected}
    for number, text in expected.items():
        assert any(text in message for message in reported[number]), (number, text, reported[number])


def test_bindings_rank_limit_is_the_one_the_parser_data_records(stand_ins):
    limits = json.loads((Path(__file__).parent / "data" / "trt_onnx_ops.json").read_text())["limits"]
    assert check(stand_ins, [])["max_dims"] == limits["max_rank"]


def test_pybind_signature_parser_reads_overloads_defaults_and_keyword_only():
    signature = parse_signature_line(
        "2. set_shape(self: tensorrt_bindings.tensorrt.IOptimizationProfile, input: str, "
        "min: tensorrt_bindings.tensorrt.Dims, opt: tensorrt_bindings.tensorrt.Dims = <Dims (1, 2)>, *, "
        "level: typing.SupportsInt = 0) -> None")
    assert [(p.name, p.has_default, p.kind) for p in signature.params] == [
        ("self", False, "plain"), ("input", False, "plain"), ("min", False, "plain"), ("opt", True, "plain"),
        ("level", True, "keyword_only")]
    assert signature.params[3].annotation == "tensorrt_bindings.tensorrt.Dims"
    assert parse_signature_line("(arg0: tensorrt_bindings.tensorrt.ICudaEngine) -> int").params[0].kind == \
        "positional_only"


def test_polygraphy_profiles_carry_every_manifest_shape_on_the_real_bindings(stand_ins, tmp_path_factory):
    from builder_fixtures import tiny_engine_dir

    engine_dir = tiny_engine_dir(tmp_path_factory)
    code = f"""
import json, sys
sys.path.insert(0, {str(Path(__file__).parent)!r})
from trt_api import use_bindings_as_tensorrt
use_bindings_as_tensorrt()
from blockpilot.builder.manifest import read_manifest
from blockpilot.builder.trt import polygraphy_profiles, require_tensorrt
require_tensorrt()
manifest = read_manifest({str(engine_dir)!r})
out = {{}}
for name in ("target", "drafter"):
    out[name] = [{{k: [list(s.min), list(s.opt), list(s.max)] for k, s in p.items()}}
                 for p in polygraphy_profiles(getattr(manifest, name))]
print(json.dumps(out))
"""
    result = run_with_bindings(stand_ins, ["-c", code], cwd=ROOT)
    assert result.returncode == 0, result.stderr[-3000:]
    profiles = json.loads(result.stdout.splitlines()[-1])
    from blockpilot.builder.manifest import read_manifest

    manifest = read_manifest(engine_dir)
    for name in ("target", "drafter"):
        wanted = [{k: [list(s) for s in v] for k, v in p.shapes.items()} for p in getattr(manifest, name).profiles]
        assert profiles[name] == wanted, name
