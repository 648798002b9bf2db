"""BlockPilot: per-request block-size selection for DFlash speculative decoding.

Importing the package is light: it pulls neither torch, onnxruntime nor tensorrt. `Runner` (the
TensorRT-LLM-shaped runtime, `blockpilot.runtime.runner.Runner`) is imported on first use:

    from blockpilot import Runner
    runner = Runner.from_dir(engine_dir)
"""

__version__ = "0.1.0"
__all__ = ["Runner", "__version__"]


def __getattr__(name: str):
    if name == "Runner":
        from blockpilot.runtime.runner import Runner

        return Runner
    raise AttributeError(f"module 'blockpilot' has no attribute {name!r}")
