"""Synthetic BraTS-like cases in the exact MSD Task01_BrainTumour layout.

The real tarball (7.7 GB) cannot be fetched in tests or CI, so the pipeline runs end to end on
data made here. Each case imitates a skull-stripped BraTS volume:

- image: ``(H, W, D, 4)`` float32 NIfTI, channels FLAIR, T1w, t1gd, T2w, 1 mm isotropic
  spacing, integer-valued intensities (arbitrary scanner units) on an exactly-zero background;
- label: ``(H, W, D)`` uint8, 0 background, 1 edema, 2 non-enhancing tumour (necrotic core),
  3 enhancing tumour.

Anatomy: a brain-shaped ellipsoid with a smooth bumpy boundary, smaller than the grid so a
foreground crop is meaningful; a grey-matter rim, white matter and two ventricles (CSF).
Tumour: nested bumpy blobs at a random position and size, whole tumour ⊃ tumour core ⊃
enhancing rim (labels 1 ⊃ 2 ⊃ 3 as regions). Each tissue has its own signature across the four
modalities, chosen after radiology convention, so a 2D U-Net can tell every class apart from a
single slice: edema is bright on FLAIR and T2, CSF bright on T2 but dark on FLAIR, the
enhancing rim bright on t1gd only, the necrotic core dark on T1. A bias field, low-frequency
texture, partial-volume blur and Gaussian noise keep it from being trivial.

Everything is deterministic per ``seed`` and case index, down to the gzip bytes (nibabel writes
gzip members with mtime 0), and case ``i`` is the same whatever the number of cases. It is so
on any x86-64 CPU too, since the smooth fields are exact sums (:func:`smooth_field`); while
they were float32 matrix products and numpy exps, the tars of 30, 120 and 750 cases of one seed
had other md5s on an Intel Xeon than on an AMD EPYC (2026-12-02). The gzip bytes are zlib's,
so other zlib builds may still give other md5s.
"""
from __future__ import annotations

import argparse
import functools
import gzip
import hashlib
import io
import json
import multiprocessing
import os
import re
import sys
import tarfile
import time
from collections import deque
from concurrent.futures import Future, ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, Iterator, Sequence

import nibabel as nib
import numpy as np
from tqdm import tqdm

from steps import limits, uris
from steps.errors import OneLineArgumentParser, run_main

TASK = "Task01_BrainTumour"
MODALITIES = {"0": "FLAIR", "1": "T1w", "2": "t1gd", "3": "T2w"}
LABELS = {"0": "background", "1": "edema", "2": "non-enhancing tumor", "3": "enhancing tumour"}
MIN_SHAPE = uris.MIN_SHAPE
FULL_SHAPE = (240, 240, 155)
TRAINING_CASES, TEST_CASES = 484, 266   # Task01's numTraining and numTest
SUBDIRS = ("imagesTr", "labelsTr", "imagesTs")
GZIP_LEVEL = 1                          # nibabel's for a .nii.gz (Opener.default_compresslevel)
APPLEDOUBLE = b"\x00\x05\x16\x07AppleDouble junk"   # a ._BRATS_* member's bytes

# Tissue index → relative intensity per modality (FLAIR, T1w, t1gd, T2w).
_BACKGROUND, _WM, _GM, _CSF, _EDEMA, _NECROSIS, _ENHANCING = range(7)
_SIGNATURES = np.array([
    [0.00, 0.00, 0.00, 0.00],  # background (stays exactly zero)
    [0.55, 0.85, 0.86, 0.40],  # white matter
    [0.68, 0.62, 0.64, 0.56],  # grey matter
    [0.14, 0.20, 0.22, 1.00],  # CSF: dark FLAIR, dark T1, bright T2
    [1.00, 0.50, 0.52, 0.82],  # edema: bright FLAIR and T2
    [0.56, 0.28, 0.30, 0.93],  # necrotic / non-enhancing core: dark T1, bright T2
    [0.78, 0.56, 1.35, 0.68],  # enhancing tumour: bright t1gd only
], dtype=np.float32)
_TUMOUR_LABEL = {_EDEMA: 1, _NECROSIS: 2, _ENHANCING: 3}
_SCALE = 1000.0  # scanner units for relative intensity 1.0
_NOISE = 0.025


