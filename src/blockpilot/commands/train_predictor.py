"""`blockpilot train-predictor`: train the block-size MLP on label datasets and export it to ONNX."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from blockpilot.commands.common import argument_type, finite_float, parse_block_sizes


def add_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "train-predictor",
        help="train the block-size predictor (2-layer MLP) on `blockpilot label` datasets, export ONNX + report",
        description="Train a K-way block-size classifier on prefill features with cross-entropy, early "
        "stopping on a held-out validation split, and export it to ONNX. Writes <out>.report.json and "
        "<out>.report.md (accuracy, confusion matrix, tau and throughput vs every fixed size and the oracle, "
        "on a test split not used for training or stopping).",
    )
    p.add_argument("--dataset", type=Path, action="append", required=True,
                   help="label dataset directory (repeatable: e.g. one per temperature)")
    p.add_argument("--out", type=Path, required=True, help="output predictor .onnx")
    p.add_argument("--objective", choices=("tau", "throughput"), default="tau",
                   help="label: argmax tau (paper) or argmax tau / measured step time")
    p.add_argument("--loss", choices=("regret", "ce"), default="regret",
                   help="regret: the expected relative loss of the objective under the predicted probabilities "
                   "(near-ties cost nothing; 1.7%% more tokens/s than ce on the shipped predictor's data); ce: "
                   "cross-entropy on the best block size of each prompt")
    p.add_argument("--features", choices=("pooled", "logits"), default="pooled",
                   help="mean-pooled last hidden state (default) or last-token prefill logits")
    p.add_argument("--hidden", type=int, default=2048, help="width of the MLP's hidden layer")
    p.add_argument("--dropout", type=finite_float, default=0.2, help="dropout probability in training")
    p.add_argument("--with-temperature", action="store_true", help="take the sampling temperature as an input")
    p.add_argument("--temperature-heads", action="store_true",
                   help="with --with-temperature: one output head for greedy and one for sampled requests, mixed by "
                   "the request's temperature (clamped to [0, 1]), so that greedy labels do not decide sampled choices")
    p.add_argument("--lr", type=finite_float, default=1e-3, help="AdamW learning rate")
    p.add_argument("--weight-decay", type=finite_float, default=1e-2, help="AdamW weight decay")
    p.add_argument("--batch-size", type=int, default=64, help="prompts per training batch")
    p.add_argument("--max-epochs", type=int, default=300, help="stop after this many epochs at the latest")
    p.add_argument("--patience", type=int, default=30, help="epochs without a better validation loss before stopping")
    p.add_argument("--val-fraction", type=finite_float, default=0.15, help="share of prompts held out for early stopping")
    p.add_argument("--test-fraction", type=finite_float, default=0.15,
                   help="share of prompts held out for the report (used neither for training nor stopping)")
    p.add_argument("--threshold", type=finite_float, default=0.0,
                   help="stored fallback threshold: below this top probability the runtime uses B_train")
    p.add_argument("--seed", type=int, default=0, help="random seed (splits, initialisation, batches)")
    p.add_argument("--block-sizes", type=argument_type(parse_block_sizes), metavar="LIST",
                   help="train over a subset of the datasets' candidate block sizes, e.g. 1,4,8 (default: all)")
    p.add_argument("--step-costs", type=Path, metavar="PATH",
                   help="score throughput with this step-cost table instead of the datasets' own: an engine dir "
                   "(`blockpilot build` measures it) or a JSON file; the predictor is then for its backend/dtype")
    p.add_argument("--target", type=Path, help="check the datasets were labelled with this target's weights")
    p.add_argument("--drafter", type=Path, help="check the datasets were labelled with this drafter's weights")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from blockpilot.errors import UserError
    from blockpilot.predictor.labels import load_label_dataset
    from blockpilot.predictor.report import report_paths
    from blockpilot.predictor.train import TrainSettings, check_dataset_models, train_predictor

    for name in ("hidden", "batch_size", "max_epochs", "patience"):
        if getattr(args, name) < 1:
            raise UserError(f"--{name.replace('_', '-')} must be >= 1 (got {getattr(args, name)})")
    if not 0.0 <= args.dropout < 1.0 or not 0.0 <= args.threshold <= 1.0:
        raise UserError("--dropout must be in [0, 1) and --threshold in [0, 1]")
    if args.lr <= 0 or args.weight_decay < 0:
        raise UserError(f"--lr must be > 0 and --weight-decay >= 0 (got {args.lr} and {args.weight_decay})")
    datasets = [load_label_dataset(path) for path in args.dataset]
    if args.step_costs is not None:
        from blockpilot.predictor.labelling import read_step_costs

        table = read_step_costs(args.step_costs)
        datasets = [dataset.with_step_costs(table) for dataset in datasets]

    for dataset in datasets:
        check_dataset_models(dataset, args.target, args.drafter)
    settings = TrainSettings(
        objective=args.objective, features=args.features, hidden=args.hidden, dropout=args.dropout,
        with_temperature=args.with_temperature, temperature_heads=args.temperature_heads, lr=args.lr,
        weight_decay=args.weight_decay,
        batch_size=args.batch_size, max_epochs=args.max_epochs, patience=args.patience,
        val_fraction=args.val_fraction, test_fraction=args.test_fraction, threshold=args.threshold, seed=args.seed,
        candidates=args.block_sizes, loss=args.loss,
    )
    report = train_predictor(datasets, settings, args.out)
    split = report["splits"][report["evaluated_on"]]
    print(json.dumps({"out": str(args.out), "report": str(report_paths(args.out)[1]),
                      "evaluated_on": report["evaluated_on"], "accuracy": round(split["accuracy"], 4),
                      "tau": {k: split["tau"][k] for k in ("auto", "best_fixed", "oracle")},
                      "throughput": {k: split["throughput"][k] for k in ("auto", "best_fixed", "oracle")}}))
    return 0
