"""Convert step: the trained network as ONNX and as a PyTorch export, proven equal to it.

    python -m steps.convert --model DIR --dataset DIR --exported DIR [--opset 17]
                            [--parity-slices 32]
    python -m steps.convert predict --onnx FILE --image CASE.nii.gz --out LABEL.nii.gz

Reads the ``model`` artifact (``best.pt`` from steps.train) and the ``dataset`` artifact (for
real validation slices) and publishes the ``exported`` artifact:

    unet2d.onnx          input ``image`` (N, 4, H, W) float32 → output ``logits`` (N, 4, H, W);
                         N, H, W dynamic, H and W multiples of ``size_multiple``; the
                         preprocessing contract is also in its metadata_props
    unet2d.pt2           ``torch.export`` program: ``torch.export.load(f).module()(image)``
                         needs torch only, not this repository
    parity.json          torch vs onnxruntime (CPU) and vs the reloaded .pt2 on real slices
    model-card.json      I/O, normalisation, labels, training config and metrics,
                         provenance, versions, parity figures
    argo-outputs/{max_abs_diff,argmax_agreement}   plain text, for Argo output parameters

The network is exported in inference form: eval mode, deep supervision off, one output.
If parity is out of bounds the step fails with one line and publishes nothing. TorchScript
is not produced: ``torch.jit.trace``/``script`` are deprecated in current torch.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import platform
import subprocess
import sys
import tempfile
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import onnx
import onnxruntime
import torch

from steps.artifacts import (check_disjoint, manifest_digest, publish, require,
                             write_outputs)
from steps.dataset import Source, fold_names, open_cases, read_dataset
from steps.checkpoints import check_state
from steps.errors import StepError, run_main
from steps import limits, params, predict, schemas
from steps.losses import dice_per_class
from steps.model import ModelConfig, build_model

STEP = "convert"
CHECKPOINT = "best.pt"
ONNX_FILE = predict.ONNX_FILE
PT2_FILE = "unet2d.pt2"
PARITY_FILE = "parity.json"
CARD_FILE = predict.CARD_FILE
INPUT_NAME = "image"
OUTPUT_NAME = "logits"
CARD_FORMAT_VERSION = 1
MAX_SIDE = 4096          # largest H or W the exported programs accept
PARITY_BATCH = 16        # slices per forward pass in the parity runs
BOUNDS = {
    "max_abs_diff": 1e-3,         # fp32 logits, absolute
    "rel_diff": 1e-4,             # or relative to the largest |logit|
    "argmax_agreement": 0.9999,   # fraction of pixels
    "dice_diff": 1e-4,            # per class, Dice against the label
}


# ------------------------------------------------------------------------------- CLI

def build_parser() -> argparse.ArgumentParser:
    return params.step_parser(
        STEP, __doc__,
        epilog="Segment one NIfTI case with the exported ONNX model alone: "
               "python -m steps.convert predict --help")


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    return build_parser().parse_args(argv)


# ------------------------------------------------------------------------ the checkpoint

def load_checkpoint(model_dir: Path) -> dict[str, Any]:
    """Verify the `model` artifact and return its ``best.pt`` dict (tensors on CPU)."""

    path = model_dir / CHECKPOINT
    if path.is_file():      # bounded before the manifest check reads it whole for its hash
        limits.check("max_checkpoint_bytes", path.stat().st_size, str(path))
    require(model_dir, "model")
    if not path.is_file():
        raise StepError(f"artifact 'model' at {model_dir}: {CHECKPOINT} is missing")
    with path.open("rb") as handle:     # the size of the file that torch reads
        limits.check("max_checkpoint_bytes", os.fstat(handle.fileno()).st_size, str(path))
        try:
            ckpt = torch.load(handle, map_location="cpu", weights_only=True)
        except Exception as exc:  # pickle, zip and unpickler errors all mean "unreadable"
            reason = str(exc).strip().splitlines()[0][:200] if str(exc).strip() else ""
            raise StepError(f"{path}: not a readable checkpoint ({type(exc).__name__}: "
                            f"{reason})") from None
    schemas.validate(schemas.ModelCheckpoint, ckpt, str(path))
    return ckpt


def inference_network(ckpt: dict[str, Any], path: Path):
    """(eval-mode DynUNet with one output, ModelConfig) from a checked checkpoint dict.

    The weights are first checked against the network that ``model_config`` describes (deep
    supervision heads included), then loaded without those heads, which inference never uses.
    """

    config = ModelConfig.from_dict(ckpt["model_config"])
    state = ckpt["model_state"]
    check_state(build_model(config).state_dict(), state, f"{path}: model_state")
    net = build_model(config, deep_supervision=False)
    net.load_state_dict({k: v for k, v in state.items() if k in net.state_dict()}, strict=True)
    return net.eval(), config


# ------------------------------------------------------------------------ parity inputs

@dataclass
class SliceGroup:
    """Up to PARITY_BATCH parity slices of one case: ``image`` (k, C, H', W') float32 padded
    to the size multiple, ``label`` (k, H, W) uint8; ``shape`` = (H, W) before padding."""
    case: str
    slices: list[int]
    image: np.ndarray
    label: np.ndarray
    shape: tuple[int, int]


def _spread(items: list, k: int) -> list:
    """``k`` items evenly spaced over ``items`` (all when k >= len)."""
    n = len(items)
    return list(items) if k >= n else [items[i * n // k] for i in range(k)]


def pick_slices(cases, n: int) -> list[tuple[int, int]]:
    """(case index, slice) pairs: up to ¾ with tumour, the rest without, evenly spread."""
    tumour, other = [], []
    for ci, case in enumerate(cases):
        has = np.asarray(case.label).reshape(case.label.shape[0], -1).any(axis=1)
        for d, flag in enumerate(has):
            (tumour if flag else other).append((ci, d))
    n_tumour = min(len(tumour), max(n - len(other), n * 3 // 4))
    chosen = _spread(tumour, n_tumour) + _spread(other, n - n_tumour)
    return sorted(chosen)


def parity_inputs(dataset: Source, meta: dict[str, Any], fold: int, n: int,
                  multiple: int) -> tuple[list[SliceGroup], dict[str, Any]]:
    """``n`` real slices from the fold's validation cases (training cases only if too few)."""
    train, val = fold_names(meta, fold)
    cases = open_cases(dataset, meta, val)
    total = sum(c.shape[1] for c in cases)
    extra = []
    if total < n:  # tiny datasets: top up from training cases, recorded in parity.json
        for case in open_cases(dataset, meta, train):
            if total >= n:
                break
            extra.append(case.name)
            cases.append(case)
            total += case.shape[1]
    if total < n:
        raise StepError(f"--parity-slices {n}: dataset at {dataset} has only {total} "
                        "slices")
    by_case: dict[int, list[int]] = {}
    for ci, d in pick_slices(cases, n):
        by_case.setdefault(ci, []).append(d)
    groups = []
    for ci, picked in sorted(by_case.items()):
        case = cases[ci]
        fill = predict.background_fill(np.asarray(case.image))
        for start in range(0, len(picked), PARITY_BATCH):
            slices = picked[start:start + PARITY_BATCH]
            image = np.asarray(case.image[:, slices], dtype=np.float32).transpose(1, 0, 2, 3)
            groups.append(SliceGroup(case=case.name, slices=slices,
                                     image=predict.pad_to_multiple(image, multiple, fill),
                                     label=np.asarray(case.label[slices], dtype=np.uint8),
                                     shape=tuple(case.label.shape[1:])))
    names = {ci: cases[ci].name for ci in by_case}
    source = {"fold": fold,
              "validation_cases": [names[ci] for ci in sorted(by_case) if names[ci] not in extra],
              "training_cases": [names[ci] for ci in sorted(by_case) if names[ci] in extra],
              "slices": {names[ci]: picked for ci, picked in sorted(by_case.items())}}
    return groups, source


