"""Teacher-forced target taps for drafter training, computed once and cached on disk.

One target pass over prompt + answer gives, at every position, the outputs of the tapped layers
(HF `hidden_states[l + 1]`), exactly what the runtime feeds the drafter as context. On the CPU they
are written in bf16 into one raw file (`taps.bf16`, `(total tokens, taps * H)`) batch by batch and
read back through a memory map, so a corpus larger than memory trains (3M tokens of SmolLM2 with 5
taps are 17 GB) and an interrupted extraction resumes at its last finished batch. `taps.json` says
what the file holds (the key of the answers it came from, the sequences), written once; `taps.done.json`
which batches are done (the cache is complete when all of them are).

For distillation (`train-drafter --distill`) the same pass also keeps the target's next-token
distribution at every position as its `K` most likely ids and their log-probabilities at T = 1 over
the full vocabulary (`soft.ids.i32` and `soft.logprobs.f32`, `(total tokens, K)` each): row `i` of a
sequence is the target's prediction for its token `i + 1`.
"""

from __future__ import annotations

import dataclasses
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
SOFT_IDS_FILE = "soft.ids.i32"
SOFT_LOGPROBS_FILE = "soft.logprobs.f32"


@dataclasses.dataclass(frozen=True)
class SoftLabels:
    """The target's next-token distributions over one sequence: at position `i`, its `K` most likely
    next tokens (for position `i + 1`) and their log-probabilities (T = 1, normalised over the full
    vocabulary, so the `K` probabilities sum to at most 1)."""

    ids: torch.Tensor  # (L, K) int32
    logprobs: torch.Tensor  # (L, K) float32


def extract_taps(target: Decoder, sequences: list[Sequence], tap_layers: tuple[int, ...],
                 tokens_per_batch: int | None = None, autocast: bool = True) -> list[torch.Tensor]:
    """Per-sequence taps `(L_i, len(tap_layers) * H)` in bf16, in memory on the target's device."""
    return extract_features(target, sequences, tap_layers, tokens_per_batch=tokens_per_batch, autocast=autocast)[0]


@torch.inference_mode()
def extract_features(target: Decoder, sequences: list[Sequence], tap_layers: tuple[int, ...], *, top_k: int = 0,
                     tokens_per_batch: int | None = None, autocast: bool = True, out_device: torch.device | None = None
                     ) -> tuple[list[torch.Tensor], list[SoftLabels] | None]:
    """Per-sequence taps (as `extract_taps`) and, with `top_k > 0`, the target's `SoftLabels`, in memory: on the
    target's device, or on `out_device` (each batch moved there as it is made: `feature_bytes`)."""
    taps_out: list = [None] * len(sequences)
    soft_out: list | None = [None] * len(sequences) if top_k else None
    for _, group, taps, soft in _tap_batches(target, sequences, tap_layers, tokens_per_batch, autocast, set(), top_k):
        if out_device is not None:
            taps, soft = taps.to(out_device), None if soft is None else (soft[0].to(out_device), soft[1].to(out_device))
        for row, i in enumerate(group):
            n = len(sequences[i].ids)
            taps_out[i] = taps[row, :n].clone()
            if soft_out is not None:
                soft_out[i] = SoftLabels(soft[0][row, :n].clone(), soft[1][row, :n].clone())
    return taps_out, soft_out


def feature_bytes(sequences: list[Sequence], taps_width: int, top_k: int = 0) -> int:
    """Bytes of the features of `sequences` in memory: bf16 taps `(L, taps_width)`, and with `top_k` the soft
    labels (int32 ids and fp32 log-probabilities, `(L, top_k)` each)."""
    return sum(len(s.ids) for s in sequences) * (2 * taps_width + 8 * top_k)


