"""Oracle labels: speculative decoding of every training prompt at every candidate block size.

A label dataset is a directory:

    meta.json            what was labelled how: model hashes, candidates, B_train, temperature, ...
    labels.safetensors   consolidated rows, in labelling order (metadata "ids": JSON list of prompt ids)
    parts/NNNNNNN.safetensors
                         one row per prompt, written atomically while labelling (NNNNNNN = the
                         prompt's index in the prompt file); merged into labels.safetensors at
                         the end of a run. A restart skips every id already in either place.

Row tensors (N prompts, K candidates): `pooled` (N, H) and `logits` (N, V) float32 prefill
features (`blockpilot.runtime.policy`), `tau` (N, K) float64 mean acceptance length, `steps`,
`accepted` (sum of acceptance lengths) and `new_tokens` (N, K) int64, `draft_s` and `verify_s`
(N, K) float64 seconds, `step_s` (N, K) their sum per decode step, `lookup_steps` (N, K) int64 the
steps whose draft was copied by lookup and made no drafter call (`runtime.lookup`; meta `lookup` says
whether the labels decoded with lookup drafts, as the runtime does for greedy requests; rows of
datasets made before it read 0), `prompt_tokens` (N,) int64.
Step times are measured per row while decoding (meta `step_time_source` "measured"), or, for
T = 0 replay datasets (`blockpilot.predictor.replay`), steps x per-call medians of a calibration
stored in meta `calibration` ("calibrated").

Candidate 1 is plain decoding: tau 1 and no drafter call.

Label objectives (chosen at training time, both computed from the dataset):
    tau         argmax of tau over candidates (the paper's labels)
    throughput  argmax of tau / step cost. The step cost of a candidate comes from the step-cost
                table in meta `step_costs` (`blockpilot.builder.manifest.StepCosts`: measured on the
                backend and dtype that will run the predictor; cost(1) = the plain decoding step,
                cost(k) = verify(k) + draft(k), verify(k) alone for a row's `lookup_steps`);
                datasets without one use the candidate's mean
                measured step time (draft + verify) over the whole dataset. Per-prompt step times
                on a shared CPU are too noisy to compare.
Ties (within 1e-9 relative) go to the candidate nearest B_train, then to the smaller one.
"""

from __future__ import annotations

import dataclasses
import json
import os
import tempfile
from collections.abc import Iterable
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from blockpilot.errors import UserError
from blockpilot.files import write_text_atomic
from blockpilot.runtime.policy import FEATURE_KINDS, prefill_features

LABEL_FORMAT = "blockpilot-labels"
LABEL_VERSION = 1
OBJECTIVES = ("tau", "throughput")
ROW_KEYS = ("pooled", "logits", "tau", "steps", "accepted", "new_tokens", "draft_s", "verify_s", "step_s",
            "lookup_steps", "prompt_tokens")
PER_CANDIDATE = ("tau", "steps", "accepted", "new_tokens", "draft_s", "verify_s", "step_s", "lookup_steps")  # (N, K)
CONSOLIDATED = "labels.safetensors"
META = "meta.json"
PARTS = "parts"
# meta.json fields that must agree for a resumed run to append to the same dataset
RESUME_KEYS = ("format", "version", "target_sha256", "drafter_sha256", "candidates", "b_train", "temperature",
               "top_k", "top_p", "max_new_tokens", "backend", "dtype", "seed", "chat_template", "clock",
               "step_time_source", "sampled_drafts", "lookup")
RESUME_DEFAULTS = {"lookup": False}  # what a meta.json written before the key existed means


@dataclasses.dataclass(frozen=True)
class LabelSettings:
    """How each prompt is decoded: candidates, sampling, budget; `seed` fixes the sampling draws."""

    candidates: tuple[int, ...]
    b_train: int
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    max_new_tokens: int = 128
    seed: int = 0
    sampled_drafts: bool = True
    """At T > 0: drafts drawn from the drafter and accepted by rejection sampling (`Runner.sampled_drafts`)."""
    lookup: bool = False
    """Steps whose context repeats copy their drafts by lookup (`runtime.lookup`), as the runtime does for
    greedy requests by default (`Runner.lookup`)."""


# ---------------------------------------------------------------- label math (pure tensor functions)


