"""The real TensorRT Python bindings, importable on a machine without TensorRT's libraries.

The wheel `tensorrt-cu12-bindings` (installed by `make setup`) ships `tensorrt_bindings/tensorrt.so`,
which links against `libnvinfer.so.11`, `libnvinfer_plugin.so.11` and `libnvonnxparser.so.11` for
about a dozen C entry points (`createInferBuilder_INTERNAL`, `getPluginRegistry`, ...). Here gcc
builds stand-ins for those libraries into a temporary directory, each exporting every such entry
point as a function returning null; with them on `LD_LIBRARY_PATH` the real module imports in a
subprocess, so every class, method, enum and pybind signature of the pinned TensorRT is there to
inspect, while constructors of native objects fail cleanly ("factory function returned nullptr").
Nothing built here is shipped. The symbol and library lists are read from `tensorrt.so` itself.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path

BINDINGS_WHEEL = "tensorrt-cu12-bindings==11.4.0.106"
TOOLS = ("gcc", "nm", "readelf")


def bindings_library() -> Path | None:
    """`tensorrt.so` of the installed bindings wheel, or None when it is not installed."""
    spec = importlib.util.find_spec("tensorrt_bindings")
    if spec is None or spec.origin is None:
        return None
    library = Path(spec.origin).parent / "tensorrt.so"
    return library if library.is_file() else None


def unavailable_reason() -> str | None:
    """Why the real bindings cannot be loaded here (a skip reason), or None when they can."""
    missing = [tool for tool in TOOLS if shutil.which(tool) is None]
    if missing:
        return f"{', '.join(missing)} not found (needed to build stand-ins for TensorRT's libraries)"
    if bindings_library() is None:
        return f"the TensorRT bindings wheel is not installed (pip install {BINDINGS_WHEEL})"
    return None


def needed_tensorrt_libraries(library: Path) -> list[str]:
    """The `libnv*` sonames `library` links against (`readelf -d` NEEDED entries)."""
    dynamic = subprocess.run(["readelf", "-d", str(library)], capture_output=True, text=True, check=True).stdout
    names = [line.split("[", 1)[1].split("]", 1)[0] for line in dynamic.splitlines() if "(NEEDED)" in line]
    return [name for name in names if name.startswith("libnv")]


def unresolved_entry_points(library: Path) -> list[str]:
    """Undefined symbols of `library` that this process cannot resolve: what TensorRT's own libraries
    provide (glibc and libstdc++ symbols carry a version, the interpreter and libc resolve the rest)."""
    import ctypes

    process = ctypes.CDLL(None)
    listing = subprocess.run(["nm", "-D", "--undefined-only", "--with-symbol-versions", str(library)],
                             capture_output=True, text=True, check=True).stdout
    symbols = []
    for line in listing.splitlines():
        parts = line.split()  # "U name" or "U name@VERSION"
        if len(parts) == 2 and parts[0] == "U" and "@" not in parts[1] and not hasattr(process, parts[1]):
            symbols.append(parts[1])
    return sorted(set(symbols))


def build_stand_in_libraries(out_dir: Path) -> Path:
    """Compile the stand-in libraries into `out_dir` and return it (for `LD_LIBRARY_PATH`)."""
    library = bindings_library()
    assert library is not None, unavailable_reason()
    out_dir.mkdir(parents=True, exist_ok=True)
    source = out_dir / "tensorrt_stand_ins.c"
    source.write_text("/* Stand-ins for TensorRT's native entry points: each returns null. */\n" + "".join(
        f"void *{name}(void) {{ return 0; }}\n" for name in unresolved_entry_points(library)))
    for soname in needed_tensorrt_libraries(library):
        subprocess.run(["gcc", "-shared", "-fPIC", f"-Wl,-soname,{soname}", "-o", str(out_dir / soname), str(source)],
                       check=True, capture_output=True, text=True)
    return out_dir


def run_with_bindings(stand_ins: Path, args: list[str], cwd: Path, timeout: float = 300) -> subprocess.CompletedProcess:
    """Run `python ARGS` with the real bindings importable as `tensorrt_bindings` (via the stand-ins)."""
    env = dict(os.environ, LD_LIBRARY_PATH=os.pathsep.join(
        p for p in (str(stand_ins), os.environ.get("LD_LIBRARY_PATH", "")) if p))
    return subprocess.run([sys.executable, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