@dataclass(frozen=True)
class Case:
    """One generated case: ``image`` (H, W, D, 4) float32, ``label`` (H, W, D) uint8."""
    image: np.ndarray
    label: np.ndarray
    affine: np.ndarray


def affine_for(shape: Sequence[int]) -> np.ndarray:
    """RAS affine with 1 mm spacing and the grid centre at the world origin."""
    affine = np.eye(4)
    affine[:3, 3] = -(np.asarray(shape[:3], dtype=float) - 1) / 2
    return affine


_COARSE_STEPS = 64      # a coarse value is a multiple of 1/64 in [-4, 4]: 9 bits and a sign
_WEIGHT_STEPS = 256     # a weight is a multiple of 1/256 in [0, 1]: 9 bits


def smooth_field(shape: Sequence[int], rng: np.random.Generator,
                 knots: Sequence[int] = (5, 5, 4)) -> np.ndarray:
    """Random low-frequency field of ``shape`` (3D), values in [-1, 1].

    Gaussian-weighted interpolation of a coarse random grid, done separably (three small
    matrix products), so a 240×240×155 field costs milliseconds. The coarse values (at most
    256 in magnitude) and the weights (0 … 256) are integers, and an axis has at most 16
    knots, so every partial sum of the products is an integer below 2**44: exact in float64
    in any order, with FMA or without. OpenBLAS picks its kernel by CPU, and its kernels add
    in other orders (``OPENBLAS_CORETYPE=Prescott`` made other float32 fields than the
    default on one Intel Xeon), so the field's bits would otherwise depend on the CPU.
    """
    coarse = np.rint(rng.standard_normal(tuple(knots)) * _COARSE_STEPS)
    coarse = np.clip(coarse, -4 * _COARSE_STEPS, 4 * _COARSE_STEPS)
    wx, wy, wz = (_interpolation_matrix(n, k) for n, k in zip(shape, knots))
    field = np.tensordot(coarse, wz, axes=([2], [1]))       # (kx, ky, D)
    field = np.tensordot(field, wy, axes=([1], [1]))        # (kx, D, W)
    field = np.tensordot(wx, field, axes=([1], [0]))        # (H, D, W)
    field = field.transpose(0, 2, 1)                        # (H, W, D)
    field /= np.multiply.outer(np.multiply.outer(wx.sum(1), wy.sum(1)), wz.sum(1))
    field = field.astype(np.float32, order="C")
    field /= max(float(np.abs(field).max()), 1e-6)
    return field


def _interpolation_matrix(n: int, knots: int) -> np.ndarray:
    """(n, knots) integer Gaussian weights (float64, 0 … 256) from knots to grid positions.

    exp(-x²/2) is taken as (1 - x²/128)**64, within 0.005 of it, made by multiplications
    alone: numpy's exp takes other SIMD paths on other CPUs.
    """
    if knots > 16:
        raise ValueError(f"{knots} knots: at most 16 keep smooth_field's sums exact")
    grid = (np.arange(n, dtype=np.float64) + 0.5) / n
    centres = (np.arange(knots, dtype=np.float64) + 0.5) / knots
    sigma = 0.6 / knots
    x = (grid[:, None] - centres[None, :]) / sigma
    weights = np.maximum(1 - x * x / 128, 0)
    for _ in range(6):
        weights = weights * weights
    return np.rint(weights * _WEIGHT_STEPS)


