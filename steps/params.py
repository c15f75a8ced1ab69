"""Every step parameter, stated once: name, type, default, bounds and help; and every step's
artifacts and output parameters (:data:`IO`).

A step's command line (:func:`add_arguments`), the pipeline config's section of the same
name (``workflows.config``), the Argo templates' inputs and the workflow parameters with
their UI descriptions and enums (``workflows.templates``) are all derived from the tuples
below, so a user running a step by hand gets what the workflow runs. Flags that only wire a
step to its surroundings (``--raw DIR``, ``--checkpoint-uri``, ``--nodes``) are not
parameters and stay with their step.

This module imports nothing heavy: the config and the workflow compile without torch.
"""
from __future__ import annotations

import argparse
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable

from steps import uris
from steps.errors import OneLineArgumentParser
from steps.model import GROUPS, MAX_FILTERS

DEVICE_KINDS = ("auto", "hpu", "cuda", "cpu")
PRECISIONS = ("auto", "fp32", "bf16", "fp16")
HPU_MODES = ("compile", "lazy", "eager")
OPTIMIZERS = ("adamw", "fusedadamw", "sgd")
LR_SCHEDULES = ("cosine", "constant")
CUDA_COMPILE_MODES = ("default", "reduce-overhead", "max-autotune-no-cudagraphs")
N_FOLDS = 5
OUTPUTS_DIR = "argo-outputs"   # under an output artifact: one small text file per value
MAX_SIDE = 4096                # largest patch H or W; the exported programs accept up to it
MAX_SEED = 2 ** 32 - 1         # numpy's legacy RandomState takes no more
_SIDE = r"(?:[1-9][0-9]{0,2}|[1-3][0-9]{3}|40[0-8][0-9]|409[0-6])"   # 1..MAX_SIDE


@dataclass(frozen=True)
class Param:
    """One parameter. ``name`` is the config key; the flag and the Argo name use dashes."""
    name: str
    type: type                      # int, float, str or bool
    default: Any                    # None: required
    help: str
    choices: tuple[str, ...] = ()
    ge: float | None = None
    gt: float | None = None
    le: float | None = None
    pattern: str | None = None      # a full match for str values
    pattern_help: str = ""          # what a matching value looks like, for the error line
    uri_kinds: tuple[str, ...] = ()  # a URI read by steps.uris with these schemes
    ui: bool = False                # a workflow parameter (the Argo UI's submit form)
    shapes_output: bool = True      # False: cannot change a byte of the output (memo key)

    @property
    def flag(self) -> str:
        return "--" + self.dashed

    @property
    def dashed(self) -> str:
        return self.name.replace("_", "-")

    def text(self, value: Any) -> str:
        """``value`` as one command-line word: ``true``/``false``, floats as ``%g``."""
        if isinstance(value, bool):
            return str(value).lower()
        if isinstance(value, float):
            return f"{value:g}"
        return str(value)

    def problem(self, value: Any) -> str | None:
        """What is wrong with a typed ``value``, or None."""
        if self.choices and value not in self.choices:
            return f"must be one of {', '.join(self.choices)} (got {value!r})"
        for bound, bad, word in ((self.ge, lambda b: value < b, ">="),
                                 (self.gt, lambda b: value <= b, ">"),
                                 (self.le, lambda b: value > b, "<=")):
            if bound is not None and bad(bound):
                return f"must be {word} {bound:g} (got {self.text(value)})"
        if self.mismatch(value):
            return f"{self.mismatch(value)} (got {value!r:.80})"
        return None

    def mismatch(self, value: str) -> str | None:
        """What is wrong with a str ``value`` against ``pattern``, or None."""
        if self.pattern and not re.fullmatch(self.pattern, value):
            return f"must {self.pattern_help or f'match {self.pattern}'}"
        return None

    def parse(self, text: str) -> Any:
        """The argparse ``type``: text to a checked value, or ArgumentTypeError. A float
        must be finite: NaN passes every bound (each comparison is false)."""
        try:
            value = _PARSERS[self.type](text)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"expected {_TYPE_WORDS[self.type]}, got {text!r}") from None
        if self.type is float and not math.isfinite(value):
            raise argparse.ArgumentTypeError(f"expected a finite number, got {text!r}")
        problem = self.problem(value)
        if problem:
            raise argparse.ArgumentTypeError(problem)
        return value


