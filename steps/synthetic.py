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
gzip members with mtime 0), and case ``i`` is the same whatever the number of cases.
"""
from __future__ import annotations

import io
import json
import shutil
import tarfile
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import nibabel as nib
import numpy as np
from tqdm import tqdm

from steps import uris

TASK = "Task01_BrainTumour"
MODALITIES = {"0": "FLAIR", "1": "T1w", "2": "t1gd", "3": "T2w"}
LABELS = {"0": "background", "1": "edema", "2": "non-enhancing tumor", "3": "enhancing tumour"}
MIN_SHAPE = uris.MIN_SHAPE
FULL_SHAPE = (240, 240, 155)

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


def smooth_field(shape: Sequence[int], rng: np.random.Generator,
                 knots: Sequence[int] = (5, 5, 4)) -> np.ndarray:
    """Random low-frequency field of ``shape`` (3D), values in [-1, 1].

    Gaussian-weighted interpolation of a coarse random grid, done separably (three small
    matrix products), so a 240×240×155 field costs milliseconds.
    """
    coarse = rng.standard_normal(tuple(knots)).astype(np.float32)
    wx, wy, wz = (_interpolation_matrix(n, k) for n, k in zip(shape, knots))
    field = np.tensordot(coarse, wz, axes=([2], [1]))       # (kx, ky, D)
    field = np.tensordot(field, wy, axes=([1], [1]))        # (kx, D, W)
    field = np.tensordot(wx, field, axes=([1], [0]))        # (H, D, W)
    field = np.ascontiguousarray(field.transpose(0, 2, 1))  # (H, W, D)
    field /= max(float(np.abs(field).max()), 1e-6)
    return field


def _interpolation_matrix(n: int, knots: int) -> np.ndarray:
    """(n, knots) row-normalised Gaussian weights from knot positions to grid positions."""
    grid = (np.arange(n, dtype=np.float32) + 0.5) / n
    centres = (np.arange(knots, dtype=np.float32) + 0.5) / knots
    sigma = 0.6 / knots
    weights = np.exp(-0.5 * ((grid[:, None] - centres[None, :]) / sigma) ** 2)
    return (weights / weights.sum(axis=1, keepdims=True)).astype(np.float32)


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


def write_msd_task(root: Path | str, cases: int, shape: Sequence[int] = FULL_SHAPE,
                   seed: int = 0, test_cases: int = 0, progress: bool = False) -> Path:
    """Write ``root/Task01_BrainTumour/{dataset.json, imagesTr, labelsTr, imagesTs}``.

    Training cases are BRATS_001…BRATS_<cases>; test cases (images only) follow on. Returns
    the Task01_BrainTumour directory.
    """
    if cases < 1 or test_cases < 0:
        raise ValueError(f"need cases >= 1 and test_cases >= 0, got {cases} and {test_cases}")
    shape = _check_shape(shape)
    task = Path(root) / TASK
    for sub in ("imagesTr", "labelsTr", "imagesTs"):
        (task / sub).mkdir(parents=True, exist_ok=True)
    numbers = range(1, cases + test_cases + 1)
    bar = _progress(len(numbers), progress)
    for number in numbers:
        case = generate_case(shape, seed, number)
        name = case_name(number)
        if number <= cases:
            nib.save(_nifti(case.image, case.affine), task / "imagesTr" / f"{name}.nii.gz")
            nib.save(_nifti(case.label, case.affine), task / "labelsTr" / f"{name}.nii.gz")
        else:
            nib.save(_nifti(case.image, case.affine), task / "imagesTs" / f"{name}.nii.gz")
        bar.update(1)
    bar.close()
    meta = dataset_json([case_name(n) for n in numbers[:cases]],
                        [case_name(n) for n in numbers[cases:]])
    (task / "dataset.json").write_text(json.dumps(meta, indent=4) + "\n")
    return task


def _progress(total: int, enabled: bool):
    return tqdm(total=total, desc="synthetic cases", unit="case", disable=not enabled)


def write_msd_tar(path: Path | str, cases: int, shape: Sequence[int] = (48, 48, 24),
                  seed: int = 0, test_cases: int = 0, macos_junk: bool = True,
                  workdir: Path | str | None = None) -> Path:
    """Write a tar of a generated task, laid out like the real ``Task01_BrainTumour.tar``.

    With ``macos_junk`` it also holds the AppleDouble ``._BRATS_*`` files that the real tar
    carries. Members are sorted with fixed owner and mtime, so the bytes depend only on the
    arguments. ``workdir`` (default: next to ``path``) holds the generated files meanwhile.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(dir=workdir or path.parent, prefix=".synthetic-"))
    try:
        task = write_msd_task(scratch, cases, shape, seed, test_cases)
        with tarfile.open(path, "w", format=tarfile.PAX_FORMAT) as tar:
            for item in sorted(task.rglob("*")):
                arcname = item.relative_to(scratch).as_posix()
                _add_member(tar, arcname, None if item.is_dir() else item.read_bytes())
                if macos_junk and item.is_file() and item.name.startswith("BRATS_"):
                    junk = item.with_name("._" + item.name).relative_to(scratch).as_posix()
                    _add_member(tar, junk, b"\x00\x05\x16\x07AppleDouble junk")
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return path


def _add_member(tar: tarfile.TarFile, name: str, data: bytes | None) -> None:
    info = tarfile.TarInfo(name)
    info.mtime, info.uid, info.gid, info.uname, info.gname = 0, 0, 0, "", ""
    if data is None:
        info.type, info.mode = tarfile.DIRTYPE, 0o755
        tar.addfile(info)
    else:
        info.size, info.mode = len(data), 0o644
        tar.addfile(info, io.BytesIO(data))
