"""Whole-volume segmentation metrics: Dice per label and per BraTS region, and the 95th
percentile Hausdorff distance per region, per case and averaged over cases.

Labels are Task01_BrainTumour's (its ``dataset.json``): 1 edema, 2 non-enhancing tumour,
3 enhancing tumour. The BraTS regions in that order are whole tumour WT = {1, 2, 3}, tumour
core TC = {2, 3} and enhancing tumour ET = {3}. (BraTS 2021 numbers its labels 1 necrotic
core, 2 edema, 4 enhancing, so a region table written for that order, TC = {1, 4}, reads
Task01's edema as core.)

Empty masks, explicitly (BraTS's convention, which ours follows):

- Dice: truth and prediction both empty → 1; exactly one empty → 0.
- HD95: both empty → 0 mm; exactly one empty → :data:`EMPTY_HD95_MM`, the diagonal of the
  240×240×155 mm volume, the largest distance it holds.

nnU-Net v2 differs for Dice: it gives NaN where truth and prediction are both empty
(``nnunetv2/evaluation/evaluate_predictions.py``, ``compute_metrics``: tp + fp + fn == 0)
and leaves such cases out of its mean (``np.nanmean``), so on a label that many cases lack
its mean is over fewer cases than ours. :func:`mean_over_cases` gives that mean too
(``empty_both="skip"``). nnU-Net reports no Hausdorff distance.

HD95 is MONAI's ``HausdorffDistanceMetric(percentile=95)`` (tests/test_metrics.py holds the
two equal): each mask's surface is the mask minus its erosion by the 6-neighbour cross
(scipy's default, MONAI's ``get_mask_edges`` without subvoxel areas); the 95th percentile of the surface distances from prediction to truth and from truth to
prediction, the larger of the two, in mm at the volume's spacing.
"""
from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

import numpy as np
from scipy import ndimage

LABELS = {1: "edema", 2: "non-enhancing", 3: "enhancing"}
REGIONS = {"WT": (1, 2, 3), "TC": (2, 3), "ET": (3,)}
EMPTY_HD95_MM = math.sqrt(240 ** 2 + 240 ** 2 + 155 ** 2)     # 373.13 mm, as BraTS reports
_CROSS = ndimage.generate_binary_structure(3, 1)       # a voxel and its 6 face neighbours


def dice(prediction: np.ndarray, truth: np.ndarray) -> float:
    """Dice of two boolean masks of one shape; 1 where both are empty, 0 where one is."""
    total = int(prediction.sum()) + int(truth.sum())
    if total == 0:
        return 1.0
    return 2.0 * int(np.logical_and(prediction, truth).sum()) / total


def surface(mask: np.ndarray) -> np.ndarray:
    """The voxels of ``mask`` (D, H, W) bool with a face neighbour outside it (the volume's
    border counts as outside)."""
    return mask & ~ndimage.binary_erosion(mask, structure=_CROSS, border_value=0)


def hd95(prediction: np.ndarray, truth: np.ndarray,
         spacing: Sequence[float] = (1.0, 1.0, 1.0)) -> float:
    """The symmetric 95th-percentile Hausdorff distance in mm between two boolean masks
    (D, H, W), ``spacing`` the voxel's size along each axis; empty masks as the module says."""
    if not prediction.any() and not truth.any():
        return 0.0
    if not prediction.any() or not truth.any():
        return EMPTY_HD95_MM
    edges_p, edges_t = surface(prediction), surface(truth)
    to_truth = ndimage.distance_transform_edt(~edges_t, sampling=spacing)[edges_p]
    to_prediction = ndimage.distance_transform_edt(~edges_p, sampling=spacing)[edges_t]
    return float(max(np.percentile(to_truth, 95), np.percentile(to_prediction, 95)))


def case_metrics(prediction: np.ndarray, truth: np.ndarray,
                 spacing: Sequence[float] = (1.0, 1.0, 1.0)) -> dict:
    """One case's figures: prediction, truth (D, H, W) integer labels of one shape →
    ``{"dice": {label or region: value}, "hd95": {region: mm}, "empty": [names]}``, where
    ``empty`` lists the labels and regions absent from both."""
    if prediction.shape != truth.shape:
        raise ValueError(f"prediction {prediction.shape} and truth {truth.shape} differ in shape")
    scores: dict = {"dice": {}, "hd95": {}, "empty": []}
    masks = [(name, (label,)) for label, name in LABELS.items()] + list(REGIONS.items())
    for name, labels in masks:
        pred, true = np.isin(prediction, labels), np.isin(truth, labels)
        scores["dice"][name] = dice(pred, true)
        if name in REGIONS:
            scores["hd95"][name] = hd95(pred, true, spacing)
        if not pred.any() and not true.any():
            scores["empty"].append(name)
    return scores


