"""The onnxruntime copy of the drafter graph with 4-bit weights (`drafter.int4.onnx`).

A drafter only proposes tokens; the target verifies every one over the full vocabulary, so the
drafter's precision changes how many drafts are accepted, never what is generated. On the CPU the
drafter call reads all of its weights once per step (23M parameters, 93 MB in fp32 for SmolLM2's),
so storing its MatMul weights in 4 bits (onnxruntime's `MatMulNBits`, symmetric, one scale per 32
weights, products on int8 activations: accuracy level 4) makes that call about 2x faster at a
measured tau loss near 0.5% (docs/benchmarks.md). `MatMulNBits` is an onnxruntime contrib op, so
TensorRT keeps building from `drafter.onnx`; only the onnxruntime backend opens this copy.
"""

from __future__ import annotations

import logging
from pathlib import Path

INT4_DRAFTER = "drafter.int4.onnx"
QUANT_BLOCK = 32
ACCURACY_LEVEL = 4  # int8 activations: VNNI dot products where the CPU has them


def write_int4_drafter(src: Path, dst: Path, external_data: bool = False) -> None:
    """Quantize every MatMul of `src` whose weight is a constant to 4 bits, into `dst`."""
    import onnx

    quantizer_class = _quantizer_class()
    quantizer = quantizer_class(onnx.load(str(src)), block_size=QUANT_BLOCK, is_symmetric=True,
                                accuracy_level=ACCURACY_LEVEL)
    quantizer.process()
    quantizer.model.save_model_to_file(str(dst), use_external_data_format=external_data)


def _quantizer_class():
    """onnxruntime's `MatMulNBitsQuantizer`, imported without the INFO-level root logging its module
    sets up on import (`logging.basicConfig`): one line per graph node, and every library's INFO after it."""
    root = logging.getLogger()
    placeholder = None if root.handlers else logging.NullHandler()
    if placeholder is not None:
        root.addHandler(placeholder)  # basicConfig leaves a configured root alone
    try:
        from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer
    finally:
        if placeholder is not None:
            root.removeHandler(placeholder)
    logging.getLogger("onnxruntime.quantization.matmul_nbits_quantizer").setLevel(logging.WARNING)
    return MatMulNBitsQuantizer
