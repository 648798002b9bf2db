"""Text <-> token ids for instruct targets: tokenizer loading and the chat template.

The runtime works on token ids only; commands, labelling and profiling turn prompts into ids here,
so every part of the package formats a prompt the same way.
"""

from __future__ import annotations

from pathlib import Path

from blockpilot.errors import UserError


def load_tokenizer(model_dir: Path | str):
    """The Hugging Face tokenizer stored in `model_dir` (offline)."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(model_dir))
    except (OSError, ValueError) as exc:
        raise UserError(f"{model_dir} has no usable tokenizer ({str(exc).splitlines()[0]}); "
                        "copy the tokenizer files of the target into it") from None


def chat_prompt_ids(tokenizer, prompt: str, use_chat_template: bool = True) -> list[int]:
    """Token ids of `prompt` as the assistant turn's context (chat template when there is one)."""
    if use_chat_template and getattr(tokenizer, "chat_template", None):
        ids = tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=True
        )
        return list(ids["input_ids"] if hasattr(ids, "keys") else ids)
    return list(tokenizer(prompt, add_special_tokens=True)["input_ids"])
