"""Draft vocabulary of a DFlash drafter: the N most frequent target tokens of the target's own answers.

    python scripts/draft_vocab.py --n 16384 --out runs/drafter-v16k          # shipped drafter + data/ answers
    python scripts/draft_vocab.py --drafter DIR --target DIR --answers a.jsonl.gz,b.jsonl --n N --out DIR \
        [--coverage-of runs/answers/humaneval-greedy-128.jsonl]

Counts token frequencies over the answers (each row's `answer_ids`, else its `answer` text tokenized
with the target's tokenizer, plus the end token when the answer stopped by itself). Every special token
and every byte-level token (the single-byte pieces of a byte-level BPE, the `<0xHH>` byte-fallback
pieces of a SentencePiece vocabulary) is kept whatever its count, since a small corpus misses most of
them; the other N - kept ids are the most frequent remaining tokens (ties: the smaller id). `--n` equal
to the vocabulary size gives the identity list.

Writes a copy of `--drafter` at `--out` (never the drafter itself) whose model.safetensors holds the
drafter's tensors unchanged (checked tensor by tensor) plus `draft_vocab_ids` `(N,)` int64, sorted; the
copy appears complete or not at all. Prints a JSON summary: N, kept ids, coverage (fraction of counted
answer tokens inside the vocabulary) of the answers and of every `--coverage-of` file.
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import json
import re
import shutil
import sys
from pathlib import Path

import torch

from blockpilot.errors import UserError

DEFAULT_ANSWERS = Path(__file__).resolve().parents[1] / "data" / "smollm2-answers-9831.jsonl.gz"
BYTE_FALLBACK = re.compile(r"^<0x[0-9A-Fa-f]{2}>$")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--drafter", type=Path, help="drafter directory to copy (default: the shipped SmolLM2 drafter)")
    p.add_argument("--target", type=Path, help="target directory with its tokenizer (default: the embedded SmolLM2)")
    p.add_argument("--answers", default=str(DEFAULT_ANSWERS),
                   help="comma-separated JSONL answer files (.gz allowed) of the target's own outputs")
    p.add_argument("--n", type=int, required=True, help="draft vocabulary size N")
    p.add_argument("--out", type=Path, required=True, help="new drafter directory (must not exist)")
    p.add_argument("--coverage-of", default="", help="comma-separated answer files to report coverage on as well")
    return p.parse_args(argv)


def read_rows(path: Path) -> list[dict]:
    """Rows of a JSONL answers file, gzip-compressed or not."""
    opener = gzip.open if path.suffix == ".gz" else open
    try:
        with opener(path, "rt", encoding="utf-8") as stream:
            rows = [json.loads(line) for line in stream if line.strip()]
    except (OSError, json.JSONDecodeError, EOFError) as exc:
        raise UserError(f"cannot read answers file {path} ({exc}); pass JSONL rows with answer_ids or answer") from None
    if not rows or not all(isinstance(r, dict) and ("answer_ids" in r or "answer" in r) for r in rows):
        raise UserError(f"{path} has no rows with answer_ids or answer; pass the target's own answers")
    return rows


def answer_ids(row: dict, tokenizer) -> list[int]:
    ids = row.get("answer_ids") or tokenizer(row["answer"], add_special_tokens=False)["input_ids"]
    if row.get("finish") == "stop" and tokenizer.eos_token_id is not None and ids[-1:] != [tokenizer.eos_token_id]:
        ids = ids + [tokenizer.eos_token_id]
    return ids


def token_counts(rows: list[dict], tokenizer, vocab_size: int) -> torch.Tensor:
    """`(V,)` int64 occurrences of every id over the answers of `rows`."""
    ids = torch.tensor([i for row in rows for i in answer_ids(row, tokenizer)], dtype=torch.long)
    if ids.numel() and not 0 <= int(ids.min()) <= int(ids.max()) < vocab_size:
        raise UserError(f"answers hold ids outside the target's vocabulary [0, {vocab_size}); "
                        "pass answers of this target")
    return torch.bincount(ids, minlength=vocab_size)


def _byte_level_alphabet() -> set[str]:
    """The 256 characters a byte-level BPE (GPT-2, SmolLM2) writes single bytes as."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b], extra = chr(256 + extra), extra + 1
    return set(chars.values())


