"""12. Where pods really run: train and preprocess on a CPU share smaller than the machine.

A step sizes its threads and workers from ``steps.limits.cpu_count`` (cgroup quota,
affinity mask, or ``UNET_CPUS``, which the templates set from the pod's CPU request).
Here each step runs confined to ``N`` CPUs, fewer than the machine's cores, in two
scenarios: alone, and beside a busy neighbour (one process spinning on the host for the
scenario's duration). The confinement, the first that works here:

- ``podman run --cpus=N`` in the CPU image, this checkout mounted over the image's code;
- a cgroup of this host with that CPU quota (root and a writable cpu controller);
- affinity to ``N`` CPUs (``taskset``; the count then comes from the mask).

"ours" is the step as shipped, with no override (it reads the quota). The sweep forces the
count with ``UNET_CPUS`` = 1, 2, ... up to twice the machine's cores: for train that is its
torch threads, for preprocess its workers times threads. One sweep point is what the steps
did before (the machine's cores). Every round runs each side once, the order reversed
every other round; medians. Train: one epoch of the ``local`` profile's network (the
step's own img/s). Preprocess: the step with the profile's ``--workers 2`` over full-size
synthetic cases (the step's own seconds).
"""
from __future__ import annotations

import contextlib
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Callable

import numpy as np

from benchmarks.common import Row, Settings, neighbours, raw_task, step_env
from benchmarks.precision import _dataset, _local_train_args
from steps import limits
from workflows.config import load_config

REPO = Path(__file__).resolve().parent.parent
OURS = "ours"
TRAIN_STEPS = 30
PREPROCESS_CASES = 8
_STEP_SECONDS = re.compile(r"preprocess: \d+ cases, .* ([0-9.]+) s with")
# A host folder of packages the image lacks for this checkout's code (pip install --target,
# for the image's Python), mounted read-only and put on PYTHONPATH after it; recorded.
IMAGE_SITE = "UNET_BENCH_IMAGE_SITE"


def _image() -> str:
    cpu = load_config(None, None, [], local=True).images.cpu
    return f"{cpu.repository}:{cpu.tag}"


def _podman_ready() -> bool:
    return bool(shutil.which("podman")) and subprocess.run(
        ["podman", "image", "exists", _image()], capture_output=True).returncode == 0


def _make_cgroup(cpus: int) -> Path | None:
    """A child of this process's cpu cgroup with a quota of ``cpus`` (v2 or v1); None
    where none can be made (not root, a read-only or delegated-away controller)."""
    for parent in limits.cgroup_dirs("cpu"):
        child = parent / f"unet-bench-{os.getpid()}"
        try:
            child.mkdir(exist_ok=True)
            if (child / "cpu.max").exists():
                (child / "cpu.max").write_text(f"{cpus * 100000} 100000")
            else:
                (child / "cpu.cfs_period_us").write_text("100000")
                (child / "cpu.cfs_quota_us").write_text(str(cpus * 100000))
            return child
        except OSError:
            with contextlib.suppress(OSError):
                child.rmdir()
    return None


class Confined:
    """Runs ``python -m steps.<name>`` on ``cpus`` CPUs: podman, a cgroup or affinity."""

    def __init__(self, cpus: int, mount: Path, workdir: Path, smoke: bool):
        """``mount``: the benchmark's scratch, which holds the inputs; ``workdir`` (in
        it): where the steps write."""
        self.cpus, self.mount, self.workdir, self.cgroup = cpus, mount, workdir, None
        if not smoke and _podman_ready():
            self.how = f"podman run --cpus={cpus} ({_image()})"
        else:
            self.cgroup = None if smoke else _make_cgroup(cpus)
            self.how = (f"cgroup CPU quota {cpus} ({self.cgroup})" if self.cgroup else
                        f"affinity to {cpus} CPU(s) (taskset)")

    def close(self) -> None:
        if self.cgroup is not None:
            with contextlib.suppress(OSError):
                self.cgroup.rmdir()

    def _enter(self) -> None:
        """In the child, before exec: join the cgroup, or narrow the affinity mask."""
        if self.cgroup is not None:
            (self.cgroup / "cgroup.procs").write_text(str(os.getpid()))
        else:
            os.sched_setaffinity(0, sorted(os.sched_getaffinity(0))[:self.cpus])

    def run(self, module: str, args: list[str], env: dict[str, str]) -> str:
        """The step's stderr; a failure raises RuntimeError with its last lines."""
        if self.how.startswith("podman"):
            site = os.environ.get(IMAGE_SITE)
            paths = {"PYTHONPATH": "/src:/site" if site else "/src", "MPLCONFIGDIR": "/tmp"}
            flags = [f for k, v in {**env, **paths}.items() for f in ("-e", f"{k}={v}")]
            mounts = ["-v", f"{REPO}:/src:ro", "-v", f"{self.mount}:{self.mount}"] + \
                (["-v", f"{site}:/site:ro"] if site else [])
            cmd = ["podman", "run", "--rm", f"--cpus={self.cpus}", "--network=none", *mounts,
                   "-w", "/src", *flags, _image(), "python", "-m", module, *args]
            done = subprocess.run(cmd, capture_output=True, text=True)
        else:
            clean = {k: v for k, v in os.environ.items()
                     if k not in (limits.CPUS_ENV, "OMP_NUM_THREADS")}
            done = subprocess.run([sys.executable, "-m", module, *args], cwd=REPO,
                                  capture_output=True, text=True, env={**clean, **env},
                                  preexec_fn=self._enter)
        if done.returncode:
            raise RuntimeError(f"{module} under {self.how}: {done.stderr[-1500:]}")
        return done.stderr


