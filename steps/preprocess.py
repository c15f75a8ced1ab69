"""Preprocess step: the ``raw`` MSD task into the ``dataset`` artifact (see ``steps.dataset``).

``python -m steps.preprocess --raw DIR|s3://BUCKET/PREFIX --dataset DIR [--workers N]
[--image-dtype float16] [--mode default|anchor] [--patch-size 192x160]``

Per case, the anchors' task-01 dim-2 algorithm (NVIDIA nnUNet / Habana U-Net):

1. Read the image (x, y, z[, c]) and label (x, y, z) as stored (float, or int with
   ``scl_slope``/``scl_inter`` applied as float32).
2. Transpose to the anchors' layout: image (C, D, H, W) = (c, z, y, x), label (D, H, W).
3. Foreground crop: the bounding box of voxels that are nonzero in any channel (anchor mode:
   greater than zero, MONAI ``CropForegroundd``'s default; the two agree on MRI, which has no
   negative intensities). The label is cropped with the same box.
4. No resampling (2D). Spacing [D, H, W] in mm is recorded from the header.
5. Channel-wise z-score over every voxel of the cropped volume, zeros included (Habana's
   ``NormalizeIntensity(nonzero=False, channel_wise=True)``); mean and population std in
   float64, a zero std counts as 1.
6. In-plane window:

   - ``--mode anchor``: pad H, W with zeros (after the z-score) to at least the patch size,
     ``floor`` of the padding before and ``ceil`` after, then centre-crop to the patch size at
     ``(size - patch) // 2``; float32. This is the anchors' ``standardize`` step, so outputs
     compare side by side with theirs.
   - ``--mode default`` keeps the whole in-plane foreground extent and only pads H, W up to
     the patch size, with the z-score of raw intensity 0 (the background's own value). The
     centre crop throws away brain, where tumour can be, whenever the foreground box is
     larger than 192×160; keeping it lets training draw random patches, which also
     augments.

Orientation: ``--mode default`` first reorients image and label to the closest canonical
(RAS+) voxel order, both with the image's affine (nibabel ``io_orientation``), so datasets
that mix orientations train consistently; ``--mode anchor`` keeps the stored voxel order, as
the anchors do. ``dataset.json`` records which.

Images are stored as float16 by default. Rounding the float32 z-score to float16 changes a
voxel by at most 2**-11 (4.9e-4) of its magnitude, so by at most 0.0078 for |z| < 16; z-scores
cannot overflow float16 (|z| <= sqrt(voxels) < 65504). Measured on synthetic BraTS-like cases
at 240×240×155×4: max abs difference 0.00098 (a thousandth of one standard deviation) for |z|
up to 3.4. Every run records its own figure in ``dataset.json``
(``normalisation.image_dtype_error.max_abs``) and each case's in
``cases[i].dtype_max_abs_error``; ``--image-dtype float32`` keeps exact values at twice the
bytes.

``--raw`` is the artifact's directory, or the S3 prefix it was saved at (``s3://BUCKET/
PREFIX``, ``steps.bykey``): then only its manifest and ``dataset.json`` are read up front,
and each worker fetches its case's two files into a scratch folder inside ``--dataset``
(checked against the manifest, removed once read; the folder goes before the dataset is
published), so the step never holds the raw artifact, only the cases in flight, and reads
no test image at all.

``--dataset-uri s3://BUCKET/PREFIX`` (an empty prefix; the workflow passes the key Argo saves
the output at) also saves the dataset by key as it is made (``steps.bykey.Saver``): each case's
two files are uploaded once written, on a thread of their own while the next cases are
computed, and leave ``--dataset``, which at the end holds ``dataset.json`` and the manifest
of the whole artifact (the executor saves those at the same prefix). So the pod never holds
the dataset, and its upload is not a wait after the step. On any failure the prefix is
emptied again.

Cases run in ``--workers`` processes (spawn); each holds about two volumes at a time and
returns only small metadata, so memory does not grow with the dataset. Every case is
computed by the same code in a fixed order, so the bytes do not depend on the worker count.
"""
from __future__ import annotations

import argparse
import ctypes
import math
import multiprocessing
import shutil
import sys
import threading
import time
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any, Callable, Iterable, Iterator, Sequence

