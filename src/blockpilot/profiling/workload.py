"""Prompt sets turned into token-id requests for the target.

Prompts come from `blockpilot.assets.prompts.load_dataset` (text only); here they are tokenized
with the target's tokenizer, through its chat template when it has one (instruct targets): one
user turn, generation prompt added.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from blockpilot.errors import UserError

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


@dataclasses.dataclass(frozen=True)
class Request:
    """One prompt as the systems see it: token ids plus the labels reports group by."""

    id: str
    dataset: str
    category: str
    input_ids: tuple[int, ...]


def load_tokenizer(model_dir: str | Path):
    """The transformers tokenizer saved in `model_dir`.

    Raises:
        UserError: the directory holds no tokenizer files.
    """
    from transformers import AutoTokenizer

    model_dir = Path(model_dir)
    if not any((model_dir / name).is_file() for name in TOKENIZER_FILES):
        raise UserError(
            f"{model_dir} has no tokenizer ({' / '.join(TOKENIZER_FILES)}); profile needs the target's "
            "tokenizer: pass --target with a Hugging Face directory that has one"
        )
    return AutoTokenizer.from_pretrained(model_dir)


def encode_prompt(tokenizer, text: str) -> list[int]:
    """Token ids of `text` as a user turn (chat template with generation prompt), or plain
    tokenization when the tokenizer has no chat template."""
    if getattr(tokenizer, "chat_template", None):
        ids = tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True
        )
        ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
        return [int(i) for i in ids]
    return [int(i) for i in tokenizer(text)["input_ids"]]


def load_requests(datasets: list[str], tokenizer, limit: int | None = None) -> list[Request]:
    """Requests for every prompt set in `datasets` (names or JSONL paths), `limit` per set.

    Args:
        datasets: "humaneval", "mtbench", "sharegpt" or paths to JSONL prompt files.
        tokenizer: the target's tokenizer (`load_tokenizer`).
        limit: at most this many prompts per set, in file order (None: all).

    Returns:
        Requests in set order, then file order; the dataset label is the name or the file stem.

    Raises:
        UserError: an unknown set, an unreadable or empty file, an empty tokenization.
    """
    from blockpilot.assets.prompts import DATASET_NAMES, load_dataset

    requests = []
    for name in datasets:
        label = name if name in DATASET_NAMES else Path(name).stem
        for prompt in load_dataset(name)[:limit]:
            ids = encode_prompt(tokenizer, prompt.text)
            if not ids:
                raise UserError(f"prompt {prompt.id} of {name} tokenizes to nothing; remove it")
            requests.append(Request(prompt.id, label, prompt.category, tuple(ids)))
    return requests