def _bool(text: str) -> bool:
    value = str(text).strip().lower()
    if value in ("true", "1", "yes", "on"):
        return True
    if value in ("false", "0", "no", "off"):
        return False
    raise ValueError(text)


_PARSERS = {int: int, float: float, str: str, bool: _bool}
_TYPE_WORDS = {int: "an integer", float: "a number", str: "text", bool: "true or false"}


DOWNLOAD = (
    Param("source", str, None, ui=True, uri_kinds=uris.SOURCE_KINDS,
          help="dataset source: https:// or http:// (resumed), s3://bucket/key (the public "
               "msd-for-monai buckets are read anonymously), file:///path to a .tar or an "
               "extracted task, or synthetic://?cases=N&shape=HxWxD&seed=S&test=M"),
    Param("md5", str, "auto", ui=True, pattern=r"(auto|[0-9a-f]{32})?",
          pattern_help="be 32 lower-case hexadecimal digits, auto, or empty",
          help="md5 of the downloaded archive, checked before extraction; auto: the "
               "published digest of Task01_BrainTumour.tar; empty: no check"),
)

PREPROCESS = (
    Param("workers", int, 1, ge=1, shapes_output=False,
          help="worker processes, each holding about two volumes; at most the step's CPUs "
               "(cgroup quota, affinity or UNET_CPUS), which the workers share as threads; "
               "the output is identical for any value"),
    Param("image_dtype", str, "auto", choices=("auto", "float16", "float32"), ui=True,
          help="dtype of the stored images; auto: float16 (its rounding error is measured "
               "and recorded), float32 with mode anchor"),
    Param("mode", str, "default", choices=("default", "anchor"),
          help="default: keep the whole in-plane foreground, reoriented to RAS+; anchor: "
               "the anchors' zero pad and centre crop in stored voxel order"),
    Param("patch_size", str, "192x160", pattern=f"{_SIDE}x{_SIDE}", ui=True,
          pattern_help=f"be HxW, each side 1..{MAX_SIDE}",
          help="training patch HxW in voxels: recorded, and the in-plane pad/crop size"),
)

