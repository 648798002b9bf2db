"""`manifest.json`: the one versioned description of an engine directory, checked once on load.

An engine directory (written by `blockpilot build`) holds:

    manifest.json            this file
    target.onnx, drafter.onnx (+ `.data` when the weights are stored externally)
    drafter.int4.onnx        the drafter with 4-bit weights, for onnxruntime only (fp32 builds)
    target.engine, drafter.engine   TensorRT engines, when built with --trt
    predictor.onnx           block-size predictor, when given
    tokenizer files          copied from the target directory
    target/, drafter/        the original weights (safetensors) and configs, for the torch backend

Per graph the manifest records its files, I/O tensor names and optimization profiles (each with
min/opt/max shapes per input); profile indices are the same in the ONNX-derived TensorRT engine.
`files` maps every other file's relative path to its SHA-256. `step_costs` (optional; absent in
directories built before it existed) is the step-cost table measured on the built graphs right after
the build (`blockpilot.runtime.step_costs`). `read_manifest` raises `UserError` for a missing directory
or file, a digest mismatch, or a format newer than this code.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from blockpilot.errors import UserError
from blockpilot.files import file_sha256, remembered_file_sha256

MANIFEST_NAME = "manifest.json"
FORMAT_NAME = "blockpilot-engine"
FORMAT_VERSION = 2
"""2: per-row positions (`positions` `(b, T)`, drafter `block_positions` / `context_positions` `(b, n)`,
`context_length` `(b, 1)`), so that one call can carry requests at different lengths; 1 had one row of
positions for the whole batch."""
DTYPES = ("fp32", "fp16", "bf16")
PREFILL = "prefill"


@dataclasses.dataclass(frozen=True)
class Profile:
    """One optimization profile: `shapes[input] = (min, opt, max)`; `block_size` None for prefill."""

    name: str
    block_size: int | None
    shapes: dict[str, tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]]

    def to_dict(self) -> dict:
        return {"name": self.name, "block_size": self.block_size,
                "shapes": {k: [list(s) for s in v] for k, v in self.shapes.items()}}

    @classmethod
    def from_dict(cls, raw: dict) -> "Profile":
        shapes = {k: tuple(tuple(int(d) for d in s) for s in v) for k, v in raw["shapes"].items()}
        return cls(raw["name"], raw["block_size"], shapes)


@dataclasses.dataclass(frozen=True)
class GraphEntry:
    """One exported graph: its files, I/O names and profiles (index = TensorRT profile index)."""

    onnx: str
    engine: str | None
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    num_cache_layers: int
    profiles: tuple[Profile, ...]

    @property
    def past_names(self) -> list[str]:
        return [n for n in self.inputs if n.startswith("past_")]

    @property
    def present_names(self) -> list[str]:
        return [n for n in self.outputs if n.startswith("present_")]

    def profile_index(self, block_size: int | None) -> int | None:
        """Index of the profile for `block_size` (None: prefill), or None when there is none."""
        for i, profile in enumerate(self.profiles):
            if profile.block_size == block_size:
                return i
        return None

    def to_dict(self) -> dict:
        return {
            "onnx": self.onnx, "engine": self.engine, "inputs": list(self.inputs),
            "outputs": list(self.outputs), "num_cache_layers": self.num_cache_layers,
            "profile_of_block_size": {str(p.block_size if p.block_size else PREFILL): i
                                      for i, p in enumerate(self.profiles)},
            "profiles": [p.to_dict() for p in self.profiles],
        }

    @classmethod
    def from_dict(cls, raw: dict) -> "GraphEntry":
        return cls(raw["onnx"], raw.get("engine"), tuple(raw["inputs"]), tuple(raw["outputs"]),
                   int(raw["num_cache_layers"]), tuple(Profile.from_dict(p) for p in raw["profiles"]))


@dataclasses.dataclass(frozen=True)
class StepCosts:
    """Median milliseconds of the calls one decode step makes, on one backend, dtype and machine class.

    `target_ms[k]`: a target forward (verify) of k query tokens at `context` tokens of cache; k = 1
    is a plain decoding step (on onnxruntime it carries the padding row plain decoding runs with).
    `drafter_ms[k]`: one drafter call proposing a block of k (k >= 2). `loop_ms[k]` (optional): a
    whole decode step of the runtime's loop at block size k (draft, verify, acceptance and cache
    bookkeeping), from wall time over a short generation. A step at block size k costs `loop_ms[k]`
    when measured, else `target_ms[k] + drafter_ms[k]` (a plain one `target_ms[1]`): `step_ms`; a step
    that copied its draft by lookup makes no drafter call: `copy_step_ms`.
    """

    backend: str  # "torch" | "onnxruntime" | "tensorrt"
    dtype: str  # "fp32" | "fp16" | "bf16"
    machine: str  # machine class: CPU model and core count (or GPU name)
    context: int
    target_ms: dict[int, float]
    drafter_ms: dict[int, float]
    threads: int | None = None
    loop_ms: dict[int, float] = dataclasses.field(default_factory=dict)

    def step_ms(self, block_size: int) -> float:
        """Milliseconds of one decode step at `block_size` (1: plain decoding, no drafter call).

        Raises:
            UserError: the table has no entry for `block_size`.
        """
        if block_size not in self.target_ms or (block_size > 1 and block_size not in self.drafter_ms):
            raise UserError(f"the step-cost table ({self.backend} {self.dtype}) has no block size {block_size} "
                            f"(it has {sorted(self.target_ms)}); measure it on an engine dir built for that size")
        if block_size in self.loop_ms:
            return self.loop_ms[block_size]
        return self.target_ms[block_size] + (self.drafter_ms[block_size] if block_size > 1 else 0.0)

    def copy_step_ms(self, block_size: int) -> float:
        """Milliseconds of a step at `block_size` whose draft was copied by lookup (`runtime.lookup`):
        `step_ms` without its drafter call (the table's steps are timed with the drafter drafting)."""
        return self.step_ms(block_size) - (self.drafter_ms[block_size] if block_size > 1 else 0.0)

    def target_ms_at(self, rows: int) -> float:
        """`target_ms[rows]`, linearly interpolated between the measured row counts (extrapolated from the
        nearest two outside them): the verify cost of any row count from a table of a few."""
        return _interpolate(self.target_ms, rows)

    def drafter_ms_at(self, block_size: int) -> float:
        """`drafter_ms[block_size]`, interpolated as `target_ms_at`."""
        return _interpolate(self.drafter_ms, block_size)

    def to_dict(self) -> dict:
        return {"backend": self.backend, "dtype": self.dtype, "machine": self.machine, "context": self.context,
                "threads": self.threads, "target_ms": {str(k): v for k, v in sorted(self.target_ms.items())},
                "drafter_ms": {str(k): v for k, v in sorted(self.drafter_ms.items())},
                "loop_ms": {str(k): v for k, v in sorted(self.loop_ms.items())}}

    @classmethod
    def from_dict(cls, raw: dict) -> "StepCosts":
        return cls(str(raw["backend"]), str(raw["dtype"]), str(raw["machine"]), int(raw["context"]),
                   {int(k): float(v) for k, v in raw["target_ms"].items()},
                   {int(k): float(v) for k, v in raw["drafter_ms"].items()},
                   None if raw.get("threads") is None else int(raw["threads"]),
                   {int(k): float(v) for k, v in raw.get("loop_ms", {}).items()})


def _interpolate(table: dict[int, float], x: int) -> float:
    """`table[x]`, else the line through the two measured points around `x` (the nearest two outside them)."""
    if x in table:
        return table[x]
    keys = sorted(table)
    if len(keys) == 1:
        return table[keys[0]]
    lo = max([k for k in keys if k < x], default=None)
    hi = min([k for k in keys if k > x], default=None)
    if lo is None:
        lo, hi = keys[0], keys[1]
    elif hi is None:
        lo, hi = keys[-2], keys[-1]
    return table[lo] + (table[hi] - table[lo]) * (x - lo) / (hi - lo)


@dataclasses.dataclass(frozen=True)
class Manifest:
    dtype: str  # "fp32" | "fp16" | "bf16": the graphs' float type
    max_seq_len: int  # cache capacity of the engines (positions 0..max_seq_len-1)
    opset: int
    block_sizes: tuple[int, ...]  # drafting block sizes built (block size 1, autoregressive, always works)
    drafter_block_size: int  # the drafter's training block size
    tap_layers: tuple[int, ...]
    mask_token_id: int
    target: GraphEntry
    drafter: GraphEntry
    target_dir: str = "target"
    drafter_dir: str = "drafter"
    tokenizer_files: tuple[str, ...] = ()
    predictor: str | None = None
    versions: dict[str, str] = dataclasses.field(default_factory=dict)
    sources: dict[str, str] = dataclasses.field(default_factory=dict)  # where target/drafter were built from
    files: dict[str, str] = dataclasses.field(default_factory=dict)  # relative path -> SHA-256
    max_batch: int = 1  # most rows (requests) one graph call may carry
    step_costs: StepCosts | None = None  # measured on the built graphs (None: not measured)
    ort_drafter: str | None = None
    """The drafter graph onnxruntime runs instead of `drafter.onnx` (same I/O): `drafter.int4.onnx`,
    4-bit weights in onnxruntime's `MatMulNBits` (`blockpilot.builder.quantize`); None: `drafter.onnx`."""
    format_version: int = FORMAT_VERSION

    @property
    def has_engines(self) -> bool:
        return self.target.engine is not None and self.drafter.engine is not None

    def to_dict(self) -> dict:
        raw = dataclasses.asdict(self)
        raw.update(target=self.target.to_dict(), drafter=self.drafter.to_dict(),
                   block_sizes=list(self.block_sizes), tap_layers=list(self.tap_layers),
                   tokenizer_files=list(self.tokenizer_files),
                   step_costs=self.step_costs.to_dict() if self.step_costs is not None else None)
        return {"format": FORMAT_NAME, **raw}

    @classmethod
    def from_dict(cls, raw: dict) -> "Manifest":
        fields = {f.name for f in dataclasses.fields(cls)}
        values = {k: v for k, v in raw.items() if k in fields}
        values.update(target=GraphEntry.from_dict(raw["target"]), drafter=GraphEntry.from_dict(raw["drafter"]),
                      block_sizes=tuple(raw["block_sizes"]), tap_layers=tuple(raw["tap_layers"]),
                      tokenizer_files=tuple(raw.get("tokenizer_files", ())),
                      step_costs=StepCosts.from_dict(raw["step_costs"]) if raw.get("step_costs") else None)
        return cls(**values)




def hash_files(root: Path) -> dict[str, str]:
    """SHA-256 of every file under `root` except the manifest, keyed by POSIX relative path."""
    paths = sorted(p for p in root.rglob("*") if p.is_file() and p.name != MANIFEST_NAME)
    return {p.relative_to(root).as_posix(): file_sha256(p) for p in paths}


def write_manifest(engine_dir: Path, manifest: Manifest) -> Manifest:
    """Hash every file of `engine_dir` into `manifest.files` and write `manifest.json` (last).

    Returns:
        The manifest as written (with `files`).
    """
    manifest = dataclasses.replace(manifest, files=hash_files(engine_dir))
    (engine_dir / MANIFEST_NAME).write_text(json.dumps(manifest.to_dict(), indent=2) + "\n")
    return manifest


def read_manifest(engine_dir: Path | str, verify_files: bool = True) -> Manifest:
    """The checked manifest of `engine_dir`.

    Args:
        engine_dir: a directory written by `blockpilot build`.
        verify_files: check that every listed file exists and matches its SHA-256.

    Raises:
        UserError: not an engine directory, unreadable or newer manifest, missing or modified file.
    """
    engine_dir = Path(engine_dir)
    path = engine_dir / MANIFEST_NAME
    rebuild = "rebuild it with `blockpilot build`"
    if not engine_dir.is_dir():
        raise UserError(f"engine directory {engine_dir} does not exist; build one with `blockpilot build`")
    if not path.is_file():
        raise UserError(f"{engine_dir} has no {MANIFEST_NAME}, so it is not an engine directory; {rebuild}")
    try:
        raw = json.loads(path.read_text())
        version = int(raw["format_version"]) if raw.get("format") == FORMAT_NAME else None
    except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError, ValueError) as exc:
        raise UserError(f"{path} is not a readable engine manifest ({exc}); {rebuild}") from None
    if version is None:
        raise UserError(f"{path} is not a BlockPilot engine manifest (format is not '{FORMAT_NAME}'); {rebuild}")
    if version > FORMAT_VERSION:
        raise UserError(f"{path} has format version {version}, newer than this BlockPilot reads "
                        f"({FORMAT_VERSION}); upgrade blockpilot or {rebuild}")
    if version < FORMAT_VERSION:
        raise UserError(f"{path} has format version {version}, from an older BlockPilot whose graphs this one cannot "
                        f"run (it reads {FORMAT_VERSION}); {rebuild}")
    try:
        manifest = Manifest.from_dict(raw)
    except (KeyError, TypeError, ValueError) as exc:
        raise UserError(f"{path} is incomplete ({type(exc).__name__}: {exc}); {rebuild}") from None
    if verify_files:
        verify_manifest_files(engine_dir, manifest)
    return manifest


def verify_manifest_files(engine_dir: Path, manifest: Manifest) -> None:
    """Raise `UserError` for the first listed file that is missing or whose SHA-256 differs (each file is
    hashed again whenever it changed since it last passed: `files.remembered_digest`)."""
    for relative, expected in sorted(manifest.files.items()):
        path = engine_dir / relative
        if not path.is_file():
            raise UserError(f"engine directory {engine_dir} is missing {relative}; rebuild it with `blockpilot build`")
        if remembered_file_sha256(path) != expected:
            raise UserError(f"{path} does not match the SHA-256 in {MANIFEST_NAME} (modified or corrupt); "
                            "rebuild the engine directory with `blockpilot build`")
