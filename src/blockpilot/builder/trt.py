"""TensorRT engines from the exported graphs, through polygraphy's lazy loaders.

One engine per graph, one optimization profile per entry of the manifest's profile list (same
order, so manifest profile index = engine profile index). Networks are parsed strongly typed:
precision comes from the ONNX dtypes (TensorRT 11 always works this way). Imported only for
`blockpilot build --trt`; tensorrt and polygraphy are the `[trt]` extra.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path

from blockpilot.builder.manifest import GraphEntry, Manifest
from blockpilot.errors import UserError

TRT_INSTALL = "pip install 'blockpilot[trt]' on a machine with an NVIDIA GPU"


def require_tensorrt() -> None:
    """Raise `UserError` unless tensorrt and polygraphy can be imported."""
    try:
        import polygraphy  # noqa: F401
        import tensorrt  # noqa: F401
    except ImportError as exc:
        raise UserError(f"--trt needs TensorRT and polygraphy ({exc.name} is not importable): {TRT_INSTALL}, "
                        "or build without --trt to write the ONNX graphs only") from None


def polygraphy_profiles(entry: GraphEntry) -> list:
    """One `polygraphy.backend.trt.Profile` per manifest profile, every input with min/opt/max."""
    from polygraphy.backend.trt import Profile

    profiles = []
    for spec in entry.profiles:
        profile = Profile()
        for name, (low, opt, high) in spec.shapes.items():
            profile.add(name, min=low, opt=opt, max=high)
        profiles.append(profile)
    return profiles


def build_engine(onnx_path: Path, engine_path: Path, entry: GraphEntry) -> Path:
    """Parse `onnx_path`, build an engine with `entry`'s profiles and serialize it to `engine_path`."""
    from polygraphy.backend.trt import CreateConfig, EngineFromNetwork, NetworkFromOnnxPath, SaveEngine
    from polygraphy.exception import PolygraphyException

    network = NetworkFromOnnxPath(str(onnx_path), strongly_typed=True)
    config = CreateConfig(profiles=polygraphy_profiles(entry))
    try:
        SaveEngine(EngineFromNetwork(network, config), str(engine_path))()
    except PolygraphyException as exc:
        import tensorrt

        raise UserError(
            f"TensorRT {tensorrt.__version__} could not build {onnx_path.name} ({exc}); TensorScatter and "
            "Attention need TensorRT >= 10.15: upgrade TensorRT or rebuild with --opset 18"
        ) from None
    return engine_path


def build_engines(engine_dir: Path, manifest: Manifest, log: Callable[[str], None]) -> Manifest:
    """Build `target.engine` and `drafter.engine` next to the ONNX graphs.

    Returns:
        `manifest` with the engine file names filled in.
    """
    entries = {}
    for name, entry in (("target", manifest.target), ("drafter", manifest.drafter)):
        log(f"building the TensorRT {name} engine ({len(entry.profiles)} profiles) ...")
        build_engine(engine_dir / entry.onnx, engine_dir / f"{name}.engine", entry)
        entries[name] = dataclasses.replace(entry, engine=f"{name}.engine")
    return dataclasses.replace(manifest, **entries)