def _bumpy_ellipsoid(shape: Sequence[int], centre: np.ndarray, radii: np.ndarray,
                     bumpiness: float, rng: np.random.Generator) -> np.ndarray:
    """Normalised radius (H, W, D) of a bumpy ellipsoid: < 1 inside, inf outside its box.

    Only the bounding box is computed, so small blobs stay cheap on a large grid.
    """
    reach = radii * (1 + bumpiness)
    lo = np.clip(np.floor(centre - reach), 0, shape).astype(int)
    hi = np.clip(np.ceil(centre + reach) + 1, 0, shape).astype(int)
    out = np.full(tuple(shape), np.inf, dtype=np.float32)
    if np.any(hi - lo < 1):
        return out
    axes = [(np.arange(a, b, dtype=np.float32) - c) / r
            for a, b, c, r in zip(lo, hi, centre, radii)]
    dist = np.sqrt(axes[0][:, None, None] ** 2 + axes[1][None, :, None] ** 2
                   + axes[2][None, None, :] ** 2)
    box_shape = tuple(int(b - a) for a, b in zip(lo, hi))
    bumps = smooth_field(box_shape, rng, knots=(6, 6, 5))
    out[lo[0]:hi[0], lo[1]:hi[1], lo[2]:hi[2]] = dist / (1 + bumpiness * bumps)
    return out


def _anatomy(shape: Sequence[int], rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray,
                                                                      np.ndarray]:
    """Tissue map (H, W, D) uint8, brain centre and brain semi-axes (voxels)."""
    dims = np.asarray(shape, dtype=np.float32)
    centre = (dims - 1) / 2 + rng.uniform(-0.03, 0.03, 3) * dims
    radii = dims * np.array([0.31, 0.37, 0.40]) * rng.uniform(0.92, 1.08, 3)
    brain_r = _bumpy_ellipsoid(shape, centre, radii, 0.07, rng)
    tissue = np.where(brain_r < 1, _WM, _BACKGROUND).astype(np.uint8)
    tissue[(brain_r < 1) & (brain_r > 0.80)] = _GM
    for side in (-1, 1):
        offset = np.array([side * 0.13, -0.05, 0.05]) * radii
        vent_radii = radii * np.array([0.09, 0.24, 0.20]) * rng.uniform(0.8, 1.2, 3)
        ventricle = _bumpy_ellipsoid(shape, centre + offset, vent_radii, 0.15, rng) < 1
        tissue[ventricle & (brain_r < 1)] = _CSF
    return tissue, centre, radii


def _add_tumour(tissue: np.ndarray, centre: np.ndarray, radii: np.ndarray,
                rng: np.random.Generator) -> None:
    """Paint nested edema ⊃ core ⊃ enhancing rim into ``tissue`` (in place, inside the brain)."""
    shape = tissue.shape
    direction = rng.standard_normal(3)
    direction /= np.linalg.norm(direction)
    wt_centre = centre + direction * rng.uniform(0.0, 0.45) * radii
    wt_radii = radii * rng.uniform(0.24, 0.42) * rng.uniform(0.8, 1.2, 3)
    core_centre = wt_centre + rng.uniform(-0.2, 0.2, 3) * wt_radii
    core_radii = wt_radii * rng.uniform(0.45, 0.7) * rng.uniform(0.85, 1.15, 3)
    core_radii = np.maximum(core_radii, 2.0)
    brain = tissue != _BACKGROUND
    whole = (_bumpy_ellipsoid(shape, wt_centre, wt_radii, 0.2, rng) < 1) & brain
    core_r = _bumpy_ellipsoid(shape, core_centre, core_radii, 0.15, rng)
    core = (core_r < 1) & whole
    rim_inner = rng.uniform(0.45, 0.75)
    tissue[whole] = _EDEMA
    tissue[core] = _NECROSIS
    tissue[core & (core_r > rim_inner)] = _ENHANCING


def generate_case(shape: Sequence[int] = FULL_SHAPE, seed: int = 0, index: int = 0) -> Case:
    """Generate case ``index`` of the set with ``seed``: image (H, W, D, 4), label (H, W, D)."""
    shape = _check_shape(shape)
    for attempt in range(20):
        rng = np.random.default_rng([seed, index, attempt])
        tissue, centre, radii = _anatomy(shape, rng)
        _add_tumour(tissue, centre, radii, rng)
        if all(np.any(tissue == t) for t in _TUMOUR_LABEL):
            break
    else:  # pragma: no cover - only for grids too small to hold a tumour
        raise ValueError(f"grid {shape} is too small for a tumour with all three regions")
    label = np.zeros(shape, dtype=np.uint8)
    for t, value in _TUMOUR_LABEL.items():
        label[tissue == t] = value
    return Case(image=_render(tissue, rng), label=label, affine=affine_for(shape))


