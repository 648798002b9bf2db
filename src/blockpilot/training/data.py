"""Self-distilled drafter training data: the target's own answers to training prompts.

A `Sequence` is the chat-formatted prompt followed by the target's answer, as token ids, with the
index where the answer starts (loss is taken on answer tokens only). Answers either come from a
JSONL file of `{"prompt", "answer", "finish"}` rows (what `blockpilot answer` writes, or the
compressed files under `data/` as they are; a row answering a later turn of a conversation also
holds the turns before it, `"history": [{"role", "content"}, ...]`) or are regenerated here with
batched greedy generation.
"""

from __future__ import annotations

import dataclasses
import gzip
import json
import time
import zlib
from pathlib import Path

import torch
from tqdm import tqdm

from blockpilot.assets.prompts import prompt_key
from blockpilot.errors import UserError
from blockpilot.text import chat_prompt_ids


@dataclasses.dataclass(frozen=True)
class Sequence:
    ids: tuple[int, ...]
    answer_start: int
    source: str = ""


def read_answer_rows(path: Path) -> list[dict]:
    """Rows of an answers JSONL file (gzip-compressed when its name ends in `.gz`); each needs
    `prompt` and `answer`."""
    path = Path(path)
    try:
        lines = (gzip.decompress(path.read_bytes()).decode() if path.suffix == ".gz" else path.read_text()).splitlines()
    except OSError as exc:
        raise UserError(f"cannot read answers file {path} ({exc.strerror or exc}); check the path") from None
    rows = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            row["prompt"], row["answer"]
        except (json.JSONDecodeError, KeyError, TypeError):
            raise UserError(f"{path}:{number} is not a JSON object with 'prompt' and 'answer'; fix that line") from None
        rows.append(row)
    if not rows:
        raise UserError(f"answers file {path} is empty; give prompts with their answers")
    return rows


def tokenize_rows(rows: list[dict], tokenizer, max_len: int) -> list[Sequence]:
    """Prompt + answer ids, cut at `max_len`; an answer that ended by itself keeps its end token."""
    eos = tokenizer.eos_token_id
    sequences = []
    for row in rows:
        prompt = chat_prompt_ids(tokenizer, row["prompt"], history=row_history(row))
        answer = row.get("answer_ids") or tokenizer(row["answer"], add_special_tokens=False)["input_ids"]
        if row.get("finish") == "stop" and eos is not None and answer[-1:] != [eos]:
            answer = answer + [eos]
        ids = (prompt + answer)[:max_len]
        if len(ids) - len(prompt) >= 2:
            sequences.append(Sequence(tuple(ids), len(prompt), row.get("source", "")))
    return sequences


def row_history(row: dict) -> tuple[tuple[str, str], ...]:
    """The earlier turns of an answers row as `(role, content)` pairs (empty for a first turn)."""
    return tuple((turn["role"], turn["content"]) for turn in row.get("history") or ())


def row_key(row: dict) -> str:
    """`prompt_key` of an answers row: its prompt, with its conversation when it has one."""
    return prompt_key(row["prompt"], row_history(row))


def _answered_prompts(out_path: Path) -> set[str]:
    """Keys (`prompt_key`) of the prompts an answers file being appended to already holds (empty when
    it does not exist yet)."""
    return {row_key(r) for r in read_answer_rows(out_path)} if out_path.exists() and out_path.stat().st_size else set()


def _todo(prompts: list[str], sources: list[str] | None, histories: list | None, done: set[str]) -> list[tuple]:
    """`(prompt, source, history)` of the prompts whose key is not in `done`."""
    sources = sources or [""] * len(prompts)
    histories = histories or [()] * len(prompts)
    items = [(p, sources[i], tuple(histories[i])) for i, p in enumerate(prompts)]
    return [item for item in items if prompt_key(item[0], item[2]) not in done]