def _fresh(path: Path) -> Path:
    """An absent ``path`` under a parent the image's uid can write to."""
    shutil.rmtree(path, ignore_errors=True)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.parent.chmod(0o777)
    return path


def train_rate(box: Confined, dataset: Path, env: dict[str, str], tag: str,
               smoke: bool) -> float:
    model = _fresh(box.workdir / "models" / tag)
    args = _local_train_args() + ["--max-epochs", "1", "--steps-per-epoch",
                                  "2" if smoke else str(TRAIN_STEPS), "--patience", "0"]
    box.run("steps.train", ["--dataset", str(dataset), "--model", str(model), *args], env)
    return float((model / "argo-outputs" / "img_per_s").read_text())


def preprocess_rate(box: Confined, raw: Path, env: dict[str, str], tag: str,
                    settings: Settings) -> float:
    out = _fresh(box.workdir / "datasets" / tag)
    stderr = box.run("steps.preprocess", ["--raw", str(raw), "--dataset", str(out),
                                          "--workers", "2", "--patch-size",
                                          "x".join(map(str, settings.patch))], env)
    cases = len(list((raw / "Task01_BrainTumour" / "imagesTr").glob("*.nii.gz")))
    seconds = float(_STEP_SECONDS.search(stderr).group(1))
    shutil.rmtree(out, ignore_errors=True)
    return cases / max(seconds, 0.05)


def sweep(measure: Callable[[dict[str, str], str], float], counts: list[int],
          rounds: int) -> dict[str, list[float]]:
    """Rates of ours (no override) and of each forced count, interleaved over rounds."""
    sides = [OURS] + [str(n) for n in counts]
    rates: dict[str, list[float]] = {side: [] for side in sides}
    for round_ in range(rounds):
        for side in (sides if round_ % 2 == 0 else sides[::-1]):
            env = step_env() | ({} if side == OURS else {limits.CPUS_ENV: side})
            rates[side].append(measure(env, f"{side}-{round_}"))
    return rates


def _rows(step: str, unit: str, where: str, rates: dict[str, list[float]],
          before: str, before_name: str) -> list[Row]:
    median = {side: float(np.median(values)) for side, values in rates.items()}
    best = max((side for side in median if side != OURS), key=median.get)
    return [Row("cpu share", f"{step} {where}: ours vs the sweep's best (UNET_CPUS={best})",
                unit, median[OURS], median[best], f"best thread count of the sweep ({best})",
                ">= 0.9"),
            Row("cpu share", f"{step} {where}: ours vs before ({before_name})",
                unit, median[OURS], median[before], f"UNET_CPUS={before}: {before_name}")]


def run(settings: Settings) -> dict:
    cores = os.cpu_count() or 1
    cpus = max(1, cores // 2)
    counts = sorted({1, cpus, cores, 2 * cores})
    rounds = 1 if settings.smoke else 3
    workdir = settings.workdir / "quota"
    workdir.mkdir(parents=True, exist_ok=True)
    for directory in (settings.workdir, workdir):   # the image's uid reads and writes here
        directory.chmod(0o777 if directory == workdir else 0o755)
    dataset = _dataset(settings)
    raw = raw_task(settings, 2 if settings.smoke else PREPROCESS_CASES)
    box = Confined(cpus, settings.workdir, workdir, settings.smoke)
    rows, details = [], {"confinement": box.how, "image_site": os.environ.get(IMAGE_SITE),
                         "cpus": cpus, "cores": cores,
                         "counts": counts, "rounds": rounds, "scenarios": {}}
    try:
        for busy in ([False] if settings.smoke else [False, True]):
            where = f"on {cpus} of {cores} CPUs" + (" beside a busy neighbour" if busy else "")
            load_start = list(os.getloadavg())
            with neighbours(1 if busy else 0):
                train = sweep(lambda env, tag: train_rate(box, dataset, env, f"t-{busy}-{tag}",
                                                          settings.smoke), counts, rounds)
                pre = sweep(lambda env, tag: preprocess_rate(box, raw, env, f"p-{busy}-{tag}",
                                                             settings), counts, rounds)
            rows += _rows("train img/s", "img/s", where, train, str(cores),
                          f"{cores} threads, the machine's cores")
            rows += _rows("preprocess cases/s", "case/s", where, pre, str(2 * cores),
                          f"2 workers x {cores} threads")
            details["scenarios"][where] = {"train_img_per_s": train,
                                           "preprocess_cases_per_s": pre,
                                           "load_average": [load_start, list(os.getloadavg())]}
    finally:
        box.close()
        shutil.rmtree(workdir, ignore_errors=True)
    return {"rows": rows, "details": details}
