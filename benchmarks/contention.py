"""13. Fair under contention: each CPU step of the ``local`` profile idle, beside one busy
neighbour and beside two, as its share of its idle rate.

A neighbour is a process spinning on one core, in a cgroup of its own (as another container
or login session is; nice values do not reach across cgroups); the step runs in a sibling
cgroup, so the two get equal CPU weights. No CPU quota on either: the case where the step's
pool sizing (steps.limits.cpu_count) sees the whole machine. "ours" is the steps as shipped,
thread pools sized to the CPUs other work leaves free (``steps.limits.FairThreads``);
"before" is the same with ``UNET_ADAPT_THREADS=0`` (pools sized to the CPUs alone, as
before). Each round runs every (scenario, side) once, the order reversed every other round;
medians; the load average and /proc/pressure/cpu are recorded with each run, and so are the
step's CPU seconds and context switches (a spinning pool uses a CPU while it waits: CPU
seconds near the wall time and almost no voluntary switches).

Rates: train, the step's own img/s over one epoch of TRAIN_STEPS; preprocess, its cases/s
(its own timing line) over PREPROCESS_CASES full-size synthetic cases with the profile's 2
workers (the local profile's own cases take about 0.1 s, too short to time); convert and
quantize, 1 / the step's wall seconds (their parity and calibration runs are most of it).
"before" beside two neighbours is left out: beside one it already collapses.
"""
from __future__ import annotations

import contextlib
import json
import os
import re
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable, Iterator

import numpy as np

from benchmarks.common import Row, Settings, neighbours, raw_task, step_dataset, step_env
from benchmarks.precision import _local_train_args
from steps import limits
from workflows.config import load_config

REPO = Path(__file__).resolve().parent.parent
TRAIN_STEPS = 20
PREPROCESS_CASES = 4      # full-size synthetic cases: the local profile's are done in ~0.1 s
NEIGHBOURS = (0, 1, 2)
BEFORE_UP_TO = 1          # "before" beside 2 neighbours is left out: it collapses as beside 1
SIDES = {"ours": {}, "before": {limits.ADAPT_ENV: "0"}}
_PREPROCESS_SECONDS = re.compile(r"preprocess: \d+ cases, .* ([0-9.]+) s with")


def _cgroup(name: str) -> Path | None:
    """A child of this process's cpu cgroup (v1 or v2) with the default weight; None where
    none can be made (not root, no writable controller): both sides then share one."""
    for parent in limits.cgroup_dirs("cpu"):
        child = parent / f"unet-contention-{name}-{os.getpid()}"
        with contextlib.suppress(OSError):
            child.mkdir(exist_ok=True)
            return child
    return None


@contextlib.contextmanager
def sibling_cgroups() -> Iterator[tuple[Path | None, Path | None]]:
    """(the step's cgroup, the neighbours'), removed after the block."""
    made = (_cgroup("step"), _cgroup("neighbours"))
    try:
        yield made
    finally:
        for cgroup in made:
            if cgroup is not None:
                with contextlib.suppress(OSError):
                    cgroup.rmdir()


def crowd(count: int, cgroup: Path | None):
    """``count`` spinning neighbours in ``cgroup``, given half a second to start."""
    return neighbours(count, cgroup, settle_s=0.5)


def _pressure() -> str:
    with contextlib.suppress(OSError):
        return Path("/proc/pressure/cpu").read_text().splitlines()[0]
    return ""


def run_step(module: str, args: list[str], env: dict[str, str],
             cgroup: Path | None) -> tuple[str, dict]:
    """``python -m module args`` in ``cgroup`` (``module`` may also be a script's path): its
    stderr and what it cost: wall and CPU seconds, context switches."""
    def enter() -> None:
        if cgroup is not None:
            (cgroup / "cgroup.procs").write_text(str(os.getpid()))

    command = [module] if module.endswith(".py") else ["-m", module]
    start, before = time.monotonic(), resource.getrusage(resource.RUSAGE_CHILDREN)
    done = subprocess.run([sys.executable, *command, *args], cwd=REPO, env=env,
                          capture_output=True, text=True, preexec_fn=enter)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if done.returncode:
        raise RuntimeError(f"{module}: {done.stderr[-1500:]}")
    cost = {"wall_s": time.monotonic() - start,
            "cpu_s": (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime),
            "voluntary_switches": after.ru_nvcsw - before.ru_nvcsw,
            "involuntary_switches": after.ru_nivcsw - before.ru_nivcsw,
            "threads_lines": re.findall(r"^threads: .*$", done.stderr, re.M),
            "load_average": os.getloadavg()[0], "pressure": _pressure()}
    return done.stderr, cost


