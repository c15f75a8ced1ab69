"""The benchmarks still execute (``--smoke``: tiny shapes). Speed is never asserted here."""
from __future__ import annotations

import json
import math
import re
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.common import Row
from benchmarks.scale import MIN_CASES, SIZES_ENV, env_sizes, fitted, slope, split
from emulator.executors import quantity_bytes
from workflows.config import load_config

pytestmark = pytest.mark.slow  # runs the benchmarks' smoke mode and whole pipelines

ROOT = Path(__file__).resolve().parents[1]
FAST = ["preprocess", "loader", "train", "handoff", "onnx", "growth", "quantize", "gpu"]


def _smoke(names: list[str], tmp_path: Path) -> dict:
    out = tmp_path / "smoke.json"
    proc = subprocess.run([sys.executable, "-m", "benchmarks", *names, "--smoke", "--out",
                           str(out), "--workdir", str(tmp_path / "work")],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(out.read_text())


def _check_rows(report: dict, names: list[str]) -> None:
    assert set(report["benchmarks"]) == set(names)
    for name in names:
        rows = report["benchmarks"][name]["rows"]
        assert rows, f"{name} produced no comparison"
        for row in rows:
            assert math.isfinite(row["ours"]) and row["ours"] >= 0, row
            assert math.isfinite(row["baseline"]) and row["baseline"] > 0, row
            assert row["ratio"] == pytest.approx(row["ours"] / row["baseline"])


def test_smoke_runs_every_fast_benchmark(tmp_path):
    report = _smoke(FAST, tmp_path)
    _check_rows(report, FAST)
    machine = report["machine"]
    assert machine["cores"] >= 1 and machine["cpu_model"]
    assert machine["versions"]["torch"] and len(machine["load_average_end"]) == 3
    # The GPU benchmark's code (steps.train's trainer per variant in its own process, the
    # interleaved rounds, the input wait, the profile, device-side augmentation, batch-64
    # mixed-precision training) runs on the CPU in --smoke, so it is exercised without a GPU.
    gpu_rows = [row["metric"] for row in report["benchmarks"]["gpu"]["rows"]]
    for what in ("steps.train default, end to end (data included)", "end to end / compute only",
                 "default vs contiguous in the compiled step (the default before), compute only",
                 "augmentation on cpu", "img/s compute only, batch 4, cpu ("):
        assert any(what in metric for metric in gpu_rows), what
    ab = report["benchmarks"]["gpu"]["details"]["ab"]
    for name in ("default", "contiguous"):
        variant = ab["variants"][name]
        assert variant["error"] is None and len(variant["rounds"]["end_to_end"]) == 1
        epoch = variant["rounds"]["epochs"][0]
        assert 0 <= epoch["host_wait_share"] < 1 and epoch["gpu_wait_share"] is None
        assert variant["warmup"]["first_step_s"] > 0
    assert "15 steps" in ab["profiles"]["default"]
    # each variant's model folder went with its process
    assert sorted((tmp_path / "work" / "gpu-variants").iterdir()) == []
    details = report["benchmarks"]["preprocess"]["details"]
    assert details["anchor_mode_labels_equal"]
    assert details["anchor_mode_max_abs_diff_image"] < 1e-3   # same algorithm, float32


def test_smoke_runs_orchestration(tmp_path):
    report = _smoke(["orchestration"], tmp_path)
    _check_rows(report, ["orchestration"])
    details = report["benchmarks"]["orchestration"]["details"]
    assert {n["task"] for n in details["nodes"]} >= {"download", "preprocess", "train",
                                                     "convert"}


def test_the_fitted_growth_exponent_takes_every_size():
    """Issue 47 fits growth on three sizes: a power law gives its exponent back, two points
    give the pair's slope, and a middle point off the line moves the fit."""
    sizes = [30, 120, 750]
    assert fitted(sizes, [3 * n ** 1.3 for n in sizes]) == pytest.approx(1.3)
    assert fitted([30, 120], [16, 96]) == pytest.approx(slope(30, 16, 120, 96))
    assert fitted(sizes, [16, 96, 600]) < slope(30, 16, 120, 96)
    assert math.isnan(fitted(sizes, [1, 0, 2])) and math.isnan(fitted([30], [1]))


def test_the_sizes_come_from_the_environment_and_a_bad_value_is_named(monkeypatch):
    """UNET_BENCH_SCALE: whole numbers of cases, at least the 5-fold split's training cases,
    sorted and distinct; unset or blank, the caller's default; anything else refused by name
    before a size runs."""
    monkeypatch.delenv(SIZES_ENV, raising=False)
    assert env_sizes([30, 120]) == [30, 120]
    monkeypatch.setenv(SIZES_ENV, " ")
    assert env_sizes([8, 12]) == [8, 12]
    monkeypatch.setenv(SIZES_ENV, " 750, 30,120,30")
    assert env_sizes([8]) == [30, 120, 750]
    for bad in ("abc", "30,", "4,30", "-30", "30;120", "1e3", "0"):
        monkeypatch.setenv(SIZES_ENV, bad)
        with pytest.raises(ValueError, match=re.escape(f"{SIZES_ENV}={bad!r}: expected")):
            env_sizes([30])
    assert split(MIN_CASES) == (MIN_CASES, 0) and split(MIN_CASES - 1) == (MIN_CASES, 0)


# beyond CI since 2026-11-29: 4 min beside the cluster's tests (docs/testing.md)
@pytest.mark.beyond_ci
def test_smoke_runs_the_scale_sizes(tmp_path, monkeypatch):
    """The whole DAG from the served tar at two sizes: every step measured, the download
    fetched the tar once (its bytes served), the S3 bytes a step read are those its producer
    wrote, and the slopes and ratios come from the two points; the larger size's tar is
    deleted once the download has it (UNET_SCALE_DROP_TAR), and the run goes on."""
    monkeypatch.setenv("UNET_SYNTHETIC_CACHE", str(tmp_path / "tars"))
    monkeypatch.setenv("UNET_SCALE_DROP_TAR", "12")
    report = _smoke(["scale"], tmp_path)
    rows = report["benchmarks"]["scale"]["rows"]
    # the tar's generation, 5 steps × 6 (download reads nothing from S3), the time around
    assert len(rows) == 1 + 5 * 6 - 1 + 1
    for row in rows:                       # a slope may be below 0 where start-up dominates
        assert math.isfinite(row["ours"]) and row["baseline"] > 0, row
    points = report["benchmarks"]["scale"]["details"]["points"]
    assert [(p["cases"], p["training"], p["test"]) for p in points] == [(8, 5, 3), (12, 8, 4)]
    for point in points:
        steps = point["steps"]
        assert list(steps) == ["download", "preprocess", "train", "convert", "quantize"]
        assert point["tar_bytes_served"] == point["tar_bytes"]
        for step in steps.values():
            assert step["cpu_s"] > 0 and step["peak_rss_bytes"] > 50e6, step
            assert 0 < step["peak_anon_bytes"] <= step["peak_rss_bytes"], step
            # what the runner copied in and out whole sat in the step's folder
            copied = max(step["s3_read_bytes"] - step["s3_read_by_key_bytes"],
                         step["s3_written_bytes"] - step["s3_saved_by_key_bytes"])
            assert step["peak_disk_bytes"] >= copied * 0.9, step
            assert 0 < step["wall_s"] <= step["node_s"] < point["wall_s"]
        # preprocess reads raw by key: its training cases, not the test images
        read = steps["preprocess"]["s3_read_by_key_bytes"]
        assert read == steps["preprocess"]["s3_read_bytes"]
        assert 0 < read < steps["download"]["s3_written_bytes"]
        assert steps["convert"]["s3_read_bytes"] > steps["train"]["s3_written_bytes"]
        for step in ("convert", "quantize"):      # ... and so do these the dataset
            assert 0 < steps[step]["s3_read_by_key_bytes"] <= \
                steps["preprocess"]["s3_written_bytes"], step
    big, small = points[1]["steps"]["download"], points[0]["steps"]["download"]
    assert big["s3_written_bytes"] > small["s3_written_bytes"]
    assert [p["tar_dropped"] for p in points] == [False, True]
    assert sorted(p.name for p in (tmp_path / "tars").iterdir()) == [
        "5+3-48x48x24-seed0"]                    # one tar per size, kept below the drop size


def test_smoke_runs_the_cpu_share_sweep(tmp_path):
    """Train and preprocess confined to fewer CPUs than the machine has (--smoke: affinity),
    each against every point of its UNET_CPUS sweep."""
    report = _smoke(["quota"], tmp_path)
    _check_rows(report, ["quota"])
    details = report["benchmarks"]["quota"]["details"]
    assert details["confinement"].startswith("affinity to ")
    for rates in details["scenarios"].values():
        for sides in rates.values():
            if isinstance(sides, dict):
                assert set(sides) == {"ours", *map(str, details["counts"])}


def test_smoke_runs_the_footprint_fit(tmp_path):
    """Preprocess at 1, 2 and 4 workers (--smoke: tiny cases), each run with the workers it
    was given (its own log line, read by the benchmark), and the line through the pooled runs:
    every spawned worker is a process of its own, so the memory grows with them. Then
    convert, quantize and evaluate on one fold's model, and the five folds' ensemble and
    quantize on it, each with the CPUs and against the memory the base gives the resources it
    runs with (the ensemble: convert's)."""
    report = _smoke(["footprint"], tmp_path)
    _check_rows(report, ["footprint"])
    details = report["benchmarks"]["footprint"]["details"]
    assert [r["workers"] for r in details["runs"]] == [1, 2, 4]
    assert details["fit"]["per_worker_bytes"] > 0
    assert details["runs"][2]["anon_bytes"] > details["runs"][1]["anon_bytes"]
    resources = load_config().resources
    assert [(r["step"], r["model"], r["resources"]) for r in details["downstream"]] == [
        ("convert", "fold 0", "convert"), ("quantize", "fold 0", "quantize"),
        ("evaluate", "fold 0", "evaluate"), ("ensemble", "ensemble", "convert"),
        ("quantize", "ensemble", "quantize")]
    for run in details["downstream"]:
        given = getattr(resources, run["resources"])
        assert run["cpus"] == int(given.cpu) and run["anon_bytes"] > 0, run
        assert run["request_bytes"] == quantity_bytes(given.memory, run["resources"]), run


# beyond CI since 2026-11-29: 7 min beside the cluster's tests (docs/testing.md)
@pytest.mark.beyond_ci
def test_smoke_runs_the_contention_rounds(tmp_path):
    """The four steps idle and beside a spinning neighbour (ours), and idle (before: its
    collapse beside the neighbour is the full run's, at about 1 % of the idle rate); ours
    says its thread count in its log, before (UNET_ADAPT_THREADS=0) does not."""
    report = _smoke(["contention"], tmp_path)
    _check_rows(report, ["contention"])
    runs = report["benchmarks"]["contention"]["details"]["runs"]
    assert {(r["step"], r["neighbours"]) for r in runs} == {
        (step, n) for step in ("train", "preprocess", "convert", "quantize") for n in (0, 1)}
    assert {(r["side"], r["neighbours"]) for r in runs} == {("ours", 0), ("ours", 1),
                                                             ("before", 0)}
    for run in runs:
        assert bool(run["threads_lines"]) == (run["side"] == "ours"), run
        assert run["cpu_s"] > 0 and run["wall_s"] > 0


def test_unknown_benchmark_is_refused():
    proc = subprocess.run([sys.executable, "-m", "benchmarks", "nosuch"], cwd=ROOT,
                          capture_output=True, text=True)
    assert proc.returncode == 2 and "nosuch" in proc.stderr


@pytest.mark.parametrize("ours, baseline, target, expected", [
    (3.0, 1.0, ">= 2", "meets target"), (1.5, 1.0, ">= 2", "MISSES target"),
    (0.4, 1.0, "<= 0.5", "meets target"), (0.6, 1.0, "<= 0.5", "MISSES target"),
    (5.0, 1.0, "", "info")])
def test_row_verdict(ours, baseline, target, expected):
    row = Row("b", "m", "u", ours, baseline, "base", target)
    assert row.ratio == pytest.approx(ours / baseline) and row.verdict == expected


def test_compat_check_passes_with_this_interpreter(tmp_path):
    """benchmarks.compat (what a Gaudi image build runs): train, export and convert with this
    torch on its own synthetic dataset, every stage checked by the steps themselves."""
    out = tmp_path / "compat.json"
    done = subprocess.run([sys.executable, "-m", "benchmarks.compat", "--workdir",
                           str(tmp_path / "work"), "--out", str(out)], cwd=ROOT,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    (run,) = json.loads(out.read_text())["runs"]
    assert run["train"]["ok"] and run["convert"]["ok"]
    assert run["convert"]["parity"]["passed"] is True
