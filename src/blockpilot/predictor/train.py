"""Train the block-size predictor on label datasets, export it to ONNX and write its report.

Rows are split once (seeded) into train / validation / test, the rows of one prompt (labelled at
several temperatures) always in the same split. The MLP is fit on train (AdamW) with
early stopping on the validation loss (the best epoch's weights are kept); the report measures the
test split, which neither fitting nor stopping has seen (the validation split when `test_fraction`
is 0). Two losses:

- `ce`: cross-entropy on the oracle class (the argmax of the objective per prompt);
- `regret`: the expected relative loss of the objective under the predicted distribution,
  `sum_k p_k (1 - score_k / max_j score_j)` (cost-sensitive classification): a near-tie between two
  block sizes costs almost nothing whichever is chosen, a choice far below the best costs in
  proportion, so the classifier learns which mistakes matter instead of splitting hairs between
  equals.
"""

from __future__ import annotations

import copy
import dataclasses
import json
from pathlib import Path

import torch

from blockpilot.errors import UserError
from blockpilot.predictor.labels import OBJECTIVES, LabelDataset
from blockpilot.predictor.model import BlockSizeMLP
from blockpilot.runtime.policy import FEATURE_KINDS, PredictorInfo, model_files_sha256

MIN_ROWS = 10
LOSSES = ("ce", "regret")


@dataclasses.dataclass(frozen=True)
class TrainSettings:
    objective: str = "tau"
    features: str = "pooled"
    hidden: int = 2048
    dropout: float = 0.2
    with_temperature: bool = False
    temperature_heads: bool = False  # a second head for sampled requests (`BlockSizeMLP`); needs with_temperature
    lr: float = 1e-3
    weight_decay: float = 1e-2
    batch_size: int = 64
    max_epochs: int = 300
    patience: int = 30
    val_fraction: float = 0.15
    test_fraction: float = 0.15
    threshold: float = 0.0
    seed: int = 0
    candidates: tuple[int, ...] | None = None  # a subset of the datasets' candidates (None: all of them)
    loss: str = "regret"  # "regret" (expected relative loss of the objective) or "ce" (oracle class)


@dataclasses.dataclass
class TrainingData:
    """Rows of one or more label datasets, in one tensor each (N rows, K candidates)."""

    features: torch.Tensor  # (N, F) float32
    temperature: torch.Tensor  # (N, 1) float32, the sampling temperature each row was labelled at
    labels: torch.Tensor  # (N,) int64 oracle class under the objective
    tau: torch.Tensor  # (N, K) float64
    throughput: torch.Tensor  # (N, K) float64 tau / mean step seconds of the row's dataset
    candidates: tuple[int, ...]
    b_train: int
    meta: dict  # the first dataset's meta.json
    lookup_temperatures: tuple[float, ...] = ()  # temperatures of the datasets labelled with lookup drafts


def assemble(datasets: list[LabelDataset], settings: TrainSettings) -> TrainingData:
    """Stack datasets labelled for the same models and candidates into one `TrainingData`.

    Raises:
        UserError: unknown objective or feature kind, or datasets that do not belong together.
    """
    if settings.objective not in OBJECTIVES:
        raise UserError(f"unknown objective {settings.objective!r}; use one of {', '.join(OBJECTIVES)}")
    if settings.loss not in LOSSES:
        raise UserError(f"unknown loss {settings.loss!r}; use one of {', '.join(LOSSES)}")
    if settings.temperature_heads and not settings.with_temperature:
        raise UserError("--temperature-heads needs --with-temperature (label datasets at T = 0 and T > 0)")
    if settings.features not in FEATURE_KINDS:
        raise UserError(f"unknown feature kind {settings.features!r}; use one of {', '.join(FEATURE_KINDS)}")
    if settings.candidates is not None:
        datasets = [d.restricted(tuple(settings.candidates)) for d in datasets]
    first = datasets[0]
    for other in datasets[1:]:
        for key in ("target_sha256", "drafter_sha256", "candidates", "b_train"):
            if other.meta.get(key) != first.meta.get(key):
                raise UserError(f"datasets differ in {key} ({first.meta.get(key)!r} vs {other.meta.get(key)!r}); "
                                "train on datasets labelled for the same models and candidates")
        if _cost_source(other) != _cost_source(first):
            raise UserError(f"datasets have step costs of {_cost_source(first)} and {_cost_source(other)}; "
                            "label them with one table (--step-costs) or pass --step-costs to train-predictor")
    return TrainingData(
        features=torch.cat([d.rows[settings.features].float() for d in datasets]),
        temperature=torch.cat([torch.full((len(d), 1), float(d.meta["temperature"])) for d in datasets]),
        labels=torch.cat([d.labels(settings.objective) for d in datasets]),
        tau=torch.cat([d.rows["tau"].double() for d in datasets]),
        throughput=torch.cat([d.scores("throughput").double() for d in datasets]),
        candidates=first.candidates, b_train=first.b_train, meta=first.meta,
        lookup_temperatures=tuple(sorted({float(d.meta["temperature"]) for d in datasets if d.meta.get("lookup")})),
    )