def _render(tissue: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """Intensities (H, W, D, 4) float32 from the tissue map; exactly zero outside the brain.

    Only the brain's bounding box is rendered; the background is never touched.
    """
    image = np.zeros(tissue.shape + (4,), dtype=np.float32, order="F")
    box = _bounding_box(tissue != _BACKGROUND)
    sub = tissue[box]
    brain = sub != _BACKGROUND
    tumour = sub >= _EDEMA
    anatomy_texture = smooth_field(sub.shape, rng, knots=(12, 12, 8))
    tumour_texture = smooth_field(sub.shape, rng, knots=(16, 16, 10)) * tumour
    for c in range(4):
        channel = _SIGNATURES[:, c][sub]
        channel += np.float32(0.04 * rng.choice([-1, 1])) * anatomy_texture
        channel += np.float32(0.08 * rng.choice([-1, 1])) * tumour_texture
        channel = _blur(channel)
        channel *= 1 + np.float32(0.12) * smooth_field(sub.shape, rng, knots=(3, 3, 3))
        channel += rng.standard_normal(sub.shape, dtype=np.float32) * np.float32(_NOISE)
        channel *= np.float32(_SCALE * rng.uniform(0.8, 1.25))
        np.rint(channel, out=channel)
        np.maximum(channel, 1, out=channel)
        channel[~brain] = 0
        image[box + (c,)] = channel
    return image


def _bounding_box(mask: np.ndarray) -> tuple[slice, ...]:
    """Smallest box (tuple of slices) holding every True voxel of ``mask``."""
    box = []
    for axis in range(mask.ndim):
        hit = np.flatnonzero(mask.any(axis=tuple(a for a in range(mask.ndim) if a != axis)))
        box.append(slice(int(hit[0]), int(hit[-1]) + 1))
    return tuple(box)


def _blur(volume: np.ndarray) -> np.ndarray:
    """Separable [1, 2, 1] / 4 smoothing in place: a cheap partial-volume effect at borders."""
    for axis in range(3):
        if volume.shape[axis] < 3:
            continue
        view = np.moveaxis(volume, axis, 0)
        inner = 0.5 * view[1:-1] + 0.25 * (view[:-2] + view[2:])
        view[1:-1] = inner
    return volume


def _check_shape(shape: Sequence[int]) -> tuple[int, int, int]:
    shape = tuple(int(s) for s in shape)
    if len(shape) != 3 or any(s < m for s, m in zip(shape, MIN_SHAPE)):
        raise ValueError(f"shape {shape} must be three sizes of at least {MIN_SHAPE}")
    return shape  # type: ignore[return-value]


def _nifti(data: np.ndarray, affine: np.ndarray) -> nib.Nifti1Image:
    image = nib.Nifti1Image(data, affine)
    image.header.set_xyzt_units("mm", "sec")
    image.set_qform(affine, code=1)
    image.set_sform(affine, code=1)
    return image


def case_name(number: int) -> str:
    """MSD case names: BRATS_001 … (three digits at least)."""
    return f"BRATS_{number:03d}"


def dataset_json(train_names: Sequence[str], test_names: Sequence[str]) -> dict:
    """A ``dataset.json`` shaped like the real Task01 one (same keys and value formats)."""
    return {
        "name": "BRATS",
        "description": "Synthetic BraTS-like gliomas: tumour and oedema on brain images "
                       "(generated by steps.synthetic, not patient data)",
        "reference": "steps.synthetic",
        "licence": "CC-BY-SA 4.0",
        "release": "synthetic 1.0",
        "tensorImageSize": "4D",
        "modality": dict(MODALITIES),
        "labels": dict(LABELS),
        "numTraining": len(train_names),
        "numTest": len(test_names),
        "training": [{"image": f"./imagesTr/{n}.nii.gz", "label": f"./labelsTr/{n}.nii.gz"}
                     for n in train_names],
        "test": [f"./imagesTs/{n}.nii.gz" for n in test_names],
    }


def case_files(shape: Sequence[int], seed: int, number: int,
               training: bool) -> list[tuple[str, bytes]]:
    """Task-relative paths and ``.nii.gz`` bytes of case ``number``: image, then label.

    A training case gives ``imagesTr/BRATS_nnn.nii.gz`` and ``labelsTr/BRATS_nnn.nii.gz``; a
    test case only ``imagesTs/BRATS_nnn.nii.gz``. A full-size case is about 12.5 MB.
    """
    case = generate_case(shape, seed, number)
    name = case_name(number)
    if not training:
        return [(f"imagesTs/{name}.nii.gz", _nii_gz(case.image, case.affine))]
    return [(f"imagesTr/{name}.nii.gz", _nii_gz(case.image, case.affine)),
            (f"labelsTr/{name}.nii.gz", _nii_gz(case.label, case.affine))]


def _nii_gz(data: np.ndarray, affine: np.ndarray) -> bytes:
    """The bytes ``nib.save`` writes for a ``.nii.gz``: no file name, mtime 0, level 1, and
    the header's OS byte "unknown" (255), as gzip.GzipFile writes it (RFC 1952 2.3.1)."""
    member = bytearray(gzip.compress(_nifti(data, affine).to_bytes(),
                                     compresslevel=GZIP_LEVEL, mtime=0))
    member[9] = 255
    return bytes(member)


def _one_case(shape: tuple[int, int, int], seed: int, cases: int,
              number: int) -> list[tuple[str, bytes]]:
    return case_files(shape, seed, number, training=number <= cases)


def _all_cases(cases: int, test_cases: int, shape: tuple[int, int, int], seed: int,
               workers: int | None, progress: bool) -> Iterator[tuple[str, bytes]]:
    """Every case's files, in case order, made by ``workers`` processes (default one; the
    CLI's default is one per CPU, about 1.2x faster than one on 2 cores: ``benchmarks scale``;
    spawned workers import the caller's main module, which in a process that has imported
    torch costs them more than they save on a few cases). At most two cases per worker wait
    to be written."""
    numbers = range(1, cases + test_cases + 1)
    workers = min(workers or 1, len(numbers))
    make = functools.partial(_one_case, shape, seed, cases)
    with tqdm(total=len(numbers), desc="synthetic cases", unit="case",
              disable=not progress) as bar:
        if workers <= 1:
            for number in numbers:
                yield from make(number)
                bar.update(1)
            return
        # spawn, not fork: a caller may hold threads (torch's, a server's).
        pool = ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn"))
        pending: deque[Future] = deque()
        try:
            for number in numbers:
                pending.append(pool.submit(make, number))
                if len(pending) >= 2 * workers:
                    yield from pending.popleft().result()
                    bar.update(1)
            while pending:
                yield from pending.popleft().result()
                bar.update(1)
        finally:  # stopped early (an error, SIGTERM): the cases not yet started are dropped
            pool.shutdown(wait=True, cancel_futures=True)


# what the CLI says on stderr once it has made the tar
MADE = re.compile(r"synthetic: (\d+) cases by (\d+) worker process")


def _check_counts(cases: int, test_cases: int) -> None:
    if cases < 1 or test_cases < 0:
        raise ValueError(f"need cases >= 1 and test_cases >= 0, got {cases} and {test_cases}")


def write_msd_task(root: Path | str, cases: int, shape: Sequence[int] = FULL_SHAPE,
                   seed: int = 0, test_cases: int = 0, progress: bool = False,
                   workers: int | None = 1) -> Path:
    """Write ``root/Task01_BrainTumour/{dataset.json, imagesTr, labelsTr, imagesTs}``.

    Training cases are BRATS_001…BRATS_<cases>; test cases (images only) follow on. Returns
    the Task01_BrainTumour directory.
    """
    _check_counts(cases, test_cases)
    shape = _check_shape(shape)
    task = Path(root) / TASK
    for sub in SUBDIRS:
        (task / sub).mkdir(parents=True, exist_ok=True)
    for rel, data in _all_cases(cases, test_cases, shape, seed, workers, progress):
        (task / rel).write_bytes(data)
    (task / "dataset.json").write_bytes(_dataset_json_bytes(cases, test_cases))
    return task


def _dataset_json_bytes(cases: int, test_cases: int) -> bytes:
    names = [case_name(n) for n in range(1, cases + test_cases + 1)]
    return (json.dumps(dataset_json(names[:cases], names[cases:]), indent=4) + "\n").encode()


class _Md5Writer(io.RawIOBase):
    """A write-only file that hashes what passes through it on its way to ``sink``."""

    def __init__(self, sink: BinaryIO):
        self.sink, self.md5, self.size = sink, hashlib.md5(), 0

    def writable(self) -> bool:
        return True

    def tell(self) -> int:   # tarfile asks where it starts
        return self.size

    def write(self, data) -> int:
        self.md5.update(data)
        self.size += len(data)
        return self.sink.write(data)


def write_msd_tar(path: Path | str, cases: int, shape: Sequence[int] = (48, 48, 24),
                  seed: int = 0, test_cases: int = 0, macos_junk: bool = True,
                  workers: int | None = 1, progress: bool = False) -> str:
    """Write a tar of a generated task, laid out like the real ``Task01_BrainTumour.tar``, and
    return its md5 (hex).

    With ``macos_junk`` it also holds the AppleDouble ``._BRATS_*`` files that the real tar
    carries. The cases stream into the tar as they are made: no case is on disk twice, and
    memory holds at most two cases per worker. Members have a fixed owner and mtime, so the
    bytes depend only on the arguments, not on ``workers``. Written under a temporary name
    and renamed into place: a failure leaves nothing at ``path``.
    """
    _check_counts(cases, test_cases)
    shape = _check_shape(shape)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    part = path.with_name(f".{path.name}.{os.getpid()}.part")
    try:
        with open(part, "wb") as sink:
            hashed = _Md5Writer(sink)
            with tarfile.open(fileobj=hashed, mode="w", format=tarfile.PAX_FORMAT) as tar:
                _add_member(tar, TASK, None)
                _add_member(tar, f"{TASK}/dataset.json", _dataset_json_bytes(cases, test_cases))
                for sub in SUBDIRS:
                    _add_member(tar, f"{TASK}/{sub}", None)
                for rel, data in _all_cases(cases, test_cases, shape, seed, workers, progress):
                    _add_member(tar, f"{TASK}/{rel}", data)
                    if macos_junk:
                        folder, name = rel.split("/")
                        _add_member(tar, f"{TASK}/{folder}/._{name}", APPLEDOUBLE)
        os.replace(part, path)
    finally:
        part.unlink(missing_ok=True)
    return hashed.md5.hexdigest()


def _add_member(tar: tarfile.TarFile, name: str, data: bytes | None) -> None:
    info = tarfile.TarInfo(name)
    info.mtime, info.uid, info.gid, info.uname, info.gname = 0, 0, 0, "", ""
    if data is None:
        info.type, info.mode = tarfile.DIRTYPE, 0o755
        tar.addfile(info)
    else:
        info.size, info.mode = len(data), 0o644
        tar.addfile(info, io.BytesIO(data))


# ----------------------------------------------------------------------------- the cache

CACHE_ENV = "UNET_SYNTHETIC_CACHE"       # default: $XDG_CACHE_HOME/unet-synthetic
_MD5_LINE = re.compile(r"([0-9a-f]{32})  (\d{1,15})  ([0-9a-f]{64})\n")


def cache_root() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(os.environ.get(CACHE_ENV) or Path(base) / "unet-synthetic")


def generator_digest() -> str:
    """sha256 of this module's source: a cached tar made by other code is made again."""
    return hashlib.sha256(Path(__file__).read_bytes()).hexdigest()


def cached_tar(cases: int = TRAINING_CASES, test_cases: int = TEST_CASES,
               shape: Sequence[int] = FULL_SHAPE, seed: int = 0,
               workers: int | None = None, progress: bool = False) -> tuple[Path, str]:
    """The tar of :func:`write_msd_tar` (with macOS junk) and its md5, made once per
    arguments and kept under :func:`cache_root`.

    Each set of arguments has one directory, ``<cases>+<test>-<HxWxD>-seed<S>``, holding
    ``Task01_BrainTumour.tar`` and ``Task01_BrainTumour.tar.md5`` (md5, size in bytes and
    the generator's digest). The tar is made again, in place, when the record is missing,
    unreadable, or names another size or generator, so the cache never holds two versions.
    """
    tar, md5, _ = _kept_or_made(cases, test_cases, shape, seed, workers, progress)
    return tar, md5


def _kept_or_made(cases: int, test_cases: int, shape: Sequence[int], seed: int,
                  workers: int | None, progress: bool) -> tuple[Path, str, bool]:
    """:func:`cached_tar`'s (tar, md5), and whether the tar was made by this call."""
    tar = cached_path(cases, test_cases, shape, seed)
    record = tar.with_name(f"{TASK}.tar.md5")
    digest = generator_digest()
    md5 = _cached_md5(tar, record, digest)
    if md5 is not None:
        return tar, md5, False
    record.unlink(missing_ok=True)
    md5 = write_msd_tar(tar, cases, shape, seed, test_cases, workers=workers,
                        progress=progress)
    record.write_text(f"{md5}  {tar.stat().st_size}  {digest}\n")
    return tar, md5, True


def cached_path(cases: int, test_cases: int, shape: Sequence[int], seed: int) -> Path:
    """Where :func:`cached_tar` keeps the tar of these arguments."""
    folder = f"{cases}+{test_cases}-{'x'.join(map(str, _check_shape(shape)))}-seed{seed}"
    return cache_root() / folder / f"{TASK}.tar"


def _cached_md5(tar: Path, record: Path, digest: str) -> str | None:
    """The recorded md5 when the record is well formed and matches ``tar`` and ``digest``."""
    try:
        text = record.read_text()[:200]
        size = tar.stat().st_size
    except (OSError, UnicodeDecodeError):
        return None
    match = _MD5_LINE.fullmatch(text)
    if not match or int(match[2]) != size or match[3] != digest:
        return None
    return match[1]


# ----------------------------------------------------------------------------- the CLI

def _parser() -> argparse.ArgumentParser:
    parser = OneLineArgumentParser(
        prog="python -m steps.synthetic",
        description="Make the synthetic Task01_BrainTumour.tar (the real one's layout and "
                    "split, by default at full size) and print its path and md5.")
    parser.add_argument("--cases", type=int, default=TRAINING_CASES,
                        help=f"training cases (default {TRAINING_CASES}, as Task01)")
    parser.add_argument("--test", type=int, default=TEST_CASES,
                        help=f"test cases, images only (default {TEST_CASES}, as Task01)")
    parser.add_argument("--shape", default="x".join(map(str, FULL_SHAPE)), metavar="HxWxD",
                        help="voxels per case (default: Task01's 240x240x155)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--workers", type=int, default=None,
                        help="processes making cases (default: one per CPU this process is "
                             "given, fewer where other work keeps them busy)")
    parser.add_argument("--out", type=Path, default=None,
                        help="write the tar here instead of to the cache "
                             f"(${CACHE_ENV}, default ~/.cache/unet-synthetic)")
    parser.add_argument("--no-progress", action="store_true")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    query = f"cases={args.cases}&test={args.test}&shape={args.shape}&seed={args.seed}"
    params = uris.synthetic_params(query, query, "arguments")
    limits.check("max_cases", params["cases"] + params["test"], "--cases plus --test")
    shape, progress = params["shape"], not args.no_progress
    total = params["cases"] + params["test"]
    workers = min(args.workers or limits.set_threads(), total)   # as _all_cases runs them
    start = time.perf_counter()
    if args.out is None:
        tar, md5, made = _kept_or_made(params["cases"], params["test"], shape,
                                       params["seed"], workers, progress)
    else:
        tar, made = args.out, True
        md5 = write_msd_tar(tar, params["cases"], shape, params["seed"], params["test"],
                            workers=workers, progress=progress)
    print(f"synthetic: {total} cases by {workers} worker "
          f"process(es) in {time.perf_counter() - start:.1f} s" if made else
          f"synthetic: {tar} was in the cache", file=sys.stderr)
    print(f"{md5}  {tar}")
    return 0


if __name__ == "__main__":
    sys.exit(run_main(main))