def _answer_line(tokenizer, source: str, prompt: str, generated: list[int], end_id: int | None,
                 sampled: dict | None = None, history=()) -> str:
    """One answers-file row: the generated ids up to the end token (`finish` "stop"), else all of them;
    a sampled answer also records how it was drawn (`sampled`: temperature, top_k, top_p, seed), an
    answer to a later turn the turns before it (`history`)."""
    stop = end_id is not None and end_id in generated
    answer_ids = generated[: generated.index(end_id)] if stop else generated
    turns = {"history": [{"role": role, "content": content} for role, content in history]} if history else {}
    return json.dumps({"source": source, "prompt": prompt, **turns,
                       "answer": tokenizer.decode(answer_ids, skip_special_tokens=True),
                       "answer_ids": answer_ids, "finish": "stop" if stop else "length", **(sampled or {})}) + "\n"


def prompt_seed(seed: int, prompt: str) -> int:
    """The sampling seed of one prompt's answer: fixed by `seed` and the prompt's text (its `prompt_key`
    for a later turn), so a resumed or reordered run draws every answer as the first run would have."""
    return (seed * 1_000_003 + zlib.crc32(prompt.encode())) % 2**63


@torch.inference_mode()
def regenerate_answers(target_dir: Path, prompts: list[str], *, max_new_tokens: int, batch_size: int,
                       out_path: Path, sources: list[str] | None = None, device: str = "cpu",
                       time_budget_s: float | None = None, histories: list | None = None) -> Path:
    """Answer `prompts` with the target (fp32 greedy, batched by similar length, left padding) into JSONL.

    Appends to `out_path` one complete line per answer and skips prompts already answered there, so
    an interrupted run resumes. With `time_budget_s`, no new batch starts once the budget is spent.
    Each row holds `source, prompt, answer, answer_ids, finish` ("stop" at the end token, else "length"),
    and `history` where `histories` gives the prompt earlier turns of its conversation.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    began = time.perf_counter()
    tokenizer = AutoTokenizer.from_pretrained(target_dir)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    model = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).to(device).eval()
    todo = [(chat_prompt_ids(tokenizer, p, history=h), p, source, h)
            for p, source, h in _todo(prompts, sources, histories, _answered_prompts(out_path))]
    todo.sort(key=lambda item: len(item[0]))  # similar lengths share a batch: little padding
    out_path.parent.mkdir(parents=True, exist_ok=True)
    with out_path.open("a") as out, tqdm(total=len(todo), desc="answering prompts", unit="prompt") as bar:
        for start in range(0, len(todo), batch_size):
            if time_budget_s is not None and time.perf_counter() - began > time_budget_s:
                tqdm.write(f"time budget spent: {start} of {len(todo)} prompts answered; run again to resume")
                break
            batch = todo[start:start + batch_size]
            width = max(len(item[0]) for item in batch)
            ids = torch.tensor([[pad_id] * (width - len(e)) + e for e, *_ in batch], device=device)
            mask = torch.tensor([[0] * (width - len(e)) + [1] * len(e) for e, *_ in batch], device=device)
            gen = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_new_tokens,
                                 do_sample=False, pad_token_id=pad_id, eos_token_id=tokenizer.eos_token_id)
            for (_, prompt, source, history), row in zip(batch, gen[:, width:].tolist()):
                out.write(_answer_line(tokenizer, source, prompt, row, tokenizer.eos_token_id, history=history))
            out.flush()
            bar.update(len(batch))
    return out_path


LENGTH_WINDOW_BATCHES = 16
"""`answer_with_runner` starts the prompts of each run of `LENGTH_WINDOW_BATCHES` x batch size shortest first.