def _cost_source(dataset: LabelDataset) -> tuple | None:
    """(backend, dtype, machine) of a dataset's step-cost table (None: measured per row, no table)."""
    table = dataset.step_costs
    return None if table is None else (table.backend, table.dtype, table.machine)


def check_dataset_models(dataset: LabelDataset, target_dir: Path | None, drafter_dir: Path | None) -> None:
    """Raise `UserError` if `dataset` was labelled with other weights than those in the given directories."""
    for role, directory in (("target", target_dir), ("drafter", drafter_dir)):
        if directory is None:
            continue
        expected, actual = dataset.meta[f"{role}_sha256"], model_files_sha256(directory)
        if expected != actual:
            raise UserError(f"the dataset was labelled with another {role} (weights sha256 {expected[:12]}, "
                            f"{directory} has {actual[:12]}); label this {role} with `blockpilot label` first")


def split_indices(n: int, val_fraction: float, test_fraction: float, seed: int,
                  groups: torch.Tensor | None = None):
    """Seeded disjoint (train, val, test) index tensors; val has at least one row, test may be empty.

    `groups` `(n,)` int64, numbered in order of first appearance (`prompt_groups`): rows of one
    group (one prompt labelled at several temperatures) fall in the same split, and the fractions
    count groups. Without it every row is its own group.
    """
    if n < MIN_ROWS:
        raise UserError(f"the dataset has {n} labelled prompts; label at least {MIN_ROWS} to train a predictor")
    if not (0 < val_fraction and 0 <= test_fraction and val_fraction + test_fraction < 1):
        raise UserError(f"validation ({val_fraction}) and test ({test_fraction}) fractions must be >= 0, the "
                        "validation one > 0, and sum to less than 1")
    groups = torch.arange(n) if groups is None else groups
    count = int(groups.max()) + 1
    order = torch.randperm(count, generator=torch.Generator().manual_seed(seed))
    rank = torch.empty(count, dtype=torch.int64)
    rank[order] = torch.arange(count)  # each group's place in the seeded order
    row_rank = rank[groups]
    rows = torch.argsort(row_rank * n + torch.arange(n))  # rows in the groups' seeded order
    n_val = max(1, round(count * val_fraction))
    n_test = round(count * test_fraction)
    place = row_rank[rows]
    return rows[place >= n_val + n_test], rows[place < n_val], rows[(place >= n_val) & (place < n_val + n_test)]


def prompt_groups(features: torch.Tensor) -> torch.Tensor:
    """`(N,)` group ids for rows `(N, F)`: rows with identical features (the same prompt, labelled at
    several temperatures) share one, numbered in order of first appearance."""
    _, inverse = torch.unique(features, dim=0, return_inverse=True)
    first = torch.full((int(inverse.max()) + 1,), len(inverse)).scatter_reduce(
        0, inverse, torch.arange(len(inverse)), reduce="amin")
    rank = torch.empty_like(first)
    rank[first.argsort()] = torch.arange(len(first))
    return rank[inverse]


def fit(model: BlockSizeMLP, data: TrainingData, train: torch.Tensor, val: torch.Tensor,
        settings: TrainSettings) -> dict:
    """Train `model` in place with early stopping on the validation loss; keeps the best epoch's weights.

    Returns:
        {"epochs", "best_epoch", "best_val_loss", "train_loss"} of the run.
    """
    optimizer = torch.optim.AdamW(model.parameters(), lr=settings.lr, weight_decay=settings.weight_decay)
    shuffle = torch.Generator().manual_seed(settings.seed + 1)
    best = {"val_loss": float("inf"), "epoch": -1, "state": None}
    epoch = train_loss = 0
    for epoch in range(settings.max_epochs):
        model.train()
        for batch in train[torch.randperm(len(train), generator=shuffle)].split(settings.batch_size):
            loss = _objective_loss(model, data, batch, settings)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            train_loss = float(loss.detach())
        val_loss = _loss(model, data, val, settings)
        if val_loss < best["val_loss"] - 1e-6:
            best = {"val_loss": val_loss, "epoch": epoch, "state": copy.deepcopy(model.state_dict())}
        elif epoch - best["epoch"] >= settings.patience:
            break
    if best["state"] is not None:
        model.load_state_dict(best["state"])
    model.eval()
    return {"epochs": epoch + 1, "best_epoch": best["epoch"] + 1, "best_val_loss": best["val_loss"],
            "train_loss": train_loss}


