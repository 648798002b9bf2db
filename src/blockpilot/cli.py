"""The `blockpilot` command line: one subcommand per module in `blockpilot.commands`.

Each command module defines `add_parser(subparsers)` (registering its arguments and
`set_defaults(run=...)`) and keeps its heavy imports inside `run`, so `--help` answers fast.
A `UserError` ends in one line on stderr and exit status 2; any other exception is a bug and
keeps its traceback.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from blockpilot.errors import UserError

COMMANDS = ("generate", "demo", "answer", "train_drafter", "label", "train_predictor", "build", "profile")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="blockpilot",
        description="Per-request block-size selection for DFlash speculative decoding.",
    )
    subparsers = parser.add_subparsers(dest="command", required=True)
    for name in COMMANDS:
        try:
            module = importlib.import_module(f"blockpilot.commands.{name}")
        except ModuleNotFoundError as exc:
            if exc.name != f"blockpilot.commands.{name}":
                raise
            continue  # command not implemented in this checkout
        module.add_parser(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.run(args) or 0)
    except UserError as exc:
        print(f"blockpilot {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"blockpilot {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
