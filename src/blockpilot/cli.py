"""The `blockpilot` command line: one subcommand per module in `blockpilot.commands`.

Each command module defines `add_parser(subparsers)` (registering its arguments and
`set_defaults(run=...)`) and keeps its heavy imports inside `run`, so `--help` answers fast.
Every parser is a `commands.common.Parser`: help shows defaults, a usage error is one line.
A `UserError` ends in one line on stderr and exit status 2; any other exception is a bug and
keeps its traceback.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from pathlib import Path

from blockpilot import __version__
from blockpilot.commands.common import Parser
from blockpilot.errors import UserError

COMMANDS = ("generate", "demo", "answer", "train_drafter", "label", "train_predictor", "build", "profile", "serve")


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(
        prog="blockpilot",
        description="Per-request block-size selection for DFlash speculative decoding. Every command "
        "defaults to the embedded SmolLM2-135M-Instruct with its shipped drafter and predictor.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    subparsers = parser.add_subparsers(dest="command", required=True, parser_class=Parser)
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
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as exc:  # --help, --version, or a usage error (already printed, one line)
        return int(exc.code or 0)
    try:
        from blockpilot.files import check_out_path

        for name in ("out", "work_dir"):  # every command's outputs: a folder on the way that is a file fails now
            if isinstance(getattr(args, name, None), Path):
                check_out_path(getattr(args, name), "--" + name.replace("_", "-"))
        return int(args.run(args) or 0)
    except UserError as exc:
        print(f"blockpilot {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"blockpilot {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