import numpy as np
from nibabel.orientations import apply_orientation, io_orientation, ornt2axcodes
from tqdm import tqdm

from steps import bykey, limits, nifti, params, schemas
from steps.artifacts import check_disjoint, inside, publish, require
from steps.dataset import (DATASET_JSON, FORMAT_VERSION, check_metadata, kfold_split,
                           torch_view, value_range)
from steps.errors import StepError, run_main

CASES_DIR = "cases"
# Image and label affines are float32 in the header; 1e-3 mm is far below any voxel size
# and far above float32 rounding of a 100 mm offset (~1e-5).
AFFINE_TOLERANCE_MM = 1e-3
FLOAT32_MAX = float(np.finfo(np.float32).max)   # voxels are normalised and stored in float32
STATISTICS = ("mean and population std (ddof=0) per channel, in float64, over every voxel of "
              "the foreground-cropped volume, zeros included; std 0 counts as 1")


@dataclass(frozen=True)
class Job:
    """Everything one worker needs for one case (picklable, small)."""
    name: str
    image: str
    label: str
    n_channels: int
    labels: tuple[int, ...]
    mode: str
    patch: tuple[int, int]
    image_dtype: str
    out_dir: str
    remote: bykey.Remote | None = None   # read by key: image and label fetched from it first
    scratch: str = ""                    # ... to their paths under this folder


# ----------------------------------------------------------------------------- the raw task

FETCHED = ".raw-by-key"   # read by key: the scratch folder inside --dataset
# Saved by key: cases begun and not yet uploaded, per worker (one in a worker, one written and
# waiting for the upload), so the pod holds a few cases at any size of the dataset.
AHEAD_PER_WORKER = 2


def choose_task(tasks: list[str], raw: Path | str) -> str:
    """Of the task directories with a dataset.json, ``Task01_BrainTumour``, else the only one."""
    if "Task01_BrainTumour" in tasks:
        return "Task01_BrainTumour"
    if len(tasks) != 1:
        what = "no" if not tasks else f"{len(tasks)}"
        raise StepError(f"artifact 'raw' at {raw}: {what} task directories with a dataset.json "
                        "(expected exactly one, e.g. Task01_BrainTumour/dataset.json)")
    return tasks[0]


def find_task(raw: Path) -> Path:
    """``raw/Task01_BrainTumour``, else the only subdirectory of ``raw`` with a dataset.json."""
    return raw / choose_task(sorted(p.parent.name for p in raw.glob("*/dataset.json")
                                    if p.is_file()), raw)


def _listed_file(task: Path, rel: Any, spec_path: Path,
                 present: Callable[[Path], bool]) -> Path:
    """The file a 'training' entry names: inside the task directory, and present."""
    path = inside(task, rel, str(spec_path))
    if not present(path):
        raise StepError(f"{spec_path}: {rel} is listed but missing")
    return path


def case_name(path: Path) -> str:
    name = path.name
    for suffix in (".nii.gz", ".nii"):
        if name.endswith(suffix):
            return name[: -len(suffix)]
    return name


def read_task(task: Path, present: Callable[[Path], bool] = Path.is_file) -> dict[str, Any]:
    """Channels, labels and sorted (name, image, label) pairs of the task's ``dataset.json``;
    ``present`` says whether a listed file is there (read by key: whether the manifest lists
    it)."""
    spec_path = task / "dataset.json"
    spec = schemas.load(spec_path, schemas.RawTask, str(spec_path))
    limits.check("max_cases", len(spec.training), f"{spec_path}: 'training'")
    pairs = {}
    for entry in spec.training:
        image = _listed_file(task, entry.image, spec_path, present)
        label = _listed_file(task, entry.label, spec_path, present)
        name = case_name(image)
        if name in pairs:
            raise StepError(f"{spec_path}: case {name} is listed twice")
        pairs[name] = (image, label)
    by_index = sorted((int(k), v) for k, v in spec.labels.items())
    return {"name": task.name,
            "channels": [spec.modality[str(i)] for i in range(len(spec.modality))],
            "labels": dict(by_index),
            "pairs": sorted((n, i, l) for n, (i, l) in pairs.items())}


