"""One-line failures for expected faults.

A step raises :class:`StepError` for anything the user can fix (bad input, bad parameter,
unreachable storage). :func:`run_main` turns it into a single ``error: ...`` line on stderr
and a non-zero exit, with no traceback. Unexpected exceptions keep their traceback.
"""
from __future__ import annotations

import sys
from typing import Callable, Sequence

EXIT_INPUT_ERROR = 2


class StepError(Exception):
    """An expected fault. The message is one line that names the input and what is wrong."""


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
