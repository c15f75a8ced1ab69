"""One-line failures for expected faults.

A step raises :class:`StepError` for anything the user can fix (bad input, bad parameter,
unreachable storage). :func:`run_main` turns it into a single ``error: ...`` line on stderr
and exit 2, which Argo does not retry. An unexpected exception exits 1 (retried) with one
line naming the step and the exception first, then its traceback; ``MemoryError`` says that
memory ran out. Control and format characters in a message are escaped, so a hostile file
name cannot split the line, drive the terminal or reorder what a reader sees (bidi
overrides), and a line is cut to MAX_LINE characters. An error line always starts a line,
also after a progress bar's carriage returns. SIGTERM and SIGINT unwind the step like an
error (so its clean-up runs) and exit 128 + the signal.
"""
from __future__ import annotations

import argparse
import contextlib
import gc
import os
import re
import signal
import stat
import sys
import threading
import traceback
import unicodedata
from typing import Callable, Iterator, Sequence

EXIT_INPUT_ERROR = 2
# Where a step also writes its input-error line, when set. The multi-node job's pods set it:
# torchrun turns a worker's exit 2 into its own exit 1, and the job object carries no exit code,
# so this file is how the job learns that its input was bad (workflows/multinode.py).
INPUT_ERROR_FILE_ENV = "UNET_INPUT_ERROR_FILE"
EXIT_UNEXPECTED = 1
# The container's termination message: the kubelet mounts this file (mode 0666) into every
# container and copies what it holds into the container's terminated state
# (terminationMessagePath, default /dev/termination-log, at most 4096 bytes; Kubernetes
# v1.35.4 pkg/kubelet/kuberuntime/kuberuntime_container.go, makeMounts and
# getTerminationMessage). Argo's controller appends it to the node's message ("main: Error
# (exit code 2): error: ...", v4.0.5 workflow/controller/operator.go, inferFailedReason),
# which the UI and `argo get` show. Written only where the file exists.
TERMINATION_LOG_ENV = "UNET_TERMINATION_LOG"
TERMINATION_LOG = "/dev/termination-log"
MAX_TERMINATION_BYTES = 4096
MAX_LINE = 600            # characters of one error line: a quoted input is cut in its middle
_CONTROL = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029]")   # C0, DEL, C1, line separators
_NON_ASCII = re.compile("[^\x00-\x7f]")


def _escaped(char: str) -> str:
    return char.encode("unicode_escape").decode()


def _escape_format(match: re.Match) -> str:
    """A format character (Unicode's Cf: bidi embeddings, overrides and isolates, zero-width
    characters, the soft hyphen, the BOM), which can make a line read other than it is,
    escaped; any other character as it is."""
    char = match.group()
    return _escaped(char) if unicodedata.category(char) == "Cf" else char


def unsafe_characters(text: str) -> bool:
    """Whether ``text`` holds a control or format character (what :func:`one_line` escapes)."""
    return bool(_CONTROL.search(text)) or any(
        unicodedata.category(char) == "Cf" for char in _NON_ASCII.findall(text))


def one_line(text: str) -> str:
    """``text`` as one printable line of at most MAX_LINE characters: every control and
    format character, line breaks included, is escaped (``\\n``, ``\\x1b``, ``\\u202e``), and
    the middle of a longer line is cut (a quoted 5 MB file name stays a line a person can
    read)."""
    text = str(text).strip()
    if len(text) > 4 * MAX_LINE:      # escaping can only lengthen: cut before it, cheaply
        text = text[:2 * MAX_LINE] + text[-2 * MAX_LINE:]
    line = _NON_ASCII.sub(_escape_format, _CONTROL.sub(lambda m: _escaped(m.group()), text))
    if len(line) <= MAX_LINE:
        return line
    keep = (MAX_LINE - 20) // 2
    return f"{line[:keep]} [...cut...] {line[-keep:]}"


class _LineTracker:
    """The process's stderr, remembering whether its last write ended a line: a progress bar
    redraws with carriage returns and no newline, and an ``error:`` line printed after it
    must still start a line (Argo's message and log readers look for it there)."""

    def __init__(self, stream):
        self.stream = stream
        self.at_line_start = True

    def write(self, text: str) -> int:
        if text:
            self.at_line_start = text.endswith("\n")
        return self.stream.write(text)

    def __getattr__(self, name: str):
        return getattr(self.stream, name)


