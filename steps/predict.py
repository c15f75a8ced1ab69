"""Segment one NIfTI case with the exported ONNX model alone (no torch, no checkpoint).

    python -m steps.convert predict --onnx unet2d.onnx --image CASE.nii.gz --out LABEL.nii.gz

The case goes through the same preprocessing as the ``dataset`` artifact (``steps.preprocess``:
reorientation in ``default`` mode, foreground crop, channel-wise z-score with the crop's own
statistics); the model's ``metadata_props`` say which mode and channels it was trained with.
Inference is slice-wise: each axial slice (C, H, W) is padded at the bottom/right to the
network's size multiple with the background's z-score, and the logits are cropped back.
The argmax labels are put back into the source grid (zero outside the foreground crop) and
written as a uint8 NIfTI with the input's shape (x, y, z) and affine.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import re
import secrets
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import nibabel as nib
import numpy as np
import onnx
import onnxruntime as ort
from nibabel.orientations import apply_orientation, io_orientation, ornt_transform

from steps import limits, metrics, nifti, schemas
from steps.artifacts import check_disjoint
from steps.errors import OneLineArgumentParser, StepError, run_main
from steps.preprocess import (channel_stats, foreground_box, image_channels_last, reorient,
                              zscore)

INPUT_NAME = "image"
OUTPUT_NAME = "logits"
# The `exported` artifact's model and card (written by steps.convert).
ONNX_FILE = "unet2d.onnx"
# An ensemble's graph (steps.ensemble) holds its k-th model's names under this prefix.
MEMBER_PREFIX = "member{}."
CARD_FILE = "model-card.json"
DEFAULT_BATCH = 16
# Operator domains a model's nodes may use: ONNX's own (ai.onnx.ml included, which
# onnxruntime's quantization tools import) and onnxruntime's built-in contrib operators; a
# custom domain needs a library this runtime lacks.
OP_DOMAINS = ("", "ai.onnx", "ai.onnx.ml", "com.microsoft")
_WAIT_S = 0.2          # how often the main thread looks up from a running inference


# ------------------------------------------------------------------------- padding

def background_fill(image: np.ndarray) -> np.ndarray:
    """(C,) float32 per-channel minimum of a normalised (C, ...) image: the z-score of the
    zero background, the value that preprocess pads with."""
    return image.reshape(image.shape[0], -1).min(axis=1).astype(np.float32)


def pad_to_multiple(x: np.ndarray, multiple: int, fill: np.ndarray) -> np.ndarray:
    """Pad (N, C, H, W) at the bottom/right to multiples of ``multiple`` with ``fill`` (C,)."""
    n, c, h, w = x.shape
    ph, pw = -h % multiple, -w % multiple
    if not ph and not pw:
        return np.ascontiguousarray(x, dtype=np.float32)
    out = np.empty((n, c, h + ph, w + pw), dtype=np.float32)
    out[:] = fill.reshape(1, c, 1, 1)
    out[..., :h, :w] = x
    return out


# -------------------------------------------------------------------------- the model

def member(node_name: str) -> str:
    """The ensemble member that a node of the graph comes from ('' for a single model)."""
    found = re.match(MEMBER_PREFIX.replace(".", r"\.").format(r"\d+"), node_name)
    return found.group(0) if found else ""


def open_session(path: Path | str):
    """onnxruntime session on the CPU execution provider; a bad file is a StepError."""

    path = Path(path)
    if not path.is_file():
        raise StepError(f"--onnx {path}: no such file")
    options = ort.SessionOptions()
    options.log_severity_level = 3
    # onnxruntime's default is one thread per core of the node, whatever the pod's share
    options.intra_op_num_threads = limits.threads()
    check_graph(path)
    try:
        return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    except Exception as exc:  # onnxruntime raises its own Fail/InvalidGraph types
        raise StepError(f"--onnx {path}: not a loadable ONNX model ({_first_line(exc)})") \
            from None


def _first_line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]


def check_graph(path: Path | str) -> None:
    """Every operator of the model (its subgraphs included) in :data:`OP_DOMAINS`, checked
    before anything runs it: onnxruntime's quantization tools would otherwise meet a
    custom-domain operator halfway through calibration. Its size is held to the memory first:
    onnx.load holds the file and the graph parsed from it, onnxruntime's session a third."""
    limits.check_memory(3 * Path(path).stat().st_size, f"--onnx {path}")
    try:
        model = onnx.load(str(path), load_external_data=False)
    except Exception as exc:  # noqa: BLE001 - protobuf's and onnx's own error types
        raise StepError(f"--onnx {path}: not a loadable ONNX model ({_first_line(exc)})") \
            from None
    graphs, domains = [model.graph], set()
    while graphs:
        graph = graphs.pop()
        for node in graph.node:
            domains.add(node.domain)
            for attribute in node.attribute:   # If, Loop and Scan bodies
                graphs.extend([attribute.g] if attribute.HasField("g") else [])
                graphs.extend(attribute.graphs)
    foreign = sorted(d for d in domains if d not in OP_DOMAINS)
    if foreign:
        raise StepError(f"--onnx {path}: uses operators of the domain '{foreign[0]}', which "
                        f"this runtime does not provide (allowed: ONNX's and com.microsoft's)")


