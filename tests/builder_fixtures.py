"""Engine directories of tiny fixture models, built once per test session (with `blockpilot build`)
and shared by modules.

ONNX export is the slow part of these tests, so `tiny_engine_dir` builds each (family, opset)
once under the session's base temp dir and later calls reuse it. Tests that modify an engine
directory must work on a copy (`copy_engine_dir`).
"""

from __future__ import annotations

import shutil
from pathlib import Path

from blockpilot.builder.engine_dir import BuildSpec, build_engine_dir
from blockpilot.cli import main

from fixtures import make_drafter, make_hf_target

TINY_BLOCK_SIZES = (3, 5)
TINY_MAX_SEQ_LEN = 40
TINY_DRAFTER_BLOCK_SIZE = 4  # not built: the default block size falls back to the closest built one


def save_char_tokenizer(model_dir: Path) -> Path:
    """A character-level tokenizer (ids 0-2 special, then letters, digits and punctuation) in `model_dir`."""
    import string

    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    vocab.update({ch: 3 + i for i, ch in enumerate(string.ascii_letters + string.digits + " .,!?")})
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>")),
                                        bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    tokenizer.save_pretrained(model_dir)
    return model_dir


def tiny_models(tmp_path_factory, family: str) -> tuple[Path, Path]:
    """A tiny target of `family` (with a tokenizer) and a 2-layer drafter for it."""
    root = tmp_path_factory.getbasetemp() / f"builder-models-{family}"
    target, drafter = root / f"target-{family}-0", root / "drafter"
    if not (drafter / "config.json").is_file():
        root.mkdir(parents=True, exist_ok=True)
        save_char_tokenizer(make_hf_target(root, family))
        make_drafter(root, target, block_size=TINY_DRAFTER_BLOCK_SIZE, layers=2)
    return target, drafter


def tiny_engine_dir(tmp_path_factory, family: str = "llama", opset: int = 24) -> Path:
    """The engine directory of the tiny `family` models at `opset` (block sizes 3 and 5, capacity 40).

    Opset-24 directories are built with the `blockpilot build` command (with the 4-bit drafter copy
    onnxruntime runs, the default); opset-18 ones through `build_engine_dir` with every graph's weights
    in an external `.data` file (the large-model path) and without it, so onnxruntime drafts with the
    fp32 drafter graph exactly as the torch backend does.
    """
    out = tmp_path_factory.getbasetemp() / "engines" / f"{family}-opset{opset}"
    if (out / "manifest.json").is_file():
        return out
    target, drafter = tiny_models(tmp_path_factory, family)
    if opset == 18:
        build_engine_dir(BuildSpec(target, drafter, out, TINY_BLOCK_SIZES, TINY_MAX_SEQ_LEN, opset=18,
                                   external_data_bytes=0, int4_drafter=False))
    else:
        sizes = ",".join(str(k) for k in TINY_BLOCK_SIZES)
        code = main(["build", "--target", str(target), "--drafter", str(drafter), "--block-sizes", sizes,
                     "--max-seq-len", str(TINY_MAX_SEQ_LEN), "--opset", str(opset), "--out", str(out)])
        assert code == 0, f"blockpilot build exited with {code}"
    return out


def copy_engine_dir(source: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(source, tmp_path / source.name))
