"""The runtime: backends (torch, onnxruntime, tensorrt), the decode loop and the block-size policy.

`Runner` is imported on first use (`from blockpilot.runtime import Runner`), so importing this
package pulls no backend.
"""

__all__ = ["Runner"]


def __getattr__(name: str):
    if name == "Runner":
        from blockpilot.runtime.runner import Runner

        return Runner
    raise AttributeError(f"module 'blockpilot.runtime' has no attribute {name!r}")
