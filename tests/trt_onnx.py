"""What TensorRT's ONNX parser would refuse in an exported graph, read from the graph itself.

`data/trt_onnx_ops.json` holds the parser's support matrix for the pinned TensorRT (its opset range,
per operator the types of its main type constraint, documented restrictions and the checkable ones
as rules) and TensorRT's shape limits. `parser_problems` walks every node of a graph (subgraphs
and local functions included) and `profile_problems` every optimization profile of a manifest
entry; both return readable problems, empty when TensorRT accepts everything.
"""

from __future__ import annotations

import json
from pathlib import Path

import onnx
from onnx import TensorProto, defs, helper, shape_inference

PARSER_DATA = Path(__file__).parent / "data" / "trt_onnx_ops.json"
DEFAULT_DOMAINS = ("", "ai.onnx")


def parser_data() -> dict:
    return json.loads(PARSER_DATA.read_text())


def load_graph(path: Path) -> onnx.ModelProto:
    """The model at `path` with types and shapes inferred for every intermediate tensor (weights not loaded)."""
    model = onnx.load(str(path), load_external_data=False)
    return shape_inference.infer_shapes(model, strict_mode=False, data_prop=True)


def default_opset(model: onnx.ModelProto) -> int:
    return next(o.version for o in model.opset_import if o.domain in DEFAULT_DOMAINS)


def tensor_types(model: onnx.ModelProto) -> dict[str, tuple[str, int | None]]:
    """Tensor name -> (ONNX dtype name, rank or None) for every typed tensor of the main graph."""
    found: dict[str, tuple[str, int | None]] = {}
    graph = model.graph
    for value in [*graph.input, *graph.output, *graph.value_info]:
        tensor = value.type.tensor_type
        if tensor.elem_type:
            rank = len(tensor.shape.dim) if tensor.HasField("shape") else None
            found[value.name] = (TensorProto.DataType.Name(tensor.elem_type), rank)
    for init in graph.initializer:
        found[init.name] = (TensorProto.DataType.Name(init.data_type), len(init.dims))
    for node in graph.node:
        if node.op_type == "Constant" and node.attribute and node.attribute[0].type == onnx.AttributeProto.TENSOR:
            value = node.attribute[0].t
            found[node.output[0]] = (TensorProto.DataType.Name(value.data_type), len(value.dims))
    return found


def constant_names(model: onnx.ModelProto) -> set[str]:
    graph = model.graph
    return {i.name for i in graph.initializer} | {n.output[0] for n in graph.node if n.op_type == "Constant"}


def all_nodes(model: onnx.ModelProto):
    """Every node: the main graph, subgraphs of control-flow attributes, and local functions."""
    def walk(nodes):
        for node in nodes:
            yield node
            for attr in node.attribute:
                for graph in [attr.g] if attr.type == onnx.AttributeProto.GRAPH else list(attr.graphs):
                    yield from walk(graph.node)

    yield from walk(model.graph.node)
    for function in model.functions:
        yield from walk(function.node)


def main_type_inputs(node, opset: int) -> list[int]:
    """Indices of the inputs bound to the type constraint of the node's first input (the one the
    support matrix's 'Supported Types' describes); index/shape/mask inputs have their own."""
    schema = defs.get_schema(node.op_type, opset)
    if not schema.inputs:
        return []
    main = schema.inputs[0].type_str
    indices = []
    for i in range(len(node.input)):
        formal = schema.inputs[min(i, len(schema.inputs) - 1)]
        if formal.type_str == main and (i < len(schema.inputs) or formal.option == formal.option.Variadic):
            indices.append(i)
    return indices


def _attribute(node, name: str, default):
    for attr in node.attribute:
        if attr.name == name:
            value = helper.get_attribute_value(attr)
            return value.decode() if isinstance(value, bytes) else value
    return default


def rule_problem(rule: dict, node, types: dict, constants: set[str]) -> str | None:
    kind, present = rule["kind"], lambda names, i: i < len(names) and names[i] != ""
    if kind == "inputs_absent" and any(present(node.input, i) for i in rule["inputs"]):
        return rule["why"]
    if kind == "outputs_absent" and any(present(node.output, i) for i in rule["outputs"]):
        return rule["why"]
    if kind == "attributes_default" and any(_attribute(node, name, default) != default
                                             for name, default in rule["defaults"].items()):
        return rule["why"]
    if kind == "input_rank":
        ranks = [types.get(node.input[i], (None, None))[1] for i in rule["inputs"] if present(node.input, i)]
        if any(rank != rule["rank"] for rank in ranks):
            return f"{rule['why']} (ranks {ranks})"
    if kind == "axis_equals":
        rank = types.get(node.input[rule["rank_of_input"]], (None, None))[1]
        axis = _attribute(node, rule["attribute"], rule["default"])
        if rank is None or (axis % rank) != (rule["value"] % rank):
            return f"{rule['why']} (axis {axis}, rank {rank})"
    if kind == "attribute_in" and _attribute(node, rule["attribute"], rule["default"]) not in rule["values"]:
        return rule["why"]
    if kind == "input_dtype":
        names = rule["dtypes"]
        if any(present(node.input, i) and _trt_type(types, node.input[i]) not in names for i in rule["inputs"]):
            return rule["why"]
    if kind == "inputs_constant" and any(present(node.input, i) and node.input[i] not in constants
                                         for i in rule["inputs"]):
        return rule["why"]
    return None


