"""15. Footprint: the memory each CPU step's pod must request (issue 47: requests measured).

The profiles give preprocess more CPUs than the test cluster's one (the base: 8), and the step
runs one worker process per CPU (``steps.preprocess.plan_workers``: ``--workers`` capped by
the CPUs it reads, ``UNET_CPUS`` here as a pod's quota would be). Each worker holds about two
full-size volumes, so the memory a pod must request grows with its CPUs, and the base's
figure must come from a measurement, not from the one-CPU pods of the cluster runs.

``steps.preprocess`` on full-size synthetic cases in Task01's layout (``Settings.shape``), at
1, 2, 4 and 8 workers, as a host process tree measured as ``run --local`` measures a step
(``emulator.executors.run``: the tree's anonymous memory, no file pages, sampled); then a line
fitted by least squares through the runs with a pool of workers (one worker works in the
step's own process), ``anonymous = base + per_worker × workers``. More workers than the
machine's cores only makes it slower; what each holds does not change with that.
"""
from __future__ import annotations

import os
import re
import shutil
import sys
from pathlib import Path

import numpy as np

from benchmarks.common import Row, Settings, raw_task
from emulator.executors import Launch, quantity_bytes, run as run_process
from steps import limits, params
from workflows.config import load_config

WORKERS = (1, 2, 4, 8)
MIB = 1 << 20
_USED = re.compile(r"with (\d+) worker\(s\)")
# A model of a few steps is no INT8 test: quantize's gate opened, which reads the same volumes.
OPEN_GATE = {"max_dice_drop": 100.0, "max_class_dice_drop": 100.0, "min_agreement": 0.0}


def step_run(step: str, args: list[str], cpus: int, log: Path) -> tuple[dict, str]:
    """``python -m steps.<step> ARGS`` given ``cpus`` CPUs, as a host process tree measured as
    ``run --local`` measures a step: its peak anonymous memory and RSS, seconds, and log."""
    env = {k: v for k, v in os.environ.items() if k not in (limits.CPUS_ENV, "OMP_NUM_THREADS")}
    # the pod's CPUs, all of them: not fewer because other work keeps the machine busy
    env.update({limits.CPUS_ENV: str(cpus), limits.ADAPT_ENV: "0"})
    log.parent.mkdir(parents=True, exist_ok=True)
    done = run_process(Launch(argv=[sys.executable, "-m", f"steps.{step}", *args], env=env,
                              cwd=Path(__file__).resolve().parents[1], log_path=log))
    text = log.read_text(errors="replace")
    if done.returncode or done.max_anon_bytes is None:
        raise RuntimeError(f"steps.{step}: exit {done.returncode}: {text[-1500:]}")
    return {"cpus": cpus, "anon_bytes": done.max_anon_bytes, "rss_bytes": done.max_rss_bytes,
            "seconds": done.seconds}, text


def preprocess_anon(raw: Path, out: Path, workers: int, patch: tuple[int, int]) -> dict:
    """One run of ``steps.preprocess`` with ``workers`` CPUs and workers (its ``dataset`` left
    in ``out``): its peak anonymous memory and seconds."""
    shutil.rmtree(out, ignore_errors=True)
    run, log = step_run("preprocess", ["--raw", str(raw), "--dataset", str(out), "--workers",
                                       str(workers), "--patch-size", "x".join(map(str, patch))],
                        workers, out.parent / "log.txt")
    used = _USED.findall(log)
    if used[-1:] != [str(workers)]:
        raise RuntimeError(f"steps.preprocess --workers {workers} used {used[-1:]}: {log[-1500:]}")
    return {"workers": workers, **run}


def base_args(step: str, **changed) -> list[str]:
    """The step's parameter flags with the base config's values, ``changed`` replacing some."""
    section = getattr(load_config(), step)
    out: list[str] = []
    for p in params.STEPS[step]:
        out += [p.flag, p.text(changed.get(p.name, getattr(section, p.name)))]
    return out


def exported_fold(settings: Settings, dataset: Path, fold: int) -> Path:
    """``fold``'s model, trained for two CPU steps with the base's network, then converted
    with the base's parameters (the run measured for fold 0): its ``exported`` folder."""
    work = settings.workdir / "footprint" / f"fold-{fold}"
    shutil.rmtree(work, ignore_errors=True)
    step_run("train", ["--dataset", str(dataset), "--model", str(work / "model"), *base_args(
        "train", device="cpu", devices=1, precision="fp32", compile_cache=False, num_workers=0,
        batch_size=4, val_batch_size=16, min_epochs=1, max_epochs=1, patience=0,
        steps_per_epoch=2, base_filters=settings.base_filters, levels=settings.levels,
        fold=fold)], 1, work / "train.txt")
    if fold:
        step_run("convert", ["--model", str(work / "model"), "--dataset", str(dataset),
                             "--exported", str(work / "exported"), *base_args("convert")],
                 1, work / "convert.txt")
    return work / "exported"


