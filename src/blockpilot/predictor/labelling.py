"""`blockpilot label` as a function: load the models and prompts, then label into a dataset directory.

Prompts come from a JSONL file (`blockpilot.assets.prompts.load_jsonl_prompts`) and are tokenized
with the target's tokenizer and its chat template when it has one. The dataset layout and the
labelling itself are in `blockpilot.predictor.labels`.
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

from blockpilot.errors import UserError
from blockpilot.predictor.labels import LABEL_FORMAT, LABEL_VERSION, LabelSettings, label_prompts, prepare_dataset_dir


@dataclasses.dataclass(frozen=True)
class LabelJob:
    """One `blockpilot label` run; `candidates` None means B_train +- 2 of the drafter."""

    target: Path
    drafter: Path
    prompts: Path
    out: Path
    candidates: tuple[int, ...] | None = None
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    max_new_tokens: int = 128
    limit: int | None = None
    seed: int = 0
    backend: str = "torch"
    device: str = "cpu"
    chat_template: bool = True
    clock: str = "wall"  # "wall": time.perf_counter; "cpu": time.process_time (robust to other processes)
    progress: bool = True


def parse_candidates(text: str) -> tuple[int, ...]:
    """"14-18" (a range, inclusive) or "14,16,18" -> sorted distinct block sizes, each >= 2.

    Raises:
        UserError: the text is neither form, or a size is below 2.
    """
    try:
        if "-" in text:
            low, high = (int(part) for part in text.split("-"))
            sizes = tuple(range(low, high + 1))
        else:
            sizes = tuple(sorted({int(part) for part in text.split(",")}))
    except ValueError:
        raise UserError(f"--candidates {text!r} is not a range like 14-18 or a list like 14,16,18") from None
    if len(sizes) < 2 or sizes[0] < 2:
        raise UserError(f"--candidates {text!r} must name at least two block sizes, each >= 2")
    return sizes


def default_candidates(b_train: int, radius: int = 2) -> tuple[int, ...]:
    """B_train - radius .. B_train + radius, without sizes below 2."""
    return tuple(range(max(2, b_train - radius), b_train + radius + 1))


def run_label_job(job: LabelJob) -> dict:
    """Label `job.prompts` into `job.out` (resuming it) and summarise the dataset.

    Returns:
        {"rows", "labelled_now", "skipped_too_long", "candidates", "mean_tau", "tau_labels"}.

    Raises:
        UserError: empty or bad prompt file, models without a tokenizer, unsupported candidates,
            or an existing dataset labelled with other models or settings.
    """
    from blockpilot.runtime.policy import model_files_sha256
    from blockpilot.runtime.runner import Runner

    prompts = _load_prompts(job.prompts, job.limit)
    tokenizer = _load_tokenizer(job.target)
    largest = max(job.candidates) if job.candidates else None
    runner = Runner.from_dir(job.target, drafter_dir=job.drafter, backend=job.backend, device=job.device,
                             max_block_size=largest)
    runner.clock = _clock(job.clock)
    settings = _settings(job, runner.backend)
    meta = {
        "format": LABEL_FORMAT, "version": LABEL_VERSION, "target": str(job.target), "drafter": str(job.drafter),
        "target_sha256": model_files_sha256(job.target), "drafter_sha256": model_files_sha256(job.drafter),
        **dataclasses.asdict(settings), "backend": runner.backend.name, "device": job.device, "dtype": "float32",
        "clock": job.clock,
        "chat_template": job.chat_template and bool(getattr(tokenizer, "chat_template", None)),
        "prompts_file": str(job.prompts),
        "feature_widths": {"pooled": runner.backend.target_config.hidden_size,
                           "logits": runner.backend.target_config.vocab_size},
    }
    done = prepare_dataset_dir(job.out, meta)
    todo, too_long = _encode_todo(prompts, done, tokenizer, meta["chat_template"], settings, runner.backend)
    if too_long:
        print(f"label: skipping {too_long} prompts longer than the cache allows", file=sys.stderr)
    rows = label_prompts(runner, todo, settings, job.out, progress=job.progress)
    return _summary(job.out, rows, len(todo), too_long)


def _clock(name: str):
    """The runner clock for step timings: wall time, or this process's CPU time (other processes'
    load does not inflate it; with one torch thread it is the compute time of the step)."""
    import time

    clocks = {"wall": time.perf_counter, "cpu": time.process_time}
    if name not in clocks:
        raise UserError(f"--clock {name!r} is not one of {', '.join(clocks)}")
    return clocks[name]


def _load_prompts(path: Path, limit: int | None):
    from blockpilot.assets.prompts import load_jsonl_prompts

    if limit is not None and limit < 1:
        raise UserError(f"--limit must be >= 1 (got {limit})")
    prompts = load_jsonl_prompts(path)[:limit]
    seen: set[str] = set()
    for prompt in prompts:
        if prompt.id in seen:
            raise UserError(f"{path}: prompt id {prompt.id!r} occurs twice; give every prompt its own id")
        seen.add(prompt.id)
    return prompts


def _load_tokenizer(target: Path):
    names = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")
    if not any((Path(target) / name).is_file() for name in names):
        raise UserError(f"{target} has no tokenizer files ({', '.join(names)}); "
                        "pass a target directory with its tokenizer")
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(target))


def _settings(job: LabelJob, backend) -> LabelSettings:
    b_train = backend.drafter_config.block_size
    candidates = job.candidates or default_candidates(b_train)
    unsupported = [c for c in candidates if not backend.supports_block_size(c)]
    if unsupported:
        raise UserError(f"candidate block size {unsupported[0]} is not supported by the {backend.name} backend; "
                        "choose candidates near the drafter's block size")
    if job.max_new_tokens < 1:
        raise UserError(f"--max-new-tokens must be >= 1 (got {job.max_new_tokens})")
    return LabelSettings(candidates=tuple(candidates), b_train=b_train, temperature=job.temperature,
                         top_k=job.top_k, top_p=job.top_p, max_new_tokens=job.max_new_tokens, seed=job.seed)


def _encode_todo(prompts, done: set[str], tokenizer, chat_template: bool, settings: LabelSettings, backend):
    """(file index, id, token ids) of the prompts still to label, and how many are too long to label."""
    from blockpilot.text import chat_prompt_ids

    todo, too_long = [], 0
    room = backend.max_capacity - settings.max_new_tokens - max(settings.candidates)
    for index, prompt in enumerate(prompts):
        if prompt.id in done:
            continue
        ids = chat_prompt_ids(tokenizer, prompt.text) if chat_template else tokenizer(prompt.text)["input_ids"]
        if len(ids) > room:
            too_long += 1
            continue
        todo.append((index, prompt.id, list(ids)))
    return todo, too_long


def _summary(out: Path, rows: int, labelled_now: int, too_long: int) -> dict:
    from blockpilot.predictor.labels import load_label_dataset

    summary = {"rows": rows, "labelled_now": labelled_now, "skipped_too_long": too_long}
    if rows == 0:
        return summary
    dataset = load_label_dataset(out)
    counts = dataset.labels("tau").bincount(minlength=len(dataset.candidates)).tolist()
    return {**summary, "candidates": list(dataset.candidates),
            "mean_tau": [round(float(t), 4) for t in dataset.rows["tau"].mean(dim=0)],
            "tau_labels": dict(zip(dataset.candidates, counts))}
