"""`blockpilot label` as a function: load the models and prompts, then label into a dataset directory.

Prompts come from a JSONL file (`blockpilot.assets.prompts.load_jsonl_prompts`) and are tokenized
with the target's tokenizer and its chat template when it has one. The dataset layout and the
labelling itself are in `blockpilot.predictor.labels`. With `replay_answers` the prompts and the
target's answers (greedy at T = 0, drawn at the job's sampling otherwise) come from one answers file
and are labelled by exact replay with calibrated step times (`blockpilot.predictor.replay`) instead
of decoding every candidate.

The throughput labels use a step-cost table (`blockpilot.builder.manifest.StepCosts`) kept in the
dataset's meta: the one in an engine directory's manifest or a JSON file (`step_costs`), measured
where the predictor will run; without one it is measured on the labelling backend, the same way
(`blockpilot.runtime.step_costs`). Its backend, dtype and machine class go into the predictor.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

from blockpilot.errors import UserError
from blockpilot.runtime.settings import DEFAULT_LOOKUP
from blockpilot.runtime.sampling import SamplingParams
from blockpilot.text import load_tokenizer
from blockpilot.predictor.labels import (LABEL_FORMAT, LABEL_VERSION, LabelSettings, check_resumable, label_prompts,
                                        prepare_dataset_dir)


@dataclasses.dataclass(frozen=True)
class LabelJob:
    """One `blockpilot label` run; `candidates` None means B_train +- 2 of the drafter."""

    target: Path
    drafter: Path
    prompts: Path | None  # None with `replay_answers`: the prompts are that file's rows
    out: Path
    candidates: tuple[int, ...] | None = None  # 1 = plain decoding
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
    replay_answers: Path | None = None  # answers JSONL: label by replay (see blockpilot.predictor.replay)
    calibration_prompts: int = 4  # replay: prompts and timed rounds of the step-time calibration
    calibration_reps: int = 5
    note: str = ""  # free text kept in meta.json (e.g. where the prompts come from)
    step_costs: Path | None = None  # engine dir (its manifest's table) or StepCosts JSON; None: measure here
    sampled_drafts: bool = True  # T > 0: drafts drawn from the drafter, rejection sampling (False: greedy drafts)
    lookup: str = DEFAULT_LOOKUP  # which requests copy drafts by lookup, as `Runner.lookup` (the labels decode alike)


def default_candidates(b_train: int, radius: int = 2) -> tuple[int, ...]:
    """B_train - radius .. B_train + radius, without sizes below 2."""
    return tuple(range(max(2, b_train - radius), b_train + radius + 1))


def run_label_job(job: LabelJob) -> dict:
    """Label `job.prompts` (or the rows of `job.replay_answers`) into `job.out` (resuming it) and summarise it.

    Returns:
        {"rows", "labelled_now", "skipped_too_long", "candidates", "mean_tau", "tau_labels"}.

    Raises:
        UserError: empty or bad prompt file, models without a tokenizer, unsupported candidates,
            replay answers made at other sampling settings, or an existing dataset labelled with other
            models or settings.
    """
    from blockpilot.runtime.runner import Runner

    _check_source(job)
    prompts = _load_prompts(job.replay_answers or job.prompts, job.limit)
    tokenizer = load_tokenizer(job.target)
    sampling = SamplingParams.checked(job.temperature, job.top_k, job.top_p, "; fix --temperature, --top-k or --top-p")
    hints = _load_hints(job.replay_answers, tokenizer, sampling)
    largest = max(job.candidates) if job.candidates else None
    runner = Runner.from_dir(job.target, drafter_dir=job.drafter, backend=job.backend, device=job.device,
                             max_block_size=largest)
    runner.clock = _clock(job.clock)
    settings = _settings(job, runner.backend, sampling)
    meta = _meta(job, runner.backend, settings, tokenizer)
    check_resumable(job.out, meta)  # an existing dataset's calibration and step costs are read below
    encoded, too_long = _encode_todo(prompts, set(), tokenizer, meta["chat_template"], settings, runner.backend)
    if too_long:
        print(f"label: skipping {too_long} prompts longer than the cache allows", file=sys.stderr)
    if job.replay_answers:
        meta["calibration"] = _calibration(job, runner, settings, [ids for _, _, ids in encoded])
    meta["step_costs"] = _step_costs(job, runner.backend, settings.candidates)
    done = prepare_dataset_dir(job.out, meta)
    todo = [item for item in encoded if item[1] not in done]
    if job.replay_answers:
        from blockpilot.predictor.replay import replay_label_prompts

        rows = replay_label_prompts(runner.backend, todo, hints, settings, runner.end_id, meta["calibration"],
                                    job.out, progress=job.progress)
    else:
        rows = label_prompts(runner, todo, settings, job.out, progress=job.progress)
    return _summary(job.out, rows, len(todo), too_long)


def _check_source(job: LabelJob) -> None:
    """Exactly one prompt source; replay on the torch backend (its answers' sampling is checked on loading)."""
    if job.prompts is not None and job.replay_answers is not None:
        raise UserError("pass --prompts or --replay-answers, not both")
    if job.prompts is None and job.replay_answers is None:
        raise UserError("pass --prompts FILE (decode every candidate) or --replay-answers FILE (replay)")
    if job.replay_answers is None:
        return
    if job.backend != "torch":
        raise UserError(f"--replay-answers replays the torch models; use --backend torch (got {job.backend!r})")
    if job.calibration_prompts < 1 or job.calibration_reps < 1:
        raise UserError("--calibration-prompts and --calibration-reps must be >= 1")


def _meta(job: LabelJob, backend, settings: LabelSettings, tokenizer) -> dict:
    """meta.json of the dataset (see `labels.RESUME_KEYS` for what a resumed run must agree on)."""
    from blockpilot.runtime.policy import model_files_sha256

    replay = job.replay_answers is not None
    return {
        "format": LABEL_FORMAT, "version": LABEL_VERSION, "target": str(job.target), "drafter": str(job.drafter),
        "target_sha256": model_files_sha256(job.target), "drafter_sha256": model_files_sha256(job.drafter),
        **dataclasses.asdict(settings), "backend": backend.name, "device": job.device, "dtype": "float32",
        "clock": job.clock,
        "chat_template": job.chat_template and bool(getattr(tokenizer, "chat_template", None)),
        "prompts_file": str(job.replay_answers or job.prompts),
        "labels_from": "replay" if replay else "decoding",
        "step_time_source": "calibrated" if replay else "measured",
        "feature_widths": {"pooled": backend.target_config.hidden_size, "logits": backend.target_config.vocab_size},
        **({"note": job.note} if job.note else {}),
    }


def _load_hints(answers: Path | None, tokenizer, sampling) -> list[list[int]] | None:
    """Answer ids per prompt of a replay answers file (None without one), all made at `sampling`."""
    if answers is None:
        return None
    from blockpilot.predictor.replay import load_answer_hints

    return load_answer_hints(answers, tokenizer, sampling)


def _calibration(job: LabelJob, runner, settings: LabelSettings, encoded: list[list[int]]) -> dict | None:
    """The step-time calibration of an existing dataset (kept, so its rows stay comparable; None when it
    has none, and `prepare_dataset_dir` then refuses it), or a new one timed on the first
    `job.calibration_prompts` prompts for a new dataset."""
    from blockpilot.predictor.labels import read_meta
    from blockpilot.predictor.replay import calibrate_step_times

    if job.out.exists() and any(job.out.iterdir()):
        existing = read_meta(job.out)
        return existing.get("calibration") if existing else None
    if not encoded:
        raise UserError("no prompt is short enough to calibrate step times on; lower --max-new-tokens")
    print(f"label: timing draft + verify on {min(len(encoded), job.calibration_prompts)} prompts", file=sys.stderr)
    return calibrate_step_times(runner.backend, encoded[:job.calibration_prompts], settings.candidates,
                                job.calibration_reps, runner.clock)


def _step_costs(job: LabelJob, backend, candidates: tuple[int, ...]) -> dict:
    """The step-cost table of the dataset (as a dict): an existing dataset's own, else `job.step_costs`'s,
    else measured on `backend` at the candidates.

    Raises:
        UserError: the source has no table, or the table lacks a candidate.
    """
    from blockpilot.builder.manifest import StepCosts
    from blockpilot.predictor.labels import read_meta

    existing = read_meta(job.out) if job.out.exists() and any(job.out.iterdir()) else None
    if existing and existing.get("step_costs"):
        table = StepCosts.from_dict(existing["step_costs"])
    elif job.step_costs is not None:
        table = read_step_costs(job.step_costs)
    else:
        from blockpilot.runtime.step_costs import measure_step_costs

        print(f"label: measuring step costs on the {backend.name} backend (pass --step-costs ENGINE_DIR for the "
              "backend that will run the predictor)", file=sys.stderr)
        table = measure_step_costs(backend, [c for c in candidates if c > 1] or [1])
    for c in candidates:
        table.step_ms(c)  # a UserError naming the missing size
    return table.to_dict()


def read_step_costs(path: Path):
    """The `StepCosts` of an engine directory's manifest, or of a JSON file holding one.

    Raises:
        UserError: unreadable, or an engine directory built without step costs.
    """
    from blockpilot.builder.manifest import StepCosts, read_manifest

    path = Path(path)
    if path.is_dir():
        table = read_manifest(path, verify_files=False).step_costs
        if table is None:
            raise UserError(f"engine directory {path} has no step-cost table (built before it existed, or with "
                            "--no-step-costs); rebuild it with `blockpilot build`")
        return table
    try:
        return StepCosts.from_dict(json.loads(path.read_text()))
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise UserError(f"--step-costs {path}: not an engine directory or a step-cost JSON file ({exc})") from None


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


def _settings(job: LabelJob, backend, sampling: SamplingParams) -> LabelSettings:
    b_train = backend.drafter_config.block_size
    candidates = job.candidates or (1, *default_candidates(b_train))
    if len(candidates) < 2:
        raise UserError(f"candidates {list(candidates)}: label needs at least two candidate block sizes")
    unsupported = [c for c in candidates if not backend.supports_block_size(c)]
    if unsupported:
        raise UserError(f"candidate block size {unsupported[0]} is not supported by the {backend.name} backend; "
                        "choose candidates near the drafter's block size")
    if job.max_new_tokens < 1:
        raise UserError(f"--max-new-tokens must be >= 1 (got {job.max_new_tokens})")
    from blockpilot.runtime.runner import check_lookup, lookup_applies

    return LabelSettings(candidates=tuple(candidates), b_train=b_train, temperature=job.temperature,
                         top_k=job.top_k, top_p=job.top_p, max_new_tokens=job.max_new_tokens, seed=job.seed,
                         sampled_drafts=job.sampled_drafts, lookup=lookup_applies(check_lookup(job.lookup), sampling))


def _encode_todo(prompts, done: set[str], tokenizer, chat_template: bool, settings: LabelSettings, backend):
    """(file index, id, token ids) of the prompts still to label, and how many are too long to label."""
    from blockpilot.text import chat_prompt_ids

    todo, too_long = [], 0
    room = backend.max_capacity - settings.max_new_tokens - max(settings.candidates)
    for index, prompt in enumerate(prompts):
        if prompt.id in done:
            continue
        ids = chat_prompt_ids(tokenizer, prompt.text, chat_template, history=prompt.history)
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