TRAIN = (
    Param("device", str, "auto", choices=DEVICE_KINDS,
          help="hpu, cuda or cpu; auto picks the first present in that order"),
    Param("devices", int, 1, ge=1, le=64, ui=True,
          help="devices per node; more than 1 runs DDP through torch.distributed.run"),
    Param("precision", str, "auto", choices=PRECISIONS, ui=True,
          help="autocast dtype; auto: bf16 on hpu, bf16 or fp16 on cuda, fp32 on cpu"),
    Param("hpu_mode", str, "compile", choices=HPU_MODES,
          help="Gaudi execution: torch.compile(hpu_backend) with PT_HPU_LAZY_MODE=0, lazy "
               "mode with mark_step, or eager"),
    Param("cuda_compile", bool, True,
          help="torch.compile the network and the loss on a CUDA GPU (false: eager; "
               "elsewhere: no effect)"),
    Param("cuda_compile_mode", str, "reduce-overhead", choices=CUDA_COMPILE_MODES,
          help="torch.compile mode on CUDA: reduce-overhead (fused kernels replayed as CUDA "
               "graphs), default (fused kernels) or max-autotune-no-cudagraphs (autotuned "
               "Triton templates)"),
    Param("cuda_channels_last", bool, False,
          help="the channels_last memory layout for the network and its batches on CUDA "
               "(false: contiguous, measured faster)"),
    Param("cuda_layout_opt", bool, True,
          help="torch.compile on CUDA lays every convolution's tensors out channels_last "
               "inside the compiled step (Inductor's layout optimization, forced: its "
               "heuristic skips a U-Net), so cuDNN's NHWC kernels run without transposes"),
    Param("compile_cache", bool, True, shapes_output=False,
          help="save torch.compile's caches beside the checkpoints (--checkpoint-uri) after "
               "the first step and load them on a retry or resume, so it does not compile "
               "again; the cache holds generated code: only the run's own store is read"),
    Param("num_workers", int, 2, ge=0,
          help="DataLoader worker processes building batches (0: in process); at most each "
               "rank's share of the step's CPUs (cgroup quota, affinity or UNET_CPUS) less "
               "one, for the rank's own training threads"),
    Param("base_filters", int, 32, ge=1, le=MAX_FILTERS,
          help="filters of the first level (the anchors: 32), doubled per level"),
    Param("levels", int, 6, ge=2, le=8,
          help="U-Net levels (the anchors: 6), at least 4 with deep supervision; H and W "
               "must be multiples of 2**(levels-1)"),
    Param("norm", str, "instance", choices=("instance", "batch", "group"),
          help="normalisation layer"),
    Param("deep_supervision", bool, True,
          help="train with two extra heads weighted 0.5 and 0.25"),
    Param("batch_size", int, 64, ge=1, ui=True,
          help="global batch: 2D slices per step over all devices"),
    Param("val_batch_size", int, 64, ge=1,
          help="slices per forward pass during validation, per device; fewer of slices "
               "larger than patch_size, so that a pass holds at most this many patches' "
               "pixels"),
    Param("learning_rate", float, 1e-3, gt=0, le=1, ui=True, help="peak learning rate"),
    Param("lr_schedule", str, "cosine", choices=LR_SCHEDULES,
          help="cosine: decay from learning_rate to 0 over the run; constant: learning_rate "
               "throughout (NVIDIA's nnU-Net without --scheduler)"),
    Param("weight_decay", float, 1e-4, ge=0, help="AdamW/SGD weight decay"),
    Param("optimizer", str, "adamw", choices=OPTIMIZERS, ui=True,
          help="adamw, sgd, or a fused AdamW (Habana's FusedAdamW on hpu, torch's fused "
               "kernel on cuda)"),
    Param("min_epochs", int, 1, ge=0, ui=True,
          help="epochs before early stopping may end training"),
    Param("max_epochs", int, 100, ge=1, ui=True, help="stop after this many epochs"),
    Param("patience", int, 10, ge=0,
          help="stop after this many epochs without a better mean Dice (0: never)"),
    Param("skip_first_n_eval", int, 0, ge=0,
          help="validate only after this many epochs (NVIDIA's nnU-Net --skip_first_n_eval): "
               "before, no Dice, no best model and no early stopping"),
    Param("steps_per_epoch", int, 0, ge=0,
          help="optimizer steps per epoch; 0: one pass over the training slices"),
    Param("fold", int, 0, ge=0, le=N_FOLDS - 1, ui=True,
          help=f"validation fold (0..{N_FOLDS - 1}) of the dataset's split; the dataset "
               "must have that fold and cases on both sides of it"),
    Param("seed", int, 1, ge=0, le=MAX_SEED,
          help="seed of initialisation, batches and augmentation"),
    Param("checkpoint_minutes", float, 10.0, ge=0,
          help="also checkpoint within an epoch at this interval (0: at epoch ends only)"),
    Param("resume", str, "auto", choices=("auto", "never"),
          help="auto continues from the latest checkpoint of this run's checkpoint store"),
    Param("resume_from", str, "", uri_kinds=uris.CHECKPOINT_KINDS, ui=True,
          help="checkpoints of an earlier run to start from (resubmit); empty: start fresh"),
)

CONVERT = (
    Param("opset", int, 17, ge=17, help="ONNX opset version"),
    Param("parity_slices", int, 32, ge=32,
          help="validation slices compared between torch, onnxruntime and the .pt2"),
)

QUANTIZE = (
    Param("calibration_slices", int, 128, ge=8, le=100_000,
          help="training-fold slices whose activations set the INT8 ranges"),
    Param("calibration_seed", int, 0, ge=0, le=MAX_SEED,
          help="seed of the calibration slices' draw"),
    Param("calibration_method", str, "percentile", choices=("minmax", "entropy", "percentile"),
          help="how onnxruntime turns calibration activations into ranges (percentile "
               "99.999 lost the least Dice in measurements, docs/usage.md)"),
    Param("float_layers", str, "first-last", choices=("first-last", "none"),
          help="convolutions kept in floating point: the first and the last, or none"),
    Param("gate_cases", int, 16, ge=1, le=100_000,
          help="validation volumes the gate segments, evenly spaced over the fold's "
               "(all of them when it has fewer): keeps the step's time flat as the data "
               "grows, about 21 s a 240x240x155 volume on one CPU"),
    Param("max_dice_drop", float, 0.5, ge=0, le=100,
          help="the gate: the INT8 model's mean Dice over the validation volumes may be at "
               "most this many points (Dice x 100) below the FP32 model's"),
    Param("max_class_dice_drop", float, 1.0, ge=0, le=100,
          help="the gate: no class's Dice may drop by more than this many points"),
    Param("min_agreement", float, 0.99, ge=0, le=1,
          help="the gate: the share of voxels inside each volume's foreground box where the "
               "INT8 and FP32 labels must agree"),
)