def _trt_type(types: dict, name: str) -> str | None:
    dtype = types.get(name, (None, None))[0]
    return parser_data()["dtype_names"].get(dtype, dtype) if dtype else None


def parser_problems(model: onnx.ModelProto, data: dict | None = None) -> list[str]:
    """Every node, opset or dtype of `model` that the pinned TensorRT's ONNX parser does not support."""
    data = data or parser_data()
    opset = default_opset(model)
    problems = []
    if not data["opset"]["min"] <= opset <= data["opset"]["max"]:
        problems.append(f"opset {opset} is outside TensorRT {data['tensorrt']}'s {data['opset']['min']}-"
                        f"{data['opset']['max']}")
    types, constants = tensor_types(model), constant_names(model)
    local_functions = {(f.domain, f.name) for f in model.functions}
    for node in all_nodes(model):
        where = f"{node.op_type} node {node.name!r}"
        if (node.domain, node.op_type) in local_functions:
            continue  # its body is walked as well
        if node.domain not in DEFAULT_DOMAINS:
            problems.append(f"{where}: custom domain {node.domain!r} (no TensorRT plugin is registered)")
            continue
        supported = data["types"].get(node.op_type)
        if supported is None:
            problems.append(f"{where}: {node.op_type} is not supported by the TensorRT {data['tensorrt']} parser")
            continue
        try:
            inputs = main_type_inputs(node, opset)
        except onnx.defs.SchemaError:
            problems.append(f"{where}: {node.op_type} is not defined at opset {opset}")
            continue
        checked = [i for i in inputs if node.input[i]]
        if node.op_type in ("Cast", "CastLike"):
            checked_names = [node.input[0], node.output[0]]
        else:
            checked_names = [node.input[i] for i in checked]
        for name in checked_names:
            dtype = _trt_type(types, name)
            if dtype is None:
                problems.append(f"{where}: no type inferred for {name!r}")
            elif dtype not in supported:
                problems.append(f"{where}: {name!r} is {dtype}, the parser takes {', '.join(supported)}")
        for rule in data["rules"].get(node.op_type, []):
            problem = rule_problem(rule, node, types, constants)
            if problem:
                problems.append(f"{where}: {problem}")
    return problems


def profile_problems(model: onnx.ModelProto, entry, data: dict | None = None) -> list[str]:
    """Every optimization profile of manifest `entry` checked against the graph's inputs and TensorRT's
    limits: each graph input present, rank equal to the graph's and <= the maximum rank, every
    dimension with 0 <= min <= opt <= max <= the maximum extent, static dimensions pinned to the graph's."""
    limits = (data or parser_data())["limits"]
    inputs = {value.name: [d.dim_value if d.HasField("dim_value") else None
                           for d in value.type.tensor_type.shape.dim] for value in model.graph.input}
    problems = []
    for profile in entry.profiles:
        where = f"profile {profile.name}"
        missing = sorted(set(inputs) - set(profile.shapes))
        extra = sorted(set(profile.shapes) - set(inputs))
        if missing or extra:
            problems.append(f"{where}: inputs missing {missing}, not in the graph {extra}")
        for name, (low, opt, high) in profile.shapes.items():
            graph_dims = inputs.get(name)
            if graph_dims is None:
                continue
            if not len(low) == len(opt) == len(high) == len(graph_dims) or len(graph_dims) > limits["max_rank"]:
                problems.append(f"{where}: {name} ranks {len(low)}/{len(opt)}/{len(high)}, graph {len(graph_dims)}, "
                                f"TensorRT at most {limits['max_rank']}")
                continue
            for axis, (a, b, c, fixed) in enumerate(zip(low, opt, high, graph_dims)):
                if not 0 <= a <= b <= c <= limits["max_dim"]:
                    problems.append(f"{where}: {name} axis {axis} has min/opt/max {a}/{b}/{c}")
                if fixed is not None and not a == b == c == fixed:
                    problems.append(f"{where}: {name} axis {axis} is {fixed} in the graph, profile {a}/{b}/{c}")
    return problems