def run_model(session, image: np.ndarray, where: str) -> np.ndarray:
    """``session``'s logits for ``image`` (N, C, H, W) float32, with the model treated as
    untrusted at run time: a failure inside onnxruntime (an index out of range, an input the
    graph cannot take) is a StepError naming ``where``; an inference that runs longer than
    ``max_inference_seconds`` is stopped (onnxruntime's ``RunOptions.terminate``) and refused;
    SIGTERM or Ctrl-C stop it too (it runs in a worker thread, so the main thread's signal
    handler is not held up by a graph that never ends)."""
    options, result = ort.RunOptions(), {}
    options.log_severity_level = 4       # its own report of a stopped run is not an error

    def infer():
        try:
            result["logits"] = session.run([OUTPUT_NAME], {INPUT_NAME: image}, options)[0]
        except Exception as exc:  # noqa: BLE001 - onnxruntime's Fail, InvalidArgument, ...
            # Text only: the exception's traceback would tie this frame, and the session,
            # into a cycle that outlives the step; onnxruntime aborts the process if a session
            # is only freed at interpreter exit.
            result["error"] = f"{type(exc).__name__}: {_first_line(exc)}"

    worker = threading.Thread(target=infer, name="onnxruntime", daemon=True)
    limit = limits.get("max_inference_seconds")
    started = time.monotonic()
    worker.start()
    try:
        while worker.is_alive():
            worker.join(_WAIT_S)
            if worker.is_alive() and time.monotonic() - started > limit:
                raise StepError(f"{where}: one inference of {image.shape[0]} slices ran past "
                                f"{limit} s ({limits.LIMITS['max_inference_seconds'].env}); "
                                "the model was stopped")
    except BaseException:
        options.terminate = True
        worker.join(10)
        raise
    if "error" in result:
        raise StepError(f"{where}: the model failed while running ({result['error']})")
    return result["logits"]


def read_contract(session, path: Path | str) -> dict[str, Any]:
    """The preprocessing contract that steps.convert stored in the model's metadata_props,
    checked against ``schemas.Contract`` and the graph."""
    props = session.get_modelmeta().custom_metadata_map
    where = f"--onnx {path}: metadata"
    if "preprocessing" not in props or "labels" not in props:
        raise StepError(f"{where} has no preprocessing contract (not written by "
                        "steps.convert)")
    contract = schemas.parse_json(props["preprocessing"], f"{where} 'preprocessing'")
    labels = schemas.parse_json(props["labels"], f"{where} 'labels'")
    if isinstance(contract, dict):
        contract["labels"] = labels
    schemas.validate(schemas.Contract, contract, where)
    check_contract(session, contract, path)
    contract["postprocessing"] = read_postprocessing(props, labels, where)
    return contract


def read_postprocessing(props: dict[str, str], labels: dict[str, str],
                        where: str) -> list[list[int]]:
    """The label groups whose largest component predict keeps (steps.ensemble writes them,
    schemas.Postprocessing); none for a model without that metadata."""
    if "postprocessing" not in props:
        return []
    where = f"{where} 'postprocessing'"
    post = schemas.parse_json(props["postprocessing"], where)
    schemas.validate(schemas.Postprocessing, post, where)
    groups = post["keep_largest_component"]
    unknown = sorted({label for g in groups for label in g} - {int(k) for k in labels})
    if unknown:
        raise StepError(f"{where}: labels {unknown} are not among the model's {labels}")
    return groups