def _logits(model: BlockSizeMLP, data: TrainingData, rows: torch.Tensor) -> torch.Tensor:
    return model(data.features[rows], data.temperature[rows] if model.with_temperature else None)


def _objective_loss(model: BlockSizeMLP, data: TrainingData, rows: torch.Tensor, settings: TrainSettings):
    logits = _logits(model, data, rows)
    if settings.loss == "ce":
        return torch.nn.functional.cross_entropy(logits, data.labels[rows])
    scores = (data.throughput if settings.objective == "throughput" else data.tau)[rows].float()
    regret = 1 - scores / scores.max(dim=-1, keepdim=True).values.clamp_min(1e-12)  # (B, K) in [0, 1]
    return (torch.softmax(logits, dim=-1) * regret).sum(dim=-1).mean()


@torch.no_grad()
def _loss(model: BlockSizeMLP, data: TrainingData, rows: torch.Tensor, settings: TrainSettings) -> float:
    model.eval()
    return float(_objective_loss(model, data, rows, settings))


@torch.no_grad()
def predict_probabilities(model: BlockSizeMLP, data: TrainingData, rows: torch.Tensor) -> torch.Tensor:
    """`(len(rows), K)` class probabilities of `model` (eval mode) on `rows`."""
    model.eval()
    return torch.softmax(_logits(model, data, rows), dim=-1)


def train_predictor(datasets: list[LabelDataset], settings: TrainSettings, out: Path) -> dict:
    """Train on `datasets`, export `out` (ONNX) and write the report beside it.

    Returns:
        The report (see `blockpilot.predictor.report`), also written as `<out stem>.report.json`
        and `.report.md` next to `out`.
    """
    from blockpilot.predictor.export import export_predictor
    from blockpilot.predictor.report import build_report, write_report

    if str(out).endswith(".report.json") or Path(out).suffix != ".onnx":
        raise UserError(f"--out {out} should be a path ending in .onnx")
    data = assemble(datasets, settings)
    train, val, test = split_indices(len(data.labels), settings.val_fraction, settings.test_fraction, settings.seed,
                                     prompt_groups(data.features))
    torch.manual_seed(settings.seed)  # initialisation and dropout
    model = _new_model(data, train, settings)
    history = fit(model, data, train, val, settings)
    metadata = _metadata(data, settings, history)
    parity_rows = torch.cat((val, test))
    temperature = data.temperature[parity_rows] if settings.with_temperature else None
    parity = export_predictor(model, out, metadata, data.features[parity_rows], temperature)
    splits = {"train": train, "val": val, "test": test}
    report = build_report(data, splits, lambda rows: predict_probabilities(model, data, rows), settings,
                          history, parity, metadata)
    write_report(report, out)
    return report


def _new_model(data: TrainingData, train: torch.Tensor, settings: TrainSettings) -> BlockSizeMLP:
    x = data.features[train]
    return BlockSizeMLP(x.shape[1], len(data.candidates), settings.hidden, settings.dropout,
                        settings.with_temperature, mean=x.mean(dim=0), std=x.std(dim=0) if len(x) > 1 else None,
                        temperature_heads=settings.temperature_heads)


def _metadata(data: TrainingData, settings: TrainSettings, history: dict) -> dict[str, str]:
    """The predictor's `metadata_props`: `PredictorInfo` (read by the runtime) plus training facts."""
    costs = data.meta.get("step_costs") if settings.objective == "throughput" else None
    info = PredictorInfo(
        candidates=data.candidates, feature_kind=settings.features, input_width=data.features.shape[1],
        objective=settings.objective, b_train=data.b_train, with_temperature=settings.with_temperature,
        target_sha256=data.meta["target_sha256"], drafter_sha256=data.meta["drafter_sha256"],
        threshold=float(settings.threshold),
        cost_backend=costs["backend"] if costs else "", cost_dtype=costs["dtype"] if costs else "",
        cost_machine=costs["machine"] if costs else "",
    )
    return {
        **info.to_metadata(), "hidden": str(settings.hidden),
        "temperature_heads": "true" if settings.temperature_heads else "false", "rows": str(len(data.labels)),
        "loss": settings.loss,
        **({"step_costs": json.dumps(costs)} if costs else {}),
        "temperatures": json.dumps(sorted({float(t) for t in data.temperature.flatten()})),
        "lookup_temperatures": json.dumps(list(data.lookup_temperatures)),  # labels that copied drafts by lookup
        "best_epoch": str(history["best_epoch"]),
    }
