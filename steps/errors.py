"""One-line failures for expected faults.

A step raises :class:`StepError` for anything the user can fix (bad input, bad parameter,
unreachable storage). :func:`run_main` turns it into a single ``error: ...`` line on stderr
and exit 2, which Argo does not retry. An unexpected exception exits 1 (retried) with one
line naming the step and the exception first, then its traceback; ``MemoryError`` says that
memory ran out. Control characters in a message are escaped, so a hostile file name cannot
split the line or drive the terminal.
"""
from __future__ import annotations

import argparse
import re
import sys
import traceback
from typing import Callable, Sequence

EXIT_INPUT_ERROR = 2
EXIT_UNEXPECTED = 1
_CONTROL = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029]")   # C0, DEL, C1, line separators


def one_line(text: str) -> str:
    """``text`` as one printable line: every control character, line breaks included, is
    escaped (``\\n``, ``\\x1b``)."""
    return _CONTROL.sub(lambda m: m.group().encode("unicode_escape").decode(), str(text).strip())


class StepError(Exception):
    """An expected fault. The message is one line that names the input and what is wrong;
    control characters that reach it from inputs (file or member names) are escaped."""

    def __init__(self, message: object = ""):
        super().__init__(one_line(str(message)))


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
        print(f"error: {one_line(f'{self.prog}: {message}')}", file=sys.stderr)
        sys.exit(EXIT_INPUT_ERROR)


def run_main(main: Callable[[Sequence[str] | None], int | None],
             argv: Sequence[str] | None = None) -> int:
    """Call ``main(argv)``; report any failure as one ``error:`` line; return the exit status."""
    step = main.__module__
    try:
        return int(main(argv) or 0)
    except StepError as exc:
        print(f"error: {one_line(str(exc))}", file=sys.stderr)
        return EXIT_INPUT_ERROR
    except KeyboardInterrupt:
        print("error: interrupted", file=sys.stderr)
        return 130
    except MemoryError:
        print(f"error: {step}: out of memory (MemoryError); give the step more memory or "
              "smaller inputs", file=sys.stderr)
        traceback.print_exc(file=sys.stderr)
        return EXIT_UNEXPECTED
    except Exception as exc:  # noqa: BLE001 - the last line of defence: one line, then detail
        print(f"error: {step}: unexpected {type(exc).__name__}: {one_line(str(exc))[:500]} "
              "(a bug: the traceback follows)", file=sys.stderr)
        traceback.print_exc(file=sys.stderr)
        return EXIT_UNEXPECTED
