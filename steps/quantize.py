"""Quantize step: the exported FP32 ONNX model as a calibrated INT8 model, gated on Dice.

    python -m steps.quantize --exported DIR --dataset DIR --quantized DIR
                             [--calibration-slices 128] [--calibration-seed 0]
                             [--calibration-method percentile] [--float-layers first-last]
                             [--gate-cases 16]

Static post-training quantization with onnxruntime's tools: QDQ format, per-channel INT8
weights, UINT8 activations whose ranges come from calibration slices of the model's
*training* fold (never validation), cut to the training patch size. Only convolutions are
quantized: normalisation, activations and concatenations stay float32, and
``--float-layers first-last`` keeps the first and the last convolution in float too. The
model card records which.

**The gate.** The FP32 and the INT8 model segment validation volumes of the model's fold
slice by slice (``steps.predict.segment``, the 2D inference over whole volumes that
``steps.predict`` uses): ``--gate-cases`` of them (16), evenly spaced over the fold, so that
the step's time does not grow with the dataset. The step fails and publishes nothing unless
the mean Dice drops by at most ``--max-dice-drop`` points (0.5), no class by more than
``--max-class-dice-drop`` (1), and the two label maps agree on at least ``--min-agreement``
(0.99) of the voxels inside each volume's foreground box. Publishes the ``quantized``
artifact:

    unet2d-int8.onnx     same input, output and metadata_props as unet2d.onnx, so
                         ``python -m steps.convert predict --onnx`` runs it unchanged
    quantization.json    calibration (method, slices, seed, digest), float layers, the
                         gate's figures per class and per case, the measured speed-up
    model-card.json      the FP32 model card with a ``quantization`` section
    argo-outputs/{int8_mean_dice,int8_speedup}
"""
from __future__ import annotations

import argparse
import contextlib
import hashlib
import io
import logging
import re
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import onnx
import onnxruntime
import torch
from onnxruntime.quantization import (CalibrationMethod, QuantFormat, QuantType,
                                      quantize_static)
from onnxruntime.quantization.shape_inference import quant_pre_process

from steps import limits, params, predict, schemas
from steps.artifacts import check_disjoint, publish, require, write_outputs
from steps.dataset import Case, Source, fold_names, open_cases, read_dataset
from steps.errors import StepError, run_main
from steps.losses import dice_per_class
from steps.preprocess import any_channel, mask_box
from steps.sampler import pad_crop_2d

STEP = "quantize"
FP32_FILE = predict.ONNX_FILE
CARD_FILE = predict.CARD_FILE
INT8_FILE = "unet2d-int8.onnx"
OPENVINO_FILE = "unet2d-int8-openvino.xml"   # and its .bin
REPORT_FILE = "quantization.json"
# Only the convolutions: quantizing InstanceNormalization, LeakyRelu and Concat too cost
# 0.3-1.1 Dice points more on the local profile's model for no measurable speed (2-core
# AMD EPYC, AVX2).
QUANTIZED_OPS = ("Conv", "ConvTranspose")
GATE_PARAMS = ("max_dice_drop", "max_class_dice_drop", "min_agreement")


def build_parser() -> argparse.ArgumentParser:
    return params.step_parser(STEP, __doc__)


# ------------------------------------------------------------------------- calibration

@dataclass
class Calibration:
    """Slices of the training fold as (1, C, H, W) float32 batches of the training patch
    size (onnxruntime's histogram calibrators need one shape throughout); ``digest`` is the
    sha256 of exactly those bytes."""
    batches: list[np.ndarray]
    picked: dict[str, list[int]]
    digest: str


def _centred(extent: int, size: int) -> int:
    """Offset of a centred ``size`` window over ``extent`` (negative: padding before)."""
    return (extent - size) // 2 if extent >= size else -((size - extent) // 2)


def patch_window(image: np.ndarray, patch: tuple[int, int]) -> np.ndarray:
    """(C, H, W) centre-cropped, then padded with the background fill, to ``patch``."""

    fill = torch.from_numpy(predict.background_fill(image[:, None])).view(-1, 1, 1)
    out = torch.empty((image.shape[0], *patch), dtype=torch.float32)
    pad_crop_2d(torch.from_numpy(image), _centred(image.shape[1], patch[0]),
                _centred(image.shape[2], patch[1]), patch, fill, out)
    return out.numpy()