def oracle_labels(scores: torch.Tensor, candidates: torch.Tensor, b_train: int) -> torch.Tensor:
    """Index of the best candidate per row, ties to the one nearest `b_train`, then the smaller.

    Args:
        scores: `(N, K)` higher is better (tau, or tau per second of step).
        candidates: `(K,)` block sizes.
        b_train: the drafter's training block size.

    Returns:
        `(N,)` int64 class indices into `candidates`.
    """
    scores = scores.double()
    best = scores.max(dim=1, keepdim=True).values  # (N, 1)
    tied = scores >= best - 1e-9 * best.abs().clamp_min(1.0)  # (N, K)
    distance = (candidates.double() - b_train).abs() + candidates.double() * 1e-6  # (K,) nearest, then smaller
    return torch.where(tied, distance, torch.inf).argmin(dim=1)


def candidate_step_cost(draft_s: torch.Tensor, verify_s: torch.Tensor, steps: torch.Tensor) -> torch.Tensor:
    """Mean seconds per decode step of each candidate over all rows: `(N, K)` x3 -> `(K,)` float64."""
    return (draft_s + verify_s).double().sum(dim=0) / steps.double().sum(dim=0).clamp_min(1)


# ---------------------------------------------------------------- the dataset


@dataclasses.dataclass
class LabelDataset:
    """Rows of a label dataset (see module docstring) with its `meta.json`."""

    ids: list[str]
    rows: dict[str, torch.Tensor]
    meta: dict

    def __len__(self) -> int:
        return len(self.ids)

    @property
    def candidates(self) -> tuple[int, ...]:
        return tuple(self.meta["candidates"])

    @property
    def b_train(self) -> int:
        return int(self.meta["b_train"])

    @property
    def step_costs(self):
        """The dataset's `StepCosts` table (None for datasets labelled without one)."""
        from blockpilot.builder.manifest import StepCosts

        raw = self.meta.get("step_costs")
        return StepCosts.from_dict(raw) if raw else None

    def step_cost(self) -> torch.Tensor:
        """`(N, K)` seconds of one decode step of each row's candidates: from the step-cost table (a step
        that copied its draft by lookup costs no drafter call), else the mean measured step time of the
        candidate over the dataset."""
        table = self.step_costs
        if table is None:
            mean = candidate_step_cost(self.rows["draft_s"], self.rows["verify_s"], self.rows["steps"])
            return mean[None, :].expand(len(self), -1)
        full, copied = (torch.tensor([[cost(c) / 1e3 for c in self.candidates]], dtype=torch.float64)
                        for cost in (table.step_ms, table.copy_step_ms))
        steps = self.rows["steps"].double()
        share = self.rows.get("lookup_steps", torch.zeros_like(steps)).double() / steps.clamp_min(1)  # (N, K)
        return full + share * (copied - full)

    def scores(self, objective: str) -> torch.Tensor:
        """`(N, K)` the quantity `objective` maximises: tau, or tau per second of step."""
        if objective == "tau":
            return self.rows["tau"]
        if objective == "throughput":
            return self.rows["tau"] / self.step_cost()
        raise UserError(f"unknown objective {objective!r}; use one of {', '.join(OBJECTIVES)}")

    def labels(self, objective: str) -> torch.Tensor:
        """`(N,)` int64 index of the oracle candidate under `objective`."""
        return oracle_labels(self.scores(objective), torch.tensor(self.candidates), self.b_train)

    def restricted(self, candidates: tuple[int, ...]) -> "LabelDataset":
        """The same rows over a subset of the candidates (the others' columns dropped).

        Raises:
            UserError: a candidate the dataset was not labelled at.
        """
        missing = [c for c in candidates if c not in self.candidates]
        if missing:
            raise UserError(f"candidate {missing[0]} was not labelled (the dataset has {list(self.candidates)}); "
                            "choose candidates among those")
        columns = torch.tensor([self.candidates.index(c) for c in candidates])
        rows = {key: value[:, columns] if value.dim() == 2 and key in PER_CANDIDATE else value
                for key, value in self.rows.items()}
        return LabelDataset(self.ids, rows, {**self.meta, "candidates": list(candidates)})

    def with_step_costs(self, table) -> "LabelDataset":
        """The same rows scored with another `StepCosts` table (e.g. another backend's).

        Raises:
            UserError: the table lacks a candidate.
        """
        for c in self.candidates:
            table.step_ms(c)
        return LabelDataset(self.ids, self.rows, {**self.meta, "step_costs": table.to_dict()})


def load_label_dataset(path: str | Path) -> LabelDataset:
    """Read a label dataset directory (consolidated rows plus any parts of an unfinished run).

    Raises:
        UserError: not a label dataset, or it has no rows yet.
    """
    path = Path(path)
    meta = read_meta(path)
    if meta is None:
        raise UserError(f"{path} is not a label dataset (no {META}); create one with `blockpilot label`")
    ids, chunks = _read_rows(path)
    if not ids:
        raise UserError(f"label dataset {path} has no labelled prompts yet; run `blockpilot label` on it")
    rows = {key: torch.cat([c[key] for c in chunks]) for key in ROW_KEYS}
    return LabelDataset(ids, rows, meta)


