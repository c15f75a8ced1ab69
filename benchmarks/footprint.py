"""15. Footprint: preprocess's memory as the CPUs it is given grow (issue 47: requests measured).

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
from emulator.executors import Launch, run as run_process
from steps import limits

WORKERS = (1, 2, 4, 8)
MIB = 1 << 20
_USED = re.compile(r"with (\d+) worker\(s\)")


def preprocess_anon(raw: Path, out: Path, workers: int, patch: tuple[int, int]) -> dict:
    """One run of ``steps.preprocess`` with ``workers`` CPUs and workers: its peak anonymous
    memory and seconds."""
    shutil.rmtree(out, ignore_errors=True)
    env = {k: v for k, v in os.environ.items() if k not in (limits.CPUS_ENV, "OMP_NUM_THREADS")}
    # the pod's CPUs, all of them: not fewer because other work keeps the machine busy
    env.update({limits.CPUS_ENV: str(workers), limits.ADAPT_ENV: "0"})
    done = run_process(Launch(
        argv=[sys.executable, "-m", "steps.preprocess", "--raw", str(raw), "--dataset",
              str(out), "--workers", str(workers), "--patch-size", "x".join(map(str, patch))],
        env=env, cwd=Path(__file__).resolve().parents[1], log_path=out.parent / "log.txt"))
    log = (out.parent / "log.txt").read_text(errors="replace")
    used = _USED.findall(log)
    if done.returncode or done.max_anon_bytes is None or used[-1:] != [str(workers)]:
        raise RuntimeError(f"steps.preprocess --workers {workers}: exit {done.returncode}, "
                           f"workers {used[-1:]}: {log[-1500:]}")
    shutil.rmtree(out, ignore_errors=True)
    return {"workers": workers, "anon_bytes": done.max_anon_bytes,
            "rss_bytes": done.max_rss_bytes, "seconds": done.seconds}


def fit_line(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """(intercept, slope) of the least-squares line through the points."""
    slope, intercept = np.polyfit(np.asarray(xs, float), np.asarray(ys, float), 1)
    return float(intercept), float(slope)


def run(settings: Settings) -> dict:
    workers = WORKERS[:3] if settings.smoke else WORKERS
    cases = 2 * max(workers)          # every worker gets two cases
    raw = raw_task(settings, cases)
    runs = [preprocess_anon(raw, settings.workdir / "footprint" / "dataset", n, settings.patch)
            for n in workers]
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
    return {"rows": rows, "details": {"cases": cases, "shape": list(settings.shape),
                                      "runs": runs, "fit": {"base_bytes": base,
                                                            "per_worker_bytes": per_worker}}}