def calibration_set(cases: list[Case], n: int, seed: int,
                    patch: tuple[int, int]) -> Calibration:
    """``n`` slices drawn without replacement by a seeded generator over all slices."""
    every = [(ci, d) for ci, case in enumerate(cases) for d in range(case.shape[1])]
    if len(every) < n:
        raise StepError(f"--calibration-slices {n}: the training fold has only {len(every)} "
                        "slices")
    chosen = np.random.default_rng(seed).choice(len(every), size=n, replace=False)
    picked: dict[int, list[int]] = {}
    batches, digest = [], hashlib.sha256()
    for index in sorted(chosen.tolist()):
        ci, d = every[index]
        picked.setdefault(ci, []).append(d)
        image = np.asarray(cases[ci].image[:, d], dtype=np.float32)
        batch = patch_window(image, patch)[None]
        digest.update(batch.tobytes())
        batches.append(batch)
    return Calibration(batches, {cases[ci].name: s for ci, s in sorted(picked.items())},
                       digest.hexdigest())


class _Reader:
    """onnxruntime's CalibrationDataReader protocol over the calibration batches, with the
    length and ranges that its strided collection reads (``set_range``)."""

    def __init__(self, batches: list[np.ndarray]):
        self.batches = batches
        self.set_range(0, len(batches))

    def __len__(self) -> int:
        return len(self.batches)

    def set_range(self, start_index: int, end_index: int) -> None:
        self.items = iter(self.batches[start_index:end_index])

    def get_next(self):
        batch = next(self.items, None)
        return None if batch is None else {predict.INPUT_NAME: batch}


# ------------------------------------------------------------------------ quantization

# onnxruntime's histogram calibrators (percentile, entropy) keep every node's output for every
# calibration batch until the last one has run (onnxruntime 1.32 quantization/calibrate.py,
# HistogramCalibrater.collect_data): about 100 MiB a slice for the base's network, 13 GiB for
# its 128 slices (`python -m benchmarks footprint`). quantize_static's CalibStridedMinMax calls
# collect_data once per range of the reader instead, each range merged into the same
# histograms (quantize.py), so the step holds the outputs of at most this many slices.
CALIBRATION_CHUNK = 8


def calibration_stride(n: int) -> int:
    """The largest number of slices, at most CALIBRATION_CHUNK, that divides ``n``
    (onnxruntime refuses ranges of unequal length)."""
    return max(k for k in range(1, min(n, CALIBRATION_CHUNK) + 1) if n % k == 0)


@contextlib.contextmanager
def _each_line_once():
    """What the block prints, each distinct line once, in order, when it ends: onnxruntime's
    calibrators print() the same line for every range of slices they collect (1.32
    calibrate.py, HistogramCollector.collect), 16 of them in a pod's log for 128 slices."""
    printed = io.StringIO()
    try:
        with contextlib.redirect_stdout(printed):
            yield
    finally:
        sys.stdout.write("".join(dict.fromkeys(printed.getvalue().splitlines(keepends=True))))


@contextlib.contextmanager
def sized_sessions(ov=None):
    """The sessions that onnxruntime's quantization tools and NNCF make in the block get
    :func:`steps.limits.threads`' pool, as this step's own do: both take the node's cores
    otherwise, and neither takes session options from its caller (onnxruntime 1.32
    calibrate.py, ``CalibraterBase.create_inference_session``: a new ``SessionOptions`` per
    ``onnxruntime.InferenceSession``; NNCF 3.4 openvino/engine.py, ``OVNativeEngine``: a new
    ``ov.Core()``, and OpenVINO's properties belong to one Core). So the two names they call
    are swapped for the block (``ov``: the openvino module, when NNCF runs in it)."""
    threads = limits.threads()
    session_class, core_class = onnxruntime.InferenceSession, ov.Core if ov else None

    def session(path_or_bytes, sess_options=None, *args, **kwargs):
        options = sess_options if sess_options is not None else onnxruntime.SessionOptions()
        if options.intra_op_num_threads == 0:       # 0: onnxruntime's "the machine's"
            options.intra_op_num_threads = threads
        return session_class(path_or_bytes, options, *args, **kwargs)

    onnxruntime.InferenceSession = session
    if ov is not None:
        class Core(core_class):
            def __init__(self, *args, **kwargs):
                super().__init__(*args, **kwargs)
                self.set_property("CPU", {"INFERENCE_NUM_THREADS": threads})
        ov.Core = Core
    try:
        yield
    finally:
        onnxruntime.InferenceSession = session_class
        if ov is not None:
            ov.Core = core_class