def read_meta(path: Path) -> dict | None:
    """`meta.json` of a dataset directory, None when absent."""
    if Path(path).is_file():  # a JSONL file given where the folder `blockpilot label --out` wrote is wanted
        raise UserError(f"{path} is a file, not a label dataset; pass the folder `blockpilot label --out` wrote")
    try:
        meta = json.loads((Path(path) / META).read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        raise UserError(f"{Path(path) / META} is unreadable ({exc}); remove the dataset and label again") from None
    if meta.get("format") != LABEL_FORMAT:
        raise UserError(f"{path} is not a BlockPilot label dataset; create one with `blockpilot label`")
    return meta


def _read_rows(path: Path) -> tuple[list[str], list[dict[str, torch.Tensor]]]:
    """Ids and row chunks of the consolidated file, then of the parts in index order; an id seen twice
    (a run interrupted while consolidating) is read once."""
    files = ([path / CONSOLIDATED] if (path / CONSOLIDATED).is_file() else [])
    files += sorted((path / PARTS).glob("*.safetensors")) if (path / PARTS).is_dir() else []
    ids: list[str] = []
    seen: set[str] = set()
    chunks: list[dict[str, torch.Tensor]] = []
    for file in files:
        file_ids, tensors = _read_row_file(file)
        keep = [i for i, row_id in enumerate(file_ids) if row_id not in seen]
        ids += [file_ids[i] for i in keep]
        seen.update(file_ids)
        tensors.setdefault("lookup_steps", torch.zeros_like(tensors["steps"]))  # labelled before lookup existed
        chunks.append({key: tensors[key][keep] for key in ROW_KEYS})
    return ids, chunks


def _read_row_file(file: Path) -> tuple[list[str], dict[str, torch.Tensor]]:
    from safetensors import safe_open

    try:
        with safe_open(str(file), "pt") as handle:
            ids = json.loads(handle.metadata()["ids"])
        return ids, load_file(file)
    except (SafetensorError, OSError, KeyError, ValueError) as exc:
        raise UserError(f"{file} is corrupt ({exc}); delete it and run `blockpilot label` again to redo it") from None


def save_rows_atomic(ids: list[str], rows: dict[str, torch.Tensor], file: Path) -> None:
    """Write rows to `file` through a temporary sibling and a rename (complete or absent)."""
    file.parent.mkdir(parents=True, exist_ok=True)
    handle, tmp = tempfile.mkstemp(prefix=f".{file.name}.", dir=file.parent)
    os.close(handle)
    try:
        save_file({k: v.contiguous() for k, v in rows.items()}, tmp, metadata={"ids": json.dumps(ids)})
        os.chmod(tmp, 0o644)  # mkstemp makes it private
        os.replace(tmp, file)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_json_atomic(data: dict, file: Path) -> None:
    """Write `data` as JSON through a temporary sibling and a rename."""
    write_text_atomic(file, json.dumps(data, indent=2) + "\n")


def consolidate(path: Path) -> int:
    """Merge the parts of `path` into `labels.safetensors` and remove them; returns the row count."""
    ids, chunks = _read_rows(path)
    if not ids:
        return 0
    parts = sorted((path / PARTS).glob("*.safetensors")) if (path / PARTS).is_dir() else []
    if parts:
        save_rows_atomic(ids, {key: torch.cat([c[key] for c in chunks]) for key in ROW_KEYS}, path / CONSOLIDATED)
        for part in parts:
            part.unlink()
    if (path / PARTS).is_dir() and not any((path / PARTS).iterdir()):
        (path / PARTS).rmdir()
    return len(ids)


# ---------------------------------------------------------------- labelling


def label_prompt(runner, input_ids: list[int], settings: LabelSettings, seed: int) -> dict[str, torch.Tensor]:
    """One dataset row: prefill features, then speculative decoding at every candidate block size.

    Args:
        runner: a `blockpilot.runtime.runner.Runner` with a drafter.
        input_ids: the prompt's token ids.
        settings: candidates and sampling.
        seed: sampling seed, the same for every candidate of this prompt.

    Returns:
        Row tensors with a leading dimension of 1 (see module docstring).
    """
    row = prefill_row(runner.backend, input_ids)
    runner.sampled_drafts = settings.sampled_drafts
    k = len(settings.candidates)
    counts = {key: torch.zeros(1, k, dtype=torch.int64) for key in ("steps", "accepted", "new_tokens", "lookup_steps")}
    times = {key: torch.zeros(1, k, dtype=torch.float64) for key in ("draft_s", "verify_s")}
    for j in _rotated(range(k), seed):  # rotate the order so no candidate always runs first (cache, clocks)
        out = runner.generate([torch.tensor(input_ids)], max_new_tokens=settings.max_new_tokens,
                              temperature=settings.temperature, top_k=settings.top_k, top_p=settings.top_p,
                              random_seed=seed, block_size=settings.candidates[j], return_dict=True)
        accepts = out["accept_lengths"][0]
        counts["steps"][0, j], counts["accepted"][0, j] = len(accepts), sum(accepts)
        counts["new_tokens"][0, j] = int(out["sequence_lengths"][0, 0]) - len(input_ids)
        counts["lookup_steps"][0, j] = len(accepts) - out["drafter_calls"][0] if settings.candidates[j] > 1 else 0
        times["draft_s"][0, j] = out["timings"][0]["draft_s"]
        times["verify_s"][0, j] = out["timings"][0]["verify_s"]
    steps = counts["steps"].double().clamp_min(1)
    tau = counts["accepted"].double() / steps
    return {**row, **counts, **times, "tau": tau, "step_s": (times["draft_s"] + times["verify_s"]) / steps}


def prefill_row(backend, input_ids: list[int]) -> dict[str, torch.Tensor]:
    """Prefill features of every kind `(1, F)` and the prompt length, from one target prefill."""
    state = backend.new_state(1, len(input_ids) + 1)
    device = getattr(backend, "device", "cpu")
    prefill = backend.prefill(state, torch.tensor([input_ids], device=device))
    features = {kind: prefill_features(kind, prefill.hidden, prefill.last_logits) for kind in FEATURE_KINDS}
    return {**features, "prompt_tokens": torch.tensor([len(input_ids)], dtype=torch.int64)}


def _rotated(indices: Iterable[int], shift: int) -> list[int]:
    items = list(indices)
    shift %= len(items)
    return items[shift:] + items[:shift]


def prepare_dataset_dir(path: Path, meta: dict) -> set[str]:
    """Create the dataset directory with `meta`, or check an existing one agrees; returns the done ids.

    Raises:
        UserError: the directory holds a dataset labelled with other models or settings, or is
            something else that is not empty.
    """
    existing = check_resumable(path, meta)
    if existing is None:
        if path.exists() and any(path.iterdir()):
            raise UserError(f"{path} exists and is not a label dataset; choose another --out")
        write_json_atomic(json.loads(json.dumps(meta)), path / META)
        return set()
    return set(_read_rows(path)[0])


def check_resumable(path: Path, meta: dict) -> dict | None:
    """The meta.json of the dataset at `path` (None: there is none), checked to agree with `meta` on every
    `RESUME_KEYS` entry; `run_label_job` calls it before it reads anything else of the dataset.

    Raises:
        UserError: the dataset was labelled with other models or settings.
    """
    meta = json.loads(json.dumps(meta))  # compare in JSON form (tuples become lists)
    existing = read_meta(path) if path.exists() else None
    for key in RESUME_KEYS if existing is not None else ():
        if existing.get(key, RESUME_DEFAULTS.get(key)) != meta.get(key):
            what = "another model" if key.endswith("sha256") else "other settings"
            raise UserError(f"{path} was labelled with {what} ({key} {existing.get(key)!r}, now {meta.get(key)!r}); "
                            "use another --out or the same models and settings")
    return existing


def label_prompts(runner, prompts: list[tuple[int, str, list[int]]], settings: LabelSettings, out: Path,
                  progress: bool = True) -> int:
    """Label `prompts` (file index, id, token ids) into the prepared dataset directory `out`.

    Each row is written as its own part file as soon as it is done, so an interrupted run loses
    at most one prompt; the parts are consolidated at the end.

    The runner drafts by lookup (`runtime.lookup`) where `settings.lookup` says so, and only there.

    Returns:
        The number of rows in the dataset afterwards.
    """
    from tqdm import tqdm

    # labels price whole blocks (`verify_length` "full"), as their replay does
    with runner.settings_set_to(lookup="all" if settings.lookup else "off", verify_length="full"):
        for index, prompt_id, ids in tqdm(prompts, desc="labelling", unit="prompt", disable=not progress):
            row = label_prompt(runner, ids, settings, seed=settings.seed * 1_000_003 + index)
            save_rows_atomic([prompt_id], row, out / PARTS / f"{index:07d}.safetensors")
    return consolidate(out)