def always_kept_ids(tokenizer, vocab_size: int) -> torch.Tensor:
    """Sorted ids of every special token and every byte-level token of `tokenizer` (below `vocab_size`)."""
    special = set(tokenizer.all_special_ids)
    special |= {i for i, token in tokenizer.added_tokens_decoder.items() if token.special}
    spec = json.loads(tokenizer.backend_tokenizer.to_str())
    is_byte_level = '"ByteLevel"' in json.dumps([spec.get("pre_tokenizer"), spec.get("decoder")])
    alphabet = _byte_level_alphabet() if is_byte_level else set()
    byte_level = {i for piece, i in tokenizer.get_vocab().items()
                  if BYTE_FALLBACK.match(piece) or (len(piece) == 1 and piece in alphabet)}
    return torch.tensor(sorted(i for i in special | byte_level if 0 <= i < vocab_size), dtype=torch.long)


def choose_ids(counts: torch.Tensor, kept: torch.Tensor, n: int) -> torch.Tensor:
    """Sorted `(n,)` ids: all of `kept`, then the most frequent others (ties: the smaller id)."""
    vocab = counts.numel()
    if not len(kept) <= n <= vocab:
        raise UserError(f"--n {n} must lie between the {len(kept)} always-kept ids (special and byte-level tokens) "
                        f"and the vocabulary size {vocab}")
    rank = counts.double() - torch.arange(vocab, dtype=torch.double) / vocab  # ties: the smaller id first
    rank[kept] = float("inf")
    return torch.sort(torch.topk(rank, n).indices).values


def coverage(counts: torch.Tensor, ids: torch.Tensor) -> float:
    total = int(counts.sum())
    return int(counts[ids].sum()) / total if total else float("nan")


def tensor_digests(path: Path) -> dict[str, str]:
    from safetensors import safe_open

    with safe_open(path, "pt") as f:
        return {k: hashlib.sha256(f.get_tensor(k).contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()
                for k in f.keys()}


def write_drafter_copy(drafter_dir: Path, ids: torch.Tensor, out_dir: Path) -> Path:
    """Copy `drafter_dir` to `out_dir` with `draft_vocab_ids` added to its model.safetensors."""
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    from blockpilot.files import staged_directory
    from blockpilot.models.checkpoint import DRAFT_VOCAB_KEY, load_drafter

    if out_dir.exists():
        raise UserError(f"{out_dir} exists; pass a new --out directory (the drafter is never modified in place)")
    weights = drafter_dir / "model.safetensors"
    with safe_open(weights, "pt") as f:
        metadata = f.metadata()
    tensors = {k: v for k, v in load_file(weights).items() if k != DRAFT_VOCAB_KEY}
    with staged_directory(out_dir) as tmp:
        shutil.copytree(drafter_dir, tmp, dirs_exist_ok=True)
        (tmp / "model.safetensors").unlink()  # a new file: never write through a hard link into the original
        save_file({**tensors, DRAFT_VOCAB_KEY: ids.contiguous()}, tmp / "model.safetensors", metadata=metadata)
        before, after = tensor_digests(weights), tensor_digests(tmp / "model.safetensors")
        changed = [k for k in tensors if before[k] != after[k]]
        if changed:
            raise RuntimeError(f"tensors changed while copying: {changed[:3]}")
        load_drafter(tmp)  # validates the ids against the drafter's vocabulary
    return out_dir


def main(argv=None) -> int:
    args = parse_args(argv)
    from blockpilot.assets import default_drafter_dir
    from blockpilot.assets.smollm2 import smollm2_dir
    from blockpilot.models.config import DrafterConfig, read_config_json
    from blockpilot.text import load_tokenizer

    try:
        drafter_dir = args.drafter or default_drafter_dir()
        vocab = DrafterConfig.from_dict(read_config_json(drafter_dir)).layers.vocab_size
        tokenizer = load_tokenizer(args.target or smollm2_dir())
        rows = [r for name in filter(None, args.answers.split(",")) for r in read_rows(Path(name))]
        counts = token_counts(rows, tokenizer, vocab)
        kept = always_kept_ids(tokenizer, vocab)
        ids = choose_ids(counts, kept, args.n)
        write_drafter_copy(Path(drafter_dir), ids, args.out)
        report = {"n": args.n, "vocab_size": vocab, "always_kept": len(kept), "answer_rows": len(rows),
                  "answer_tokens": int(counts.sum()), "coverage": coverage(counts, ids),
                  "seen_tokens": int((counts > 0).sum()), "out": str(args.out)}
        for name in filter(None, args.coverage_of.split(",")):
            report[f"coverage_of {name}"] = coverage(token_counts(read_rows(Path(name)), tokenizer, vocab), ids)
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
