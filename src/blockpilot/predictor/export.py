"""Export a trained `BlockSizeMLP` to a single-file ONNX predictor and check it.

The graph: inputs `features` `(batch, F)` float32 [and `temperature` `(batch, 1)` float32], output
`probabilities` `(batch, K)`; names from `blockpilot.runtime.policy`. `metadata_props` carry
`PredictorInfo`'s fields (all strings). The file passes `onnx.checker`, and onnxruntime's output
must equal torch's within `PARITY_ATOL` on the given features, or export fails (a bug, not a user
error).
"""

from __future__ import annotations

import logging
import os
import tempfile
import warnings
from pathlib import Path

import torch

from blockpilot.predictor.model import BlockSizeMLP, ProbabilityModel
from blockpilot.runtime.policy import FEATURES_INPUT, PROBABILITIES_OUTPUT, TEMPERATURE_INPUT

PARITY_ATOL = 1e-5


def export_predictor(mlp: BlockSizeMLP, path: str | Path, metadata: dict[str, str], features: torch.Tensor,
                     temperature: torch.Tensor | None = None) -> float:
    """Write `mlp` as ONNX to `path` (atomically) and return the torch-vs-onnxruntime max abs difference.

    Args:
        mlp: the trained network (put in eval mode here).
        path: output `.onnx`.
        metadata: `metadata_props` to store, string to string.
        features: `(N, F)` rows to check parity on (N >= 1).
        temperature: `(N, 1)` when `mlp.with_temperature`.

    Returns:
        The largest absolute difference between torch and onnxruntime probabilities.

    Raises:
        RuntimeError: onnxruntime disagrees with torch by more than `PARITY_ATOL`.
    """
    import onnx

    model = ProbabilityModel(mlp).eval()
    proto = _to_onnx(model, features[:1], temperature[:1] if temperature is not None else None)
    del proto.metadata_props[:]
    for key, value in sorted(metadata.items()):
        proto.metadata_props.add(key=key, value=str(value))
    onnx.checker.check_model(proto, full_check=True)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    handle, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    os.close(handle)
    try:
        onnx.save_model(proto, tmp)
        os.chmod(tmp, 0o644)  # mkstemp makes it private
        difference = onnx_torch_difference(tmp, model, features, temperature)
        if difference > PARITY_ATOL:
            raise RuntimeError(f"onnxruntime differs from torch by {difference:.2e} (> {PARITY_ATOL}) "
                               "on the exported predictor")
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return difference


def _to_onnx(model: ProbabilityModel, features: torch.Tensor, temperature: torch.Tensor | None):
    """The ONNX `ModelProto` of `model` with a dynamic batch dimension."""
    batch = torch.export.Dim("batch")
    args, names, shapes = (features,), [FEATURES_INPUT], [{0: batch}]
    if temperature is not None:
        args, names, shapes = (features, temperature), names + [TEMPERATURE_INPUT], shapes + [{0: batch}]
    quiet = logging.getLogger("torch.onnx")  # the exporter logs every missing torchvision op
    level = quiet.level
    quiet.setLevel(logging.ERROR)
    try:
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            program = torch.onnx.export(model, args, dynamo=True, input_names=names,
                                        output_names=[PROBABILITIES_OUTPUT], dynamic_shapes=tuple(shapes),
                                        external_data=False, verbose=False)
    finally:
        quiet.setLevel(level)
    return program.model_proto


def onnx_torch_difference(path: str | Path, model: torch.nn.Module, features: torch.Tensor,
                          temperature: torch.Tensor | None = None) -> float:
    """Max |torch - onnxruntime| of the probabilities of `model` and the ONNX file at `path`."""
    import onnxruntime as ort

    from blockpilot.runtime.ort_session import session_options

    session = ort.InferenceSession(str(path), session_options(), providers=["CPUExecutionProvider"])
    inputs = {FEATURES_INPUT: features.float().numpy()}
    if temperature is not None:
        inputs[TEMPERATURE_INPUT] = temperature.float().numpy()
    onnx_probs = torch.from_numpy(session.run([PROBABILITIES_OUTPUT], inputs)[0])
    with torch.no_grad():
        torch_probs = model.eval()(features.float(), temperature)
    return float((onnx_probs - torch_probs).abs().max())