@contextmanager
def raw_task(raw: Path | str, scratch: Path) -> Iterator[tuple[dict[str, Any], Any]]:
    """(``read_task`` of the raw artifact, the ``bykey.Remote`` its cases come from or None).

    A directory is checked whole (``require``) and read in place. An S3 prefix is read by
    key: its manifest, then the task's dataset.json fetched into ``scratch``, which holds the
    cases in flight later and is removed on the way out.
    """
    if not bykey.is_remote(raw):
        require(raw, "raw")
        yield read_task(find_task(raw)), None
        return
    remote = bykey.open_remote(raw, "raw")
    listed = [PurePosixPath(rel) for rel in remote.files]
    name = choose_task(sorted(p.parts[0] for p in listed
                              if len(p.parts) == 2 and p.name == "dataset.json"), raw)
    try:
        remote.fetch(f"{name}/dataset.json", scratch / name / "dataset.json")
        yield read_task(scratch / name, lambda path: path.relative_to(scratch).as_posix()
                        in remote.files), remote
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


@contextmanager
def _case_files(job: Job) -> Iterator[None]:
    """Read by key: the case's image and label fetched to their paths under the scratch
    folder, and removed once read (``nifti.load`` reads a file whole)."""
    if job.remote is None:
        yield
        return
    paths = [Path(job.image), Path(job.label)]
    try:
        for path in paths:
            job.remote.fetch(path.relative_to(job.scratch).as_posix(), path)
        yield
    finally:
        for path in paths:
            path.unlink(missing_ok=True)


# ----------------------------------------------------------------------------- one case

def image_channels_last(volume: nifti.Volume, n_channels: int, where: str,
                        wanted: str) -> np.ndarray:
    """(x, y, z, C) voxel values checked by :func:`check_voxels`; a 3D image is one
    channel. The one reading of an image's channels: preprocess's and predict's (``wanted``
    ends the line when the count differs: who asks for ``n_channels``)."""
    data = volume.values()
    shape = data.shape
    if data.ndim == 5 and shape[3] == 1:
        data = data[:, :, :, 0, :]
    elif data.ndim == 3:
        data = data[..., np.newaxis]
    if data.ndim != 4:
        raise StepError(f"{where} {volume.path.name} has shape {list(shape)}, expected "
                        "(x, y, z) or (x, y, z, channels)")
    if data.shape[3] != n_channels:
        raise StepError(f"{where} has {data.shape[3]} channels, {wanted}")
    check_voxels(data, where)
    return data


def check_voxels(data: np.ndarray, where: str) -> None:
    """Float voxels must be finite and inside float32's range, in which they are normalised
    and stored (a float64 1e39 would become Inf); one pass, and the line says which fault."""
    if data.dtype.kind != "f":
        return
    lo, hi = value_range(data)
    largest = max(-lo, hi)
    if math.isfinite(lo) and math.isfinite(hi) and largest <= FLOAT32_MAX:
        return
    bad = int(np.count_nonzero(~np.isfinite(data)))
    if bad:
        raise StepError(f"{where} has {bad} NaN/Inf voxels")
    raise StepError(f"{where} has values up to {largest:g}, beyond float32's range "
                    f"(+-{FLOAT32_MAX:.3g}) in which it is normalised")


def _check_label_values(label: np.ndarray, job: Job) -> None:
    allowed = np.zeros(256, dtype=bool)
    allowed[list(job.labels)] = True
    lo, hi = int(label.min()), int(label.max())
    if allowed[: hi + 1].all():
        return
    counts = np.zeros(256, dtype=np.int64)
    for z in range(label.shape[2]):  # slab by slab keeps the bincount temporary small
        counts += np.bincount(label[:, :, z].ravel(order="K"), minlength=256)
    bad = [v for v in np.flatnonzero(counts).tolist() if not allowed[v]]
    if bad:
        raise StepError(f"case {job.name}: label values {bad} are not in dataset.json labels "
                        f"{list(job.labels)} (range {lo}..{hi})")


