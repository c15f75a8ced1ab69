"""7. Growth: preprocess time and peak memory at 2, 4 and 8 cases (one core). Time should
grow linearly and peak memory stay flat.

Each point runs the per-case function over n cases in a fresh process (peak RSS of that
process). The whole step needs at least 5 cases (the 5-fold split), so it is measured once
more at the largest count through its CLI (interpreter start and manifest hashing
included).
"""
from __future__ import annotations

import shutil

from benchmarks.common import (Row, Settings, case_files, in_child, raw_task, run_measured,
                               step_env)
from benchmarks.preprocess import run_ours


def run(settings: Settings) -> dict:
    points, env = [], step_env()
    patch = "x".join(map(str, settings.patch))
    for n in settings.growth:
        cases = case_files(raw_task(settings, n))
        out = settings.workdir / f"growth-{n}"
        shutil.rmtree(out, ignore_errors=True)
        out.mkdir(parents=True)
        times, rss = in_child(run_ours, cases, out, settings.patch, "default", threads=1,
                              env=env)
        seconds = sum(wall for wall, _cpu in times)
        points.append({"cases": n, "seconds": seconds, "seconds_per_case": seconds / n,
                       "peak_rss_bytes": rss})
        shutil.rmtree(out, ignore_errors=True)
    step = None
    if settings.growth[-1] >= 5:
        n = settings.growth[-1]
        out = settings.workdir / "growth-step"
        args = ["--raw", str(raw_task(settings, n)), "--dataset", str(out), "--workers", "1",
                "--patch-size", patch]
        wall, rss = run_measured("steps.preprocess", args, env)
        step = {"cases": n, "wall_seconds": wall, "peak_rss_bytes": rss,
                "command": " ".join(["-m", "steps.preprocess", *args])}
        shutil.rmtree(out, ignore_errors=True)
    first, last = points[0], points[-1]
    rows = [
        Row("growth", f"time per case at {last['cases']} vs {first['cases']} cases", "s/case",
            last["seconds_per_case"], first["seconds_per_case"],
            f"same code at {first['cases']} cases", "<= 1.1"),
        Row("growth", f"peak RSS at {last['cases']} vs {first['cases']} cases", "MB",
            last["peak_rss_bytes"] / 1e6, first["peak_rss_bytes"] / 1e6,
            f"same code at {first['cases']} cases", "<= 1.1"),
    ]
    return {"rows": rows, "details": {"points": points, "whole_step": step}}