def check_contract(session, contract: dict[str, Any], path: Path | str) -> None:
    """The (schema-checked) metadata must agree with the graph: input ``image``
    (N, C, H, W) with C channels, output ``logits`` (N, K, H, W) with K the number of labels
    (where the graph fixes those dimensions; :func:`segment` checks K again on what the
    model returns)."""
    labels, channels = contract["labels"], contract["channels"]
    inputs = {i.name: i.shape for i in session.get_inputs()}
    outputs = {o.name: o.shape for o in session.get_outputs()}
    types = {t.name: t.type for t in session.get_inputs() + session.get_outputs()}
    if set(inputs) != {INPUT_NAME} or types.get(INPUT_NAME) != "tensor(float)" or \
            types.get(OUTPUT_NAME) != "tensor(float)":
        raise StepError(f"--onnx {path}: the graph takes {sorted(inputs)} "
                        f"({types.get(INPUT_NAME)}) and gives {OUTPUT_NAME} "
                        f"({types.get(OUTPUT_NAME)}); the metadata's contract is one float "
                        f"input '{INPUT_NAME}' and float '{OUTPUT_NAME}'")
    for name, table, want in ((INPUT_NAME, inputs, len(channels)),
                              (OUTPUT_NAME, outputs, len(labels))):
        shape = table.get(name)
        if shape is None or len(shape) != 4 or (isinstance(shape[1], int) and shape[1] != want):
            raise StepError(f"--onnx {path}: {name} is {shape}, the metadata needs "
                            f"(N, {want}, H, W) for {want} "
                            f"{'channels' if name == INPUT_NAME else 'classes'}")


def read_card(exported: Path) -> dict[str, Any]:
    """The ``exported`` artifact's model card, checked against ``schemas.ModelCard``."""
    where = f"artifact 'exported' at {exported}: {CARD_FILE}"
    if not (exported / CARD_FILE).is_file():
        raise StepError(f"{where} is missing (not an artifact of steps.convert)")
    card = schemas.read_json(exported / CARD_FILE, where)
    schemas.validate(schemas.ModelCard, card, where)
    return card


# ---------------------------------------------------------------------- preprocessing

@dataclass
class Prepared:
    """A case ready for slice-wise inference: ``image`` (C, D, h, w) float32 normalised
    foreground crop; ``box`` its [start, stop) per (D, H, W) axis in the reoriented grid of
    shape ``grid``; ``volume`` the source NIfTI."""
    image: np.ndarray
    box: list[tuple[int, int]]
    grid: tuple[int, int, int]
    volume: Any


def prepare(path: Path | str, contract: dict[str, Any]) -> Prepared:
    """Read ``path`` and apply the dataset's preprocessing (steps.preprocess functions)."""
    volume = nifti.load(path)
    mode = contract.get("mode", "default")
    channels = contract["channels"]
    data = image_channels_last(volume, len(channels), f"--image {volume.path}:",
                               f"the model needs {len(channels)} ({', '.join(channels)}) as "
                               f"(x, y, z, {len(channels)})")
    image, _, _, _ = reorient(data, None, volume, mode)
    image = image.transpose(3, 2, 1, 0)  # (C, D, H, W) = (c, z, y, x)
    box = foreground_box(image, mode == "anchor", Path(path).name)
    (d0, d1), (h0, h1), (w0, w1) = box
    crop = image[:, d0:d1, h0:h1, w0:w1]
    out = np.empty(crop.shape, dtype=np.float32)
    for c, channel in enumerate(crop):
        out[c] = zscore(channel, *channel_stats(channel))
    return Prepared(image=out, box=box, grid=tuple(image.shape[1:]), volume=volume)


# -------------------------------------------------------------------------- inference

def segment(session, image: np.ndarray, multiple: int, n_classes: int,
            batch: int = DEFAULT_BATCH) -> np.ndarray:
    """Slice-wise argmax labels (D, H, W) uint8 of a normalised image (C, D, H, W).

    The logits must be (N, n_classes, H, W) for the (N, C, H, W) batch sent, so no label
    outside the model's metadata can be written."""
    channels, depth, height, width = image.shape
    limits.check_memory(4 * min(batch, depth) * (channels + n_classes)
                        * (height + multiple) * (width + multiple), f"--batch-size {batch}")
    fill = background_fill(image)
    labels = np.empty((depth, height, width), dtype=np.uint8)
    for start in range(0, depth, batch):
        x = pad_to_multiple(image[:, start:start + batch].transpose(1, 0, 2, 3), multiple, fill)
        logits = run_model(session, x, "the model")
        if logits.shape != (x.shape[0], n_classes) + x.shape[2:]:
            raise StepError(f"the model returned logits {list(logits.shape)} for input "
                            f"{list(x.shape)}; its metadata needs {n_classes} classes at the "
                            "input's size")
        labels[start:start + batch] = logits[..., :height, :width].argmax(axis=1)
    return labels