def _label(volume: nifti.Volume, spatial: tuple[int, ...], job: Job) -> np.ndarray:
    """(x, y, z) uint8 label, checked against the image grid and dataset.json's labels."""
    data = volume.values()
    while data.ndim > 3 and data.shape[-1] == 1:
        data = data[..., 0]
    if data.shape != spatial:
        raise StepError(f"case {job.name}: label shape {list(volume.data.shape)} does not match "
                        f"image grid {list(spatial)}")
    if data.dtype != np.uint8:
        if data.dtype.kind == "f" and not (np.isfinite(data).all()
                                           and (np.rint(data) == data).all()):
            raise StepError(f"case {job.name}: label has non-integer, NaN or Inf values")
        lo, hi = data.min(), data.max()
        if lo < 0 or hi > 255:
            raise StepError(f"case {job.name}: label values {lo:g}..{hi:g} are not in "
                            f"dataset.json labels {list(job.labels)}")
        data = data.astype(np.uint8)
    _check_label_values(data, job)
    return data


def check_same_grid(image: nifti.Volume, label: nifti.Volume, job: Job) -> None:
    """The label must lie on the image's grid: affines equal within AFFINE_TOLERANCE_MM."""
    gap = float(np.abs(image.affine - label.affine).max())
    if gap > AFFINE_TOLERANCE_MM:
        raise StepError(f"case {job.name}: label {label.path.name} affine differs from image "
                        f"{image.path.name} affine by up to {gap:.3g} (tolerance "
                        f"{AFFINE_TOLERANCE_MM} mm); the label would be read on the wrong grid")


def reorient(image: np.ndarray, label: np.ndarray | None, volume: nifti.Volume,
             mode: str) -> tuple[np.ndarray, np.ndarray | None, list[float], str]:
    """Views of image (x, y, z, C) and label in the output voxel order, zooms, axis codes.

    Public for ``steps.predict``, which passes ``label=None`` and gets None back.
    """
    zooms = list(volume.zooms[:3]) + [1.0] * (3 - len(volume.zooms[:3]))
    ornt = io_orientation(volume.affine)
    source = "".join(ornt2axcodes(ornt))
    if mode == "anchor":
        return image, label, zooms, source
    image = apply_orientation(image, ornt)
    label = None if label is None else apply_orientation(label, ornt)
    new_zooms = [0.0] * 3
    for axis, (target, _flip) in enumerate(ornt):
        new_zooms[int(target)] = zooms[axis]
    return image, label, new_zooms, source


def foreground_box(image: np.ndarray, positive: bool, name: str) -> list[tuple[int, int]]:
    """Half-open [start, stop) per spatial axis of the voxels in any channel of (C, D, H, W)
    that are nonzero (``positive``: greater than zero)."""
    box = mask_box(any_channel(image, np.greater if positive else np.not_equal,
                               [0] * len(image)))
    if box is None:
        raise StepError(f"case {name}: empty foreground (every image voxel is "
                        f"{'<= 0' if positive else '0'})")
    return box


def any_channel(image: np.ndarray, compare: Callable, values: Sequence) -> np.ndarray:
    """(D, H, W) bool: where ``compare(channel, value)`` (a numpy ufunc) holds in any channel
    of (C, D, H, W) ``image``, ``values`` one per channel; made a channel at a time, into one
    reused buffer (no (C, D, H, W) mask, and no fresh temporary's page faults per channel)."""
    mask = np.zeros(image.shape[1:], dtype=bool)
    hits = np.empty_like(mask)
    for channel, value in zip(image, values):
        compare(channel, value, out=hits)
        mask |= hits
    return mask


def mask_box(mask: np.ndarray) -> list[tuple[int, int]] | None:
    """Half-open [start, stop) per axis of ``mask``'s True voxels; None when it has none."""
    box = []
    for axis in range(mask.ndim):
        hits = np.flatnonzero(mask.any(axis=tuple(a for a in range(mask.ndim) if a != axis)))
        if hits.size == 0:
            return None
        box.append((int(hits[0]), int(hits[-1]) + 1))
    return box


def in_plane_window(size: int, patch: int, mode: str) -> tuple[int, int]:
    """[start, stop) of the stored extent along H or W, in cropped coordinates (negative = pad)."""
    padded = max(size, patch)
    before = (padded - size) // 2
    if mode == "anchor":
        start = -before + (padded - patch) // 2
        return start, start + patch
    return -before, -before + padded


