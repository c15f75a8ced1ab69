"""The INT8 gate, deterministic by construction: two stand-in models whose labels are written
into the image they segment, so the Dice drop and the agreement are known exactly, and the
gate is checked a hair inside and a hair outside each of its bounds."""
from __future__ import annotations

import time
import tracemalloc

import numpy as np
import pytest

from steps import limits
from steps.dataset import Case
from steps.errors import StepError
from steps.quantize import check_gate, gate, gate_subset

CLASSES = 3
SHAPE = (4, 16, 16)                  # (D, H, W)
FLIPPED = 3                          # class-1 voxels the "INT8" model calls background


class LabelReader:
    """A session whose logits pick, per voxel, the label written in channel 0 of its input,
    or background where channel 1 marks the voxel and ``flips`` is set."""

    def __init__(self, flips: bool):
        self.flips = flips

    def run(self, names, feeds, run_options=None):
        x = feeds["image"]                                        # (N, C, H, W)
        labels = np.rint(x[:, 0]).astype(np.int64)
        if self.flips:
            labels[x[:, 1] > 0.5] = 0
        return [np.eye(CLASSES, dtype=np.float32)[labels].transpose(0, 3, 1, 2) * 10]


def _case() -> Case:
    truth = np.zeros(SHAPE, dtype=np.uint8)
    truth[:, 2:10, 2:10] = 1                                      # 256 voxels of class 1
    truth[:, 10:14, 10:14] = 2                                    # 64 voxels of class 2
    flip = np.zeros(SHAPE, dtype=np.float32)
    flip[0, 2, 2:2 + FLIPPED] = 1
    ramp = np.arange(np.prod(SHAPE), dtype=np.float32).reshape(SHAPE)   # a box of everything
    image = np.stack([truth.astype(np.float32), flip, ramp])
    return Case("case_0", image, truth, (1.0, 1.0, 1.0))


def _figures():
    return gate({"fp32": LabelReader(False), "int8": LabelReader(True)}, [_case()], 8,
                CLASSES)


def test_the_gate_measures_the_known_drop_and_agreement():
    figures = _figures()
    class_1 = 2 * (256 - FLIPPED) / (256 + 256 - FLIPPED)
    assert figures["fp32"]["mean_dice"] == 1.0
    assert figures["int8"]["class_dice_drop_points"]["1"] == pytest.approx(100 * (1 - class_1))
    assert figures["int8"]["class_dice_drop_points"]["2"] == 0.0
    assert figures["int8"]["mean_dice_drop_points"] == pytest.approx(50 * (1 - class_1))
    assert figures["int8"]["agreement_in_foreground"] == pytest.approx(
        1 - FLIPPED / np.prod(SHAPE))


@pytest.mark.parametrize("bound, needle", [
    ("max_dice_drop", "mean Dice 99.71 is 0.29 points below FP32 (allowed"),
    ("max_class_dice_drop", "Dice of class 1 is 0.59 points below FP32 (allowed"),
    ("min_agreement", "labels agree on 99.71 % of the foreground voxels (needed"),
])
def test_each_bound_passes_just_inside_and_fails_just_outside(bound, needle):
    figures = _figures()["int8"]
    measured = {"max_dice_drop": figures["mean_dice_drop_points"],
                "max_class_dice_drop": max(figures["class_dice_drop_points"].values()),
                "min_agreement": figures["agreement_in_foreground"]}
    loose = {"max_dice_drop": 100.0, "max_class_dice_drop": 100.0, "min_agreement": 0.0}
    step = -1e-4 if bound == "min_agreement" else 1e-4
    check_gate(figures, "INT8", {**loose, bound: measured[bound] + step})
    with pytest.raises(StepError, match="nothing published") as missed:
        check_gate(figures, "INT8", {**loose, bound: measured[bound] - step})
    assert needle in str(missed.value)


class Slow(LabelReader):
    """The same labels, a fixed time later."""

    def run(self, names, feeds, run_options=None):
        time.sleep(0.02)
        return super().run(names, feeds, run_options)


@pytest.mark.parametrize("int8, slower", [(Slow(False), True), (LabelReader(False), False)])
def test_the_figures_say_whether_int8_was_slower_and_on_which_cpu(int8, slower):
    """A user reads int8_speedup against the CPU that measured it: the figures name it, and
    say when INT8 was the slower (here a stand-in that sleeps, against one that does not)."""
    fp32 = LabelReader(False) if slower else Slow(False)
    figures = gate({"fp32": fp32, "int8": int8}, [_case()], 8, CLASSES)
    assert figures["int8"]["slower_than_fp32"] is slower
    assert (figures["int8"]["speedup"] < 1) is slower
    assert figures["speed_measured_on"] == limits.cpu_model() != ""


@pytest.mark.parametrize("count, n, expected", [
    (97, 16, [0, 6, 12, 18, 24, 30, 36, 42, 48, 54, 60, 66, 72, 78, 84, 90]),
    (15, 16, list(range(15))),
    (16, 16, list(range(16))),
    (17, 4, [0, 4, 8, 12]),
    (5, 1, [0]),
])
def test_the_gate_takes_evenly_spaced_cases_of_the_fold(count, n, expected):
    """At 750 cases a fold holds about 97 validation cases, at 120 about 15: the gate takes at
    most ``--gate-cases`` of them, spread over the fold in its order, never one twice."""
    names = [f"BRATS_{i:03d}" for i in range(count)]
    assert gate_subset(names, n) == [names[i] for i in expected]


def _gate_peak(tmp_path, depth: int) -> int:
    """The gate's peak traced allocation on one case of ``depth`` (D, 64, 64) slices as the
    dataset stores it: a float16 (C, D, H, W) image and a uint8 label, memory-mapped."""
    truth = np.zeros((depth, 64, 64), dtype=np.uint8)
    truth[:, 8:40, 8:40] = 1
    truth[:, 40:56, 40:56] = 2
    image = np.zeros((3,) + truth.shape, dtype=np.float16)
    image[0] = truth
    image[2] = np.linspace(-1, 1, 64 * 64, dtype=np.float16).reshape(64, 64)
    np.save(tmp_path / f"image-{depth}.npy", image)
    np.save(tmp_path / f"label-{depth}.npy", truth)
    case = Case("case_0", np.load(tmp_path / f"image-{depth}.npy", mmap_mode="r"),
                np.load(tmp_path / f"label-{depth}.npy", mmap_mode="r"), (1.0, 1.0, 1.0))
    tracemalloc.start()
    try:
        figures = gate({"fp32": LabelReader(False), "int8": LabelReader(True)}, [case], 8,
                       CLASSES)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert figures["fp32"]["mean_dice"] == 1.0
    return peak


def test_the_gate_holds_no_whole_volume_copy_but_its_labels(tmp_path):
    """What the gate allocates per voxel of a case, beyond its batches: the labels it writes
    (a byte a voxel per model), the truth's copy and one mask (a byte each); no float32
    image, no int64 label (30 bytes a voxel here before 2026-12-01)."""
    small, large = 64 * 64 * 64, 256 * 64 * 64
    per_voxel = (_gate_peak(tmp_path, 256) - _gate_peak(tmp_path, 64)) / (large - small)
    assert per_voxel <= 4.5, f"{per_voxel:.2f} bytes a voxel"
