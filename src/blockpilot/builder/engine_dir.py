"""`build_engine_dir`: target + drafter (+ predictor) -> a complete engine directory, or nothing.

Everything is written into a temporary sibling directory and renamed into place at the end, so a
failed or interrupted build leaves no half-written engine directory (an existing one stays as it
was). The layout is described in `blockpilot.builder.manifest`.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch

from blockpilot.builder.manifest import DTYPES, MANIFEST_NAME, GraphEntry, Manifest, StepCosts, write_manifest
from blockpilot.errors import UserError

TORCH_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                   "tokenizer.model", "vocab.json", "merges.txt", "added_tokens.json")
MODEL_FILES = ("config.json", "generation_config.json", "model.safetensors.index.json")
VERSIONED_PACKAGES = ("blockpilot", "torch", "onnx", "onnxscript", "onnxruntime", "transformers",
                      "tensorrt", "polygraphy")


@dataclasses.dataclass(frozen=True)
class BuildSpec:
    """What `blockpilot build` was asked for.

    Args:
        target_dir: Hugging Face Llama/Qwen2/Qwen3 directory (config.json + safetensors).
        drafter_dir: z-lab-format DFlash drafter directory fitting the target.
        out_dir: engine directory to create (replaced when it is an engine directory already).
        block_sizes: drafting block sizes, one TensorRT profile each.
        max_seq_len: cache capacity of the graphs' profiles (prompt + generated + one block).
        dtype: "fp32", "fp16" or "bf16" for the graphs.
        predictor: block-size predictor `.onnx` to ship in the directory (already checked).
        trt: also build TensorRT engines (needs TensorRT and a GPU).
        opset: 24 (TensorScatter + Attention, TensorRT >= 10.15) or 18 (ScatterND, any TensorRT 10).
        external_data_bytes: store a graph's weights in a `.data` file above this many bytes.
        int4_drafter: also write `drafter.int4.onnx`, the drafter with 4-bit weights that the
            onnxruntime backend runs (fp32 builds only; `blockpilot.builder.quantize`).
    """

    target_dir: Path
    drafter_dir: Path
    out_dir: Path
    block_sizes: tuple[int, ...]
    max_seq_len: int
    dtype: str = "fp32"
    predictor: Path | None = None
    trt: bool = False
    opset: int = 24
    external_data_bytes: int = 1 << 30
    int4_drafter: bool = True


def check_spec(spec: BuildSpec, max_position_embeddings: int) -> None:
    """Raise `UserError` for the first user-fixable problem of `spec` (models already loaded)."""
    sizes, s = spec.block_sizes, spec.max_seq_len
    if spec.dtype not in DTYPES:
        raise UserError(f"dtype {spec.dtype!r} is not one of {', '.join(DTYPES)}")
    if not sizes or min(sizes) < 2:
        raise UserError(f"block sizes {list(sizes)} must be >= 2 (block size 1, autoregressive, is always built)")
    if s < 2 * max(sizes) + 1:
        raise UserError(f"--max-seq-len {s} leaves no room for a prompt and a block of {max(sizes)}; "
                        f"use at least {2 * max(sizes) + 1}")
    if s > max_position_embeddings:
        raise UserError(f"--max-seq-len {s} exceeds the target's max_position_embeddings "
                        f"({max_position_embeddings}); use at most that")
    if spec.predictor is not None and not Path(spec.predictor).is_file():
        raise UserError(f"predictor {spec.predictor} not found; pass the .onnx from `blockpilot train-predictor`")
    out = Path(spec.out_dir)
    if out.exists() and not (out / MANIFEST_NAME).is_file() and (not out.is_dir() or any(out.iterdir())):
        raise UserError(f"{out} exists and is not an engine directory; choose another --out or remove it")


def replace_dir_atomically(out_dir: Path, fill: Callable[[Path], None]) -> Path:
    """Call `fill(tmp)` on a fresh sibling directory, then rename it to `out_dir`.

    If `fill` raises, the temporary directory is removed and `out_dir` is left untouched.
    """
    out_dir = Path(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.building-", dir=out_dir.parent))
    try:
        fill(tmp)
        if out_dir.exists():
            old = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.old-", dir=out_dir.parent))
            os.replace(out_dir, old / "dir")
            os.replace(tmp, out_dir)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir


def _link_or_copy(src: Path, dst: Path) -> None:
    """Hard-link `src` to `dst` (same bytes, no space) or copy it across file systems."""
    dst.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


def copy_model_files(src_dir: Path, dst_dir: Path) -> None:
    """Configs and safetensors weights of a model directory, unchanged (their hashes stay valid)."""
    for path in sorted(Path(src_dir).glob("*.safetensors")):
        _link_or_copy(path, dst_dir / path.name)
    for name in MODEL_FILES:
        if (Path(src_dir) / name).is_file():
            _link_or_copy(Path(src_dir) / name, dst_dir / name)


def copy_tokenizer_files(target_dir: Path, out_dir: Path) -> tuple[str, ...]:
    names = tuple(n for n in TOKENIZER_FILES if (Path(target_dir) / n).is_file())
    for name in names:
        shutil.copy2(Path(target_dir) / name, out_dir / name)
    return names


def package_versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    found = {}
    for name in VERSIONED_PACKAGES:
        try:
            found[name] = version(name)
        except PackageNotFoundError:
            continue
    return found


def _weight_bytes(*modules: torch.nn.Module) -> int:
    unique = {id(p): p for m in modules for p in m.parameters()}
    return sum(p.numel() * p.element_size() for p in unique.values())


def _load_models(spec: BuildSpec):
    """Target and drafter in the build dtype with RoPE tables of `max_seq_len` positions."""
    from blockpilot.models.checkpoint import load_drafter, load_target
    from blockpilot.models.config import DecoderConfig, check_drafter_fits_target, read_config_json

    config = DecoderConfig.from_dict(read_config_json(spec.target_dir), str(Path(spec.target_dir) / "config.json"))
    check_spec(spec, config.max_position_embeddings)
    dtype = TORCH_DTYPES[spec.dtype]
    target = load_target(spec.target_dir, dtype=dtype, max_positions=spec.max_seq_len)
    drafter = load_drafter(spec.drafter_dir, dtype=dtype, max_positions=spec.max_seq_len)
    check_drafter_fits_target(target.config, drafter.config, where=f"drafter {spec.drafter_dir}")
    return target, drafter


def _export_graphs(spec: BuildSpec, target, drafter, out: Path, log) -> tuple[GraphEntry, GraphEntry, int, str | None]:
    """The two graphs' manifest entries, the batch they take, and the onnxruntime drafter copy (or None)."""
    from blockpilot.builder.export import ExportLimits, export_drafter, export_target
    from blockpilot.builder.profiles import drafter_profiles, target_profiles

    limits, taps = ExportLimits(spec.max_seq_len), drafter.config.target_layer_ids
    log(f"exporting the target graph (opset {spec.opset}, {spec.dtype}) ...")
    big = _weight_bytes(target) > spec.external_data_bytes
    target.fuse_projections()  # q/k/v and gate/up as one product each: fewer, larger MatMuls in the graph
    t_spec = export_target(target, taps, out / "target.onnx", limits, spec.opset, external_data=big)
    log("exporting the drafter graph ...")
    big = _weight_bytes(drafter, target.embed_tokens, target.lm_head) > spec.external_data_bytes
    d_spec = export_drafter(target, drafter, out / "drafter.onnx", limits, spec.opset, external_data=big)
    ort_drafter = None
    if spec.int4_drafter and spec.dtype == "fp32":
        from blockpilot.builder.quantize import INT4_DRAFTER, write_int4_drafter

        log("writing the drafter with 4-bit weights for onnxruntime ...")
        write_int4_drafter(out / "drafter.onnx", out / INT4_DRAFTER, external_data=big)
        ort_drafter = INT4_DRAFTER
    t_profiles = target_profiles(t_spec, target.config, spec.block_sizes, spec.max_seq_len)
    d_profiles = drafter_profiles(d_spec, drafter.config, spec.block_sizes, spec.max_seq_len)
    return (GraphEntry("target.onnx", None, t_spec.inputs, t_spec.outputs, t_spec.num_cache_layers, t_profiles),
            GraphEntry("drafter.onnx", None, d_spec.inputs, d_spec.outputs, d_spec.num_cache_layers, d_profiles),
            limits.max_batch, ort_drafter)