def _overlap(window: tuple[int, int], size: int) -> tuple[slice, slice]:
    """(source slice in [0, size), destination slice in the window) of their intersection."""
    lo, hi = max(window[0], 0), min(window[1], size)
    return slice(lo, hi), slice(lo - window[0], hi - window[0])


def channel_stats(crop: np.ndarray) -> tuple[float, float]:
    """(mean, std) of one channel (D, H, W) as STATISTICS defines them.

    Sum and sum of squares in float64 through numpy's buffered casting: a few thousand
    voxels are converted at a time, in cache, with no float64 copy of the volume (3.5x the
    CPU time of copying 16 slices at a time into a float64 buffer, on the AMD EPYC VM).
    Float64 keeps E[x²] − mean² exact to ~1e-12 relative for image intensities.
    """
    total = float(np.add.reduce(crop, axis=None, dtype=np.float64))
    axes = "abcdefgh"[:crop.ndim]
    squares = float(np.einsum(f"{axes},{axes}->", crop, crop, dtype=np.float64))
    count = crop.size
    mean = total / count
    std = max(squares / count - mean * mean, 0.0) ** 0.5      # NaN stays NaN (max keeps it)
    return mean, (1.0 if std == 0 else std)


def zscore(values: np.ndarray, mean: float, std: float,
           out: np.ndarray | None = None) -> np.ndarray:
    """float32 ``(values - mean) / std`` with float32 statistics: the stored normalisation
    (also used by ``steps.predict`` on new cases). ``out``: a float32 array to reuse."""
    z = np.subtract(values, np.float32(mean), dtype=np.float32, out=out)
    np.divide(z, np.float32(std), out=z)
    return z


def process_case(job: Job) -> dict[str, Any]:
    """Preprocess one case, write its two .npy files, return its dataset.json entry."""
    entry = _write_case(job)
    _return_freed_memory()          # the case's arrays are gone with _write_case's frame
    return entry


def _write_case(job: Job) -> dict[str, Any]:
    try:
        with _case_files(job):
            image_vol = nifti.load(job.image)
            label_vol = nifti.load(job.label)
    except StepError as exc:
        raise StepError(f"case {job.name}: {exc}") from None
    image = image_channels_last(image_vol, job.n_channels, f"case {job.name}: image",
                                f"dataset.json declares {job.n_channels} modalities")
    label = _label(label_vol, image.shape[:3], job)
    check_same_grid(image_vol, label_vol, job)
    image, label, zooms, source = reorient(image, label, image_vol, job.mode)
    image = image.transpose(3, 2, 1, 0)   # (C, D, H, W) = (c, z, y, x)
    label = label.transpose(2, 1, 0)      # (D, H, W)
    box = foreground_box(image, job.mode == "anchor", job.name)
    (d0, d1), (h0, h1), (w0, w1) = box
    image = image[:, d0:d1, h0:h1, w0:w1]
    label = label[d0:d1, h0:h1, w0:w1]
    win_h = in_plane_window(h1 - h0, job.patch[0], job.mode)
    win_w = in_plane_window(w1 - w0, job.patch[1], job.mode)
    src_h, dst_h = _overlap(win_h, h1 - h0)
    src_w, dst_w = _overlap(win_w, w1 - w0)

    shape = (image.shape[0], d1 - d0, win_h[1] - win_h[0], win_w[1] - win_w[0])
    # The window is the patch size at least: bounded by memory before it is allocated.
    limits.check_memory(int(np.prod(shape)) * (np.dtype(job.image_dtype).itemsize + 1),
                        f"case {job.name}: stored shape {list(shape)} (--patch-size "
                        f"{job.patch[0]}x{job.patch[1]})")
    out = np.empty(shape, dtype=job.image_dtype)
    z_buffer = np.empty(label[:, src_h, src_w].shape, dtype=np.float32)
    means, stds, error = [], [], 0.0
    stored_all = torch_view(out)
    for c, channel in enumerate(image):
        mean, std = channel_stats(channel)     # finite: check_voxels bounded the values
        means.append(mean)
        stds.append(std)
        mean32, std32 = np.float32(mean), np.float32(std)
        out[c] = 0.0 if job.mode == "anchor" else -mean32 / std32
        stored = stored_all[c, :, dst_h, dst_w]
        z = torch_view(zscore(channel[:, src_h, src_w], mean, std, out=z_buffer))
        stored.copy_(z)
        if out.dtype != np.float32:
            error = max(error, float(z.sub_(stored).abs_().max()) if z.numel() else 0.0)
    out_label = np.zeros(shape[1:], dtype=np.uint8)
    out_label[:, dst_h, dst_w] = label[:, src_h, src_w]

    out_dir = Path(job.out_dir)
    np.save(out_dir / f"{job.name}_image.npy", out, allow_pickle=False)
    np.save(out_dir / f"{job.name}_label.npy", out_label, allow_pickle=False)
    return {
        "name": job.name,
        "image": f"{CASES_DIR}/{job.name}_image.npy",
        "label": f"{CASES_DIR}/{job.name}_label.npy",
        "shape": list(shape),
        "spacing": [zooms[2], zooms[1], zooms[0]],
        "original_shape": list(image_vol.data.shape[:3]),
        "source_orientation": source,
        "crop": [list(axis) for axis in box],
        "window": [list(win_h), list(win_w)],
        "mean": means,
        "std": stds,
        "dtype_max_abs_error": error,
    }


