"""Opening an engine directory (`blockpilot build`) with a backend: torch, onnxruntime or tensorrt.

The manifest is read and every file's SHA-256 checked once, here. The torch backend runs the
original weights kept in the directory (`target/`, `drafter/`); the other two run the exported
graphs or engines. With `backend=None` the fastest usable one is chosen: tensorrt when the
directory has engines and tensorrt and a GPU are available, else onnxruntime for fp32/fp16
builds (faster than eager torch on CPU, see scripts/bench_backends.py), else torch.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from blockpilot.builder.manifest import Manifest, read_manifest
from blockpilot.errors import UserError
from blockpilot.models.config import DecoderConfig, DrafterConfig, read_config_json

BACKENDS = ("torch", "onnxruntime", "tensorrt")


@dataclasses.dataclass
class OpenedEngineDir:
    """What a `Runner` needs from an engine directory."""

    backend: object  # a `Backend`
    manifest: Manifest
    policy: object | None  # an `OnnxBlockSizePolicy` when a predictor is loaded
    default_block_size: int
    target_dir: Path  # original target config/weights inside the engine directory


def _tensorrt_usable() -> bool:
    import importlib.util

    if importlib.util.find_spec("tensorrt") is None:
        return False
    import torch

    return torch.cuda.is_available()


def choose_backend(manifest: Manifest, requested: str | None) -> str:
    """`requested` when valid; for None the fastest backend this machine can run the directory with."""
    if requested is not None:
        if requested not in BACKENDS:
            raise UserError(f"backend {requested!r} is not one of {', '.join(BACKENDS)}")
        return requested
    if manifest.has_engines and _tensorrt_usable():
        return "tensorrt"
    return "onnxruntime" if manifest.dtype in ("fp32", "fp16") else "torch"


def _open_torch(engine_dir: Path, manifest: Manifest, device: str):
    from blockpilot.builder.engine_dir import TORCH_DTYPES
    from blockpilot.models.checkpoint import load_drafter, load_target
    from blockpilot.runtime.backend import TorchBackend

    dtype, positions = TORCH_DTYPES[manifest.dtype], manifest.max_seq_len
    target = load_target(engine_dir / manifest.target_dir, dtype=dtype, max_positions=positions).to(device)
    drafter = load_drafter(engine_dir / manifest.drafter_dir, dtype=dtype, max_positions=positions).to(device)
    return TorchBackend(target, drafter, max_block_size=max(manifest.block_sizes),
                        fixed_shape=manifest.dtype != "fp32")  # see TorchBackend


def _open_backend(name: str, engine_dir: Path, manifest: Manifest, device: str | None, threads: int | None):
    if name == "torch":
        return _open_torch(engine_dir, manifest, device or "cpu")
    target = DecoderConfig.from_dict(read_config_json(engine_dir / manifest.target_dir))
    drafter = DrafterConfig.from_dict(read_config_json(engine_dir / manifest.drafter_dir))
    if name == "onnxruntime":
        if device not in (None, "cpu"):
            raise UserError(f"the onnxruntime backend runs on the CPU, not {device!r}; use backend 'tensorrt' or 'torch'")
        from blockpilot.runtime.onnx_backend import OnnxBackend

        return OnnxBackend.from_engine_dir(engine_dir, manifest, target, drafter, threads=threads)
    if device is not None and not str(device).startswith("cuda"):
        raise UserError(f"the tensorrt backend runs on a CUDA device, not {device!r}; pass device='cuda'")
    from blockpilot.runtime.trt_backend import TrtBackend

    return TrtBackend.from_engine_dir(engine_dir, manifest, target, drafter, device=device or "cuda")


def default_block_size(manifest: Manifest) -> int:
    """The drafter's training block size when built, else the built size closest to it."""
    return min(manifest.block_sizes, key=lambda k: (abs(k - manifest.drafter_block_size), k))


def open_engine_dir(engine_dir: str | Path, *, backend: str | None = None, device: str | None = None,
                    predictor: str | Path | None = None, predictor_threshold: float | None = None,
                    threads: int | None = None, predictor_any_backend: bool = False,
                    use_predictor: bool = True) -> OpenedEngineDir:
    """Check `engine_dir` and open it.

    Args:
        engine_dir: a directory written by `blockpilot build`.
        backend: "torch", "onnxruntime", "tensorrt", or None (see the module docstring).
        device: torch device for the torch backend, CUDA device for tensorrt; None: cpu / cuda.
        predictor: a predictor `.onnx` to use instead of the directory's own `predictor.onnx`.
        predictor_threshold: overrides the predictor's fallback threshold.
        threads: onnxruntime intra-op threads (None: all cores).
        predictor_any_backend: accept a predictor labelled with another backend's or dtype's step costs.
        use_predictor: False opens no predictor at all (plain decoding needs none).

    Returns:
        The backend, the block-size policy (None without a predictor) and the defaults.

    Raises:
        UserError: not an engine directory, missing/modified files, newer format, unusable backend.
    """
    engine_dir = Path(engine_dir)
    manifest = read_manifest(engine_dir)
    opened = _open_backend(choose_backend(manifest, backend), engine_dir, manifest, device, threads)
    policy = None
    predictor_path = predictor or (engine_dir / manifest.predictor if manifest.predictor else None)
    if predictor_path is not None and use_predictor:
        from blockpilot.runtime.policy import load_policy

        policy = load_policy(predictor_path, opened, target_dir=engine_dir / manifest.target_dir,
                             drafter_dir=engine_dir / manifest.drafter_dir, threshold=predictor_threshold,
                             any_backend=predictor_any_backend)
    return OpenedEngineDir(opened, manifest, policy, default_block_size(manifest), engine_dir / manifest.target_dir)
