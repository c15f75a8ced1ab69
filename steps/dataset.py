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

import functools
import math
import shutil
import tempfile
import time
import warnings
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import numpy as np
import torch

from steps import bykey, schemas
from steps.artifacts import MANIFEST, inside, manifest_digest, require
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


class Case:
    """One preprocessed case: ``image`` (C, D, H, W) and ``label`` (D, H, W), memory-mapped.

    ``open_cases`` opens both when either is first used (a case read by key is fetched then);
    ``shape`` is the image's (C, D, H, W) as ``dataset.json`` states it, known before that.
    """

    def __init__(self, name: str, image: np.ndarray | None = None,
                 label: np.ndarray | None = None, spacing=(1.0, 1.0, 1.0),
                 shape: Sequence[int] | None = None,
                 opener: Callable[[], tuple[np.ndarray, np.ndarray]] | None = None):
        self.name, self.spacing = name, tuple(spacing)
        self._arrays = None if opener else (image, label)
        self._opener = opener
        self.shape = tuple(shape) if shape is not None else tuple(image.shape)

    def open(self) -> tuple[np.ndarray, np.ndarray]:
        """(image, label), opened and checked the first time."""
        if self._arrays is None:
            self._arrays = self._opener()
        return self._arrays

    @property
    def image(self) -> np.ndarray:
        return self.open()[0]

    @property
    def label(self) -> np.ndarray:
        return self.open()[1]


@dataclass
class Source:
    """Where a step reads the ``dataset`` artifact: its directory (``remote`` None), or the
    scratch folder that the files it uses are fetched into, each when first opened, from the
    S3 prefix the artifact was saved at (``steps.bykey``)."""
    root: Path
    remote: bykey.Remote | None = None
    fetched: set[str] = field(default_factory=set)
    seconds: float = 0.0            # spent fetching (the step waits for each fetch)

    def __str__(self) -> str:
        return self.remote.uri if self.remote is not None else str(self.root)

    def path(self, rel: Any, where: str) -> Path:
        """The file ``rel`` of the artifact, inside it (read by key: fetched and checked
        against the manifest the first time)."""
        path = inside(self.root, rel, where)
        if self.remote is not None and rel not in self.fetched:
            if rel not in self.remote.files:
                raise StepError(f"{where}: {rel!r} is not listed in its {MANIFEST}")
            start = time.perf_counter()
            self.remote.fetch(rel, path)
            self.seconds += time.perf_counter() - start
            self.fetched.add(rel)
        return path

    def manifest_sha256(self) -> str:
        return self.remote.manifest_sha256 if self.remote is not None else \
            manifest_digest(self.root)

    def moved_note(self) -> str:
        """``, <n> bytes of dataset fetched by key in <s> s`` (``bykey.FETCHED``), or
        nothing."""
        return "" if self.remote is None else ", " + bykey.fetched_note(
            self.remote, sorted(self.fetched), self.seconds)


def read_metadata(dataset_dir: Path | str, check_hashes: bool = True) -> dict[str, Any]:
    """Verify the artifact's manifest and return its checked ``dataset.json``."""
    dataset_dir = Path(dataset_dir)
    require(dataset_dir, "dataset", check_hashes=check_hashes)
    where = f"artifact 'dataset' at {dataset_dir}: {DATASET_JSON}"
    return _checked_json(dataset_dir / DATASET_JSON, where)


