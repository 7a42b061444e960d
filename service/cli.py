"""The ``tserve`` command (``pip install .`` puts it on the PATH): ``tserve serve ...`` is ``python -m service``,
and every other command is a training one, ``python -m training <command>`` (prepare, train, lora, evaluate,
export, import, recipe, ...)."""

from __future__ import annotations

import sys
from collections.abc import Sequence

USAGE = """usage: tserve <command> [options]

  serve       serve models over HTTP (tserve serve --models DIR; tserve serve --help lists every setting)
  <command>   a training command: {commands}

tserve <command> --help tells more.
"""


def main(argv: Sequence[str] | None = None) -> int:
    """Dispatch ``argv`` (default: the process's arguments) to the server or the training CLI."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["serve"]:
        from service.__main__ import main as serve

        return serve(argv[1:], prog="tserve serve")
    from training.cli import command_names
    from training.cli import main as train

    if not argv or argv[0] in ("-h", "--help"):
        names = ", ".join(command_names())
        (sys.stdout if argv else sys.stderr).write(USAGE.format(commands=names))
        return 0 if argv else 2
    return train(argv, prog="tserve")


if __name__ == "__main__":
    sys.exit(main())