EVALUATE = (
    Param("overlap", float, 0.5, ge=0, le=0.9,
          help="sliding windows' overlap, a share of the window (nnU-Net's 0.5)"),
    Param("mirroring", bool, True,
          help="also predict each window flipped along W, H and both, and average the four "
               "softmaxes (nnU-Net's test-time mirroring)"),
)

STEPS = {"download": DOWNLOAD, "preprocess": PREPROCESS, "train": TRAIN, "convert": CONVERT,
         "quantize": QUANTIZE, "evaluate": EVALUATE}


@dataclass(frozen=True)
class StepIO:
    """A step's artifacts and output parameters, as a Kubeflow component's signature states
    them. The step's ``--<artifact> DIR`` flags, its Argo template's artifacts, arguments and
    output parameters, and the DAG's wiring (each input from the step that writes it) are
    derived from this; a new artifact or result is one entry here."""
    reads: dict[str, str]                  # input artifact -> what the step takes from it
    writes: str                            # its one output artifact (a key of ARTIFACTS)
    outputs: tuple[str, ...] = ()          # small results, <writes>/OUTPUTS_DIR/<name>
    files: dict[str, str] = field(default_factory=dict)   # artifact name -> a part of writes
    release: str | None = None             # also stored at models/<model>/<workflow><release>
    by_key: tuple[str, ...] = ()           # inputs it can also read from S3 by key (bykey)
    saves_by_key: bool = False             # it can save its output by key as it works (bykey)


# What each artifact holds (the writer's flag help); the readers say what they take from it.
ARTIFACTS = {
    "raw": "Task01_BrainTumour/{dataset.json, imagesTr/, labelsTr/, imagesTs/} plus "
           "MANIFEST.json",
    "dataset": "(C, D, H, W) image and (D, H, W) label .npy per case, dataset.json with "
               "spacing, statistics and the fold split (up to 5 folds)",
    "model": "checkpoints, metrics and the training report",
    "exported": "ONNX, .pt2, parity figures and model card",
    "quantized": "the INT8 model, its figures and model card",
    "evaluation": "evaluation.json (per held-out case and averaged: Dice per label and per "
                  "BraTS region, HD95 per region) and evaluation.html, which opens with them",
}

# The training report's folder in the model (report.html and the figures it shows) is an
# artifact of its own, so that the Argo UI opens the page with its figures beside it: argo
# server serves a file of a folder artifact at .../outputs/report/<file>, where the page's
# relative links resolve (v4.0.5 server/artifacts/artifact_server.go, GetArtifactFile).
REPORT_FOLDER = "report"

IO = {
    "download": StepIO(reads={}, writes="raw", saves_by_key=True),
    "preprocess": StepIO(
        reads={"raw": "MANIFEST.json and Task01_BrainTumour/ or one other task directory "
                      "with a dataset.json"},
        writes="dataset", by_key=("raw",), saves_by_key=True),
    "train": StepIO(
        reads={"dataset": "the preprocessed cases and their folds"}, writes="model",
        outputs=("mean_dice", "best_epoch", "img_per_s"), files={"report": REPORT_FOLDER}),
    "convert": StepIO(
        reads={"model": "best.pt from steps.train",
               "dataset": "its validation slices are the parity inputs and its dataset.json "
                          "the normalisation contract"},
        writes="exported", outputs=("max_abs_diff", "argmax_agreement"), release="",
        by_key=("dataset",)),
    "quantize": StepIO(
        reads={"exported": "unet2d.onnx and its model card from steps.convert",
               "dataset": "training-fold slices calibrate, validation volumes gate"},
        writes="quantized", outputs=("int8_mean_dice", "int8_speedup"), release="/int8",
        by_key=("dataset",)),
    "evaluate": StepIO(
        reads={"exported": "unet2d.onnx and its model card (the fold it held out)",
               "dataset": "the held-out cases of the model's fold, whole, and their spacing"},
        writes="evaluation", outputs=("dice_wt", "dice_tc", "dice_et"), by_key=("dataset",)),
}


def by_name(params: Iterable[Param]) -> dict[str, Param]:
    return {p.name: p for p in params}


def step_parser(step: str, doc: str, epilog: str | None = None) -> argparse.ArgumentParser:
    """A step's command line: its artifact directories from IO, then its parameters."""
    parser = OneLineArgumentParser(prog=f"python -m steps.{step}",
                                   description=doc.split("\n\n")[0], epilog=epilog)
    add_artifacts(parser, step)
    add_arguments(parser, STEPS[step])
    return parser