def _fresh(path: Path) -> Path:
    shutil.rmtree(path, ignore_errors=True)
    return path


class Inputs:
    """What the four steps read, made once by the real steps: the local profile's dataset,
    a model trained on it, its export, and a raw task for preprocess."""

    def __init__(self, settings: Settings):
        cfg = load_config(None, None, [], local=True)
        root = settings.workdir / "contention"
        source = ("synthetic://?cases=5&shape=32x32x16&seed=0" if settings.smoke
                  else cfg.download.source)
        self.patch = "32x32" if settings.smoke else cfg.preprocess.patch_size
        self.dataset = step_dataset(root / "data", source, self.patch)
        self.raw = raw_task(settings, 2 if settings.smoke else PREPROCESS_CASES)
        self.work = root / "work"
        self.steps = 2 if settings.smoke else TRAIN_STEPS
        self.model = self.work / "model-input"
        self.exported = self.work / "exported-input"
        env = step_env()
        if not (self.model / "MANIFEST.json").is_file():
            run_step("steps.train", self.train_args(self.model), env, None)
        if not (self.exported / "MANIFEST.json").is_file():
            run_step("steps.convert", self.convert_args(self.exported), env, None)

    def train_args(self, model: Path) -> list[str]:
        return ["--dataset", str(self.dataset), "--model", str(model), *_local_train_args(),
                "--max-epochs", "1", "--steps-per-epoch", str(self.steps), "--patience", "0"]

    def convert_args(self, out: Path) -> list[str]:
        return ["--model", str(self.model), "--dataset", str(self.dataset), "--exported",
                str(out)]


def measures(inputs: Inputs) -> dict[str, tuple[str, Callable[[dict, Path | None], tuple]]]:
    """step -> (unit, measure(env, cgroup) -> (rate, cost))."""
    work = inputs.work

    def train(env, cgroup):
        model = _fresh(work / "model")
        _, cost = run_step("steps.train", inputs.train_args(model), env, cgroup)
        return float((model / "argo-outputs" / "img_per_s").read_text()), cost

    def preprocess(env, cgroup):
        out = _fresh(work / "dataset")
        stderr, cost = run_step("steps.preprocess", ["--raw", str(inputs.raw), "--dataset",
                                                     str(out), "--workers", "2"], env, cgroup)
        cases = len(json.loads((out / "dataset.json").read_text())["cases"])
        return cases / max(float(_PREPROCESS_SECONDS.search(stderr).group(1)), 0.01), cost

    def convert(env, cgroup):
        _, cost = run_step("steps.convert", inputs.convert_args(_fresh(work / "exported")),
                           env, cgroup)
        return 1 / cost["wall_s"], cost

    def quantize(env, cgroup):
        _, cost = run_step("steps.quantize", ["--exported", str(inputs.exported), "--dataset",
                                              str(inputs.dataset), "--quantized",
                                              str(_fresh(work / "quantized")),
                                              "--calibration-slices",
                                              "16" if inputs.steps < 10 else "128",
                                              "--calibration-method", "percentile",
                                              "--max-dice-drop", "100",
                                              "--max-class-dice-drop", "100",
                                              "--min-agreement", "0"], env, cgroup)
        return 1 / cost["wall_s"], cost

    return {"train": ("img/s", train), "preprocess": ("case/s", preprocess),
            "convert": ("1/s", convert), "quantize": ("1/s", quantize)}


def local_run_seconds(settings: Settings, env: dict[str, str], cgroup: Path | None,
                      tag: str) -> tuple[float, dict]:
    """The README's main command, ``run --local`` (the whole DAG, its S3 server included),
    in ``cgroup``: its wall seconds and cost."""
    root = settings.workdir / "contention" / "run-local" / tag
    shutil.rmtree(root, ignore_errors=True)
    args = ["--local", "--run-dir", str(root / "run"), "--output-dir", str(root / "outputs")]
    if settings.smoke:
        args += ["-p", "train.max_epochs=1", "-p", "train.steps_per_epoch=2"]
    _, cost = run_step("workflows/unet.py", ["run", *args], env, cgroup)
    shutil.rmtree(root, ignore_errors=True)
    return cost["wall_s"], cost


