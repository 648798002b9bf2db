"""Teacher-forced target taps for drafter training, computed once and cached on disk.

One target pass over prompt + answer gives, at every position, the outputs of the tapped layers
(HF `hidden_states[l + 1]`), exactly what the runtime feeds the drafter as context. On the CPU they
are written in bf16 into one raw file (`taps.bf16`, `(total tokens, taps * H)`) batch by batch and
read back through a memory map, so a corpus larger than memory trains (3M tokens of SmolLM2 with 5
taps are 17 GB) and an interrupted extraction resumes at its last finished batch. `taps.json` says
what the file holds (the key of the answers it came from, the sequences), written once; `taps.done.json`
which batches are done (the cache is complete when all of them are).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterator

import numpy as np
import torch
from tqdm import tqdm

from blockpilot.files import write_text_atomic
from blockpilot.models.decoder import Decoder, KVCache
from blockpilot.training.data import Sequence

TAPS_FILE = "taps.bf16"
INDEX_FILE = "taps.json"
PROGRESS_FILE = "taps.done.json"


@torch.inference_mode()
def extract_taps(target: Decoder, sequences: list[Sequence], tap_layers: tuple[int, ...],
                 tokens_per_batch: int | None = None, autocast: bool = True) -> list[torch.Tensor]:
    """Per-sequence taps `(L_i, len(tap_layers) * H)` in bf16, in memory on the target's device."""
    out: list[torch.Tensor | None] = [None] * len(sequences)
    for _, group, taps in _tap_batches(target, sequences, tap_layers, tokens_per_batch, autocast, done=set()):
        for row, i in enumerate(group):
            out[i] = taps[row, : len(sequences[i].ids)].clone()
    return out  # type: ignore[return-value]


def cached_taps(path: Path, target: Decoder, sequences: list[Sequence], tap_layers: tuple[int, ...], key: str,
                tokens_per_batch: int | None = None, autocast: bool = True) -> list[torch.Tensor]:
    """The taps of `sequences`, computed into `path` where missing and returned as memory-mapped views.

    A cache made for another `key` (other answers, taps or length cut) is replaced."""
    path.mkdir(parents=True, exist_ok=True)
    lengths = [len(s.ids) for s in sequences]
    width = len(tap_layers) * target.config.hidden_size
    tokens_per_batch = _tokens_per_batch(target, tokens_per_batch)
    wanted = {"key": key, "width": width, "tokens_per_batch": tokens_per_batch, "lengths": lengths}
    index = _read_json(path / INDEX_FILE)
    data = path / TAPS_FILE
    if index is None or {k: index.get(k) for k in wanted} != wanted or not data.is_file():
        data.unlink(missing_ok=True)
        index = {**wanted, "sequences": [{"ids": list(s.ids), "answer_start": s.answer_start, "source": s.source}
                                         for s in sequences]}
        with open(data, "wb") as f:  # sparse until written
            f.truncate(sum(lengths) * width * 2)
        _write_progress(path, [])
        write_text_atomic(path / INDEX_FILE, json.dumps(index))
    done = _done_batches(path, index)
    if not _complete(index, done):
        store = np.memmap(data, dtype=np.uint16, mode="r+", shape=(sum(lengths), width))
        offsets = np.concatenate([[0], np.cumsum(lengths)])
        for number, group, taps in _tap_batches(target, sequences, tap_layers, tokens_per_batch, autocast, done):
            for row, i in enumerate(group):
                store[offsets[i]: offsets[i + 1]] = taps[row, : lengths[i]].cpu().view(torch.int16).numpy().view(np.uint16)
            store.flush()
            done.add(number)
            _write_progress(path, sorted(done))
        del store
    return _views(data, lengths, width)


def load_cached_taps(path: Path, key: str) -> tuple[list[Sequence], list[torch.Tensor]] | None:
    """The sequences and memory-mapped taps of a complete cache made for `key`, else None."""
    index = _read_json(path / INDEX_FILE)
    if (index is None or index.get("key") != key or not (path / TAPS_FILE).is_file()
            or not _complete(index, _done_batches(path, index))):
        return None
    sequences = [Sequence(tuple(s["ids"]), s["answer_start"], s.get("source", "")) for s in index["sequences"]]
    return sequences, _views(path / TAPS_FILE, index["lengths"], index["width"])


def _read_json(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None


def _done_batches(path: Path, index: dict) -> set[int]:
    """The finished batch numbers of the cache in `path` (caches written before the progress file had its
    own keep them in the index)."""
    return set((_read_json(path / PROGRESS_FILE) or index).get("done", []))


def _complete(index: dict, done: set[int]) -> bool:
    """Whether every batch of the index's sequences is in `done`."""
    return len(done) >= len(_length_groups(index["lengths"], index["tokens_per_batch"]))


def _write_progress(path: Path, done: list[int]) -> None:
    write_text_atomic(path / PROGRESS_FILE, json.dumps({"done": done}))


def _views(data: Path, lengths: list[int], width: int) -> list[torch.Tensor]:
    """Per-sequence bf16 views into the file (copy-on-write map: pages are read when a batch needs them)."""
    if not lengths:
        return []
    store = np.memmap(data, dtype=np.uint16, mode="c", shape=(sum(lengths), width))
    flat = torch.from_numpy(store).view(torch.bfloat16)
    return list(torch.split(flat, lengths))


def _tokens_per_batch(target: Decoder, tokens_per_batch: int | None) -> int:
    """4096 tokens per batch on CPU, 32768 on CUDA, unless given."""
    return tokens_per_batch or (32768 if target.embed_tokens.weight.device.type == "cuda" else 4096)


@torch.inference_mode()
def _tap_batches(target: Decoder, sequences: list[Sequence], tap_layers: tuple[int, ...],
                 tokens_per_batch: int | None, autocast: bool, done: set[int]
                 ) -> Iterator[tuple[int, list[int], torch.Tensor]]:
    """(batch number, sequence indices, bf16 taps `(len(group), width, F)`) for the length-sorted batches
    not in `done`, on the target's device."""
    device = target.embed_tokens.weight.device
    lengths = [len(s.ids) for s in sequences]
    groups = _length_groups(lengths, _tokens_per_batch(target, tokens_per_batch))
    progress = tqdm(total=sum(lengths), desc="target features", unit="tok")
    progress.update(sum(lengths[i] for number in done if number < len(groups) for i in groups[number]))
    for number, group in enumerate(groups):
        if number in done:
            continue
        width = max(lengths[i] for i in group)
        ids = torch.zeros(len(group), width, dtype=torch.long)  # right padding never reaches earlier positions
        for row, i in enumerate(group):
            ids[row, : lengths[i]] = torch.tensor(sequences[i].ids)
        ids = ids.to(device)
        cache = KVCache.allocate(target.config, len(group), width, torch.float32, device)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
            taps = target(target.embed_tokens(ids), torch.arange(width, device=device), cache, width, tap_layers).taps
        yield number, group, taps.to(torch.bfloat16)
        progress.update(sum(lengths[i] for i in group))
    progress.close()


def _length_groups(lengths: list[int], tokens_per_batch: int) -> list[list[int]]:
    """Indices grouped by ascending length so that group size x longest <= tokens_per_batch."""
    groups, group = [], []
    for i in sorted(range(len(lengths)), key=lengths.__getitem__):
        if group and (len(group) + 1) * lengths[i] > tokens_per_batch:
            groups.append(group)
            group = []
        group.append(i)
    return groups + ([group] if group else [])