def cached_taps(path: Path, target: Decoder, sequences: list[Sequence], tap_layers: tuple[int, ...], key: str,
                tokens_per_batch: int | None = None, autocast: bool = True, top_k: int = 0
                ) -> tuple[list[torch.Tensor], list[SoftLabels] | None]:
    """The taps of `sequences` (and with `top_k > 0` their `SoftLabels`), computed into `path` where missing
    and returned as memory-mapped views.

    A cache made for another `key` (other answers, taps or length cut) or without the soft labels asked for
    is replaced; one made with soft labels also serves a run that does not ask for them."""
    path.mkdir(parents=True, exist_ok=True)
    lengths = [len(s.ids) for s in sequences]
    width = len(tap_layers) * target.config.hidden_size
    tokens_per_batch = _tokens_per_batch(target, tokens_per_batch)
    wanted = {"key": key, "width": width, "tokens_per_batch": tokens_per_batch, "lengths": lengths}
    if top_k:
        wanted["top_k"] = top_k
    index = _read_json(path / INDEX_FILE)
    data = path / TAPS_FILE
    soft_files = (path / SOFT_IDS_FILE, path / SOFT_LOGPROBS_FILE)
    if (index is None or {k: index.get(k) for k in wanted} != wanted or not data.is_file()
            or (top_k and not all(f.is_file() for f in soft_files))):
        for f in (data, *soft_files):
            f.unlink(missing_ok=True)
        index = {**wanted, "sequences": [{"ids": list(s.ids), "answer_start": s.answer_start, "source": s.source}
                                         for s in sequences]}
        with open(data, "wb") as f:  # sparse until written
            f.truncate(sum(lengths) * width * 2)
        for f in soft_files if top_k else ():
            with open(f, "wb") as out:
                out.truncate(sum(lengths) * top_k * 4)  # int32 / float32
        _write_progress(path, [])
        write_text_atomic(path / INDEX_FILE, json.dumps(index))
    done = _done_batches(path, index)
    if not _complete(index, done):
        total = sum(lengths)
        store = np.memmap(data, dtype=np.uint16, mode="r+", shape=(total, width))
        soft_store = _soft_maps(path, total, top_k, "r+") if top_k else None
        offsets = np.concatenate([[0], np.cumsum(lengths)])
        for number, group, taps, soft in _tap_batches(target, sequences, tap_layers, tokens_per_batch, autocast, done,
                                                      top_k):
            for row, i in enumerate(group):
                rows = slice(offsets[i], offsets[i + 1])
                store[rows] = taps[row, : lengths[i]].cpu().view(torch.int16).numpy().view(np.uint16)
                for part, values in zip(soft_store or (), soft or ()):
                    part[rows] = values[row, : lengths[i]].cpu().numpy()
            for part in (store, *(soft_store or ())):
                part.flush()
            done.add(number)
            _write_progress(path, sorted(done))
        del store, soft_store
    return _views(data, lengths, width), _soft_views(path, lengths, top_k) if top_k else None


def load_cached_taps(path: Path, key: str, top_k: int = 0
                     ) -> tuple[list[Sequence], list[torch.Tensor], list[SoftLabels] | None] | None:
    """The sequences, memory-mapped taps and soft labels of a complete cache made for `key`, else None.

    With `top_k > 0` the cache must hold that many soft labels per position; with 0 any soft labels it
    holds are returned too (a hard-label run then logs the same sampled-acceptance estimate), else None."""
    index = _read_json(path / INDEX_FILE)
    if (index is None or index.get("key") != key or not (path / TAPS_FILE).is_file()
            or not _complete(index, _done_batches(path, index))):
        return None
    has = index.get("top_k", 0) if (path / SOFT_IDS_FILE).is_file() else 0
    if top_k and has != top_k:
        return None
    sequences = [Sequence(tuple(s["ids"]), s["answer_start"], s.get("source", "")) for s in index["sequences"]]
    soft = _soft_views(path, index["lengths"], has) if has else None
    return sequences, _views(path / TAPS_FILE, index["lengths"], index["width"]), soft


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


def _soft_views(path: Path, lengths: list[int], top_k: int) -> list[SoftLabels]:
    """Per-sequence soft labels as views into the cache's two files (copy-on-write maps)."""
    if not lengths:
        return []
    ids, logprobs = (torch.from_numpy(m) for m in _soft_maps(path, sum(lengths), top_k, "c"))
    return [SoftLabels(i, lp) for i, lp in zip(torch.split(ids, lengths), torch.split(logprobs, lengths))]


def _soft_maps(path: Path, total: int, top_k: int, mode: str) -> tuple[np.memmap, np.memmap]:
    """The cache's soft-label files as `(total, top_k)` int32 ids and float32 log-probabilities."""
    return (np.memmap(path / SOFT_IDS_FILE, dtype=np.int32, mode=mode, shape=(total, top_k)),
            np.memmap(path / SOFT_LOGPROBS_FILE, dtype=np.float32, mode=mode, shape=(total, top_k)))


def _tokens_per_batch(target: Decoder, tokens_per_batch: int | None) -> int:
    """4096 tokens per batch on CPU, 32768 on CUDA, unless given."""
    return tokens_per_batch or (32768 if target.embed_tokens.weight.device.type == "cuda" else 4096)


@torch.inference_mode()
def _tap_batches(target: Decoder, sequences: list[Sequence], tap_layers: tuple[int, ...],
                 tokens_per_batch: int | None, autocast: bool, done: set[int], top_k: int = 0
                 ) -> Iterator[tuple[int, list[int], torch.Tensor, tuple[torch.Tensor, torch.Tensor] | None]]:
    """(batch number, sequence indices, bf16 taps `(len(group), width, F)`, soft labels or None) for the
    length-sorted batches not in `done`, on the target's device. Soft labels (`top_k > 0`): int32 ids and
    fp32 log-probabilities `(len(group), width, top_k)` of the target's most likely next tokens."""
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
            out = target(target.embed_tokens(ids), torch.arange(width, device=device), cache, width, tap_layers)
            soft = None
            if top_k:
                logprobs = target.lm_head(out.hidden).float().log_softmax(dim=-1)  # (n, width, V)
                values, top = logprobs.topk(top_k, dim=-1)
                soft = (top.to(torch.int32), values)
        yield number, group, out.taps.to(torch.bfloat16), soft
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
