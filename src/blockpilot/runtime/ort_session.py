"""Options for every onnxruntime session the package makes: one process-wide intra-op thread pool,
and optimized copies of large graphs kept in the user cache (`open_session`).

With a thread pool per session, the idle threads of one session keep spinning while another runs,
so the drafter's and the predictor's pools competed with the target's for the cores: measured on
2 cores, a target forward took up to twice as long beside a drafter session as alone. All sessions
share one pool instead. onnxruntime requires every session of the process to agree once a global
pool exists, so every session here goes through `session_options`.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import hashlib
import json
import os
import platform
import shutil
import tempfile
import time
from pathlib import Path


def session_options(threads: int | None = None):
    """`SessionOptions` on the shared pool, warnings muted. `threads` sizes the pool the first time
    (None: all cores); later calls keep the first size."""
    import onnxruntime as ort

    _share_thread_pool(threads)
    options = ort.SessionOptions()
    options.log_severity_level = 3
    options.use_per_session_threads = False
    return options


@functools.cache
def _share_thread_pool(threads: int | None) -> None:
    from onnxruntime.capi import _pybind_state

    try:
        _pybind_state.set_global_thread_pool_sizes(threads or 0, 1)
    except Exception as exc:  # onnxruntime's own Fail type: the pool exists (another size asked for first)
        if "already been created" not in str(exc):
            raise


# ---------------------------------------------------------------- optimized graphs, kept in the user cache

CACHE_ENV = "BLOCKPILOT_ORT_CACHE"
"""Set to 0 to open every graph from its .onnx file as built (no optimized copy is read or written)."""
CACHE_MIN_BYTES = 256 << 20
"""Smaller graphs open fast as they are: SmolLM2's 4-bit drafter (130 MB) in 0.09 s, 0.03 s from a copy of 149 MB."""
CACHE_FORMAT = 1
PROVIDERS = ["CPUExecutionProvider"]
_uncached = contextvars.ContextVar("blockpilot_ort_uncached", default=False)


@contextlib.contextmanager
def without_cached_copies():
    """Sessions opened inside open their files as they are and save no copy: for graphs about to move or
    be deleted (a build timing its staged directory), whose copies would only be orphans."""
    token = _uncached.set(True)
    try:
        yield
    finally:
        _uncached.reset(token)


def open_session(path: Path, threads: int | None = None, source_digest: str | None = None):
    """An onnxruntime CPU session for `path` on the shared pool, from an optimized copy when one is cached.

    Creating a session optimizes the graph and prepacks every weight matrix for this CPU's kernels:
    SmolLM2's fp32 target (540 MB) took 1.6-4.3 s of every `generate` on the 2-core AMD EPYC, nearly
    all of it prepacking. The first session of a graph also saves the optimized graph with its
    prepacked weights (`session.save_external_prepacked_constant_initializers`) under
    `cache_dir()/ort-optimized/`, one entry per graph file; later sessions load that copy (0.35 s),
    whose results are bit-identical. An entry is used only for the same source content
    (`source_digest`), onnxruntime version and CPU instruction set
    (prepacked layouts are kernel-specific), and only while its own files are intact; otherwise it is
    rebuilt. Any failure to write the copy leaves the session as it would be without it.

    Args:
        path: the `.onnx` file (its weights inside or in `<path>.data`).
        threads: see `session_options`.
        source_digest: a digest of every file the graph reads (the engine manifest's checked hashes);
            None (or `BLOCKPILOT_ORT_CACHE=0`, a graph under `CACHE_MIN_BYTES`, or inside
            `without_cached_copies`) opens the file as it is.
    """
    import onnxruntime as ort

    path = Path(path)
    data = path.with_name(path.name + ".data")
    size = path.stat().st_size + (data.stat().st_size if data.is_file() else 0)
    if source_digest is None or os.environ.get(CACHE_ENV, "1") == "0" or size < CACHE_MIN_BYTES or _uncached.get():
        return ort.InferenceSession(str(path), session_options(threads), providers=PROVIDERS)
    from blockpilot.assets.packages import cache_dir

    root = cache_dir() / "ort-optimized"
    entry = root / hashlib.sha256(str(path.resolve()).encode()).hexdigest()[:16]
    identity = {"format": CACHE_FORMAT, "source": str(path.resolve()), "source_digest": source_digest,
                "onnxruntime": ort.__version__, "cpu": cpu_signature()}
    if _intact(entry, identity):
        try:
            return ort.InferenceSession(str(entry / "model.onnx"), session_options(threads), providers=PROVIDERS)
        except Exception:  # onnxruntime's own exception types; the entry is rebuilt below
            pass
    return _session_saving_copy(path, threads, root, entry, identity)


