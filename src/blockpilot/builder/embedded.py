"""The embedded default's engine directory, built once into the user cache and reused.

`generate`, `demo`, `profile` (and `make run`) run the embedded SmolLM2 + shipped drafter on the
fastest lossless CPU path, the onnxruntime backend over an fp32 engine directory. That directory is
built on first use into `cache_dir()/engines/smollm2-<key>` next to the converted model, where
`key` is a digest of everything the build reads: the converted target's source marker, the shipped
drafter's files (its weights and configs; not its model card) and the predictor's, the build settings
and `EXPORT_VERSION`. Any change to one of them gives another key, so a new package version with a
new drafter, predictor or export builds a new directory; stale ones are removed after the new one is
in place. The build itself is atomic (`build_engine_dir` writes a sibling directory and renames it);
opening the directory checks its manifest and every file's SHA-256 (remembered while a file is unchanged:
`files.remembered_digest`), and a cached directory that fails is discarded and rebuilt.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import sys
from pathlib import Path

from blockpilot.errors import UserError
from blockpilot.files import remembered_file_sha256

EXPORT_VERSION = 5
"""Bump when the exported graphs change (fused projections, RMSNormalization: 2; per-row positions: 3;
the 4-bit drafter for onnxruntime: 4; the drafter's logits as a second output: 5)."""

BLOCK_SIZES = tuple(range(2, 17))  # every size up to 2 x B_train of the shipped drafter
MAX_SEQ_LEN = 2048
DTYPE = "fp32"
PREFIX = "smollm2-"


def _digest(paths: list[Path], settings: dict) -> str:
    h = hashlib.sha256(json.dumps(settings, sort_keys=True).encode())
    for path in paths:  # each file's SHA-256, remembered while it is unchanged (the drafter's 25 MB at every start)
        h.update(path.name.encode())
        h.update(bytes.fromhex(remembered_file_sha256(path)))
    return h.hexdigest()[:16]


def embedded_engine_dir(log=lambda message: print(message, file=sys.stderr, flush=True)) -> Path:
    """The engine directory of the embedded default, building it first when it is missing or stale.

    Returns:
        The directory (under `cache_dir()/engines`).

    Raises:
        UserError: the package ships no drafter, or the build fails for a reason the user can fix.
    """
    from blockpilot.assets import default_drafter_dir, default_predictor_path
    from blockpilot.assets.packages import usable_cache_dir
    from blockpilot.assets.smollm2 import SOURCE_MARKER, smollm2_dir

    target, drafter, predictor = smollm2_dir(), default_drafter_dir(), default_predictor_path()
    drafter_files = [p for p in sorted(drafter.iterdir()) if p.suffix != ".md"]  # a model card's edit builds nothing
    inputs = [target / SOURCE_MARKER, *drafter_files] + ([predictor] if predictor else [])
    settings = {"export": EXPORT_VERSION, "block_sizes": BLOCK_SIZES, "max_seq_len": MAX_SEQ_LEN, "dtype": DTYPE}
    root = usable_cache_dir() / "engines"
    out = root / f"{PREFIX}{_digest([p for p in inputs if p.is_file()], settings)}"
    if _usable(out):
        return out
    discard(out)  # a damaged or incomplete copy in its place (a build never leaves one; a hand or a disk might)
    from blockpilot.builder.engine_dir import BuildSpec, build_engine_dir

    log(f"building the embedded default's engine directory once, into {out} (about 2 minutes on 2 cores) ...")
    build_engine_dir(BuildSpec(target, drafter, out, BLOCK_SIZES, MAX_SEQ_LEN, DTYPE, predictor=predictor), log=log)
    for stale in root.glob(f"{PREFIX}*"):
        if stale != out and stale.is_dir():
            shutil.rmtree(stale, ignore_errors=True)
    return out


def _usable(engine_dir: Path) -> bool:
    """True when `engine_dir` holds a complete engine directory with a readable manifest (opening
    it checks every file's SHA-256; `discard` removes one that fails that check)."""
    from blockpilot.builder.manifest import MANIFEST_NAME, read_manifest

    if not (engine_dir / MANIFEST_NAME).is_file():
        return False
    try:
        read_manifest(engine_dir, verify_files=False)
    except UserError:
        return False
    return True


def discard(engine_dir: Path) -> None:
    """Remove a cached engine directory that failed its checks, so the next call rebuilds it."""
    shutil.rmtree(engine_dir, ignore_errors=True)
