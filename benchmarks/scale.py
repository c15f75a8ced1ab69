"""14. Scale: the whole DAG of ``run --local`` as the data grows (issue 47).

At each size (cases in all, split as Task01's 484 training : 266 test), the synthetic Task01
tar (:func:`steps.synthetic.cached_tar`, made once per size and kept) is served over HTTP with
Range support (:mod:`benchmarks.fileserver`), and download → preprocess → train → convert →
quantize runs on the embedded S3 with train bounded by steps: the point is data, not learning,
so quantize's gate is opened too. Per step it records

- the step process's wall and CPU time, its peak RSS and the peak disk of its pod's folder
  (inputs as Argo's init container would place them, and outputs; ``emulator.executors``);
- the node's time around it (artifact transfers and manifest checks, as Argo's init and wait
  containers would spend it);
- bytes written to S3 (its output artifacts' objects) and read from it (its inputs');

and per run the run's wall time, the bytes the run directory still holds afterwards, and the
tar's size and md5. Then, from the smallest size to the largest, each step's log-log growth
slope of wall time and S3 bytes (target at most 1.1: at most linear), its peak anonymous
memory ratio (target at most 1.25) and its peak-RSS ratio (reported: RSS counts the pages of
memory-mapped files it has read, which the kernel takes back under a pod's limit); at the
largest size each step's peak disk against the larger of its input and output artifacts
(target at most 2: no extra full copy); and the tar's generation with one worker process
per CPU against one. Sizes: ``UNET_BENCH_SCALE`` (cases, comma-separated, each at least 5;
default 30,120,750; anything else refused by name); the tars' generation is left out of
every time. ``UNET_SCALE_DROP_TAR=N`` deletes the tar of each size of at least N cases once
the download step has it.
"""
from __future__ import annotations

import math
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.common import Row, Settings
from benchmarks.fileserver import FileServer
from emulator.results import RunResult
from emulator.runner import run_workflow
from steps import bykey, storage, synthetic
from workflows.config import load_config
from workflows.s3server import SeaweedServer
from workflows.unet import build

SIZES_ENV = "UNET_BENCH_SCALE"
DROP_TAR_ENV = "UNET_SCALE_DROP_TAR"
MIN_CASES = 5          # the training cases that the 5-fold split needs (split)
STEPS = ("download", "preprocess", "train", "convert", "quantize")
TAR = f"{synthetic.TASK}.tar"
# Train bounded by steps; the gate opened (a model of 50 steps is no INT8 test).
OVERRIDES = ["pipeline.stages=[download,preprocess,train,convert,quantize]",
             "train.max_epochs=1", "train.min_epochs=1", "train.patience=0",
             "quantize.max_dice_drop=100", "quantize.max_class_dice_drop=100",
             "quantize.min_agreement=0"]
FULL = ["train.steps_per_epoch=50"]
SMOKE = ["preprocess.patch_size=32x32", "preprocess.workers=1", "train.steps_per_epoch=1",
         "train.batch_size=4", "train.val_batch_size=8", "convert.parity_slices=32",
         "quantize.calibration_slices=8"]


def env_sizes(default: list[int]) -> list[int]:
    """The sizes to run, in cases: ``UNET_BENCH_SCALE``'s comma-separated whole numbers, each
    at least ``MIN_CASES``, sorted and distinct; ``default`` where it is unset or blank."""
    raw = os.environ.get(SIZES_ENV, "")
    if not raw.strip():
        return default
    parts = [part.strip() for part in raw.split(",")]
    if not all(part.isdigit() and int(part) >= MIN_CASES for part in parts):
        raise ValueError(f"{SIZES_ENV}={raw!r}: expected cases as whole numbers, each at least "
                         f"{MIN_CASES}, separated by commas")
    return sorted({int(part) for part in parts})


def sizes(settings: Settings) -> list[int]:
    return env_sizes([8, 12] if settings.smoke else [30, 120, 750])


def drops_tar(total: int) -> bool:
    """Whether a run of ``total`` cases deletes its served tar from the cache once the download
    step has it (``UNET_SCALE_DROP_TAR=N``: at N cases or more; a user's node never holds the
    tar, and at Task01's size this machine kind's disk does not hold it beside the run)."""
    first = int(os.environ.get(DROP_TAR_ENV) or 0)
    return 0 < first <= total


def split(total: int) -> tuple[int, int]:
    """(training, test) cases of ``total`` in Task01's proportion; at least the 5 training
    cases that the 5-fold split needs."""
    train = max(MIN_CASES, round(total * synthetic.TRAINING_CASES
                                 / (synthetic.TRAINING_CASES + synthetic.TEST_CASES)))
    return train, max(total - train, 0)


