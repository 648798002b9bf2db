"""Every graph `blockpilot build` exports is one TensorRT 11.4's ONNX parser accepts (no TensorRT needed).

Each op, with its opset and input dtypes, is checked against the parser's support matrix committed in
`data/trt_onnx_ops.json` (source and version inside), and each optimization profile against the
graph's inputs and TensorRT's shape limits (`trt_onnx.py`). The graphs are read, not listed: an op
a model change brings in is checked the same way.
"""

import dataclasses

import onnx
import pytest
from onnx import TensorProto, helper

from blockpilot.builder.manifest import read_manifest
from trt_onnx import load_graph, parser_data, parser_problems, profile_problems

from builder_fixtures import tiny_engine_dir

GRAPH_CASES = [(24, "target"), (24, "drafter"), (18, "target"), (18, "drafter")]


def graph_problems(engine_dir, name: str) -> list[str]:
    manifest = read_manifest(engine_dir)
    entry = getattr(manifest, name)
    model = load_graph(engine_dir / entry.onnx)
    return parser_problems(model) + profile_problems(model, entry)


@pytest.mark.parametrize(("opset", "name"), GRAPH_CASES)
def test_tiny_model_graph_is_accepted_by_the_tensorrt_parser(tmp_path_factory, opset, name):
    problems = graph_problems(tiny_engine_dir(tmp_path_factory, "llama", opset), name)
    assert not problems, "\n".join(problems)


@pytest.mark.slow
@pytest.mark.parametrize(("opset", "name"), [GRAPH_CASES[0], GRAPH_CASES[1]])
def test_embedded_default_graph_is_accepted_by_the_tensorrt_parser(tmp_path_factory, opset, name):
    from blockpilot.assets import default_drafter_dir
    from blockpilot.assets.smollm2 import smollm2_dir
    from blockpilot.builder.engine_dir import BuildSpec, build_engine_dir

    out = tmp_path_factory.getbasetemp() / "engines" / f"smollm2-opset{opset}"
    if not (out / "manifest.json").is_file():
        build_engine_dir(BuildSpec(smollm2_dir(), default_drafter_dir(), out, (8,), 64, opset=opset))
    problems = graph_problems(out, name)
    assert not problems, "\n".join(problems)


def _model(nodes, inputs, outputs, opset=24, initializers=()):
    graph = helper.make_graph(nodes, "g", inputs, outputs, list(initializers))
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])


def _value(name, dtype, shape):
    return helper.make_tensor_value_info(name, dtype, shape)


def test_parser_check_reports_unsupported_ops_types_rules_and_opsets():
    f32, i64 = TensorProto.FLOAT, TensorProto.INT64
    nodes = [
        helper.make_node("Unique", ["x"], ["u"]),  # not supported by the parser
        helper.make_node("Sqrt", ["n"], ["sn"]),  # INT64 input: Sqrt takes floats only
        helper.make_node("TensorScatter", ["cache", "update", "pos"], ["present"], axis=1),  # axis must be -2
        helper.make_node("Attention", ["q", "k", "v", "", "pk", "pv"], ["o", "ok", "ov"]),  # past inputs
        helper.make_node("ScatterND", ["cache", "idx", "update"], ["scattered"], reduction="add"),
    ]
    inputs = [_value("x", f32, [4]), _value("n", i64, [4]), _value("cache", f32, [1, 2, 8, 4]),
              _value("update", f32, [1, 2, 1, 4]), _value("pos", i64, [1]), _value("q", f32, [1, 2, 1, 4]),
              _value("k", f32, [1, 2, 1, 4]), _value("v", f32, [1, 2, 1, 4]), _value("pk", f32, [1, 2, 3, 4]),
              _value("pv", f32, [1, 2, 3, 4]), _value("idx", i64, [1, 2, 1, 3])]
    outputs = [_value(n, f32, None) for n in ("u", "present", "o", "ok", "ov", "scattered")] + [_value("sn", i64, None)]
    problems = parser_problems(load_model(_model(nodes, inputs, outputs, opset=24)))
    text = "\n".join(problems)
    assert "Unique is not supported" in text
    assert "'n' is INT64" in text
    assert "axis must be -2 (axis 1, rank 4)" in text
    assert "past_key, past_value and nonpad_kv_seqlen inputs are unsupported" in text
    assert "present_key, present_value and qk_matmul_output outputs are unsupported" in text
    assert "reduction other than none" in text
    newer = _model([helper.make_node("Relu", ["x"], ["y"])], [_value("x", f32, [4])], [_value("y", f32, None)], 25)
    assert any("opset 25 is outside" in p for p in parser_problems(load_model(newer)))


def test_parser_check_accepts_a_supported_graph():
    f32 = TensorProto.FLOAT
    model = _model([helper.make_node("TensorScatter", ["cache", "update", "pos"], ["present"], axis=-2)],
                   [_value("cache", f32, [1, 2, 8, 4]), _value("update", f32, [1, 2, 1, 4]),
                    _value("pos", TensorProto.INT64, [1])], [_value("present", f32, None)])
    assert parser_problems(load_model(model)) == []


def load_model(model: onnx.ModelProto) -> onnx.ModelProto:
    return onnx.shape_inference.infer_shapes(model, strict_mode=False, data_prop=True)


@dataclasses.dataclass
class _Profile:
    name: str
    shapes: dict


@dataclasses.dataclass
class _Entry:
    profiles: list


def test_profile_check_reports_shapes_outside_the_graph_and_tensorrt_limits():
    f32 = TensorProto.FLOAT
    model = _model([helper.make_node("Relu", ["x"], ["y"])], [_value("x", f32, [1, "t", 8])], [_value("y", f32, None)])
    good = _Profile("ok", {"x": ((1, 1, 8), (1, 4, 8), (1, 16, 8))})
    assert profile_problems(model, _Entry([good])) == []
    bad = [_Profile("inverted", {"x": ((1, 5, 8), (1, 4, 8), (1, 16, 8))}),
           _Profile("static", {"x": ((1, 1, 8), (1, 1, 8), (1, 1, 9))}),
           _Profile("rank", {"x": ((1,) * 9,) * 3}),
           _Profile("missing", {})]
    problems = "\n".join(profile_problems(model, _Entry(bad)))
    for expected in ("inverted: x axis 1 has min/opt/max 5/4/16", "static: x axis 2 is 8 in the graph",
                     f"TensorRT at most {parser_data()['limits']['max_rank']}", "missing: inputs missing ['x']"):
        assert expected in problems
