"""The ``dataset`` artifact: format, fold split and memory-mapped reading.

Layout (written by ``steps.preprocess``, read by ``steps.train`` and ``steps.convert``)::

    dataset/
      dataset.json                 metadata, below
      cases/<case>_image.npy       (C, D, H, W) image, float16 (default) or float32
      cases/<case>_label.npy       (D, H, W) uint8 label
      MANIFEST.json                written last (steps.artifacts)

Axes follow the anchors: a NIfTI image stored (x, y, z, c) becomes (c, z, y, x) = (C, D, H, W)
(their transpose (3, 2, 1, 0)), so one D index is one axial 2D slice of shape (H, W) with H
along y and W along x.

``dataset.json`` keys:

- ``format_version`` (int), ``name`` (str), ``mode`` ("default" or "anchor")
- ``channels``: list of modality names in channel order, e.g. ["FLAIR", "T1w", "t1gd", "T2w"]
- ``labels``: {"0": "background", "1": "edema", ...}
- ``patch_size``: [H, W] training patch, e.g. [192, 160]
- ``image_dtype``, ``label_dtype``: numpy dtype names
- ``normalisation``: {"method": "zscore", "channel_wise": true, "nonzero": false,
  "foreground_crop": true, "statistics": "<how mean and std were computed>"}
- ``cases``: list of {"name", "image", "label" (paths relative to the artifact), "shape"
  ([C, D, H, W] as stored), "spacing" ([D, H, W] in mm), "original_shape" ([x, y, z] of the
  source NIfTI grid), "crop" ([[d0, d1], [h0, h1], [w0, w1]] half-open box in the source grid
  after the transpose), "mean", "std" (per channel, before normalisation), "window"
  ([[h0, h1], [w0, w1]] stored in-plane extent in crop coordinates; negative = padding),
  "source_orientation" (axis codes of the source affine), "dtype_max_abs_error"}
- ``orientation``, ``in_plane``: how voxel order and the in-plane extent were decided
- ``normalisation`` also holds ``foreground`` (the crop's voxel test) and
  ``image_dtype_error`` {"max_abs", "definition"}: the measured storage rounding error
- ``folds``: five {"train": [case names], "val": [case names]}, the anchors' split
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from steps import schemas
from steps.artifacts import inside, require
from steps.errors import StepError
from steps.params import N_FOLDS

DATASET_JSON = "dataset.json"
FORMAT_VERSION = 1
SPLIT_SEED = 12345


def kfold_split(names: list[str], n_splits: int = N_FOLDS,
                seed: int = SPLIT_SEED) -> list[dict[str, list[str]]]:
    """The anchors' split: ``KFold(n_splits, shuffle=True, random_state=seed)`` over sorted names.

    Reimplemented with NumPy's legacy RandomState so it gives exactly scikit-learn's folds.
    With fewer cases than ``n_splits`` there is one fold per case (leave one out); a single
    case makes one fold with nothing to train on, which train refuses for its ``--fold``.
    """
    ordered = sorted(names)
    n = len(ordered)
    if n == 0:
        return []
    n_splits = min(n_splits, n)
    order = np.arange(n)
    np.random.RandomState(seed).shuffle(order)
    sizes = np.full(n_splits, n // n_splits, dtype=int)
    sizes[: n % n_splits] += 1
    folds, start = [], 0
    for size in sizes:
        val_index = set(order[start:start + size].tolist())
        start += size
        folds.append({
            "train": [ordered[i] for i in range(n) if i not in val_index],
            "val": [ordered[i] for i in range(n) if i in val_index],
        })
    return folds


@dataclass
class Case:
    """One preprocessed case: ``image`` (C, D, H, W) and ``label`` (D, H, W), memory-mapped."""
    name: str
    image: np.ndarray
    label: np.ndarray
    spacing: tuple[float, float, float]


def read_metadata(dataset_dir: Path | str, check_hashes: bool = True) -> dict[str, Any]:
    """Verify the artifact's manifest and return its checked ``dataset.json``."""
    dataset_dir = Path(dataset_dir)
    require(dataset_dir, "dataset", check_hashes=check_hashes)
    where = f"artifact 'dataset' at {dataset_dir}: {DATASET_JSON}"
    meta = schemas.read_json(dataset_dir / DATASET_JSON, where)
    check_metadata(meta, where)
    return meta