# ------------------------------------------------------- postprocessing (nnU-Net v1's)
# nnU-Net v1 (nnunet/postprocessing/connected_components.py, determine_postprocessing) decides
# on the pooled cross-validation predictions: first, keep only the largest connected component
# of the foreground (every label together), if that raises some label's mean Dice and lowers
# none; then, on that result or the raw one, keep only the largest component of each label,
# for the labels whose mean Dice it raises. Components are scipy.ndimage.label's (face
# neighbours), as there. Each case records its labels' Dice under the three variants below;
# :func:`decide_postprocessing` makes the decision over the pooled cases.
VARIANTS = ("foreground", "per_label", "foreground_then_per_label")


def keep_largest_component(prediction: np.ndarray, labels: Sequence[int]) -> np.ndarray:
    """A copy of ``prediction`` (D, H, W) whose voxels of ``labels`` (taken together) outside
    their largest connected component are background."""
    out = prediction.copy()
    mask = np.isin(out, labels)
    components, count = ndimage.label(mask)
    if count > 1:
        sizes = np.bincount(components.ravel())[1:]
        out[mask & (components != int(sizes.argmax()) + 1)] = 0
    return out


def postprocessed(prediction: np.ndarray) -> dict[str, np.ndarray]:
    """The prediction under each of :data:`VARIANTS`."""
    foreground = keep_largest_component(prediction, tuple(LABELS))
    return {"foreground": foreground, "per_label": _each_label(prediction),
            "foreground_then_per_label": _each_label(foreground)}


def _each_label(prediction: np.ndarray) -> np.ndarray:
    return apply_postprocessing(prediction, [[label] for label in LABELS])


def apply_postprocessing(prediction: np.ndarray, groups: Sequence[Sequence[int]]) -> np.ndarray:
    """``prediction`` (D, H, W) with each group's largest component kept, group by group."""
    for group in groups:
        prediction = keep_largest_component(prediction, group)
    return prediction


def decided_groups(decision: dict) -> list[list[int]]:
    """:func:`decide_postprocessing`'s decision as the label groups to apply, in order
    (nnU-Net v1's ``for_which_classes``): the foreground, then each chosen label."""
    ids = {name: label for label, name in LABELS.items()}
    return ([sorted(LABELS)] if decision["foreground_largest_component"] else []) + [
        [ids[name]] for name in decision["largest_component_labels"]]


def label_dice(prediction: np.ndarray, truth: np.ndarray) -> dict[str, float]:
    return {name: dice(prediction == label, truth == label) for label, name in LABELS.items()}


def decide_postprocessing(cases: Iterable[dict]) -> dict:
    """nnU-Net v1's decision (above) over cases that each hold ``dice`` per label (raw) and
    ``largest_component`` (:func:`postprocessed`'s variants' label Dice); means as nnU-Net's,
    leaving out a label's both-empty cases (keeping components never empties a mask).
    A label that every case lacks has no mean: NaN in the comparisons, so that, as in
    nnU-Net v1 (whose nanmean gives NaN there and ``>``/``<`` on it are false), it neither
    gains nor loses and is never chosen; None in ``mean_dice`` (JSON null, as
    ``mean_nnunet``'s)."""
    cases = list(cases)

    def mean(variant: str | None) -> dict[str, float]:
        return {name: float(np.mean(values)) if (values := [
            (c["dice"] if variant is None else c["largest_component"][variant])[name]
            for c in cases if name not in c["empty"]]) else float("nan")
            for name in LABELS.values()}

    raw = mean(None)
    foreground = mean("foreground")
    gains = [foreground[n] > raw[n] for n in raw]
    losses = [foreground[n] < raw[n] for n in raw]
    whole = any(gains) and not any(losses)
    before = foreground if whole else raw
    after = mean("foreground_then_per_label" if whole else "per_label")
    labels = [n for n in raw if after[n] > before[n]]

    def shown(table: dict[str, float]) -> dict[str, float | None]:
        return {n: None if math.isnan(v) else v for n, v in table.items()}

    return {"foreground_largest_component": whole, "largest_component_labels": labels,
            "mean_dice": {"raw": shown(raw), "foreground": shown(foreground),
                          "then_per_label": shown(after)},
            "rule": "nnU-Net v1 determine_postprocessing, dice_threshold 0"}


def mean_over_cases(cases: Iterable[dict], empty_both: str = "count") -> dict[str, dict]:
    """Each figure's mean over cases (:func:`case_metrics`' dicts). ``empty_both="skip"``
    leaves out, per figure, the cases where truth and prediction are both empty, as
    nnU-Net's nanmean does (NaN where no case is left)."""
    if empty_both not in ("count", "skip"):
        raise ValueError(f"empty_both must be 'count' or 'skip', not {empty_both!r}")
    cases = list(cases)
    if not cases:
        raise ValueError("no case to average")
    out: dict[str, dict[str, float]] = {}
    for metric in ("dice", "hd95"):
        out[metric] = {}
        for key in cases[0][metric]:
            values = [c[metric][key] for c in cases
                      if empty_both == "count" or key not in c["empty"]]
            out[metric][key] = float(np.mean(values)) if values else float("nan")
    return out