# ------------------------------------------------------------------------------ export

def _dynamic_shapes(multiple: int):

    batch = torch.export.Dim("N", min=1, max=4096)
    h = torch.export.Dim("H_blocks", min=1, max=MAX_SIDE // multiple)
    w = torch.export.Dim("W_blocks", min=1, max=MAX_SIDE // multiple)
    return ({0: batch, 2: multiple * h, 3: multiple * w},)


def export_program(net, in_channels: int, multiple: int):
    """(program, example input): ``torch.export`` of the inference network; N, H and W are
    dynamic, H and W multiples of ``multiple``."""

    example = torch.randn(2, in_channels, 2 * multiple, 2 * multiple)
    with torch.no_grad():
        program = torch.export.export(net, (example,), dynamic_shapes=_dynamic_shapes(multiple))
    return program, example


def _onnx_export_kwargs(opset: int) -> dict[str, Any]:
    """Arguments of ``torch.onnx.export`` (dynamo) that exist on torch 2.6 and current torch."""
    return {"input_names": [INPUT_NAME], "output_names": [OUTPUT_NAME],
            "opset_version": opset, "dynamo": True, "external_data": False}


@contextlib.contextmanager
def _quiet_exporter():
    """Exporter progress to stderr (it prints to stdout); its version notices and missing
    torchvision warnings off (the opset actually produced is checked afterwards)."""
    loggers = [logging.getLogger(name) for name in ("torch.onnx", "onnxscript")]
    levels = [logger.level for logger in loggers]
    try:
        for logger in loggers:
            logger.setLevel(logging.ERROR)
        with contextlib.redirect_stdout(sys.stderr), warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            yield
    finally:
        for logger, level in zip(loggers, levels):
            logger.setLevel(level)


def _rename_dims(model, names: dict[str, str]) -> None:
    """Replace the exporter's symbolic dim names (e.g. 's77', '8*s99') by N, H, W."""
    values = list(model.graph.input) + list(model.graph.output) + list(model.graph.value_info)
    for value in values:
        for dim in value.type.tensor_type.shape.dim:
            if dim.HasField("dim_param") and dim.dim_param in names:
                dim.dim_param = names[dim.dim_param]


def write_onnx(program, example, path: Path, opset: int, metadata: dict[str, str]) -> int:
    """Export ``program`` to ``path``, name its dims, add metadata; return the opset it has."""

    with _quiet_exporter():
        torch.onnx.export(program, (example,), str(path), **_onnx_export_kwargs(opset))
    model = onnx.load(str(path))
    dims = model.graph.input[0].type.tensor_type.shape.dim
    _rename_dims(model, {dims[0].dim_param: "N", dims[2].dim_param: "H",
                         dims[3].dim_param: "W"})
    del model.metadata_props[:]
    for key, value in sorted(metadata.items()):
        model.metadata_props.add(key=key, value=value)
    onnx.save(model, str(path))
    onnx.checker.check_model(str(path), full_check=True)
    return next(o.version for o in model.opset_import if o.domain in ("", "ai.onnx"))


# ------------------------------------------------------------------------------ parity

def run_torch(net, groups: list[SliceGroup]) -> list[np.ndarray]:
    """Logits (k, C_out, H, W) per group from the eager network."""

    outputs = []
    with torch.inference_mode():
        for g in groups:
            logits = net(torch.from_numpy(g.image)).numpy()
            outputs.append(logits[..., :g.shape[0], :g.shape[1]])
    return outputs


def run_onnx(path: Path, groups: list[SliceGroup]) -> list[np.ndarray]:
    """Logits per group from onnxruntime's CPU execution provider."""
    session = predict.open_session(path)
    return [predict.run_model(session, g.image, f"the exported model {path}")
            [..., :g.shape[0], :g.shape[1]] for g in groups]


# Runs in a fresh interpreter (-I: no PYTHONPATH, no user site; cwd outside the repository)
# so that loading the .pt2 proves it needs torch alone.
_CLEAN_LOAD = """
import sys
import numpy as np
import torch
program = torch.export.load(sys.argv[1])
module = program.module()
inputs = np.load(sys.argv[2])
with torch.no_grad():
    outputs = {k: module(torch.from_numpy(inputs[k])).numpy() for k in inputs.files}
np.savez(sys.argv[3], **outputs)
leaked = sorted(m for m in sys.modules if m.split(".")[0] in ("steps", "monai"))
if leaked:
    sys.exit("the .pt2 pulled in " + leaked[0])
"""


def run_pt2_clean(path: Path, groups: list[SliceGroup]) -> list[np.ndarray]:
    """Logits per group from ``path`` reloaded in a separate Python process."""
    with tempfile.TemporaryDirectory(prefix="convert-pt2-") as tmp:
        inputs, outputs = Path(tmp) / "inputs.npz", Path(tmp) / "outputs.npz"
        np.savez(inputs, **{f"g{i}": g.image for i, g in enumerate(groups)})
        done = subprocess.run([sys.executable, "-I", "-c", _CLEAN_LOAD, str(path.resolve()),
                               str(inputs), str(outputs)], cwd=tmp, capture_output=True,
                              text=True)
        if done.returncode != 0:
            last = (done.stderr.strip().splitlines() or ["no output"])[-1]
            raise StepError(f"{path.name}: reloading in a clean Python process failed "
                            f"({last})")
        with np.load(outputs) as data:
            return [data[f"g{i}"][..., :g.shape[0], :g.shape[1]]
                    for i, g in enumerate(groups)]


def _dice(logits: list[np.ndarray], groups: list[SliceGroup], n_classes: int) -> list[float]:
    """Per-class Dice (classes 1..) of the argmax against the labels, over all parity slices."""

    pred = np.concatenate([x.argmax(axis=1).ravel() for x in logits])
    truth = np.concatenate([g.label.ravel() for g in groups])
    return dice_per_class(torch.from_numpy(pred), torch.from_numpy(truth), n_classes).tolist()


def compare(reference: list[np.ndarray], candidate: list[np.ndarray],
            groups: list[SliceGroup], n_classes: int) -> dict[str, Any]:
    """Parity figures of ``candidate`` logits against ``reference`` (the eager network)."""
    max_diff = max(float(np.max(np.abs(a - b))) for a, b in zip(reference, candidate))
    max_logit = max(float(np.max(np.abs(a))) for a in reference)
    agree = sum(int(np.count_nonzero(a.argmax(1) == b.argmax(1)))
                for a, b in zip(reference, candidate))
    pixels = sum(a.shape[0] * a.shape[2] * a.shape[3] for a in reference)
    dice_ref, dice_new = _dice(reference, groups, n_classes), _dice(candidate, groups, n_classes)
    return {
        "max_abs_diff": max_diff,
        "max_abs_logit": max_logit,
        "rel_diff": max_diff / max_logit if max_logit > 0 else max_diff,
        "argmax_agreement": agree / pixels,
        "pixels": pixels,
        "dice_torch": dice_ref,
        "dice": dice_new,
        "max_dice_diff": max(abs(a - b) for a, b in zip(dice_ref, dice_new)),
    }


def check_reference(reference: list[np.ndarray], pixels: int) -> None:
    """Refuse a checkpoint whose own logits are NaN/Inf (a diverged run): no export can match."""
    bad = sum(int(np.count_nonzero(~np.isfinite(x))) for x in reference)
    if bad:
        raise StepError(f"parity failed before export: the checkpoint's torch logits have "
                        f"{bad} NaN/Inf values on {pixels} validation pixels (diverged "
                        "training?)")


def check_bounds(figures: dict[str, Any], what: str) -> None:
    """Raise a one-line StepError when ``figures`` are out of BOUNDS (NaN is out)."""
    close = (figures["max_abs_diff"] <= BOUNDS["max_abs_diff"]
             or figures["rel_diff"] <= BOUNDS["rel_diff"])
    problems = []
    if not np.isfinite(figures["max_abs_logit"]):
        problems.append("the torch logits are not finite")
    elif not close:
        problems.append(f"max |logit diff| {figures['max_abs_diff']:.3g} > "
                        f"{BOUNDS['max_abs_diff']:g} and relative {figures['rel_diff']:.3g} > "
                        f"{BOUNDS['rel_diff']:g}")
    if not figures["argmax_agreement"] >= BOUNDS["argmax_agreement"]:
        problems.append(f"argmax agreement {100 * figures['argmax_agreement']:.4f}% < "
                        f"{100 * BOUNDS['argmax_agreement']:.2f}%")
    if not figures["max_dice_diff"] <= BOUNDS["dice_diff"]:
        problems.append(f"Dice differs by {figures['max_dice_diff']:.3g} > "
                        f"{BOUNDS['dice_diff']:g}")
    if problems:
        raise StepError(f"parity failed for {what} on {figures['pixels']} pixels: "
                        + "; ".join(problems))


# ------------------------------------------------------------------------ model card

def _versions(opset: int, requested: int) -> dict[str, Any]:

    return {"torch": torch.__version__, "onnx": onnx.__version__,
            "onnxruntime": onnxruntime.__version__, "python": platform.python_version(),
            "opset": opset, "opset_requested": requested}


def preprocessing_contract(meta: dict[str, Any], multiple: int) -> dict[str, Any]:
    """What a caller must do to a NIfTI case before the network (from dataset.json)."""
    return {
        "channels": list(meta["channels"]),
        "layout": "NIfTI image (x, y, z, C) → (C, D, H, W) = (c, z, y, x); one D index is "
                  "one 2D slice (H, W); the network takes slices as (N, C, H, W)",
        "mode": meta.get("mode", "default"),
        "orientation": meta.get("orientation", ""),
        "normalisation": meta["normalisation"],
        "size_multiple": multiple,
        "padding": f"pad H and W at the bottom/right to multiples of {multiple} with each "
                   "channel's minimum over the normalised volume (the background's z-score); "
                   "crop the logits back",
        "postprocessing": "argmax over the channel axis of `logits` gives the label; undo the "
                          "foreground crop (zero outside it) and the transpose",
    }


def onnx_metadata(contract: dict[str, Any], labels: dict[str, str]) -> dict[str, str]:
    """metadata_props that let ``predict`` run from the .onnx file alone."""
    return {"size_multiple": str(contract["size_multiple"]),
            "channels": json.dumps(contract["channels"]),
            "labels": json.dumps(labels),
            "preprocessing": json.dumps(contract)}


def model_card(ckpt: dict[str, Any], config, meta: dict[str, Any], contract: dict[str, Any],
               parity: dict[str, Any], provenance: dict[str, Any],
               versions: dict[str, Any]) -> dict[str, Any]:
    n_in, n_out = config.in_channels, config.out_channels
    return {
        "format_version": CARD_FORMAT_VERSION,
        "name": "unet2d",
        "task": meta.get("name", ""),
        "files": {"onnx": ONNX_FILE, "pytorch": PT2_FILE, "parity": PARITY_FILE},
        "inputs": [{"name": INPUT_NAME, "shape": ["N", n_in, "H", "W"], "dtype": "float32"}],
        "outputs": [{"name": OUTPUT_NAME, "shape": ["N", n_out, "H", "W"], "dtype": "float32",
                     "meaning": "unnormalised class scores; argmax over axis 1 is the label"}],
        "size_multiple": contract["size_multiple"],
        "dynamic_axes": {"N": "batch of slices", "H": f"multiple of {contract['size_multiple']}",
                         "W": f"multiple of {contract['size_multiple']}"},
        "preprocessing": contract,
        "labels": dict(meta["labels"]),
        "model_config": config.to_dict(),
        "inference_form": "eval mode, deep supervision off, one output",
        "training": {"config": ckpt.get("train_config", {}), "metrics": ckpt.get("metrics", {}),
                     "patch_size": ckpt.get("patch_size")},
        "provenance": provenance,
        "versions": versions,
        "pytorch_export": {
            "format": "torch.export ExportedProgram (.pt2)",
            "load": f"torch.export.load('{PT2_FILE}').module()(image)",
            "torchscript": "not produced: torch.jit.trace and torch.jit.script are deprecated "
                           "in current torch (torch.export is the replacement)",
        },
        "parity": parity,
        "usage": {"predict": f"python -m steps.convert predict --onnx {ONNX_FILE} "
                             "--image CASE.nii.gz --out LABEL.nii.gz"},
    }


# ------------------------------------------------------------------------------- main

def _check_channels(ckpt: dict[str, Any], config, meta: dict[str, Any], path: Path) -> None:
    channels = list(meta["channels"])
    if config.in_channels != len(channels):
        raise StepError(f"{path}: model takes {config.in_channels} channels, the dataset has "
                        f"{len(channels)} ({', '.join(channels)})")
    trained = ckpt.get("channels")
    if trained is not None and list(trained) != channels:
        raise StepError(f"{path}: trained on channels {list(trained)}, the dataset has "
                        f"{channels}")
    if config.out_channels != len(meta["labels"]):
        raise StepError(f"{path}: model has {config.out_channels} output classes, the "
                        f"dataset has {len(meta['labels'])} labels")


@dataclass
class Inputs:
    """Everything read and checked before anything is written."""
    ckpt: dict[str, Any]
    config: Any
    net: Any
    meta: dict[str, Any]
    groups: list[SliceGroup]
    source: dict[str, Any]
    reference: list[np.ndarray]
    provenance: dict[str, Any]
    moved: str = ""           # what the dataset's read by key fetched (Source.moved_note)


def read_inputs(args: argparse.Namespace) -> Inputs:
    """Checkpoint, network, dataset and the eager network's parity logits (a dataset read by
    key: only the cases the parity slices come from are fetched)."""
    ckpt_path = args.model / CHECKPOINT
    ckpt = load_checkpoint(args.model)
    with read_dataset(args.dataset, args.exported.parent) as (dataset, meta):
        net, config = inference_network(ckpt, ckpt_path)
        _check_channels(ckpt, config, meta, ckpt_path)
        fold = (ckpt.get("train_config") or {}).get("fold", 0)     # checked by the schema
        groups, source = parity_inputs(dataset, meta, fold, args.parity_slices,
                                       config.size_multiple())
    reference = run_torch(net, groups)
    check_reference(reference, sum(g.label.size for g in groups))
    trained_on = ckpt.get("dataset_manifest_sha256")
    provenance = {"dataset_manifest_sha256": trained_on,
                  "parity_dataset_manifest_sha256": dataset.manifest_sha256(),
                  "model_manifest_sha256": manifest_digest(args.model),
                  "checkpoint": CHECKPOINT}
    if trained_on and trained_on != provenance["parity_dataset_manifest_sha256"]:
        print(f"convert: warning: {dataset} is not the dataset the model was trained on "
              "(manifest digests differ); parity is still measured on it", file=sys.stderr)
    return Inputs(ckpt, config, net, meta, groups, source, reference, provenance,
                  dataset.moved_note())


def export_all(out: Path, inputs: Inputs, requested: int) -> int:
    """Write the .pt2 and the .onnx into ``out``; return the ONNX opset produced."""

    config = inputs.config
    print("convert: torch.export ...", file=sys.stderr)
    program, example = export_program(inputs.net, config.in_channels, config.size_multiple())
    torch.export.save(program, str(out / PT2_FILE))
    print(f"convert: ONNX opset {requested} ...", file=sys.stderr)
    contract = preprocessing_contract(inputs.meta, config.size_multiple())
    opset = write_onnx(program, example, out / ONNX_FILE, requested,
                       onnx_metadata(contract, dict(inputs.meta["labels"])))
    if opset < requested:
        raise StepError(f"--opset {requested}: the exporter produced opset {opset}; nothing "
                        "published")
    if opset != requested:   # torch 2.6/2.7 write 18 when asked for 17: newer, still honest
        print(f"convert: note: asked for opset {requested}, the exporter produced {opset}",
              file=sys.stderr)
    return opset


def verify(out: Path, inputs: Inputs) -> dict[str, Any]:
    """parity.json's content; a StepError when either export is out of BOUNDS."""
    groups, n_classes = inputs.groups, inputs.config.out_channels
    print(f"convert: parity on {sum(len(g.slices) for g in groups)} slices ...",
          file=sys.stderr)
    onnx_fig = compare(inputs.reference, run_onnx(out / ONNX_FILE, groups), groups, n_classes)
    pt2_fig = compare(inputs.reference, run_pt2_clean(out / PT2_FILE, groups), groups,
                      n_classes)
    check_bounds(onnx_fig, f"{ONNX_FILE} (onnxruntime)")
    check_bounds(pt2_fig, f"{PT2_FILE} (reloaded)")
    return {"slices": sum(len(g.slices) for g in groups), "source": inputs.source,
            "bounds": BOUNDS, "passed": True,
            "onnx": {"runtime": "onnxruntime CPUExecutionProvider", **onnx_fig},
            "pt2": {"runtime": "torch.export.load in a separate python -I process", **pt2_fig}}


def write_results(out: Path, inputs: Inputs, parity: dict[str, Any], versions: dict) -> None:
    contract = preprocessing_contract(inputs.meta, inputs.config.size_multiple())
    schemas.write_json(out / PARITY_FILE, parity)
    card = model_card(inputs.ckpt, inputs.config, inputs.meta, contract, parity,
                      inputs.provenance, versions)
    schemas.write_json(out / CARD_FILE, card)
    write_outputs(out, STEP, {"max_abs_diff": f"{parity['onnx']['max_abs_diff']:.3g}",
                              "argmax_agreement": f"{parity['onnx']['argmax_agreement']:.6f}"})


def check_opset(requested: int) -> None:
    """An opset newer than the installed onnx knows cannot be produced: refused before any
    work rather than published as an older one."""

    newest = onnx.defs.onnx_opset_version()
    if requested > newest:
        raise StepError(f"--opset {requested}: the installed onnx {onnx.__version__} knows "
                        f"opsets up to {newest}")


def convert(args: argparse.Namespace) -> int:
    start = time.perf_counter()
    check_disjoint({"--exported": args.exported}, {"--model": args.model,
                                                   "--dataset": args.dataset})
    check_opset(args.opset)
    inputs = read_inputs(args)
    params = {"opset": args.opset, "parity_slices": args.parity_slices}
    with publish(args.exported, "exported", STEP, params) as out:
        opset = export_all(out, inputs, args.opset)
        parity = verify(out, inputs)
        write_results(out, inputs, parity, _versions(opset, args.opset))
    fig = parity["onnx"]
    print(f"convert: {ONNX_FILE} (opset {opset}) and {PT2_FILE} in {args.exported}; "
          f"max |logit diff| {fig['max_abs_diff']:.2g} (relative {fig['rel_diff']:.2g}), "
          f"argmax agreement {100 * fig['argmax_agreement']:.4f}%, "
          f"{time.perf_counter() - start:.1f} s{inputs.moved}", file=sys.stderr)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["predict"]:
        return predict.main(argv[1:])
    args = parse_args(argv)
    limits.set_threads()
    return convert(args)


if __name__ == "__main__":
    sys.exit(run_main(main))