def downstream(settings: Settings, dataset: Path) -> list[dict]:
    """Convert, quantize and evaluate as the base runs them, each with the base's CPUs, on
    fold 0's model; then the folds' ensemble (which runs with convert's resources) and
    quantize on it, as the folds' DAG runs them: one measured run each."""
    work = settings.workdir / "footprint"
    exported = exported_fold(settings, dataset, 0)
    model = exported.parent / "model"
    others = [exported_fold(settings, dataset, k) for k in range(1, params.N_FOLDS)]
    for out in (work / "quantized", work / "evaluation", work / "ensemble",
                work / "quantized-ensemble"):
        shutil.rmtree(out, ignore_errors=True)
    small = {"calibration_slices": 8} if settings.smoke else {}
    gate = {**OPEN_GATE, **small}
    ensemble = work / "ensemble"
    with_others = [a for e in others for a in ("--with-exported", str(e))]
    runs = [  # (what, on whose model, the config's resources it runs with, argv)
        ("convert", "fold 0", "convert",
         ["--model", str(model), "--dataset", str(dataset), "--exported", str(exported),
          *base_args("convert")]),
        ("quantize", "fold 0", "quantize",
         ["--exported", str(exported), "--dataset", str(dataset), "--quantized",
          str(work / "quantized"), *base_args("quantize", **gate)]),
        ("evaluate", "fold 0", "evaluate",
         ["--exported", str(exported), "--dataset", str(dataset), "--evaluation",
          str(work / "evaluation"), *base_args("evaluate")]),
        ("ensemble", "ensemble", "convert",
         ["--exported", str(exported), *with_others, "--dataset", str(dataset), "--ensemble",
          str(ensemble)]),
        ("quantize", "ensemble", "quantize",
         ["--exported", str(ensemble), "--dataset", str(dataset), "--quantized",
          str(work / "quantized-ensemble"), *base_args("quantize", **gate)])]
    resources = load_config().resources
    out = []
    for i, (step, model_of, section, argv) in enumerate(runs):
        given = getattr(resources, section)
        measured, _ = step_run(step, argv, int(given.cpu), work / f"{i}-{step}.txt")
        out.append({"step": step, "model": model_of, "resources": section,
                    "request_bytes": quantity_bytes(given.memory, section), **measured})
    return out


def fit_line(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """(intercept, slope) of the least-squares line through the points."""
    slope, intercept = np.polyfit(np.asarray(xs, float), np.asarray(ys, float), 1)
    return float(intercept), float(slope)


def run(settings: Settings) -> dict:
    workers = WORKERS[:3] if settings.smoke else WORKERS
    cases = 2 * max(workers)          # every worker gets two cases
    raw = raw_task(settings, cases)
    dataset = settings.workdir / "footprint" / "dataset"
    runs = [preprocess_anon(raw, dataset, n, settings.patch) for n in workers]
    after = downstream(settings, dataset)
    alone, pooled = runs[0], runs[1:]          # one worker works in the step's own process
    base, per_worker = fit_line([r["workers"] for r in pooled],
                                [r["anon_bytes"] for r in pooled])
    shape = "x".join(map(str, settings.shape))
    rows = [Row("footprint", f"preprocess anonymous memory, {r['workers']} workers, {cases} "
                             f"cases of {shape}", "MiB", r["anon_bytes"] / MIB,
                alone["anon_bytes"] / MIB, "one worker (in the step's process)")
            for r in pooled]
    rows.append(Row("footprint", "preprocess anonymous memory per worker process (fitted on "
                                 f"{', '.join(str(r['workers']) for r in pooled)} workers)",
                    "MiB", per_worker / MIB, alone["anon_bytes"] / MIB,
                    "one worker (in the step's process)"))
    rows += [Row("footprint", f"{r['step']} anonymous memory ({r['model']}'s model), the "
                              f"base's parameters and {r['cpus']} CPUs, {cases} cases of "
                              f"{shape}", "MiB", r["anon_bytes"] / MIB, r["request_bytes"] / MIB,
                 f"the base's resources.{r['resources']}.memory", "<= 0.67") for r in after]
    return {"rows": rows, "details": {"cases": cases, "shape": list(settings.shape),
                                      "runs": runs, "fit": {"base_bytes": base,
                                                            "per_worker_bytes": per_worker},
                                      "downstream": after}}