A batch's cache holds as many positions as its longest member needs, and every step's attention reads all of
them: on the 2-core AMD EPYC a step of 16 rows took 96 ms at 512 positions and 146 ms at 1,024 (onnxruntime
fp32, SmolLM2). Prompts of similar length in flight together keep that capacity near what each needs (the
package-code prompts of `scripts/package_code_prompts.py`, 55-3,180 tokens, median 141: a mean capacity of
447 positions instead of 711 in groups of 16; 128 of them answered 1.10x as fast, 199 s against 219 s listed,
the same answers, session 40), while a time-budgeted run still answers a prefix of its list, up to one
window, rather than only its shortest prompts. Answers do not depend on their batch (every row of
a batch decodes as it would alone, `tests/test_batching.py`); only the order of the rows in the file does."""


def by_length_in_windows(items: list, length, window: int) -> list:
    """`items` with each consecutive run of `window` sorted by `length(item)` (stable), the runs in order."""
    return [item for start in range(0, len(items), window)
            for item in sorted(items[start:start + window], key=length)]


def answer_with_runner(runner, tokenizer, prompts: list[str], *, max_new_tokens: int, batch_size: int,
                       out_path: Path, sources: list[str] | None = None,
                       time_budget_s: float | None = None, sampling=None, seed: int = 0,
                       histories: list | None = None) -> Path:
    """Answer `prompts` with a runner's plain decoding (block size 1), continuously batched.

    The fast path on the CPU: an onnxruntime engine directory's target decodes up to `batch_size`
    answers in every step, and a finished answer leaves the batch at once and is appended to
    `out_path` as one complete line (so an interruption loses only the answers in flight, and a
    rerun skips every prompt already there). Prompts start shortest first within windows of the list
    (`LENGTH_WINDOW_BATCHES`). With `time_budget_s`, no new prompt starts once the
    budget is spent; those in flight finish. Rows as `regenerate_answers` writes them. A prompt the
    decoder refuses (too long for the engine's cache) is skipped with a count at the end.

    Greedy by default; with `sampling` (a `SamplingParams` at a temperature above 0) each answer is
    one draw from the target's distribution, its generator seeded with `prompt_seed(seed, prompt)`,
    and its row records `temperature`, `top_k`, `top_p` and `seed` (what `label --replay-answers`
    checks before it replays sampled decoding on it). `histories` as for `regenerate_answers`.
    """
    from blockpilot.runtime.batching import BatchDecoder, GenerationRequest
    from blockpilot.runtime.sampling import SamplingParams

    sampling = sampling or SamplingParams()

    began = time.perf_counter()
    todo = [(p, source, h, chat_prompt_ids(tokenizer, p, history=h))  # encoded first: a bad prompt writes nothing
            for p, source, h in _todo(prompts, sources, histories, _answered_prompts(out_path))]
    todo = by_length_in_windows(todo, lambda item: len(item[3]), batch_size * LENGTH_WINDOW_BATCHES)
    end_id = runner.end_id if runner.end_id is not None else tokenizer.eos_token_id
    decoder = BatchDecoder(runner, max_batch=batch_size)
    in_flight: dict[int, tuple] = {}
    skipped = 0
    out_path.parent.mkdir(parents=True, exist_ok=True)
    with out_path.open("a") as out, tqdm(total=len(todo), desc="answering prompts", unit="prompt") as bar:
        while todo or in_flight:
            while todo and len(decoder) < decoder.max_batch and not (
                    time_budget_s is not None and time.perf_counter() - began > time_budget_s):
                prompt, source, history, ids = todo.pop(0)
                request = GenerationRequest(ids, max_new_tokens, block_size=1, end_id=end_id,
                                            temperature=sampling.temperature, top_k=sampling.top_k,
                                            top_p=sampling.top_p, seed=prompt_seed(seed, prompt_key(prompt, history)))
                try:
                    in_flight[decoder.add(request)] = (prompt, source, history)
                except UserError:  # prompt + max_new_tokens beyond the cache
                    skipped += 1
                    bar.update(1)
            if not in_flight:
                break
            for event in decoder.step():
                if not event.finished:
                    continue
                prompt, source, history = in_flight.pop(event.request_id)
                drawn = None if sampling.greedy else {**dataclasses.asdict(sampling),
                                                      "seed": prompt_seed(seed, prompt_key(prompt, history))}
                out.write(_answer_line(tokenizer, source, prompt, list(event.result.output_tokens), end_id, drawn,
                                       history))
                out.flush()
                bar.update(1)
    if todo:
        tqdm.write(f"time budget spent: {len(todo)} prompts left; run again to resume")
    if skipped:
        tqdm.write(f"{skipped} prompts skipped: prompt + {max_new_tokens} new tokens exceed the engine's cache")
    return out_path
