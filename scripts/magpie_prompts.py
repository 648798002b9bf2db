"""Chat prompts written by the target itself, for drafter training data closer to MT-Bench's first turns.

The Magpie recipe (Xu et al. 2024, "Magpie: Alignment Data Synthesis from Scratch by Prompting Aligned LLMs with
Nothing"): an instruction-tuned model given only its chat template up to the start of a user turn writes a user
query, drawn from what its own instruction tuning taught it users ask. SmolLM2-135M-Instruct was tuned on such
data, so its queries are first-turn chat requests of every kind (advice, writing, code, maths, explanations) --
the kind of prompt MT-Bench asks and ShareGPT's first turns (all of them already answered under `data/`) had.

Queries are drawn by plain decoding on onnxruntime (the embedded engine dir unless `--engine-dir`), batched, at
`--temperature`, and kept when the model ended its turn (`<|im_end|>`), the text is 16-2,000 characters, it is
not a repeat (case and spacing ignored) and shares no 8-word run with a HumanEval problem or an MT-Bench turn
(nor is one). Rows `{"prompt", "source": "magpie", "batch"}` are appended batch by batch; every batch has its
own seeds (`--seed`, the batch number), so a stopped run resumes where it stopped and a rerun draws the same
queries. `<|im_end|>` above is the target's end-of-sequence token. Then answer them as any prompt file:

    python scripts/magpie_prompts.py --out runs/magpie.jsonl --count 4000
    blockpilot answer --prompts runs/magpie.jsonl --out runs/magpie-answers.jsonl --batch-size 16
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from pathlib import Path

import torch

MARKER = "\x00QUERY\x00"
MIN_CHARS, MAX_CHARS, SHINGLE = 16, 2000, 8


def pre_query_ids(tokenizer) -> list[int]:
    """Token ids of the chat template up to where the user's text starts (with the template's default system
    prompt, as `blockpilot answer` renders a prompt)."""
    from blockpilot.errors import UserError

    if not getattr(tokenizer, "chat_template", None):
        raise UserError("the target's tokenizer has no chat template; queries are drawn from a chat model's template")
    text = tokenizer.apply_chat_template([{"role": "user", "content": MARKER}], tokenize=False)
    return tokenizer(text[: text.index(MARKER)], add_special_tokens=False)["input_ids"]


def _words(text: str) -> list[str]:
    return re.findall(r"\w+", text.lower())


def shingles(text: str, n: int = SHINGLE) -> set[tuple[str, ...]]:
    words = _words(text)
    return {tuple(words[i:i + n]) for i in range(len(words) - n + 1)}


def _normalised(text: str) -> str:
    return " ".join(_words(text))


class Filter:
    """Decides which drawn queries are kept; remembers the kept ones (no repeats)."""

    def __init__(self, evaluation: set[str], kept: list[str] = ()):
        self.evaluation = {_normalised(t) for t in evaluation}
        self.evaluation_shingles = set().union(*(shingles(t) for t in evaluation)) if evaluation else set()
        self.seen = {_normalised(t) for t in kept}

    def reason(self, text: str, ended: bool) -> str | None:
        """Why `text` is left out, or None when it is kept (and then remembered)."""
        if not ended:
            return "unfinished"
        if not MIN_CHARS <= len(text) <= MAX_CHARS:
            return "length"
        key = _normalised(text)
        if key in self.evaluation or shingles(text) & self.evaluation_shingles:
            return "evaluation"
        if key in self.seen:
            return "repeat"
        self.seen.add(key)
        return None


def read_rows(path: Path) -> list[dict]:
    """The rows a run wrote to `path` (to resume it)."""
    from blockpilot.errors import UserError

    rows = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        try:
            row = json.loads(line) if line.strip() else None
        except json.JSONDecodeError:
            row = {}
        if row is not None and not (isinstance(row, dict) and isinstance(row.get("prompt"), str)
                                    and isinstance(row.get("batch"), int)):
            raise UserError(f"{path}:{number} is not a row this script writes; give a new --out or this script's own")
        rows += [row] if row is not None else []
    return rows


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True, help="prompt JSONL (appended to; resumes)")
    ap.add_argument("--count", type=int, default=4000, help="stop once the file holds this many prompts")
    ap.add_argument("--engine-dir", type=Path, default=None, help="default: the embedded model's")
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--max-new-tokens", type=int, default=256, help="a longer query is left out as unfinished")
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=None)
    return ap.parse_args(argv)


def check_args(args: argparse.Namespace) -> None:
    from blockpilot.errors import UserError
    from blockpilot.runtime.sampling import SamplingParams

    for name in ("count", "batch_size", "max_new_tokens"):
        if getattr(args, name) <= 0:
            raise UserError(f"--{name.replace('_', '-')} must be positive (got {getattr(args, name)})")
    if SamplingParams.checked(args.temperature, 0, args.top_p, "; fix --temperature or --top-p").greedy:
        raise UserError("--temperature 0 writes the same query every time; draw them at a temperature > 0")
    if args.out.is_dir():
        raise UserError(f"--out {args.out} is a folder; give the prompt file to write (a .jsonl path)")


def draw(args: argparse.Namespace) -> int:
    """Append batches of kept queries to `args.out` until it holds `args.count`; returns how many it holds."""
    from transformers import AutoTokenizer

    from blockpilot.assets.prompts import evaluation_texts
    from blockpilot.builder.embedded import embedded_engine_dir
    from blockpilot.errors import UserError
    from blockpilot.runtime.runner import Runner

    engine_dir = args.engine_dir or embedded_engine_dir()
    runner = Runner.from_engine_dir(engine_dir, backend="onnxruntime", threads=args.threads, use_predictor=False)
    tokenizer = AutoTokenizer.from_pretrained(engine_dir)
    end_id = runner.end_id  # the end of a turn: <|im_end|> for SmolLM2
    if end_id is None:
        raise UserError(f"{engine_dir}: the target's config.json names no eos_token_id, which ends a query")
    prefix = pre_query_ids(tokenizer)
    rows = read_rows(args.out) if args.out.exists() else []
    keep = Filter(evaluation_texts(), [r["prompt"] for r in rows])
    batch = max((r["batch"] for r in rows), default=-1) + 1
    args.out.parent.mkdir(parents=True, exist_ok=True)
    left_out: dict[str, int] = {}
    start, barren = time.perf_counter(), 0
    while len(rows) < args.count:
        out = runner.generate([torch.tensor(prefix)] * args.batch_size, max_new_tokens=args.max_new_tokens,
                              temperature=args.temperature, top_p=args.top_p, end_id=end_id, block_size=1,
                              random_seed=(args.seed << 32) + batch * args.batch_size, return_dict=True)
        new = []
        for i in range(args.batch_size):
            ids = out["output_ids"][i, 0, len(prefix):int(out["sequence_lengths"][i, 0])].tolist()
            ended = bool(ids) and ids[-1] == end_id
            text = tokenizer.decode(ids[:-1] if ended else ids).strip()
            reason = keep.reason(text, ended)
            if reason is None:
                new.append({"prompt": text, "source": "magpie", "batch": batch})
            else:
                left_out[reason] = left_out.get(reason, 0) + 1
        with args.out.open("a") as stream:  # one batch at a time: a stop loses at most the batch in flight
            stream.writelines(json.dumps(r) + "\n" for r in new)
        rows += new
        batch += 1
        barren = 0 if new else barren + 1
        print(f"batch {batch}: {len(rows)} prompts, left out {left_out}, {time.perf_counter() - start:.0f} s",
              file=sys.stderr, flush=True)
        if barren == 10:
            raise UserError(f"10 batches in a row kept no query (left out: {left_out}); raise --max-new-tokens or "
                            "--temperature")
    return len(rows)


def main(argv=None) -> int:
    from blockpilot.errors import UserError

    args = parse_args(argv)
    try:
        check_args(args)
        count = draw(args)
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"{count} prompts in {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
