"""Prompt sets turned into token-id requests for the target.

Prompts come from `blockpilot.assets.prompts.load_dataset` (text only); here they are tokenized
with the target's tokenizer, through its chat template when it has one (instruct targets): one
user turn, generation prompt added.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from blockpilot.errors import UserError
from blockpilot.text import chat_prompt_ids, load_tokenizer  # noqa: F401 - load_tokenizer re-exported



@dataclasses.dataclass(frozen=True)
class Request:
    """One prompt as the systems see it: token ids plus the labels reports group by."""

    id: str
    dataset: str
    category: str
    input_ids: tuple[int, ...]


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
            ids = chat_prompt_ids(tokenizer, prompt.text, history=prompt.history)
            if not ids:
                raise UserError(f"prompt {prompt.id} of {name} tokenizes to nothing; remove it")
            requests.append(Request(prompt.id, label, prompt.category, tuple(ids)))
    return requests
