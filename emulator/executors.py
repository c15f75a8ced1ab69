"""Running one process to its end or its deadline, with its output in the pod's log.

The ``subprocess`` executor runs the container's ``command`` + ``args`` in this Python
environment (``python`` → this interpreter, the project on ``PYTHONPATH``), in the node
directory; container paths were already remapped under it by the runner. The container
executors (:mod:`emulator.pods`) run ``podman start --attach`` through the same
:func:`run`, with a ``stop`` command that kills the container at the deadline.
"""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

from emulator.errors import LocalRunError

PROJECT_ROOT = Path(__file__).resolve().parents[1]
_PYTHON = re.compile(r"^python(3(\.\d+)?)?$")
_QUANTITY = re.compile(r"^(\d+(?:\.\d+)?)(Ki|Mi|Gi|Ti|k|K|M|G|T)?$")
_UNITS = {None: 1, "k": 10**3, "K": 10**3, "M": 10**6, "G": 10**9, "T": 10**12,
          "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40}
KILL_GRACE_S = 5.0


@dataclass
class Launch:
    argv: list[str]
    env: dict[str, str]          # the whole environment of the process
    cwd: Path
    log_path: Path
    timeout: float | None = None
    stop: list[str] | None = None  # run first when stopping (the process is only a client)


@dataclass
class Outcome:
    returncode: int
    seconds: float
    timed_out: bool = False


def subprocess_argv(command: list[str]) -> list[str]:
    """``python …`` runs in this interpreter; anything else runs as written."""
    if command and _PYTHON.match(command[0]):
        return [sys.executable, *command[1:]]
    return list(command)


def with_project_path(env: dict[str, str]) -> dict[str, str]:
    """Make ``python -m steps.<name>`` importable from any working directory."""
    paths = [str(PROJECT_ROOT)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    return {**env, "PYTHONPATH": os.pathsep.join(dict.fromkeys(paths))}


def quantity_bytes(text: str, where: str) -> int:
    """A Kubernetes quantity (``1Gi``, ``512M``) in bytes."""
    match = _QUANTITY.match(str(text).strip())
    if not match:
        raise LocalRunError(f"{where}: {text!r} is not a size (e.g. 1Gi)")
    return int(float(match.group(1)) * _UNITS[match.group(2)])


def _pump(stream, log_file, echo: TextIO | None) -> None:
    for chunk in iter(lambda: stream.read1(65536), b""):
        log_file.write(chunk)
        log_file.flush()
        if echo is not None:
            echo.write(chunk.decode("utf-8", errors="replace"))
            echo.flush()


def run(launch: Launch, echo: TextIO | None = None) -> Outcome:
    """Run to the end (or the timeout: SIGTERM, then SIGKILL, to the process group)."""
    launch.log_path.parent.mkdir(parents=True, exist_ok=True)
    start = time.monotonic()
    with open(launch.log_path, "ab") as log_file:
        try:
            process = subprocess.Popen(launch.argv, env=launch.env, cwd=launch.cwd,
                                       stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                       stderr=subprocess.STDOUT, start_new_session=True)
        except OSError as exc:
            raise LocalRunError(f"cannot start {launch.argv[0]}: {exc.strerror}") from None
        pump = threading.Thread(target=_pump, args=(process.stdout, log_file, echo),
                                daemon=True)
        pump.start()
        timed_out = False
        try:
            process.wait(launch.timeout)
        except subprocess.TimeoutExpired:
            timed_out = True
            _stop(process, launch.stop)
        except BaseException:
            _stop(process, launch.stop)
            raise
        finally:
            pump.join(10)
    return Outcome(container_exit_code(process.returncode), time.monotonic() - start,
                   timed_out)


def container_exit_code(returncode: int) -> int:
    """A process killed by signal N as a container reports it: 128 + N (Popen says -N). Argo
    v4.0.5 reported 143 for a pod stopped at its deadline (SIGTERM), and its retry
    expressions see that number (tests/test_cluster.py)."""
    return 128 - returncode if returncode < 0 else returncode


def _stop(process: subprocess.Popen, stop: list[str] | None = None) -> None:
    if stop:
        subprocess.run(stop, capture_output=True, timeout=60)
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(process.pid, sig)
        except ProcessLookupError:
            return
        try:
            process.wait(KILL_GRACE_S)
            return
        except subprocess.TimeoutExpired:
            continue