def cpu_signature() -> str:
    """A digest of this CPU's architecture and instruction-set flags (what selects onnxruntime's kernels)."""
    flags = ""
    try:
        with open("/proc/cpuinfo") as stream:
            flags = next((line for line in stream if line.startswith(("flags", "Features"))), "")
    except OSError:
        pass
    return hashlib.sha256(f"{platform.machine()}|{platform.processor()}|{flags.strip()}".encode()).hexdigest()[:16]


def _intact(entry: Path, identity: dict) -> bool:
    from blockpilot.files import remembered_file_sha256

    try:
        meta = json.loads((entry / "meta.json").read_text())
        return meta["identity"] == identity and all(
            remembered_file_sha256(entry / name) == sha for name, sha in meta["files"].items())
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return False


def _session_saving_copy(path: Path, threads: int | None, root: Path, entry: Path, identity: dict):
    """A session for `path` that also writes its optimized copy to `entry` (atomically: a sibling folder
    renamed into place, `meta.json` last); on any failure to do so, a plain session."""
    import onnxruntime as ort

    from blockpilot.files import remembered_file_sha256, write_text_atomic

    tmp = None
    try:
        root.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{entry.name}.", dir=root))
        options = session_options(threads)
        options.optimized_model_filepath = str(tmp / "model.onnx")
        for key, value in (("session.optimized_model_external_initializers_file_name", "model.data"),
                           ("session.optimized_model_external_initializers_min_size_in_bytes", "1024"),
                           ("session.save_external_prepacked_constant_initializers", "1")):
            options.add_session_config_entry(key, value)
        session = ort.InferenceSession(str(path), options, providers=PROVIDERS)
    except Exception:  # a cache that cannot be written (or a graph that cannot load: the plain open says why)
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
        return ort.InferenceSession(str(path), session_options(threads), providers=PROVIDERS)
    try:
        names = sorted(p.name for p in tmp.iterdir())
        aside = entry.with_name(f".{entry.name}.old.{os.getpid()}")
        if entry.exists():
            os.replace(entry, aside)
        os.replace(tmp, entry)
        shutil.rmtree(aside, ignore_errors=True)
        files = {name: remembered_file_sha256(entry / name) for name in names}
        write_text_atomic(entry / "meta.json", json.dumps({"identity": identity, "files": files}, indent=1))
        _prune(root, keep=entry)
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
    return session


def _prune(root: Path, keep: Path) -> None:
    """Remove entries whose source graph is gone (a rebuilt or deleted engine directory), and folders without a
    readable `meta.json` (interrupted writes; a writer renames its folder in and writes it at once) older than an hour."""
    for entry in root.iterdir():
        if entry == keep:
            continue
        try:
            source = json.loads((entry / "meta.json").read_text())["identity"]["source"]
            stale = not Path(source).is_file()
        except (OSError, ValueError, KeyError, TypeError):
            try:
                stale = time.time() - entry.stat().st_mtime > 3600
            except OSError:
                continue
        if stale:
            shutil.rmtree(entry, ignore_errors=True)
