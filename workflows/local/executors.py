"""Running one container template: as a subprocess here, or as ``docker run``.

- ``subprocess``: the container's ``command`` + ``args`` run in this Python environment
  (``python`` → this interpreter, the project on ``PYTHONPATH``), in the node directory;
  container paths were already remapped under it by the runner.
- ``docker``: the template's image with the node directory's folders bind-mounted at the
  container paths, ``command[0]`` as the entrypoint, every env variable passed by name
  (``-e NAME``) so that no value, secret or not, appears on the command line.
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
from pathlib import Path, PurePosixPath
from typing import TextIO

from workflows.local.errors import LocalRunError

PROJECT_ROOT = Path(__file__).resolve().parents[2]
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


def mount_points(paths: list[str], where: str) -> list[str]:
    """The folders to bind-mount so that every artifact path exists in the container.

    Each path's parent is mounted (an output may be a file or a folder), and a folder that
    lies inside another mounted folder is covered by it.
    """
    parents = sorted({str(PurePosixPath(p).parent) for p in paths})
    chosen: list[str] = []
    for parent in parents:
        if parent == "/":
            raise LocalRunError(f"{where}: artifact path directly under / cannot be mounted "
                                "by the docker executor; use a folder such as /data/<name>")
        if not any(parent == c or parent.startswith(c + "/") for c in chosen):
            chosen.append(parent)
    return chosen


def docker_argv(image: str, command: list[str], args: list[str], *, name: str,
                mounts: list[tuple[Path, str]], env_names: list[str],
                workdir: str | None = None, shm_bytes: int | None = None,
                gpus: int = 0, hpus: int = 0, network: str | None = "host",
                user: str | None = None, docker: str = "docker") -> list[str]:
    argv = [docker, "run", "--rm", "--name", name]
    if network:
        argv += ["--network", network]
    if user:
        argv += ["--user", user]
    if shm_bytes:
        argv += ["--shm-size", str(shm_bytes)]
    if gpus:
        argv += ["--gpus", str(gpus)]
    if hpus:  # Habana's documented docker flags for Gaudi
        argv += ["--runtime", "habana", "-e", "HABANA_VISIBLE_DEVICES=all",
                 "--cap-add", "sys_nice", "--ipc", "host"]
    for host, container in mounts:
        argv += ["-v", f"{host}:{container}"]
    for env_name in env_names:
        argv += ["-e", env_name]
    if workdir:
        argv += ["-w", workdir]
    if command:
        argv += ["--entrypoint", command[0], image, *command[1:], *args]
    else:
        argv += [image, *args]
    return argv


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
            _stop(process)
        except BaseException:
            _stop(process)
            raise
        finally:
            pump.join(10)
    return Outcome(process.returncode, time.monotonic() - start, timed_out)


def _stop(process: subprocess.Popen) -> None:
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