def _disk_bytes(root) -> int:
    return sum(f.stat().st_size for f in root.rglob("*") if f.is_file()) if root.exists() else 0


def _artifact_bytes(objects: dict[str, tuple[int, str]], ref) -> int:
    if ref.kind == "file":
        return objects.get(ref.key, (0, ""))[0]
    prefix = ref.key.rstrip("/") + "/"
    return sum(size for key, (size, _) in objects.items() if key.startswith(prefix))


def inputs_of(workflow: dict) -> dict[str, list[tuple[str, str]]]:
    """Task → the (task, artifact) pairs Argo copies into its pod, from its ``from``
    references (what a step reads by key it counts itself: ``steps.bykey.fetched_bytes``)."""
    dag = next(t["dag"] for t in workflow["spec"]["templates"] if "dag" in t)
    taken = {}
    for task in dag["tasks"]:
        refs = (a.get("from", "") for a in
                (task.get("arguments") or {}).get("artifacts") or [])
        taken[task["name"]] = [tuple(r.strip("{}").split(".")[1:5:3]) for r in refs if r]
    return taken


def run_size(settings: Settings, total: int) -> dict:
    train, test = split(total)
    tar, md5 = synthetic.cached_tar(train, test, settings.shape, progress=True)
    work = settings.workdir / f"scale-{total}"
    shutil.rmtree(work, ignore_errors=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    tar_bytes, drop = tar.stat().st_size, drops_tar(total)

    def log(line: str) -> None:
        if drop and line.startswith("download: Succeeded"):
            shutil.rmtree(tar.parent)             # the tar and its md5 record

    with FileServer({f"/{TAR}": tar}) as files:
        overrides = [f"download.source={files.url('/' + TAR)}", f"download.md5={md5}",
                     *OVERRIDES, *(SMOKE if settings.smoke else FULL)]
        config = load_config(None, None, overrides, local=True)
        workflow = build(config, "workflow").to_dict()
        with SeaweedServer(work / "s3", buckets=[config.storage.bucket]) as s3:
            start = time.monotonic()
            result = run_workflow(workflow, run_dir=work / "run", env={**env, **s3.env()},
                                  output_dir=work / "outputs", bucket=config.storage.bucket,
                                  log=log, echo=None)
            wall = time.monotonic() - start
            if not result.succeeded:
                raise RuntimeError(f"{total} cases: run --local failed: {result.message}")
            objects = storage.list_objects(f"s3://{config.storage.bucket}/", client=s3.client())
        served = files.bytes_sent
    point = _point(result, workflow, objects)
    point.update(cases=total, training=train, test=test, tar_bytes=tar_bytes,
                 tar_md5=md5, tar_dropped=drop, tar_bytes_served=served, wall_s=wall,
                 s3_bytes=sum(size for size, _ in objects.values()),
                 left_in_run_dir_bytes=_disk_bytes(work / "run"), overrides=overrides)
    shutil.rmtree(work, ignore_errors=True)
    return point


def _point(result: RunResult, workflow: dict, objects: dict) -> dict:
    written = {n.task: {name: _artifact_bytes(objects, ref) for name, ref in n.artifacts.items()}
               for n in result.nodes}
    steps = {}
    for node in result.nodes:
        log = Path(node.log_path).read_text(errors="replace")
        steps[node.task] = {"wall_s": node.step_seconds, "node_s": node.seconds,
                            "around_s": node.seconds - node.step_seconds,
                            "cpu_s": node.cpu_seconds, "peak_rss_bytes": node.max_rss_bytes,
                            "peak_anon_bytes": node.max_anon_bytes,
                            "peak_disk_bytes": node.max_disk_bytes,
                            **s3_traffic(log, written, node.task, workflow)}
    return {"steps": steps}


def s3_traffic(log: str, written: dict[str, dict[str, int]], task: str,
               workflow: dict) -> dict:
    """What step ``task`` moved through S3: its output artifacts' bytes (``written``: task ->
    artifact -> bytes in the bucket), its inputs' as copied plus what its log says it fetched
    by key, what it saved by key itself, and the seconds it says it waited for its fetches."""
    by_key = sum(bykey.fetched_bytes(log).values())
    return {"s3_written_bytes": sum(written[task].values()),
            "s3_read_bytes": sum(written[t][a] for t, a in inputs_of(workflow)[task]) + by_key,
            "s3_read_by_key_bytes": by_key,
            "s3_saved_by_key_bytes": sum(bykey.saved_bytes(log).values()),
            "fetch_in_main_s": bykey.fetch_seconds(log)}


def slope(x0: float, y0: float, x1: float, y1: float) -> float:
    """Growth exponent of y in x between two points (log-log): 1 is linear."""
    if min(x0, y0, x1, y1) <= 0:
        return float("nan")
    return math.log(y1 / y0) / math.log(x1 / x0)


def fitted(xs: list[float], ys: list[float]) -> float:
    """Growth exponent of y in x fitted on every point (least squares in log-log; with two
    points, :func:`slope`): 1 is linear."""
    if len(xs) < 2 or min(*xs, *ys) <= 0:
        return float("nan")
    lx, ly = [math.log(x) for x in xs], [math.log(y) for y in ys]
    mx, my = statistics.fmean(lx), statistics.fmean(ly)
    return (sum((x - mx) * (y - my) for x, y in zip(lx, ly))
            / sum((x - mx) ** 2 for x in lx))


def generation(settings: Settings, cases: int = 8, rounds: int = 3) -> tuple[Row, dict]:
    """``python -m steps.synthetic`` as a user runs it: by default (one worker process per CPU
    it is given) against ``--workers 1``, interleaved (the order reversed every other round);
    medians of cases per second, the CLI's start included on both sides. Each run is a
    process of its own: spawned workers import the main module of the process that starts
    them, which for this benchmark's process means torch (two workers then made 8 full-size
    cases at 0.88x one process's rate, where the CLI's made them 1.18-1.21x faster)."""
    out = settings.workdir / "generation.tar"
    flags = {"ours": [], "baseline": ["--workers", "1"]}
    rates: dict[str, list[float]] = {side: [] for side in flags}
    workers: dict[str, int] = {}
    for round_ in range(rounds):
        for side in (("ours", "baseline") if round_ % 2 == 0 else ("baseline", "ours")):
            start = time.perf_counter()
            done = subprocess.run(
                [sys.executable, "-m", "steps.synthetic", "--cases", str(cases), "--test", "0",
                 "--shape", "x".join(map(str, settings.shape)), "--out", str(out),
                 "--no-progress", *flags[side]],
                capture_output=True, text=True, check=True, timeout=1800)
            rates[side].append(cases / (time.perf_counter() - start))
            workers[side] = int(synthetic.MADE.search(done.stderr)[2])
    out.unlink()
    row = Row("scale", f"synthetic tar: cases/s by default ({workers['ours']} worker "
              "processes)", "cases/s", statistics.median(rates["ours"]),
              statistics.median(rates["baseline"]), "one process",
              ">= 1.1" if workers["ours"] > 1 else "")
    return row, {"workers": workers, "cases": cases, "rates": rates}


def run(settings: Settings) -> dict:
    tar_row, tar_details = generation(settings)
    points = [run_size(settings, total) for total in sizes(settings)]
    first, last = points[0], points[-1]
    rows = [tar_row]
    cases = [point["cases"] for point in points]
    for step in STEPS:
        a, b = first["steps"][step], last["steps"][step]
        span = f"{', '.join(map(str, cases))} cases"
        for metric, key in (("wall time", "wall_s"), ("S3 bytes written", "s3_written_bytes"),
                            ("S3 bytes read", "s3_read_bytes")):
            if a[key] and b[key]:
                rows.append(Row("scale", f"{step} {metric}: log-log slope fitted on {span}",
                                "exponent", fitted(cases, [p["steps"][step][key]
                                                           for p in points]), 1.0,
                                "linear growth", "<= 1.1"))
        for metric, key, target in (("peak anonymous memory", "peak_anon_bytes", "<= 1.25"),
                                     ("peak RSS", "peak_rss_bytes", "")):
            rows.append(Row("scale", f"{step} {metric} at {last['cases']} vs {first['cases']} "
                            "cases", "MB", b[key] / 1e6, a[key] / 1e6,
                            f"same step at {first['cases']} cases", target))
        held = max(b["s3_read_bytes"], b["s3_written_bytes"])     # read: copied or by key
        rows.append(Row("scale", f"{step} peak disk at {last['cases']} cases vs its largest "
                        "artifact", "MB", b["peak_disk_bytes"] / 1e6, held / 1e6,
                        "the larger of what it read (copied or fetched by key) and wrote",
                        "<= 2"))
    around = sum(s["around_s"] for s in last["steps"].values())
    rows.append(Row("scale", f"time around the steps at {last['cases']} cases vs the run's wall",
                    "s", around, last["wall_s"], "the run's wall time", "<= 0.2"))
    return {"rows": rows, "details": {"points": points, "shape": list(settings.shape),
                                      "generation": tar_details,
                                      "note": "run --local (host processes, embedded "
                                              "SeaweedFS); tar generation not timed"}}