def restore(labels: np.ndarray, prepared: Prepared, mode: str) -> np.ndarray:
    """(x, y, z) uint8 label in the source voxel grid: uncrop, untranspose, unreorient."""

    full = np.zeros(prepared.grid, dtype=np.uint8)
    (d0, d1), (h0, h1), (w0, w1) = prepared.box
    full[d0:d1, h0:h1, w0:w1] = labels
    full = full.transpose(2, 1, 0)  # (x, y, z) in the reoriented order
    if mode != "anchor":
        ornt = io_orientation(prepared.volume.affine)
        identity = np.array([[0, 1], [1, 1], [2, 1]])
        full = apply_orientation(full, ornt_transform(identity, ornt))
    return np.ascontiguousarray(full)


NIFTI_SUFFIXES = (".nii.gz", ".nii")   # what nibabel writes as NIfTI-1 by the name alone


def write_label(labels: np.ndarray, affine: np.ndarray, path: Path) -> None:
    """Write ``labels`` as a uint8 NIfTI at ``path`` completely or not at all: through a
    fresh temporary file beside it (a random name made with O_EXCL: never an existing file,
    so never an input), renamed into place; removed on any failure, SIGTERM's ``Stopped``
    included."""
    image = nib.Nifti1Image(labels, affine)
    image.set_data_dtype(np.uint8)
    # nibabel picks the format by the name's ending, so the temporary name keeps it.
    suffix = next((s for s in NIFTI_SUFFIXES if path.name.endswith(s)), ".nii")
    tmp: Path | None = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        name = path.parent / f".{path.name}.{secrets.token_hex(8)}.part{suffix}"
        os.close(os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666))
        tmp = name
        nib.save(image, str(name))
        os.replace(name, path)
        tmp = None
    except OSError as exc:
        raise StepError(f"--out {path}: cannot write it ({exc.strerror or exc})") from None
    finally:
        if tmp is not None:
            with contextlib.suppress(OSError):
                tmp.unlink(missing_ok=True)


# -------------------------------------------------------------------------------- CLI

def build_parser() -> argparse.ArgumentParser:
    p = OneLineArgumentParser(prog="python -m steps.convert predict",
                              description="Segment one NIfTI case (x, y, z, 4) with the "
                                          "exported ONNX model alone; writes a uint8 label "
                                          "NIfTI with the input's shape and affine.")
    p.add_argument("--onnx", required=True, type=Path, metavar="FILE",
                   help="the exported model (unet2d.onnx from the `exported` artifact)")
    p.add_argument("--image", required=True, type=Path, metavar="CASE.nii.gz",
                   help="input case, .nii or .nii.gz, channels in the model's order "
                        "(FLAIR, T1w, t1gd, T2w for Task01)")
    p.add_argument("--out", required=True, type=Path, metavar="LABEL.nii.gz",
                   help="output uint8 label map (x, y, z); its directory is created")
    p.add_argument("--batch-size", type=int, default=DEFAULT_BATCH,
                   help=f"slices per onnxruntime call (default {DEFAULT_BATCH})")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.batch_size < 1:
        raise StepError(f"--batch-size {args.batch_size}: must be at least 1")
    check_disjoint({"--out": args.out}, {"--image": args.image, "--onnx": args.onnx})
    if not args.out.name.endswith(NIFTI_SUFFIXES):
        raise StepError(f"--out {args.out}: a label map is written as NIfTI, so its name "
                        f"must end with {' or '.join(NIFTI_SUFFIXES)}")
    session = open_session(args.onnx)
    contract = read_contract(session, args.onnx)
    prepared = prepare(args.image, contract)
    labels = segment(session, prepared.image, int(contract["size_multiple"]),
                     len(contract["labels"]), args.batch_size)
    labels = metrics.apply_postprocessing(labels, contract["postprocessing"])
    full = restore(labels, prepared, contract.get("mode", "default"))
    write_label(full, prepared.volume.affine, args.out)
    counts = {contract["labels"].get(str(v), str(v)): int(n)
              for v, n in enumerate(np.bincount(full.ravel(), minlength=1)) if v and n}
    print(f"predict: {args.out} {list(full.shape)}, voxels per label {counts}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(run_main(main))