def end_convolutions(model) -> list[str]:
    """Names of the first convolution (reads the input) and the last (feeds the output) of
    the model, or of each member of an ensemble (steps.ensemble), in graph order."""
    convs = [node for node in model.graph.node if node.op_type in ("Conv", "ConvTranspose")]
    if not convs:
        raise StepError(f"{FP32_FILE}: the graph has no convolution to quantize")
    members: dict[str, list[str]] = {}
    for node in convs:
        members.setdefault(predict.member(node.name), []).append(node.name)
    return list(dict.fromkeys(n for names in members.values() for n in (names[0], names[-1])))


def quantize(fp32: Path, out: Path, calibration: Calibration, method: str,
             float_layers: str) -> list[str]:
    """Write the QDQ INT8 model; return the node names kept in floating point."""

    model = onnx.load(str(fp32))
    keep = end_convolutions(model) if float_layers == "first-last" else []
    methods = {"minmax": CalibrationMethod.MinMax, "entropy": CalibrationMethod.Entropy,
               "percentile": CalibrationMethod.Percentile}
    with tempfile.TemporaryDirectory() as scratch, _each_line_once(), sized_sessions():
        prepared = Path(scratch) / "prepared.onnx"
        quant_pre_process(str(fp32), str(prepared), skip_symbolic_shape=True)
        quantize_static(str(prepared), str(out), _Reader(calibration.batches),
                        quant_format=QuantFormat.QDQ, per_channel=True,
                        activation_type=QuantType.QUInt8, weight_type=QuantType.QInt8,
                        calibrate_method=methods[method], nodes_to_exclude=keep,
                        op_types_to_quantize=list(QUANTIZED_OPS),
                        extra_options={"CalibStridedMinMax":
                                       calibration_stride(len(calibration.batches))})
    quantized = onnx.load(str(out))
    del quantized.metadata_props[:]
    for prop in model.metadata_props:   # predict reads its contract from these
        quantized.metadata_props.add(key=prop.key, value=prop.value)
    onnx.checker.check_model(quantized)
    onnx.save(quantized, str(out))
    return keep


# ------------------------------------------------------------------------------- gate

def foreground_box(image: np.ndarray) -> tuple[slice, slice, slice]:
    """The (D, H, W) box of voxels where any channel differs from its background fill."""
    box = mask_box(any_channel(image, np.not_equal, predict.background_fill(image)))
    if box is None:
        return slice(0, 0), slice(0, 0), slice(0, 0)
    return tuple(slice(*ends) for ends in box)