def error_print(line: str) -> None:
    """Print ``line`` (an ``error:`` line) to stderr at the start of a line, and make it the
    container's termination message where there is one."""
    if not getattr(sys.stderr, "at_line_start", True):
        sys.stderr.write("\n")
    print(line, file=sys.stderr)
    _termination_message(line)


def _termination_message(line: str) -> None:
    """``line`` into the kubelet's termination-message file, replacing what it held; nothing
    where the file is absent (outside a pod) or not a regular file (never created, no link
    followed)."""
    path = os.environ.get(TERMINATION_LOG_ENV, TERMINATION_LOG)
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_WRONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        with os.fdopen(fd, "wb") as f:
            if stat.S_ISREG(os.fstat(fd).st_mode):
                f.truncate(0)
                f.write(line.encode("utf-8", "replace")[:MAX_TERMINATION_BYTES])


def report_input_error(message: str) -> None:
    """Print the one ``error:`` line of an input error; also write it to the file that
    ``UNET_INPUT_ERROR_FILE`` names, when set (one write, so concurrent ranks cannot mix)."""
    line = f"error: {one_line(message)}"
    error_print(line)
    path = os.environ.get(INPUT_ERROR_FILE_ENV)
    if path:
        with contextlib.suppress(OSError), open(path, "w", encoding="utf-8") as f:
            f.write(line + "\n")


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
        report_input_error(f"{self.prog}: {message}")
        sys.exit(EXIT_INPUT_ERROR)


class Stopped(BaseException):
    """SIGTERM (Argo's deadline or stop, an eviction) or SIGINT (Ctrl-C) as an exception:
    the step unwinds as it does from an error, so every clean-up runs (``publish`` empties
    its output, a download drops its staging folder)."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


_STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


def _stop(signum: int, _frame) -> None:
    for sig in _STOP_SIGNALS:       # the clean-up runs once, not cut short by a second signal
        signal.signal(sig, signal.SIG_IGN)
    raise Stopped(signum)


@contextlib.contextmanager
def _stop_on_signals() -> Iterator[None]:
    """SIGTERM and SIGINT raise :class:`Stopped` while the block runs (main thread only:
    Python delivers signals there); the previous handlers come back afterwards."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {sig: signal.signal(sig, _stop) for sig in _STOP_SIGNALS}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def module_name(function: Callable) -> str:
    """The dotted name of ``function``'s module, also under ``python -m`` (where the module
    is ``__main__`` and its spec keeps the name): ``steps.train``."""
    spec = getattr(sys.modules.get(function.__module__), "__spec__", None)
    return spec.name if spec is not None else function.__module__


def run_main(main: Callable[[Sequence[str] | None], int | None],
             argv: Sequence[str] | None = None) -> int:
    """Call ``main(argv)``; report any failure as one ``error:`` line; return the exit status
    (128 + the signal's number when SIGTERM or SIGINT stopped it)."""
    step = module_name(main)
    tracked = sys.stderr = _LineTracker(sys.stderr)
    try:
        return _run_reported(main, argv, step)
    finally:
        if sys.stderr is tracked:
            sys.stderr = tracked.stream


def _run_reported(main, argv, step: str) -> int:
    try:
        with _stop_on_signals():
            return int(main(argv) or 0)
    except StepError as exc:
        report_input_error(str(exc))
        return EXIT_INPUT_ERROR
    except Stopped as stop:
        name = signal.Signals(stop.signum).name
        error_print(f"error: {step}: stopped by {name}; unfinished outputs were removed")
        # What the stopped work held (an onnxruntime session among it) is freed now, not at
        # interpreter exit, where a native library may abort the process instead of exiting.
        stop.__traceback__ = None
        gc.collect()
        return 128 + stop.signum
    except KeyboardInterrupt:
        error_print("error: interrupted")
        return 130
    except MemoryError:
        error_print(f"error: {step}: out of memory (MemoryError); give the step more memory "
                    "or smaller inputs")
        traceback.print_exc(file=sys.stderr)
        return EXIT_UNEXPECTED
    except Exception as exc:  # noqa: BLE001 - the last line of defence: one line, then detail
        error_print(f"error: {step}: unexpected {type(exc).__name__}: "
                    f"{one_line(str(exc))[:500]} (a bug: the traceback follows)")
        traceback.print_exc(file=sys.stderr)
        return EXIT_UNEXPECTED
