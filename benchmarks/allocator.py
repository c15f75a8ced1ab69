"""8. The pipeline's step environment (``resources.extra_env``), per step: ours with it
against ours without it, in interleaved A/B rounds.

Each round runs both sides in fresh processes (glibc reads ``GLIBC_TUNABLES`` at start), the
side that goes first alternating from round to round, so drift in machine load hits both
alike. A setting earns its place in a step only if it wins in every round: the row's
verdict says ``keep`` or ``drop``, and the per-round ratios are in the JSON.
"""
from __future__ import annotations

import os
import shutil
from contextlib import contextmanager
from typing import Callable

import numpy as np

from benchmarks import loader, preprocess, trainstep
from benchmarks.common import Row, Settings, case_files, dataset_dir, in_child, raw_task, step_env


@contextmanager
def _without(names):
    """The driver's own environment without ``names``, so the 'without' side is clean."""
    saved = {name: os.environ.pop(name) for name in names if name in os.environ}
    try:
        yield
    finally:
        os.environ.update(saved)


def _measures(settings: Settings) -> dict[str, tuple[str, Callable[[dict], float]]]:
    """Step name → (unit, rate of ours with the given extra env; higher is better)."""
    cases = case_files(raw_task(settings, settings.cases))
    out = settings.workdir / "allocator-pre"
    ds = dataset_dir(settings, "default")
    threads = len(os.sched_getaffinity(0))
    train_args = (settings.patch, settings.batch, settings.train_steps, settings.base_filters,
                  settings.levels)

    def pre(env: dict) -> float:
        shutil.rmtree(out, ignore_errors=True)
        out.mkdir(parents=True)
        times, _ = in_child(preprocess.run_ours, cases, out, settings.patch, "default",
                            threads=1, env=env)
        return 1 / float(np.median([wall for wall, _cpu in times]))

    return {
        "preprocess": ("case/s per core", pre),
        "loader": ("slice/s per core", lambda env: in_child(
            loader.run_ours, ds, settings.patch, settings.batch, settings.loader_batches,
            threads=1, env=env)[0]),
        "train": ("img/s end to end", lambda env: in_child(
            trainstep.run_ours, ds, *train_args, threads=threads, env=env)[0][0]),
    }


def run(settings: Settings) -> dict:
    env = step_env()
    if not env:
        return {"rows": [], "details": {"why": "the pipeline sets no extra_env"}}
    rows, details = [], {"env": env, "rounds": settings.ab_rounds, "steps": {}}
    with _without(env):
        for step, (unit, measure) in _measures(settings).items():
            with_env, without = [], []
            for round_ in range(settings.ab_rounds):
                order = (True, False) if round_ % 2 == 0 else (False, True)
                for use in order:
                    (with_env if use else without).append(measure(env if use else {}))
            ratios = [a / b for a, b in zip(with_env, without)]
            keep = min(ratios) > 1.0
            rows.append(Row("allocator", f"{step}: {unit}, with / without the env", unit,
                            float(np.median(with_env)), float(np.median(without)),
                            f"{step} without {', '.join(env)}"))
            rows[-1].verdict = "keep (wins every round)" if keep else "drop"
            details["steps"][step] = {"with": with_env, "without": without,
                                      "ratio_by_round": ratios, "keep": keep}
    shutil.rmtree(settings.workdir / "allocator-pre", ignore_errors=True)
    return {"rows": rows, "details": details}
