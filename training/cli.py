"""Command-line entry: `python -m training <command> ...`.

Each command is a module with `add_parser(subparsers) -> None` that adds its parser and sets
`func=training.runs.command(RunType, work)` via `set_defaults`: the parsed flags become a typed run
(training.runs) once, and `work` takes that. To add a command, import its module here and append it
to COMMANDS. Keep heavy imports (torch) inside the command's work function so that `--help` and
other commands stay fast.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence

from training import (
    baselines_cmd,
    calibrate_cmd,
    evaluate_cmd,
    export_cmd,
    import_cmd,
    lora_cmd,
    prepare_cmd,
    recipe_cmd,
    train_cmd,
    translate_po_cmd,
    tune_generation_cmd,
    vmap_cmd,
)
from training.errors import UserError

# Commands in the order `--help` lists them.
COMMANDS = (prepare_cmd, train_cmd, lora_cmd, evaluate_cmd, export_cmd, import_cmd, baselines_cmd,
            tune_generation_cmd, calibrate_cmd, translate_po_cmd, vmap_cmd, recipe_cmd)


def build_parser(prog: str = "python -m training") -> argparse.ArgumentParser:
    """The top-level parser with one subparser per module in COMMANDS."""
    parser = argparse.ArgumentParser(prog=prog, description="Data, training and export.")
    parser.add_argument("--log-level", default="INFO", choices=("DEBUG", "INFO", "WARNING", "ERROR"))
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="<command>")
    for command in COMMANDS:
        command.add_parser(subparsers)
    return parser


def command_names() -> list[str]:
    """The commands' names, in the order `--help` lists them (as each module's add_parser names its parser)."""
    names: list[str] = []

    class Recorder:  # stands in for argparse's subparsers: keeps the names, hands out throwaway parsers
        def add_parser(self, name: str, **kwargs) -> argparse.ArgumentParser:
            names.append(name)
            return argparse.ArgumentParser(add_help=False)

    for command in COMMANDS:
        command.add_parser(Recorder())
    return names


def main(argv: Sequence[str] | None = None, prog: str = "python -m training") -> int:
    """Parse `argv` and run the command; 0 on success, 1 on a UserError (2 on bad usage, by argparse)."""
    args = build_parser(prog).parse_args(argv)
    logging.basicConfig(level=args.log_level, format="%(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    try:
        args.func(args)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0
