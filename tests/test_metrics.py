"""steps.metrics: Dice per label and BraTS region and HD95 against cases computed by hand,
the empty-mask rules, and MONAI's DiceMetric and HausdorffDistanceMetric(percentile=95) on
the same masks."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from monai.metrics import DiceMetric, HausdorffDistanceMetric
from scipy import ndimage

from steps import metrics


def volume(shape=(4, 4, 4)) -> np.ndarray:
    return np.zeros(shape, dtype=np.uint8)


def test_dice_by_label_and_region_by_hand():
    """truth: 4 voxels of edema, 2 of enhancing; prediction: 3 of edema (2 on the truth's),
    1 of non-enhancing on a truth's enhancing voxel, no enhancing."""
    truth, prediction = volume(), volume()
    truth[0, 0, :4] = 1
    truth[1, 0, :2] = 3
    prediction[0, 0, 2:4] = 1
    prediction[2, 0, 0] = 1
    prediction[1, 0, 0] = 2
    got = metrics.case_metrics(prediction, truth)["dice"]
    assert got["edema"] == pytest.approx(2 * 2 / (3 + 4))
    assert got["non-enhancing"] == 0.0             # truth has none, prediction has one
    assert got["enhancing"] == 0.0                 # prediction has none, truth has two
    assert got["WT"] == pytest.approx(2 * 3 / (4 + 6))    # {1,2,3}: overlap 2 + 1
    assert got["TC"] == pytest.approx(2 * 1 / (1 + 2))    # {2,3}: the one core voxel
    assert got["ET"] == got["enhancing"]


def test_hd95_by_hand():
    """A line of 21 voxels against its first voxel: distances from the line 0..20 mm, whose
    95th percentile is 19 (numpy's linear rule, 0.95 × 20); back, 0. Along an axis of
    2 mm voxels, twice that."""
    truth, prediction = volume((1, 1, 21)), volume((1, 1, 21))
    truth[0, 0, 0] = 1
    prediction[0, 0, :] = 1
    assert metrics.hd95(prediction == 1, truth == 1) == pytest.approx(19.0)
    assert metrics.hd95(prediction == 1, truth == 1, (1, 1, 2)) == pytest.approx(38.0)
    assert metrics.hd95(truth == 1, truth == 1) == 0.0


def test_surface_is_the_mask_minus_its_face_neighbour_erosion():
    """The erosion keeps a voxel whose six face neighbours are all inside: the centre of a
    3×3×3 cube, and the centre of a 7-voxel cross, whose edges and corners (no matter to
    the 6-neighbour rule) are empty. Everything else is surface."""
    cube = volume((5, 5, 5)).astype(bool)
    cube[1:4, 1:4, 1:4] = True
    assert metrics.surface(cube).sum() == 26 and not metrics.surface(cube)[2, 2, 2]
    plus = volume((5, 5, 5)).astype(bool)
    for axis in range(3):
        index = [2, 2, 2]
        for at in (1, 2, 3):
            index[axis] = at
            plus[tuple(index)] = True
    assert plus.sum() == 7 and metrics.surface(plus).sum() == 6 and not metrics.surface(
        plus)[2, 2, 2]


def test_empty_versus_empty_and_one_empty():
    empty, some = volume(), volume()
    some[1, 1, 1] = 3
    both = metrics.case_metrics(empty, empty)
    assert both["dice"] == {k: 1.0 for k in both["dice"]}
    assert both["hd95"] == {"WT": 0.0, "TC": 0.0, "ET": 0.0}
    assert set(both["empty"]) == {"edema", "non-enhancing", "enhancing", "WT", "TC", "ET"}
    for pred, true in ((empty, some), (some, empty)):
        one = metrics.case_metrics(pred, true)
        assert one["dice"]["ET"] == 0.0 and one["dice"]["edema"] == 1.0
        assert one["hd95"]["ET"] == pytest.approx(373.13, abs=0.01)
        assert one["empty"] == ["edema", "non-enhancing"]


def test_the_mean_counts_empty_pairs_or_skips_them_as_nnunet_does():
    empty, hit, miss = volume(), volume(), volume()
    hit[0, 0, 0] = 3
    miss[3, 3, 3] = 3
    cases = [metrics.case_metrics(empty, empty), metrics.case_metrics(hit, hit),
             metrics.case_metrics(miss, hit)]
    ours = metrics.mean_over_cases(cases)
    nnunet = metrics.mean_over_cases(cases, empty_both="skip")
    assert ours["dice"]["ET"] == pytest.approx((1 + 1 + 0) / 3)
    assert nnunet["dice"]["ET"] == pytest.approx((1 + 0) / 2)
    assert math.isnan(nnunet["dice"]["edema"])          # empty in every case
    assert ours["hd95"]["ET"] == pytest.approx((0 + 0 + math.sqrt(27)) / 3)
    with pytest.raises(ValueError, match="empty_both"):
        metrics.mean_over_cases(cases, empty_both="nan")
    with pytest.raises(ValueError, match="no case"):
        metrics.mean_over_cases([])


def test_shapes_must_agree():
    with pytest.raises(ValueError, match="differ in shape"):
        metrics.case_metrics(volume((4, 4, 4)), volume((4, 4, 5)))


def blobs(seed: int, shape=(24, 32, 28)) -> np.ndarray:
    """Nested tumour-like regions: smoothed noise thresholded at three levels."""
    field = ndimage.gaussian_filter(np.random.default_rng(seed).normal(size=shape), 3)
    labels = volume(shape)
    for label, quantile in ((1, 0.80), (2, 0.90), (3, 0.96)):
        labels[field > np.quantile(field, quantile)] = label
    return labels


@pytest.mark.parametrize("seed, spacing", [(1, (1.0, 1.0, 1.0)), (2, (2.0, 0.8, 1.2))])
def test_the_same_numbers_as_monai(seed, spacing):
    """Per region, Dice and HD95 as MONAI's DiceMetric and HausdorffDistanceMetric
    (percentile 95, symmetric, Euclidean) compute them on the same one-hot masks."""
    truth, prediction = blobs(seed), blobs(seed + 100)
    ours = metrics.case_metrics(prediction, truth, spacing)
    assert ours["empty"] == []

    def one_hot(labels):
        masks = [np.isin(labels, region) for region in metrics.REGIONS.values()]
        return torch.from_numpy(np.stack(masks)[None].astype(np.float32))   # (1, 3, D, H, W)

    dice = DiceMetric(include_background=True, reduction="none")(one_hot(prediction),
                                                                 one_hot(truth))
    hd = HausdorffDistanceMetric(include_background=True, percentile=95, reduction="none")(
        one_hot(prediction), one_hot(truth), spacing=list(spacing))
    for i, region in enumerate(metrics.REGIONS):
        assert ours["dice"][region] == pytest.approx(dice[0, i].item(), abs=1e-6)
        assert ours["hd95"][region] == pytest.approx(hd[0, i].item(), abs=1e-4)


# ---------------------------------------------------------------- postprocessing, by hand

def test_the_largest_component_is_kept_by_face_neighbours():
    """Two blobs of label 1 (4 voxels and 2), a voxel of label 2 touching the big one by an
    edge only, and a label-3 voxel inside the big blob's face neighbourhood."""
    volume = np.zeros((1, 5, 6), np.uint8)
    volume[0, 0, 0:4] = 1            # 4 voxels
    volume[0, 3, 4:6] = 1            # 2 voxels, apart
    volume[0, 1, 4] = 2              # touches (0, 3) by an edge only
    volume[0, 1, 0] = 3              # face neighbour of (0, 0)
    only_1 = metrics.keep_largest_component(volume, (1,))
    assert only_1[0, 3, 4:6].tolist() == [0, 0] and only_1[0, 0, 0:4].tolist() == [1] * 4
    assert only_1[0, 1, 4] == 2 and only_1[0, 1, 0] == 3         # other labels untouched
    foreground = metrics.keep_largest_component(volume, (1, 2, 3))
    assert np.argwhere(foreground).tolist() == [[0, 0, 0], [0, 0, 1], [0, 0, 2], [0, 0, 3],
                                                 [0, 1, 0]]
    assert volume[0, 3, 4] == 1                                   # a copy, not in place
    kept = metrics.postprocessed(volume)
    assert np.array_equal(kept["foreground"], foreground)
    assert np.array_equal(kept["per_label"], only_1)              # one voxel each of 2 and 3
    assert np.array_equal(kept["foreground_then_per_label"], foreground)


def _case(raw: dict, foreground: dict, per_label: dict, then: dict, empty=()) -> dict:
    return {"dice": raw, "empty": list(empty), "largest_component": {
        "foreground": foreground, "per_label": per_label, "foreground_then_per_label": then}}


def _labels(edema, core, enhancing) -> dict:
    return {"edema": edema, "non-enhancing": core, "enhancing": enhancing}


def test_the_postprocessing_decision_follows_nnunet_v1():
    """The foreground's component is kept only if some label gains and none loses; each
    label's is then kept where its mean gains over the result so far; a label's both-empty
    cases are left out of its mean."""
    cases = [_case(_labels(0.8, 0.5, 0.6), _labels(0.9, 0.5, 0.6), _labels(0.8, 0.5, 0.7),
                   _labels(0.9, 0.5, 0.65)),
             _case(_labels(0.6, 1.0, 0.4), _labels(0.6, 1.0, 0.4), _labels(0.6, 1.0, 0.4),
                   _labels(0.6, 1.0, 0.4), empty=["non-enhancing"])]
    decision = metrics.decide_postprocessing(cases)
    assert decision["foreground_largest_component"] is True
    assert decision["mean_dice"]["raw"] == pytest.approx(_labels(0.7, 0.5, 0.5))
    assert decision["mean_dice"]["foreground"] == pytest.approx(_labels(0.75, 0.5, 0.5))
    assert decision["mean_dice"]["then_per_label"] == pytest.approx(_labels(0.75, 0.5, 0.525))
    assert decision["largest_component_labels"] == ["enhancing"]
    # the foreground's step costs a label: not taken; each label's step then starts from raw
    cases[1]["largest_component"]["foreground"]["non-enhancing"] = 0.0
    cases[0]["largest_component"]["foreground"]["non-enhancing"] = 0.4
    decision = metrics.decide_postprocessing(cases)
    assert decision["foreground_largest_component"] is False
    assert decision["mean_dice"]["then_per_label"] == pytest.approx(_labels(0.7, 0.5, 0.55))
    assert decision["largest_component_labels"] == ["enhancing"]
