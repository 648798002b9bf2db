"""BlockPilot: per-request block-size selection for DFlash speculative decoding.

Importing the package is light: it pulls neither onnxruntime nor tensorrt.
"""

__version__ = "0.1.0"
