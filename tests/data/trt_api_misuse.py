"""Deliberately wrong TensorRT and polygraphy calls: the API conformance check must report every line
marked `# wrong:` (with the text after it in its message) and no other. Never imported or run."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import tensorrt as trt


def build(onnx_bytes: bytes):
    import tensorrt as trt

    logger = trt.Logger(trt.Logger.WARNING)
    builder = trt.Builder(logger)
    network = builder.create_network(0)
    config = builder.create_builder_config()
    config.set_flag(trt.BuilderFlag.FP16)  # wrong: has no attribute 'FP16'
    config.set_flag(trt.float16)  # wrong: flag must be
    profile = builder.create_optimization_profile()
    profile.set_shape("input_ids", (1, 1), (1, 8), (1, 16))
    profile.set_shape("input_ids", (1, 1), (1, 8))  # wrong: matches no signature
    parser = trt.OnnxParser(network, logger)
    parser.parse(onnx_bytes)
    return builder.build_serialized_network(network, config)


def run(engine: trt.ICudaEngine, stream: int):
    ctx = engine.create_execution_context()
    ctx.set_optimization_profile(0, stream)  # wrong: has no attribute 'set_optimization_profile'
    ctx.set_input_shape(0, (1, 8))  # wrong: name must be str
    ctx.set_tensor_address(name="logits", ptr=0)  # wrong: no keyword argument 'ptr'
    ctx.execute_async_v3()  # wrong: missing stream_handle
    count = engine.num_optimization_profiles()  # wrong: not callable
    return count, trt.ILogger.Severity.WARN  # wrong: has no attribute 'WARN'


def deserialize(data: bytes):
    import tensorrt as trt

    runtime = trt.Runtime()  # wrong: missing logger
    return pass_engine_on(runtime.deserialize_cuda_engine(data))


def pass_engine_on(engine):
    return engine.get_tensor_dtyp("logits")  # wrong: has no attribute 'get_tensor_dtyp'


def quiet_logger():
    import tensorrt as trt

    class QuietLogger(trt.ILogger):
        def __init__(self):  # wrong: must call
            self.lines = []

        def logg(self, severity, msg):  # wrong: overrides nothing
            self.lines.append(msg)

        def log(self, msg):  # wrong: takes 2 arguments
            self.lines.append(msg)

    return QuietLogger()


def polygraphy_profile():
    from polygraphy.backend.trt import CreateConfig, EngineFromNetworks, Profile  # wrong: has no attribute 'EngineFromNetworks'

    profile = Profile().add("input_ids", min=(1, 1), opt=(1, 8), maximum=(1, 16))  # wrong: does not accept this call
    return CreateConfig(profiles=[profile], fp16=True), EngineFromNetworks
