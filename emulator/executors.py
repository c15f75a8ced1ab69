"""Running one process to its end or its deadline, with its output in the pod's log.

The ``subprocess`` executor runs the container's ``command`` + ``args`` in this Python
environment (``python`` → this interpreter, the project on ``PYTHONPATH``), in the node
directory; container paths were already remapped under it by the runner. The container
executors (:mod:`emulator.pods`) run ``podman start --attach`` through the same
:func:`run`, with a ``stop`` command that kills the container at the deadline.
"""
from __future__ import annotations

import math
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
    """How a process ended. ``cpu_seconds``: its user + system time and that of the
    descendants it waited for (wait4(2)). ``max_rss_bytes``: its peak memory,
    ``max_anon_bytes`` the part of it that is not file pages (what a memory limit cannot take
    back), and
    ``max_disk_bytes`` the peak of what its working folder held (the pod's volume), sampled
    (see :class:`_Peaks`). All None when it was stopped, or when it was only a client of the
    work (a container engine's)."""
    returncode: int
    seconds: float
    timed_out: bool = False
    cpu_seconds: float | None = None
    max_rss_bytes: int | None = None
    max_anon_bytes: int | None = None
    max_disk_bytes: int | None = None


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
        timed_out, usage, peaks = False, None, _Peaks(process.pid, launch.cwd)
        try:
            usage = _wait(process, launch.timeout, peaks.sample)
        except subprocess.TimeoutExpired:
            timed_out = True
            _stop(process, launch.stop)
        except BaseException:
            _stop(process, launch.stop)
            raise
        finally:
            pump.join(10)
    outcome = Outcome(container_exit_code(process.returncode), time.monotonic() - start,
                      timed_out)
    if usage is not None:
        outcome.cpu_seconds = usage.ru_utime + usage.ru_stime
        peaks.sample_disk()                  # what it left there counts too
        outcome.max_rss_bytes, outcome.max_anon_bytes = peaks.memory, peaks.anon
        outcome.max_disk_bytes = peaks.disk
    return outcome


class _Peaks:
    """The peaks of a process tree, sampled at each poll.

    ``memory``: the largest of the process's own high-water mark (``VmHWM``) and the
    resident sets of it and its descendants summed (``VmRSS``), read from /proc. Not
    getrusage's ``ru_maxrss``: Linux starts a child's from its parent's, since exec keeps the
    high-water mark of the memory it replaces (fs/exec.c, exec_mmap:
    setmax_mm_hiwater_rss), so every step would weigh at least the runner. ``anon``: the
    largest sum of the tree's ``RssAnon`` (no file pages: a memory-mapped dataset it has
    read counts in RSS, and a cgroup's limit reclaims it).

    ``disk``: the blocks allocated under ``root``, its working folder, at most every
    DISK_SAMPLE_S (a walk of the tree; links not followed)."""

    DISK_SAMPLE_S = 1.0

    def __init__(self, pid: int, root: Path):
        self.pid, self.root = pid, root
        self.memory: int | None = None
        self.anon: int | None = None
        self.disk: int | None = None
        self._disk_at = -math.inf

    def sample(self) -> None:
        high = _status_kib(self.pid, "VmHWM")
        if high is None:                 # gone, or a zombie: its memory is released
            return
        pids = [self.pid, *_descendants(self.pid)]
        tree = sum(_status_kib(pid, "VmRSS") or 0 for pid in pids)
        anon = sum(_status_kib(pid, "RssAnon") or 0 for pid in pids)
        self.memory = max(self.memory or 0, high * 1024, tree * 1024)
        self.anon = max(self.anon or 0, anon * 1024)
        if time.monotonic() - self._disk_at >= self.DISK_SAMPLE_S:
            self.sample_disk()

    def sample_disk(self) -> None:
        self._disk_at = time.monotonic()
        self.disk = max(self.disk or 0, allocated_bytes(self.root))


def allocated_bytes(root: Path) -> int:
    """The bytes of disk the files under ``root`` take (st_blocks), not following links;
    files that vanish during the walk are skipped."""
    total, todo = 0, [root]
    while todo:
        try:
            entries = list(os.scandir(todo.pop()))
        except OSError:
            continue
        for entry in entries:
            try:
                if entry.is_dir(follow_symlinks=False):
                    todo.append(Path(entry.path))
                else:
                    total += entry.stat(follow_symlinks=False).st_blocks * 512
            except OSError:
                pass
    return total


def _status_kib(pid: int, field: str) -> int | None:
    try:
        with open(f"/proc/{pid}/status") as status:
            for line in status:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        pass
    return None


def _descendants(pid: int) -> list[int]:
    """Every live descendant of ``pid`` (/proc/<pid>/task/<tid>/children, Linux 3.5+)."""
    found, todo = [], [pid]
    while todo:
        parent = todo.pop()
        try:
            tasks = os.listdir(f"/proc/{parent}/task")
        except OSError:
            continue
        for tid in tasks:
            try:
                with open(f"/proc/{parent}/task/{tid}/children") as children:
                    kids = [int(k) for k in children.read().split()]
            except (OSError, ValueError):
                continue
            found += kids
            todo += kids
    return found


def _wait(process: subprocess.Popen, timeout: float | None, poll=lambda: None):
    """``process.wait(timeout)``, reaping with wait4(2) to keep the process's resource usage
    (returned), which Popen discards. Polls as Popen.wait does, at most every 50 ms, and
    calls ``poll`` each time."""
    deadline = None if timeout is None else time.monotonic() + timeout
    delay = 0.0005
    while True:
        poll()
        pid, status, usage = os.wait4(process.pid, os.WNOHANG)
        if pid:
            process.returncode = os.waitstatus_to_exitcode(status)
            return usage
        if deadline is not None and time.monotonic() >= deadline:
            raise subprocess.TimeoutExpired(process.args, timeout)
        time.sleep(delay)
        delay = min(delay * 2, 0.05)


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