def check_metadata(meta: Any, where: str) -> None:
    """``meta`` against ``schemas.Dataset``: what preprocess publishes and its readers
    accept (whether a fold can train is train's check)."""
    schemas.validate(schemas.Dataset, meta, where)


def fold_names(meta: dict[str, Any], fold: int) -> tuple[list[str], list[str]]:
    """(train, val) case names of ``fold``; a fold out of range is a StepError."""
    folds = meta["folds"]
    if not 0 <= fold < len(folds):
        raise StepError(f"--fold {fold} is out of range: dataset has folds 0..{len(folds) - 1}")
    return list(folds[fold]["train"]), list(folds[fold]["val"])


def _load(path: Path, where: str) -> np.ndarray:
    try:
        return np.load(path, mmap_mode="r", allow_pickle=False)
    except (OSError, ValueError, EOFError) as exc:
        raise StepError(f"{where}: {path.name} is not a readable .npy array ({exc})") from None


def open_cases(dataset_dir: Path | str, meta: dict[str, Any],
               names: list[str] | None = None) -> list[Case]:
    """Memory-map the cases called ``names`` (all cases when None), in that order.

    Each array's path stays inside the artifact, and its dtype and shape are what
    ``dataset.json`` says: image (C, D, H, W) of ``image_dtype``, label (D, H, W) uint8.
    """
    dataset_dir = Path(dataset_dir)
    by_name = {case["name"]: case for case in meta["cases"]}
    selected = list(by_name) if names is None else names
    channels = len(meta["channels"])
    cases = []
    for name in selected:
        where = f"artifact 'dataset' at {dataset_dir}: case '{name}'"
        if name not in by_name:
            raise StepError(f"{where} is not in {DATASET_JSON}")
        entry = by_name[name]
        image = _load(inside(dataset_dir, entry["image"], where), where)
        label = _load(inside(dataset_dir, entry["label"], where), where)
        if (image.dtype != np.dtype(meta.get("image_dtype", image.dtype)) or image.ndim != 4
                or image.shape[0] != channels or label.dtype != np.uint8
                or label.shape != image.shape[1:] or 0 in image.shape):
            raise StepError(f"{where}: image {image.dtype} {list(image.shape)} and label "
                            f"{label.dtype} {list(label.shape)} are not (C={channels}, D, H, W) "
                            f"{meta.get('image_dtype')} and (D, H, W) uint8")
        # preprocess pads every case in-plane to at least patch_size, which train has checked
        # against the network's depth; a smaller slice could reach a 1x1 deepest level, where
        # instance norm has nothing to normalise (torch refuses it even in eval).
        if any(got < want for got, want in zip(image.shape[2:], meta["patch_size"])):
            raise StepError(f"{where}: slices of {image.shape[2]}x{image.shape[3]} are smaller "
                            f"than patch_size {meta['patch_size'][0]}x{meta['patch_size'][1]}, "
                            "to which preprocess pads every case")
        cases.append(Case(name=name, image=image, label=label,
                          spacing=tuple(entry["spacing"])))
    return cases


def check_values(cases: list[Case], n_classes: int) -> None:
    """Every image voxel finite and every label below ``n_classes``: one read of each case
    (the manifest's hash check has just read the same bytes, so they are in the page cache)."""

    for case in cases:
        image = torch_view(case.image)
        if not bool(torch.isfinite(image).all()):
            bad = int((~torch.isfinite(image)).sum())
            raise StepError(f"artifact 'dataset': case '{case.name}' image has {bad} NaN/Inf "
                            "voxels")
        top = int(case.label.max())
        if top >= n_classes:
            raise StepError(f"artifact 'dataset': case '{case.name}' label value {top} is not "
                            f"one of the {n_classes} classes in {DATASET_JSON}")


def torch_view(array: np.ndarray):
    """``array`` as a torch tensor on the same memory, read-only buffers (memory maps,
    decompressed bytes) included: callers only read those. Torch's element-wise copies are
    vectorised where numpy's are not (float32 ↔ float16 about 10× faster)."""

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)     # "not writable"
        return torch.from_numpy(array)