def gate_subset(names: list[str], n: int) -> list[str]:
    """``n`` of ``names``, evenly spaced and in their order (all of them when there are
    fewer): the same fold and ``n`` give the same cases."""
    if len(names) <= n:
        return list(names)
    return [names[i * len(names) // n] for i in range(n)]


def gate(sessions: dict[str, Any], cases: list[Case], multiple: int,
         n_classes: int) -> dict[str, Any]:
    """Each model's Dice against the labels, per case and overall, and each candidate's
    agreement with ``sessions["fp32"]``; the segmentation time of each model, summed over
    two rounds in alternating order."""

    names = list(sessions)
    dice = {name: np.zeros(n_classes - 1) for name in names}
    seconds = dict.fromkeys(names, 0.0)
    agree, total = dict.fromkeys(names, 0), 0
    for case in cases:
        image = case.image            # memory-mapped; segment converts a batch at a time
        box = foreground_box(image)   # before the labels, so that its masks do not add to them
        labels = {}
        for order in (names, names[::-1]):
            for name in order:
                start = time.perf_counter()
                labels[name] = predict.segment(sessions[name], image, multiple, n_classes)
                seconds[name] += time.perf_counter() - start
        truth = torch.from_numpy(np.array(case.label, dtype=np.uint8))
        total += int(labels["fp32"][box].size)
        for name in names:
            dice[name] += dice_per_class(torch.from_numpy(labels[name]), truth,
                                         n_classes).numpy()
            agree[name] += int((labels[name][box] == labels["fp32"][box]).sum())
    classes = [str(c) for c in range(1, n_classes)]
    mean = {name: dice[name] / max(len(cases), 1) for name in names}
    out = {"fp32": {"dice": dict(zip(classes, mean["fp32"].tolist())),
                    "mean_dice": float(mean["fp32"].mean()), "seconds": seconds["fp32"]},
           "validation_cases": [case.name for case in cases]}
    for name in names[1:]:
        out[name] = {
            "dice": dict(zip(classes, mean[name].tolist())),
            "mean_dice": float(mean[name].mean()),
            "mean_dice_drop_points": float(100 * (mean["fp32"].mean() - mean[name].mean())),
            "class_dice_drop_points": dict(zip(classes,
                                               (100 * (mean["fp32"] - mean[name])).tolist())),
            "agreement_in_foreground": agree[name] / max(total, 1),
            "seconds": seconds[name], "speedup": seconds["fp32"] / max(seconds[name], 1e-9)}
        out[name]["slower_than_fp32"] = out[name]["speedup"] < 1
    out["speed_measured_on"] = limits.cpu_model()
    return out


def gate_bounds(args: argparse.Namespace) -> dict[str, float]:
    """The gate's three bounds (``--max-dice-drop``, ``--max-class-dice-drop``,
    ``--min-agreement``)."""
    return {name: getattr(args, name) for name in GATE_PARAMS}


def check_gate(figures: dict[str, Any], what: str, bounds: dict[str, float]) -> None:
    """A StepError naming the first of ``bounds`` (:func:`gate_bounds`) that the model
    ``what`` misses."""
    if figures["mean_dice_drop_points"] > bounds["max_dice_drop"]:
        raise StepError(f"quantize: {what} mean Dice {100 * figures['mean_dice']:.2f} is "
                        f"{figures['mean_dice_drop_points']:.2f} points below FP32 "
                        f"(allowed {bounds['max_dice_drop']:g}); nothing published")
    for cls, drop in figures["class_dice_drop_points"].items():
        if drop > bounds["max_class_dice_drop"]:
            raise StepError(f"quantize: {what} Dice of class {cls} is {drop:.2f} points below "
                            f"FP32 (allowed {bounds['max_class_dice_drop']:g}); nothing "
                            "published")
    if figures["agreement_in_foreground"] < bounds["min_agreement"]:
        raise StepError(f"quantize: {what} and FP32 labels agree on "
                        f"{100 * figures['agreement_in_foreground']:.2f} % of the foreground "
                        f"voxels (needed {100 * bounds['min_agreement']:g} %); nothing "
                        "published")


# --------------------------------------------------------------------------- OpenVINO

def _keep_if_gated(out: Path, figures: dict[str, Any], bounds: dict[str, float]) -> str:
    """The IR is optional: published only within the same gate, else removed with the
    reason (the onnxruntime model, which passed, is the step's product)."""
    try:
        check_gate(figures, "INT8 (OpenVINO)", bounds)
        return OPENVINO_FILE
    except StepError as exc:
        for path in (out / OPENVINO_FILE, (out / OPENVINO_FILE).with_suffix(".bin")):
            path.unlink(missing_ok=True)
        reason = str(exc).replace("; nothing published", "")
        print(f"quantize: the OpenVINO IR is left out: {reason}", file=sys.stderr)
        return f"not published: {reason}"


class OpenVINOSession:
    """An OpenVINO compiled model behind onnxruntime's ``run(names, feeds)``, so that
    ``predict.segment`` drives it exactly as it drives the ONNX models."""

    def __init__(self, compiled):
        self.compiled = compiled

    def run(self, names, feeds, run_options=None):
        return [self.compiled(feeds)[0]]


def openvino_ir(fp32: Path, out: Path, calibration: Calibration, keep: list[str]):
    """NNCF's INT8 OpenVINO IR of the FP32 model, from the same calibration slices and with
    the same convolutions kept float; (compiled model, versions), or None without
    openvino and nncf, or (None, why) when OpenVINO's CPU plugin cannot compile it here
    (the IR is then removed: it is optional)."""
    # openvino_telemetry sends usage data over HTTP from NNCF (nncf 3.4 telemetry/wrapper.py,
    # unless NNCF_CI is set) and from convert_model (openvino.tools.ovc telemetry_utils.py,
    # unless a consent file in $HOME opts out). A pod has no route out: on the test cluster,
    # quantize attempts hung on those sends' DNS lookups until their 10 min deadline. Both
    # send nothing when the package cannot be imported, so this process never imports it.
    sys.modules.setdefault("openvino_telemetry", None)
    try:  # optional (extra `openvino`): without them only the onnxruntime model is published
        import nncf
        import openvino as ov
    except ImportError:
        return None
    nncf.set_log_level(logging.WARNING)   # not its INFO lines on each node it leaves float
    model = ov.convert_model(str(fp32))
    ignored = nncf.IgnoredScope(patterns=[f"^{re.escape(name)}(/WithoutBiases)?$"
                                          for name in keep], validate=False)
    # MIXED: asymmetric activations (they follow LeakyReLU and instance norm); the default
    # symmetric preset lost 0.6-0.9 Dice points more on the test models.
    with sized_sessions(ov):
        int8 = nncf.quantize(model, nncf.Dataset(calibration.batches),
                             subset_size=len(calibration.batches), ignored_scope=ignored,
                             preset=nncf.QuantizationPreset.MIXED)
    ov.save_model(int8, str(out))
    try:  # OpenVINO's CPU plugin also sizes its pool from the node's cores
        compiled = ov.Core().compile_model(str(out), "CPU",
                                           {"INFERENCE_NUM_THREADS": limits.threads()})
    except RuntimeError as exc:   # e.g. no int8 deconvolution for this CPU's instruction set
        for path in (out, out.with_suffix(".bin")):
            path.unlink(missing_ok=True)
        lines = [line for line in str(exc).splitlines() if line.strip()]
        why = (lines[-1] if lines else type(exc).__name__).split(". ")[0][:160]
        return None, f"not published: OpenVINO's CPU plugin cannot compile it here ({why})"
    return compiled, {"openvino": ov.__version__, "nncf": nncf.__version__}


# ------------------------------------------------------------------------------- main

def run(args: argparse.Namespace) -> tuple[dict[str, Any], str]:
    """(the gate's figures, what a dataset read by key fetched: only the cases of the
    calibration slices and of the gate)."""
    check_disjoint({"--quantized": args.quantized}, {"--exported": args.exported,
                                                     "--dataset": args.dataset})
    require(args.exported, "exported")
    card = predict.read_card(args.exported)
    with read_dataset(args.dataset, args.quantized.parent) as (dataset, meta):
        return quantize_and_gate(args, card, dataset, meta), dataset.moved_note()


def quantize_and_gate(args: argparse.Namespace, card: dict[str, Any], dataset: Source,
                      meta: dict[str, Any]) -> dict[str, Any]:
    """Calibrate on the model's training fold, quantize, gate on its validation cases and
    publish ``quantized``; the gate's figures."""
    fold = card.get("training", {}).get("config", {}).get("fold", 0)   # checked by read_card
    train_names, val_names = fold_names(meta, fold)
    if not train_names or not val_names:
        raise StepError(f"artifact 'dataset' at {dataset}: fold {fold} of the model needs "
                        "training cases to calibrate on and validation cases to gate on")
    multiple, n_classes = card["size_multiple"], len(meta["labels"])
    patch = tuple(meta["patch_size"])
    if any(side % multiple for side in patch):
        raise StepError(f"artifact 'dataset' at {dataset}: patch_size {list(patch)} is not "
                        f"a multiple of the model's {multiple}")
    calibration = calibration_set(open_cases(dataset, meta, train_names),
                                  args.calibration_slices, args.calibration_seed, patch)
    recorded = {p.name: getattr(args, p.name) for p in params.QUANTIZE}
    fp32 = predict.open_session(args.exported / FP32_FILE)   # its graph checked before use
    predict.check_contract(fp32, {"labels": meta["labels"], "channels": meta["channels"]},
                           args.exported / FP32_FILE)
    with publish(args.quantized, "quantized", STEP, recorded) as out:
        kept = quantize(args.exported / FP32_FILE, out / INT8_FILE, calibration,
                        args.calibration_method, args.float_layers)
        sessions = {"fp32": fp32, "int8": predict.open_session(out / INT8_FILE)}
        openvino = openvino_ir(args.exported / FP32_FILE, out / OPENVINO_FILE, calibration,
                               kept)
        if openvino is not None and openvino[0] is not None:
            sessions["openvino_int8"] = OpenVINOSession(openvino[0])
        figures = gate(sessions, open_cases(dataset, meta,
                                            gate_subset(val_names, args.gate_cases)),
                       multiple, n_classes)
        bounds = gate_bounds(args)
        check_gate(figures["int8"], "INT8 (onnxruntime)", bounds)
        openvino_file = "not produced: openvino and nncf are not installed"
        if openvino is not None and openvino[0] is None:
            openvino_file = openvino[1]
            print(f"quantize: the OpenVINO IR is left out: {openvino_file}", file=sys.stderr)
        elif openvino is not None:
            openvino_file = _keep_if_gated(out, figures["openvino_int8"], bounds)
        report = {"format": "onnx QDQ, per-channel int8 weights, uint8 activations",
                  "files": {"onnxruntime": INT8_FILE, "openvino": openvino_file},
                  "versions": openvino[1] if openvino and openvino[0] is not None else {},
                  "calibration": {"method": args.calibration_method,
                                  "slices": args.calibration_slices,
                                  "seed": args.calibration_seed, "fold": fold,
                                  "patch_size": list(patch),
                                  "training_cases": calibration.picked,
                                  "sha256": calibration.digest},
                  "float_layers": {"convolutions": kept,
                                   "operators": "only Conv and ConvTranspose are quantized; "
                                                "InstanceNormalization, LeakyRelu and Concat "
                                                "run in float32"},
                  "gate": bounds, "figures": figures}
        schemas.write_json(out / REPORT_FILE, report)
        card["quantization"] = {k: report[k] for k in ("format", "files", "calibration",
                                                       "float_layers", "gate")}
        schemas.write_json(out / CARD_FILE, card)
        write_outputs(out, STEP, {"int8_mean_dice": f"{figures['int8']['mean_dice']:.4f}",
                                  "int8_speedup": f"{figures['int8']['speedup']:.2f}"})
    return figures


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    limits.set_threads()
    start = time.perf_counter()
    figures, moved = run(args)
    line = f"quantize: {args.quantized}: mean Dice FP32 {100 * figures['fp32']['mean_dice']:.2f}"
    slower = []
    for name, label in (("int8", "INT8 onnxruntime"), ("openvino_int8", "INT8 OpenVINO")):
        if name in figures:
            f = figures[name]
            line += (f"; {label} {100 * f['mean_dice']:.2f}, agreement "
                     f"{100 * f['agreement_in_foreground']:.3f} %, {f['speedup']:.2f}x")
            slower += [label] * f["slower_than_fp32"]
    print(f"{line} (speed against FP32 onnxruntime), {time.perf_counter() - start:.1f} s"
          f"{moved}", file=sys.stderr)
    if slower:   # int8-speedup < 1 is a fact of this CPU and this network's size, not a fault
        print(f"quantize: {' and '.join(slower)} ran slower than FP32 on this CPU "
              f"({figures['speed_measured_on']}, {limits.threads()} thread(s)); small networks "
              "and CPUs without int8 dot-product instructions (VNNI, AMX) gain nothing",
              file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(run_main(main))
