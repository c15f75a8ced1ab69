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

import json
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

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
    try:
        meta = json.loads((dataset_dir / DATASET_JSON).read_text())
    except (OSError, ValueError, UnicodeDecodeError) as exc:
        raise StepError(f"{where} cannot be read ({exc})") from None
    if not isinstance(meta, dict) or meta.get("format_version") != FORMAT_VERSION:
        raise StepError(f"{where} format_version "
                        f"{meta.get('format_version') if isinstance(meta, dict) else None} "
                        f"is not {FORMAT_VERSION}")
    _check_structure(meta, where)
    return meta


def _check_structure(meta: dict[str, Any], where: str) -> None:
    """The keys that train and convert index, with their types; folds never validate on
    their own training cases (whether a fold can train is train's check)."""
    def need(ok: bool, what: str) -> None:
        if not ok:
            raise StepError(f"{where}: {what}")

    labels, patch, cases = meta.get("labels"), meta.get("patch_size"), meta.get("cases")
    need(isinstance(meta.get("channels"), list) and meta["channels"], "'channels' must be a "
         "non-empty list")
    need(isinstance(labels, dict) and 2 <= len(labels) <= 256
         and sorted(labels) == sorted(str(i) for i in range(len(labels))),
         "'labels' must map '0'..'N-1' (2 to 256 classes) to names")
    need(isinstance(patch, list) and len(patch) == 2
         and all(isinstance(n, int) and 1 <= n <= 4096 for n in patch),
         "'patch_size' must be [H, W], each 1..4096")
    need(isinstance(cases, list) and len(cases) >= 1, "'cases' must list at least one case")
    for case in cases:
        need(isinstance(case, dict) and all(isinstance(case.get(k), str)
                                            for k in ("name", "image", "label"))
             and isinstance(case.get("spacing"), list) and len(case["spacing"]) == 3,
             "every case needs 'name', 'image', 'label' and 'spacing' [D, H, W]")
    names = [case["name"] for case in cases]
    need(len(set(names)) == len(names), "case names must be unique")
    folds = meta.get("folds")
    need(isinstance(folds, list) and folds and all(
        isinstance(f, dict) and isinstance(f.get("train"), list) and isinstance(f.get("val"), list)
        for f in folds), "'folds' must list {train, val} name lists")
    for index, fold in enumerate(folds):
        shared = sorted(set(fold["train"]) & set(fold["val"]))
        need(not shared, f"fold {index} validates on its training case {shared[:1]}")
        unknown = sorted(set(fold["train"] + fold["val"]) - set(names))
        need(not unknown, f"fold {index} names unknown case {unknown[:1]}")


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
        cases.append(Case(name=name, image=image, label=label,
                          spacing=tuple(entry["spacing"])))
    return cases


def check_values(cases: list[Case], n_classes: int) -> None:
    """Every image voxel finite and every label below ``n_classes``: one read of each case
    (the manifest's hash check has just read the same bytes, so they are in the page cache)."""
    import torch

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
    import torch

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)     # "not writable"
        return torch.from_numpy(array)