def add_artifacts(parser: argparse.ArgumentParser, step: str) -> None:
    """``--<name> DIR`` for each input and the output artifact, with what it holds."""
    io = IO[step]
    for name, what in io.reads.items():
        if name in io.by_key:
            parser.add_argument(f"--{name}", required=True, type=artifact_location,
                                metavar="DIR|s3://BUCKET/PREFIX",
                                help=f"input `{name}` artifact, a directory or the S3 prefix it "
                                     f"was saved at (then each file is fetched when needed "
                                     f"and checked against its manifest): {what}")
            continue
        parser.add_argument(f"--{name}", required=True, type=Path, metavar="DIR",
                            help=f"input `{name}` artifact directory: {what}")
    parser.add_argument(f"--{io.writes}", required=True, type=Path, metavar="DIR",
                        help=f"output `{io.writes}` artifact directory (absent or empty): "
                             f"{ARTIFACTS[io.writes]}")
    if io.saves_by_key:
        parser.add_argument(f"--{io.writes}-uri", type=s3_prefix,
                            metavar="s3://BUCKET/PREFIX",
                            help=f"also save `{io.writes}` at this empty S3 prefix as it is "
                                 f"made: each finished file is uploaded and leaves "
                                 f"--{io.writes}, which keeps the rest and the manifest of "
                                 "the whole (the same prefix then receives those)")


def artifact_location(text: str) -> Path | str:
    """An input artifact flag's value: ``s3://BUCKET/PREFIX`` kept as text (read by key,
    ``steps.bykey``), anything else a directory."""
    return text.rstrip("/") if text.startswith("s3://") else Path(text)


def s3_prefix(text: str) -> str:
    """An output's ``s3://BUCKET/PREFIX`` (no trailing slash); anything else is refused."""
    if not text.startswith("s3://") or not text[len("s3://"):].strip("/").count("/"):
        raise argparse.ArgumentTypeError(f"{uris.redact(text)!r} is not s3://BUCKET/PREFIX")
    return text.rstrip("/")


def add_arguments(parser: argparse.ArgumentParser | Any, params: Iterable[Param]) -> None:
    """One flag per parameter, typed and bounded (a bad value exits 2 in argparse)."""
    for p in params:
        kw: dict[str, Any] = {"type": p.parse, "help": p.help}
        if p.default is None:
            kw["required"] = True
        else:
            kw["default"] = p.default
            kw["help"] += f" (default: {p.text(p.default) or 'empty'})"
        parser.add_argument(p.flag, metavar=p.name.upper() if not p.choices else None,
                            choices=p.choices or None, **kw)


def check_uris(values: Any, params: Iterable[Param]) -> None:
    """Read every non-empty URI parameter with the one parser (StepError naming the flag)."""
    for p in params:
        text = getattr(values, p.name)
        if p.uri_kinds and text:
            uris.parse(text, p.flag, p.uri_kinds)


def train_relations(values: Any, nodes: int = 1) -> list[tuple[str, str]]:
    """(parameter, what is wrong) for train parameters that are wrong together."""
    out = []
    if values.norm == "group" and values.base_filters % GROUPS:
        out.append(("norm", f"group uses {GROUPS} groups: base_filters must be a multiple of "
                            f"{GROUPS}, got {values.base_filters}"))
    if values.deep_supervision and values.levels < 4:
        out.append(("levels", f"must be >= 4 with deep supervision (two extra heads), "
                              f"got {values.levels}"))
    if values.min_epochs > values.max_epochs:
        out.append(("min_epochs", f"must be <= max_epochs ({values.min_epochs} > "
                                  f"{values.max_epochs})"))
    if values.skip_first_n_eval >= values.max_epochs:
        out.append(("skip_first_n_eval", f"must be < max_epochs, or no epoch is validated "
                                         f"({values.skip_first_n_eval} >= {values.max_epochs})"))
    if values.batch_size < values.devices * nodes:
        out.append(("batch_size", f"must be >= devices x nodes, one slice per device "
                                  f"({values.batch_size} < {values.devices} x {nodes})"))
    return out


def image_dtype(requested: str, mode: str) -> str:
    """Preprocess's stored dtype: ``auto`` is float32 in anchor mode, else float16."""
    if requested != "auto":
        return requested
    return "float32" if mode == "anchor" else "float16"
