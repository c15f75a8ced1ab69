"""One-line failures for expected faults.

A step raises :class:`StepError` for anything the user can fix (bad input, bad parameter,
unreachable storage). :func:`run_main` turns it into a single ``error: ...`` line on stderr
and a non-zero exit, with no traceback. Unexpected exceptions keep their traceback.
"""
from __future__ import annotations

import argparse
import sys
from typing import Callable, Sequence

EXIT_INPUT_ERROR = 2


class StepError(Exception):
    """An expected fault. The message is one line that names the input and what is wrong."""


class OneLineArgumentParser(argparse.ArgumentParser):
    """argparse with a one-line usage error (``error: <prog>: <message>``, exit 2).

    argparse's own ``error()`` prints the usage block first, i.e. two or more lines; every
    step and the workflow CLI report bad input as exactly one ``error:`` line. Abbreviated
    flags are refused: ``--learning-rat`` must not quietly mean ``--learning-rate``.
    """

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def error(self, message: str):
        text = " ".join(f"{self.prog}: {message}".split())
        print(f"error: {text}", file=sys.stderr)
        sys.exit(EXIT_INPUT_ERROR)


def run_main(main: Callable[[Sequence[str] | None], int | None],
             argv: Sequence[str] | None = None) -> int:
    """Call ``main(argv)``; report a StepError as one line and return the exit status."""
    try:
        return int(main(argv) or 0)
    except StepError as exc:
        message = " ".join(str(exc).split())
        print(f"error: {message}", file=sys.stderr)
        return EXIT_INPUT_ERROR
    except KeyboardInterrupt:
        print("error: interrupted", file=sys.stderr)
        return 130