def build_engine_dir(spec: BuildSpec, log: Callable[[str], None] = lambda message: None,
                     measure_step_costs: Callable[[Path], StepCosts] | None = None) -> Manifest:
    """Export, copy and (optionally) compile everything into `spec.out_dir`.

    Args:
        spec: the build request.
        log: receives one line per stage.
        measure_step_costs: times the finished (not yet renamed) directory's graphs; its table is
            stored in the manifest's `step_costs` (`blockpilot.runtime.step_costs.measure_engine_dir`).

    Returns:
        The manifest written into the directory.

    Raises:
        UserError: bad models, arguments, output directory, or TensorRT unavailable for `trt`.
    """
    if spec.trt:
        from blockpilot.builder.trt import require_tensorrt

        require_tensorrt()
    target, drafter = _load_models(spec)
    written: list[Manifest] = []

    def fill(out: Path) -> None:
        target_entry, drafter_entry, max_batch, ort_drafter = _export_graphs(spec, target, drafter, out, log)
        copy_model_files(spec.target_dir, out / "target")
        copy_model_files(spec.drafter_dir, out / "drafter")
        if spec.predictor is not None:
            shutil.copy2(spec.predictor, out / "predictor.onnx")
        manifest = Manifest(
            dtype=spec.dtype, max_seq_len=spec.max_seq_len, opset=spec.opset,
            block_sizes=tuple(sorted(set(spec.block_sizes))), drafter_block_size=drafter.config.block_size,
            tap_layers=drafter.config.target_layer_ids, mask_token_id=drafter.config.mask_token_id,
            target=target_entry, drafter=drafter_entry, tokenizer_files=copy_tokenizer_files(spec.target_dir, out),
            predictor="predictor.onnx" if spec.predictor is not None else None, versions=package_versions(),
            sources={"target": str(Path(spec.target_dir).resolve()), "drafter": str(Path(spec.drafter_dir).resolve())},
            max_batch=max_batch, ort_drafter=ort_drafter,
        )
        if spec.trt:
            from blockpilot.builder.trt import build_engines

            manifest = build_engines(out, manifest, log)
        log("hashing files and writing the manifest ...")
        manifest = write_manifest(out, manifest)
        if measure_step_costs is not None:
            log("measuring step costs on the built graphs ...")
            manifest = dataclasses.replace(manifest, step_costs=measure_step_costs(out))
            (out / MANIFEST_NAME).write_text(json.dumps(manifest.to_dict(), indent=2) + "\n")
        written.append(manifest)

    replace_dir_atomically(spec.out_dir, fill)
    return written[0]