@contextmanager
def read_dataset(location: Path | str, beside: Path) -> Iterator[tuple[Source, dict[str, Any]]]:
    """(the :class:`Source`, the checked ``dataset.json``) of the artifact at ``location``: a
    directory, verified whole (``read_metadata``), or an S3 prefix (``--dataset
    s3://BUCKET/PREFIX``), read by key: its manifest, its ``dataset.json``, then only the
    cases the step opens, into a scratch folder made in ``beside`` (the output's parent) and
    removed on the way out, on error and SIGTERM too."""
    if not bykey.is_remote(location):
        yield Source(Path(location)), read_metadata(location)
        return
    beside.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix=".dataset-by-key-", dir=beside))
    try:
        source = Source(scratch, bykey.open_remote(str(location), "dataset"))
        where = f"artifact 'dataset' at {location}: {DATASET_JSON}"
        yield source, _checked_json(source.path(DATASET_JSON, where), where)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def _checked_json(path: Path, where: str) -> dict[str, Any]:
    meta = schemas.read_json(path, where)
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
    # OverflowError: a negative dimension in the header (mmap's length); TypeError: one that
    # is not an integer.
    except (OSError, ValueError, EOFError, OverflowError, TypeError) as exc:
        raise StepError(f"{where}: {path.name} is not a readable .npy array ({exc})") from None


def open_cases(dataset: Source | Path | str, meta: dict[str, Any],
               names: list[str] | None = None) -> list[Case]:
    """The cases called ``names`` (all cases when None), in that order: a directory's mapped
    at once, a prefix's each fetched and mapped when first used (:func:`open_pair`)."""
    source = dataset if isinstance(dataset, Source) else Source(Path(dataset))
    by_name = {case["name"]: case for case in meta["cases"]}
    cases = []
    for name in (list(by_name) if names is None else names):
        if name not in by_name:
            raise StepError(f"artifact 'dataset' at {source}: case '{name}' is not in "
                            f"{DATASET_JSON}")
        entry = by_name[name]
        case = Case(name, spacing=entry["spacing"], shape=entry["shape"],
                    opener=functools.partial(open_pair, source, meta, entry))
        if source.remote is None:
            case.open()               # a directory's cases are mapped, and checked, at once
        cases.append(case)
    return cases


def open_pair(source: Source, meta: dict[str, Any],
              entry: dict[str, Any]) -> tuple[np.ndarray, np.ndarray]:
    """Memory-map one case's image and label. Each path stays inside the artifact, and each
    array's dtype and shape are what ``dataset.json`` says: image (C, D, H, W) of
    ``image_dtype``, label (D, H, W) uint8."""
    where = f"artifact 'dataset' at {source}: case '{entry['name']}'"
    image = _load(source.path(entry["image"], where), where)
    label = _load(source.path(entry["label"], where), where)
    channels = len(meta["channels"])
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
    if list(image.shape) != list(entry["shape"]):
        raise StepError(f"{where}: image of shape {list(image.shape)}, {DATASET_JSON} says "
                        f"{list(entry['shape'])}")
    return image, label


def check_values(cases: list[Case], n_classes: int) -> None:
    """Every image voxel finite and every label below ``n_classes``: one read of each case
    (the manifest's hash check has just read the same bytes, so they are in the page cache)."""

    for case in cases:
        # a reduction: isfinite(image) made a mask of the whole volume, and train's memory
        # followed the largest case (issue 47)
        if not all(math.isfinite(end) for end in value_range(case.image)):
            image = torch_view(case.image)
            bad = sum(int(torch.count_nonzero(~torch.isfinite(image[:, z])))
                      for z in range(image.shape[1]))
            raise StepError(f"artifact 'dataset': case '{case.name}' image has {bad} NaN/Inf "
                            "voxels")
        top = int(case.label.max())
        if top >= n_classes:
            raise StepError(f"artifact 'dataset': case '{case.name}' label value {top} is not "
                            f"one of the {n_classes} classes in {DATASET_JSON}")


def value_range(array: np.ndarray) -> tuple[float, float]:
    """(min, max) of ``array`` in one pass, without a mask or a copy of it: a NaN anywhere
    makes both NaN and an infinity one end infinite, so both are finite only when every
    value is."""
    return tuple(float(v) for v in torch_view(array.ravel(order="K")).aminmax())


def torch_view(array: np.ndarray):
    """``array`` as a torch tensor on the same memory, read-only buffers (memory maps,
    decompressed bytes) included: callers only read those. Torch's element-wise copies are
    vectorised where numpy's are not (float32 ↔ float16 about 10× faster)."""

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)     # "not writable"
        return torch.from_numpy(array)