def _return_freed_memory() -> None:
    """Hand the case's freed heap pages back to the OS. glibc keeps them for reuse, and what
    it keeps grows over the cases (measured: resident 280 → 362 MB over 8 cases, flat with
    this); without glibc there is nothing to do."""
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):
        pass


# ----------------------------------------------------------------------------- the run

def plan_workers(requested: int, jobs: int) -> tuple[int, int]:
    """(worker processes, torch threads in each): ``--workers`` up to the step's threads
    (its CPUs, fewer where other work keeps them busy: limits.set_threads) and the number of
    cases, and those threads shared among them, so that workers times threads stays within
    the CPUs the pod can use."""
    threads = limits.threads()
    workers = max(1, min(requested, threads, jobs))
    return workers, max(1, threads // workers)


def _imap(jobs: Iterable[Job], workers: int, threads: int) -> Iterator[dict[str, Any]]:
    """Results of process_case in job order; worker pools are always shut down."""
    if workers == 1:
        yield from map(process_case, jobs)
        return
    context = multiprocessing.get_context("spawn")
    with context.Pool(processes=workers, initializer=_start_worker,
                      initargs=(threads,)) as pool:
        yield from pool.imap(process_case, jobs, chunksize=1)


def _start_worker(threads: int) -> None:
    """A worker's threads; and tqdm's lock a thread lock: the first bar of a process (a
    fetch's, hidden) would otherwise make a multiprocessing lock, which a worker that the
    pool terminates on a failed case leaks, and the resource tracker then warns about after
    the step's ``error:`` line."""
    limits.set_threads(threads)
    tqdm.set_lock(threading.RLock())


def dataset_json(task: dict[str, Any], cases: list[dict[str, Any]], args: argparse.Namespace,
                 patch: tuple[int, int]) -> dict[str, Any]:
    error = max((case["dtype_max_abs_error"] for case in cases), default=0.0)
    return {
        "format_version": FORMAT_VERSION,
        "name": task["name"],
        "mode": args.mode,
        "channels": task["channels"],
        "labels": {str(k): v for k, v in task["labels"].items()},
        "patch_size": list(patch),
        "image_dtype": args.image_dtype,
        "label_dtype": "uint8",
        "orientation": ("stored voxel order (as the anchors)" if args.mode == "anchor" else
                        "closest canonical RAS+ (nibabel io_orientation of the image affine)"),
        "in_plane": ("padded with 0 to at least patch_size, then centre-cropped to it"
                     if args.mode == "anchor" else
                     "whole foreground extent, padded to at least patch_size with the z-score "
                     "of intensity 0"),
        "normalisation": {
            "method": "zscore", "channel_wise": True, "nonzero": False,
            "foreground_crop": True,
            "foreground": "any channel > 0" if args.mode == "anchor" else "any channel != 0",
            "statistics": STATISTICS,
            "image_dtype_error": {
                "max_abs": error,
                "definition": f"max |{args.image_dtype}(z) - z| over every stored voxel of "
                              "every case, z the float32 z-score",
            },
        },
        "cases": cases,
        "folds": kfold_split([case["name"] for case in cases]),
    }


def parse_patch(text: str) -> tuple[int, int]:
    """``"192x160"`` (checked by its parameter's pattern) as (H, W)."""
    height, width = text.split("x")
    return int(height), int(width)


def build_parser() -> argparse.ArgumentParser:
    return params.step_parser("preprocess", __doc__)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    args = build_parser().parse_args(argv)
    args.image_dtype = params.image_dtype(args.image_dtype, args.mode)
    return args


def _for_case(remote, scratch: Path, *paths: Path):
    """The part of ``remote`` one case's worker fetches (its two files), or None."""
    if remote is None:
        return None
    rels = [path.relative_to(scratch).as_posix() for path in paths]
    return bykey.Remote(remote.uri, remote.artifact, {rel: remote.files[rel] for rel in rels})


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    limits.set_threads()
    patch = parse_patch(args.patch_size)
    check_disjoint({"--dataset": args.dataset, "--dataset-uri": args.dataset_uri},
                   {"--raw": args.raw})
    recorded = {p.name: getattr(args, p.name) for p in params.PREPROCESS if p.shapes_output}
    start = time.perf_counter()
    scratch = Path(args.dataset) / FETCHED   # beside publish's staging folder, in --dataset
    saver = bykey.Saver(args.dataset_uri, "dataset") if args.dataset_uri else None
    # the saver inside publish: on an error its queued uploads finish (and the prefix is
    # emptied) before publish empties the folder they read from
    with publish(args.dataset, "dataset", "preprocess", recorded,
                 saved=saver and saver.saved) as staging, \
            saver or nullcontext(), raw_task(args.raw, scratch) as (task, remote):
        cases_dir = staging / CASES_DIR
        cases_dir.mkdir()
        jobs = [Job(name=name, image=str(image), label=str(label),
                    n_channels=len(task["channels"]), labels=tuple(task["labels"]),
                    mode=args.mode, patch=patch, image_dtype=args.image_dtype,
                    out_dir=str(cases_dir), scratch=str(scratch),
                    remote=_for_case(remote, scratch, image, label))
                for name, image, label in task["pairs"]]
        workers, threads = plan_workers(args.workers, len(jobs))
        paced = saver.paced(jobs, AHEAD_PER_WORKER * workers) if saver else jobs
        results = tqdm(_imap(paced, workers, threads),
                       total=len(jobs), desc="preprocess", unit="case", file=sys.stderr)
        cases = [_saved(entry, staging, saver) for entry in results]
        meta = dataset_json(task, cases, args, patch)
        check_metadata(meta, f"{DATASET_JSON} for {args.dataset}")   # what train reads
        schemas.write_json(staging / DATASET_JSON, meta)
        if saver:
            saver.saved()            # every case uploaded before publish moves the folder
    total = bykey.artifact_bytes(args.dataset, saver)
    print(f"preprocess: {len(cases)} cases, {total / 1e6:.1f} MB -> {args.dataset}, "
          f"{time.perf_counter() - start:.1f} s with {workers} worker(s) of {threads} "
          f"thread(s) (--workers {args.workers}), gzip via "
          f"{nifti.GZIP_BACKEND}, max {args.image_dtype} error "
          f"{meta['normalisation']['image_dtype_error']['max_abs']:.2g}"
          f"{_moved_by_key(task, jobs, remote, saver)}", file=sys.stderr)
    return 0


def _moved_by_key(task: dict[str, Any], jobs: list[Job], remote, saver) -> str:
    """The summary's account of what the step read and saved by key itself (``bykey``)."""
    moved = ""
    if remote is not None:
        moved += ", " + bykey.fetched_note(remote, [
            f"{task['name']}/dataset.json", *(rel for job in jobs for rel in job.remote.files)])
    if saver is not None:
        moved += ", " + bykey.saved_note(saver)
    return moved


def _saved(entry: dict[str, Any], staging: Path, saver: bykey.Saver | None) -> dict[str, Any]:
    """A case's entry, once its two files are queued to be saved by key (when they are)."""
    if saver is not None:
        saver.save([(staging / entry[part], entry[part]) for part in ("image", "label")])
    return entry

if __name__ == "__main__":
    sys.exit(run_main(main))
