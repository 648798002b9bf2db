"""Text <-> token ids for instruct targets: tokenizer loading and the chat template.

The runtime works on token ids only; commands, labelling and profiling turn prompts into ids here,
so every part of the package formats a prompt the same way.
"""

from __future__ import annotations

from pathlib import Path

from blockpilot.errors import UserError

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def load_tokenizer(model_dir: Path | str):
    """The Hugging Face tokenizer stored in `model_dir`, read from there only (never a hub).

    Raises:
        UserError: the directory has no tokenizer files, or they cannot be loaded.
    """
    model_dir = Path(model_dir)
    if not any((model_dir / name).is_file() for name in TOKENIZER_FILES):
        raise UserError(f"{model_dir} has no tokenizer files ({', '.join(TOKENIZER_FILES)}); "
                        "save the target's tokenizer beside the model")
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)
    except Exception as exc:  # noqa: BLE001 - the tokenizer files are the user's; any failure is theirs
        raise UserError(f"cannot load the tokenizer in {model_dir} ({one_line(exc)}); restore its files") from None


def chat_prompt_ids(tokenizer, prompt: str, use_chat_template: bool = True, history=()) -> list[int]:
    """Token ids of `prompt` as the user turn of the chat template (with the generation prompt), after
    the earlier turns `history` (`(role, content)` pairs), or its plain tokenization when the tokenizer
    has no template or `use_chat_template` is False.

    Raises:
        UserError: a conversation (`history`) without a chat template to render it.
    """
    if use_chat_template and getattr(tokenizer, "chat_template", None):
        messages = [{"role": role, "content": content} for role, content in history]
        ids = tokenizer.apply_chat_template(
            [*messages, {"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=True
        )
        return [int(i) for i in (ids["input_ids"] if hasattr(ids, "keys") else ids)]
    if history:
        raise UserError("a prompt with earlier turns needs the tokenizer's chat template; this tokenizer has none "
                        "(or it was turned off): give first turns only")
    return [int(i) for i in tokenizer(prompt, add_special_tokens=True)["input_ids"]]


def one_line(exc: BaseException) -> str:
    """An exception's message squeezed onto one line (for `UserError` texts)."""
    return " ".join(str(exc).split()) or type(exc).__name__
