"""1. Preprocess, one core: ours (steps.preprocess.process_case) vs the anchors' algorithm.

The baseline is the anchors' task-01 dim-2 preprocessing written again here: nibabel load as
float32, transpose to (C, D, H, W), MONAI ``CropForegroundd(source_key="image")``,
``NormalizeIntensity(nonzero=False, channel_wise=True)``, pad H, W to at least the patch
(floor before, ceil after), centre-crop to it, ``np.save`` float32 image and uint8 label.
"""
from __future__ import annotations

import shutil
import time
import zlib
from pathlib import Path
from typing import Callable

from monai.transforms import CropForegroundd, NormalizeIntensity
import nibabel as nib
import numpy as np

from benchmarks.common import Row, Settings, case_files, in_child, raw_task, step_env
from steps import nifti
from steps.preprocess import Job, process_case


# ---------------------------------------------------------------------------- baseline

def _pad_crop(array: np.ndarray, patch: tuple[int, int]) -> np.ndarray:
    """The anchors' in-plane window of (C, D, H, W): zero pad to >= patch, centre crop."""
    pads = [(0, 0), (0, 0)]
    for size, want in zip(array.shape[2:], patch):
        extra = max(want - size, 0)
        pads.append((extra // 2, extra - extra // 2))
    array = np.pad(array, pads)
    h, w = array.shape[2:]
    top, left = (h - patch[0]) // 2, (w - patch[1]) // 2
    return array[:, :, top:top + patch[0], left:left + patch[1]]


def anchor_case(image_path: Path, label_path: Path, out_dir: Path, name: str,
                patch: tuple[int, int]) -> None:

    image = nib.load(str(image_path)).get_fdata(dtype=np.float32)       # (x, y, z, C)
    label = np.asarray(nib.load(str(label_path)).dataobj).astype(np.uint8)
    data = {"image": np.transpose(image, (3, 2, 1, 0)),
            "label": np.transpose(label, (2, 1, 0))[np.newaxis]}
    data = CropForegroundd(keys=["image", "label"], source_key="image",
                           allow_smaller=True)(data)
    image = NormalizeIntensity(nonzero=False, channel_wise=True)(data["image"])
    image = _pad_crop(np.asarray(image, dtype=np.float32), patch)
    label = _pad_crop(np.asarray(data["label"], dtype=np.uint8), patch)
    np.save(out_dir / f"{name}_x.npy", image.astype(np.float32))
    np.save(out_dir / f"{name}_y.npy", label.astype(np.uint8))


def _timed(fn: Callable[[], None]) -> tuple[float, float]:
    """(wall, CPU) seconds of ``fn()``. CPU time is the per-core figure that a loaded
    machine does not distort: every side here runs one thread."""
    wall, cpu = time.perf_counter(), time.process_time()
    fn()
    return time.perf_counter() - wall, time.process_time() - cpu


def run_anchor(cases: list, out_dir: Path, patch: tuple[int, int]) -> list[tuple[float, float]]:
    anchor_case(*cases[0][1:], out_dir, cases[0][0], patch)     # warm-up, as ours
    return [_timed(lambda: anchor_case(image, label, out_dir, name, patch))
            for name, image, label in cases]


# ---------------------------------------------------------------------------- ours

def run_ours(cases: list, out_dir: Path, patch: tuple[int, int], mode: str,
             gzip: str | None = None) -> list[tuple[float, float]]:
    """(wall, CPU) seconds per case; ``gzip`` forces steps.nifti's decoder ("zlib")."""

    jobs = [Job(name=name, image=str(image), label=str(label), n_channels=4,
                labels=(0, 1, 2, 3), mode=mode, patch=patch,
                image_dtype="float32" if mode == "anchor" else "float16",
                out_dir=str(out_dir)) for name, image, label in cases]
    saved = nifti._zlib, nifti.GZIP_BACKEND       # --smoke runs this in the driver itself
    if gzip == "zlib":
        nifti._zlib, nifti.GZIP_BACKEND = zlib, "zlib"
    try:
        process_case(jobs[0])   # warm-up: a step's worker pays first-use costs once, not per case
        return [_timed(lambda: process_case(job)) for job in jobs]
    finally:
        nifti._zlib, nifti.GZIP_BACKEND = saved


def inflate(cases: list, backend: str) -> float:
    """Seconds per case to gunzip image and label only (the floor), one-shot into a buffer of
    the trailer's size (steps.nifti inflates the same bytes in pieces, only as far as the
    header declares)."""
    if backend == "isal":
        from isal import isal_zlib as codec
    else:
        codec = zlib
    total = 0.0
    for _name, image, label in cases:
        for path in (image, label):
            raw = Path(path).read_bytes()
            start = time.perf_counter()
            codec.decompress(raw, 31, int.from_bytes(raw[-4:], "little"))
            total += time.perf_counter() - start
    return total / len(cases)


def _max_diff(ours: Path, anchor: Path, cases: list) -> tuple[float, bool]:
    worst, labels_equal = 0.0, True
    for name, *_ in cases:
        a = np.load(ours / f"{name}_image.npy")
        b = np.load(anchor / f"{name}_x.npy")
        if a.shape != b.shape:
            return float("inf"), False
        worst = max(worst, float(np.max(np.abs(a - b))))
        labels_equal &= bool(np.array_equal(np.load(ours / f"{name}_label.npy"),
                                            np.load(anchor / f"{name}_y.npy")[0]))
    return worst, labels_equal


def _bytes(directory: Path, n: int) -> float:
    return sum(p.stat().st_size for p in directory.iterdir()) / n


def run(settings: Settings) -> dict:
    raw = raw_task(settings, settings.cases)
    cases = case_files(raw)
    n = len(cases)
    outs = {k: settings.workdir / f"pre-{k}" for k in ("ours", "ours-anchor", "anchor")}
    for d in outs.values():
        shutil.rmtree(d, ignore_errors=True)
        d.mkdir(parents=True)
    env = step_env()
    sides = {"anchor": lambda: in_child(run_anchor, cases, outs["anchor"], settings.patch,
                                        threads=1),
             "ours_default": lambda: in_child(run_ours, cases, outs["ours"], settings.patch,
                                              "default", threads=1, env=env)}
    if nifti.GZIP_BACKEND == "isal":     # what the decoder is worth: the same, with zlib
        sides["ours_default_zlib"] = lambda: in_child(
            run_ours, cases, outs["ours"], settings.patch, "default", "zlib", threads=1,
            env=env)
    # Alternating rounds (the order reversed every other one), so drift in machine load
    # hits every side alike.
    seconds = {name: [] for name in sides}
    rss = dict.fromkeys(sides, 0)
    for round_ in range(2 if settings.smoke else 3):
        for name in (list(sides) if round_ % 2 == 0 else list(sides)[::-1]):
            times, peak = sides[name]()
            seconds[name] += times
            rss[name] = max(rss[name], peak)
    seconds["ours_anchor_mode"], rss["ours_anchor_mode"] = in_child(
        run_ours, cases, outs["ours-anchor"], settings.patch, "anchor", threads=1, env=env)
    diff, labels_equal = _max_diff(outs["ours-anchor"], outs["anchor"], cases)
    floors = {"zlib": inflate(cases, "zlib")}
    try:
        floors["isal"] = inflate(cases, "isal")
    except ImportError:
        floors["isal"] = None
    rate = {name: 1 / float(np.median([w for w, _ in times])) for name, times in seconds.items()}
    cpu_rate = {name: 1 / float(np.median([c for _, c in times]))
                for name, times in seconds.items()}
    anchors = "anchors' algorithm (MONAI)"
    rows = [
        Row("preprocess", f"cases/s per core (default mode, float16, gzip via "
            f"{nifti.GZIP_BACKEND})", "case/s", rate["ours_default"], rate["anchor"], anchors,
            ">= 2"),
        Row("preprocess", "the same in cases per CPU-second (load on the machine does not "
            "count)", "case/s", cpu_rate["ours_default"], cpu_rate["anchor"], anchors, ">= 2"),
        Row("preprocess", "cases/s per core (--mode anchor, float32)", "case/s",
            rate["ours_anchor_mode"], rate["anchor"], anchors),
        Row("preprocess", "bytes written per case", "MB", _bytes(outs["ours"], n) / 1e6,
            _bytes(outs["anchor"], n) / 1e6, "anchors' float32 192x160 crop"),
        Row("preprocess", "peak RSS", "MB", rss["ours_default"] / 1e6, rss["anchor"] / 1e6,
            anchors),
    ]
    if "ours_default_zlib" in seconds:
        rows.append(Row("preprocess", "default mode, cases per CPU-second: isal vs zlib",
                        "case/s", cpu_rate["ours_default"], cpu_rate["ours_default_zlib"],
                        "ours with zlib (the standard library)"))
    for d in outs.values():
        shutil.rmtree(d, ignore_errors=True)
    return {"rows": rows, "details": {
        "cases": n, "shape": list(settings.shape), "patch": list(settings.patch),
        "ours_env": env,
        "median_seconds_per_case": {name: 1 / r for name, r in rate.items()},
        "median_cpu_seconds_per_case": {name: 1 / r for name, r in cpu_rate.items()},
        "wall_and_cpu_seconds_per_case_all": seconds, "peak_rss_bytes": rss,
        "gzip_inflate_seconds_per_case": floors,
        "anchor_mode_max_abs_diff_image": diff, "anchor_mode_labels_equal": labels_equal,
        "compressed_mb_per_case": sum(p.stat().st_size for c in cases for p in c[1:]) / n / 1e6,
        "threads": 1,
    }}
