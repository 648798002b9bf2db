"""Teacher-forced target taps for drafter training, computed once and cached on disk.

One target pass over prompt + answer gives, at every position, the outputs of the tapped layers
(HF `hidden_states[l + 1]`), exactly what the runtime feeds the drafter as context. They are
stored in bf16 in one safetensors file (`seq_{i}` -> `(L_i, taps * H)`), next to the sequences.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from tqdm import tqdm

from blockpilot.models.decoder import Decoder, KVCache
from blockpilot.training.data import Sequence


@torch.inference_mode()
def extract_taps(target: Decoder, sequences: list[Sequence], tap_layers: tuple[int, ...],
                 tokens_per_batch: int | None = None, autocast: bool = True) -> list[torch.Tensor]:
    """Per-sequence taps `(L_i, len(tap_layers) * H)` in bf16, batched by similar length.

    Runs on the target's device and leaves the taps there; `tokens_per_batch` defaults to 4096 on
    CPU and 32768 on CUDA."""
    device = target.embed_tokens.weight.device
    tokens_per_batch = tokens_per_batch or (32768 if device.type == "cuda" else 4096)
    lengths = [len(s.ids) for s in sequences]
    out: list[torch.Tensor | None] = [None] * len(sequences)
    progress = tqdm(total=sum(lengths), desc="target features", unit="tok")
    for group in _length_groups(lengths, tokens_per_batch):
        width = max(lengths[i] for i in group)
        ids = torch.zeros(len(group), width, dtype=torch.long)  # right padding never reaches earlier positions
        for row, i in enumerate(group):
            ids[row, : len(sequences[i].ids)] = torch.tensor(sequences[i].ids)
        ids = ids.to(device)
        cache = KVCache.allocate(target.config, len(group), width, torch.float32, device)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
            taps = target(target.embed_tokens(ids), torch.arange(width, device=device), cache, width, tap_layers).taps
        for row, i in enumerate(group):
            out[i] = taps[row, : len(sequences[i].ids)].to(torch.bfloat16).clone()
        progress.update(sum(lengths[i] for i in group))
    progress.close()
    return out  # type: ignore[return-value]


def _length_groups(lengths: list[int], tokens_per_batch: int) -> list[list[int]]:
    """Indices grouped by ascending length so that group size x longest <= tokens_per_batch."""
    groups, group = [], []
    for i in sorted(range(len(lengths)), key=lengths.__getitem__):
        if group and (len(group) + 1) * lengths[i] > tokens_per_batch:
            groups.append(group)
            group = []
        group.append(i)
    return groups + ([group] if group else [])


def save_feature_cache(path: Path, sequences: list[Sequence], taps: list[torch.Tensor], meta: dict) -> None:
    path.mkdir(parents=True, exist_ok=True)
    tmp = path / "features.safetensors.tmp"
    save_file({f"seq_{i}": t.cpu().contiguous() for i, t in enumerate(taps)}, tmp)
    (path / "sequences.json").write_text(json.dumps({
        "meta": meta,
        "sequences": [{"ids": list(s.ids), "answer_start": s.answer_start, "source": s.source} for s in sequences],
    }))
    tmp.replace(path / "features.safetensors")


def load_feature_cache(path: Path) -> tuple[list[Sequence], list[torch.Tensor], dict] | None:
    """The cached sequences, taps and metadata, or None when there is no complete cache."""
    if not (path / "features.safetensors").is_file() or not (path / "sequences.json").is_file():
        return None
    raw = json.loads((path / "sequences.json").read_text())
    tensors = load_file(path / "features.safetensors")
    sequences = [Sequence(tuple(s["ids"]), s["answer_start"], s.get("source", "")) for s in raw["sequences"]]
    return sequences, [tensors[f"seq_{i}"] for i in range(len(sequences))], raw["meta"]