def run_local_part(settings: Settings, rounds: int) -> dict:
    """``run --local`` idle and beside one busy neighbour, interleaved rounds (target: at
    most 2.5 times its idle time)."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("OMP_NUM_THREADS", limits.CPUS_ENV, limits.ADAPT_ENV)}
    runs = []
    with sibling_cgroups() as (step_cg, crowd_cg):
        for round_ in range(rounds):
            for count in ((0, 1) if round_ % 2 == 0 else (1, 0)):
                with crowd(count, crowd_cg):
                    _, cost = local_run_seconds(settings, env, step_cg, f"{count}-{round_}")
                runs.append({"round": round_, "neighbours": count, **cost})
    idle, busy = (float(np.median([r["wall_s"] for r in runs if r["neighbours"] == n]))
                  for n in (0, 1))
    return {"rows": [Row("contention", "run --local: seconds beside 1 busy neighbour vs idle",
                         "s", busy, idle, "run --local idle", "<= 2.5")],
            "details": {"run_local": runs}}


def run(settings: Settings) -> dict:
    """The steps' rounds; ``UNET_CONTENTION_PART=run-local`` measures ``run --local``
    instead (a separate call: about 2 minutes a round beside the neighbour)."""
    if os.environ.get("UNET_CONTENTION_PART") == "run-local":
        return run_local_part(settings, 1 if settings.smoke else 2)
    inputs = Inputs(settings)
    rounds = 1 if settings.smoke else 3
    counts = (0, 1) if settings.smoke else NEIGHBOURS
    # --smoke leaves out "before" beside a neighbour: the collapse it shows runs at about
    # 1 % of the idle rate (most of the smoke's time), on the code that "ours" runs.
    before_up_to = 0 if settings.smoke else BEFORE_UP_TO
    steps = measures(inputs)
    env = step_env()     # the pipeline's step environment alone, as a pod gets it
    runs: list[dict] = []
    with sibling_cgroups() as (step_cg, crowd_cg):
        for round_ in range(rounds):
            for count in (counts if round_ % 2 == 0 else counts[::-1]):
                with crowd(count, crowd_cg):
                    for side in (list(SIDES) if round_ % 2 == 0 else list(SIDES)[::-1]):
                        if side == "before" and count > before_up_to:
                            continue
                        for step, (unit, measure) in steps.items():
                            rate, cost = measure({**env, **SIDES[side]}, step_cg)
                            runs.append({"round": round_, "neighbours": count, "side": side,
                                         "step": step, "unit": unit, "rate": rate, **cost})
    return {"rows": rows(runs, counts, before_up_to),
            "details": {"runs": runs, "rounds": rounds, "train_steps": inputs.steps,
                        "cpus": len(os.sched_getaffinity(0)),
                        "cgroups": str(step_cg) if step_cg else "none (one cgroup)"}}


def rows(runs: list[dict], counts: tuple[int, ...], before_up_to: int) -> list[Row]:
    """Per step: ours beside n neighbours / ours idle (targets 0.45 and 0.3), the same for
    before, and ours idle / before idle (target: within 5 %)."""
    def median(step, side, count):
        return float(np.median([r["rate"] for r in runs if (r["step"], r["side"],
                                                            r["neighbours"]) == (step, side, count)]))
    out = []
    for step in dict.fromkeys(r["step"] for r in runs):
        unit = next(r["unit"] for r in runs if r["step"] == step)
        for side in SIDES:
            idle = median(step, side, 0)
            for count in counts[1:]:
                if side == "before" and count > before_up_to:
                    continue
                out.append(Row("contention", f"{step} {side}: beside {count} busy "
                                              f"neighbour(s) vs idle", unit,
                               median(step, side, count), idle, f"{step} {side} idle",
                               (">= 0.45" if count == 1 else ">= 0.3") if side == "ours" else ""))
        out.append(Row("contention", f"{step}: ours idle vs before idle", unit,
                       median(step, "ours", 0), median(step, "before", 0),
                       f"{step} before idle ({limits.ADAPT_ENV}=0)", ">= 0.95"))
    return out
