"""One schema per metadata format a step reads, and the one way to read JSON.

A step never indexes metadata it has not validated: every reader goes through
:func:`read_json` (or :func:`parse_json` for JSON inside another file) and :func:`validate`,
so any input gives either a checked value or one :class:`StepError` line naming the file and
the first field that is wrong. JSON is read as UTF-8 only, at most ``max_json_bytes`` long and
:data:`MAX_DEPTH` levels deep (Python's parser recurses: a document nested 100 000 deep would
raise RecursionError), without NaN or Infinity.

Formats and their readers:

- ``MANIFEST.json``: :class:`Manifest` (``artifacts.read_manifest``, every consumer);
- an MSD task's ``dataset.json``: :class:`RawTask` (download before publishing ``raw``, and
  preprocess: what one publishes the other accepts);
- the ``dataset`` artifact's ``dataset.json``: :class:`Dataset` (``dataset.read_metadata``
  for train, convert and quantize; preprocess before publishing);
- the ONNX model's metadata: :class:`Contract` (predict);
- ``model-card.json``: :class:`ModelCard` (quantize, evaluate, ensemble);
- the ``evaluation`` artifact's ``evaluation.json``: :class:`Evaluation` (evaluate's pool);
- ``best.pt``/``last.pt``: :class:`ModelCheckpoint` (convert);
- ``ckpt-*.pt`` and ``best-epoch*.pt``: :class:`TrainCheckpoint`, :class:`BestWeights`
  (train, on resume);
- download's cache mark: :class:`CacheMark`.

Schemas are strict (no "4" for 4, no 1.0 for 1) and ignore keys they do not name, so newer
writers stay readable. Validation returns the model; callers that keep a plain dict use
the value they passed in, which strict validation leaves exactly as checked.
"""
from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Annotated, Any, Literal, TypeVar

from pydantic import (AfterValidator, BaseModel, ConfigDict, Field, ValidationError,
                      model_validator)

from steps import limits, metrics
from steps.errors import StepError
from steps.model import MAX_FILTERS
from steps.params import MAX_SIDE, N_FOLDS

MAX_DEPTH = 32          # deepest nesting any format needs is 5 (a dataset's crop boxes)
MAX_CLASSES = 256       # labels are uint8
MAX_CHANNELS = 64
Model = TypeVar("Model", bound=BaseModel)


# ------------------------------------------------------------------------------ reading

def _refuse_constant(name: str) -> None:
    raise ValueError(f"{name} is not a JSON number")


def _depth(value: Any) -> int:
    """Nesting depth of parsed JSON, without recursion."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        node, depth = stack.pop()
        if isinstance(node, (dict, list)):
            deepest = max(deepest, depth)
            stack.extend((child, depth + 1)
                         for child in (node.values() if isinstance(node, dict) else node))
    return deepest


def parse_json(data: bytes | str, where: str) -> Any:
    """``data`` as JSON: UTF-8, no NaN/Infinity, at most MAX_DEPTH deep; else StepError."""
    try:
        text = data.decode("utf-8") if isinstance(data, bytes) else data
    except UnicodeDecodeError as exc:
        raise StepError(f"{where} is not UTF-8 text (byte {exc.start})") from None
    try:
        value = json.loads(text, parse_constant=_refuse_constant)
    except RecursionError:
        raise StepError(f"{where} is nested deeper than {MAX_DEPTH} levels") from None
    except ValueError as exc:
        raise StepError(f"{where} is not valid JSON ({exc})") from None
    if _depth(value) > MAX_DEPTH:
        raise StepError(f"{where} is nested deeper than {MAX_DEPTH} levels")
    return value


def read_json(path: Path | str, where: str) -> Any:
    """The JSON file ``path``, held to ``max_json_bytes`` before it is read (the size of
    the file opened, and never more bytes than that bound)."""
    try:
        with open(path, "rb") as handle:
            limits.check("max_json_bytes", os.fstat(handle.fileno()).st_size, where)
            data = handle.read(limits.get("max_json_bytes") + 1)
        limits.check("max_json_bytes", len(data), where)
    except OSError as exc:
        raise StepError(f"{where} cannot be read ({exc.strerror or exc})") from None
    return parse_json(data, where)


def write_json(path: Path, value: Any) -> None:
    """``value`` as the JSON file ``path``, as :func:`read_json` will accept it: strict JSON
    (a NaN, an infinity or an object that is not JSON data is a StepError naming the file and
    the key, and nothing is written), within ``max_json_bytes``. Every JSON file that a step
    publishes is written here."""
    try:
        text = json.dumps(value, indent=1, allow_nan=False) + "\n"
    except (TypeError, ValueError) as exc:
        place = _non_finite(value)
        reason = f"{place} is not a finite number" if place else str(exc)
        raise StepError(f"{path.name}: {reason} (JSON has none); not published") from None
    limits.check("max_json_bytes", len(text.encode()), f"{path.name} as written")
    path.write_text(text)


def _non_finite(value: Any) -> str | None:
    """The dotted key of the first NaN or infinity in JSON-like ``value``, else None."""
    stack = [(value, "")]
    while stack:
        node, at = stack.pop()
        if isinstance(node, float) and not math.isfinite(node):
            return at or "the top level"
        items = node.items() if isinstance(node, dict) else \
            enumerate(node) if isinstance(node, (list, tuple)) else ()
        stack.extend((v, f"{at}.{k}" if at else str(k)) for k, v in reversed(list(items)))
    return None


def validate(schema: type[Model], value: Any, where: str) -> Model:
    """``value`` checked against ``schema``; the first problem as one StepError line."""
    try:
        return schema.model_validate(value)
    except ValidationError as exc:
        first = exc.errors(include_url=False)[0]
        field = ".".join(str(part) for part in first["loc"]) or "top level"
        got = first.get("input")
        shown = "" if isinstance(got, (dict, list)) or first["type"] == "missing" \
            else f" (got {got!r:.80})"
        message = first["msg"].removeprefix("Value error, ")
        raise StepError(f"{where}: {field}: {message}{shown}") from None


def load(path: Path | str, schema: type[Model], where: str) -> Model:
    return validate(schema, read_json(path, where), where)


# ------------------------------------------------------------------------ building blocks

class Schema(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore", protected_namespaces=())


def _index_map(low: int, high: int):
    """A map whose keys are exactly '0'..'N-1', with ``low`` <= N <= ``high``."""
    def check(table: dict[str, str]) -> dict[str, str]:
        if not low <= len(table) <= high:
            raise ValueError(f"needs {low} to {high} entries, has {len(table)}")
        if sorted(table) != sorted(str(i) for i in range(len(table))):
            raise ValueError(f"keys must be '0'..'{len(table) - 1}', got {sorted(table)[:5]}")
        return table
    return AfterValidator(check)


Labels = Annotated[dict[str, str], _index_map(2, MAX_CLASSES)]
Channels = Annotated[list[str], Field(min_length=1, max_length=MAX_CHANNELS)]
Count = Annotated[int, Field(ge=0)]
Side = Annotated[int, Field(ge=1, le=MAX_SIDE)]
Finite = Annotated[float, Field(allow_inf_nan=False)]
Fold = Annotated[int, Field(ge=0, le=N_FOLDS - 1)]
Sha256 = Annotated[str, Field(pattern=r"^[0-9a-f]{64}$")]


def _tensor(value: Any) -> Any:
    # Lazy: download and storage read metadata through this module without torch installed.
    import torch

    if not isinstance(value, torch.Tensor):
        raise ValueError(f"must be a tensor, got {type(value).__name__}")
    return value


Tensor = Annotated[Any, AfterValidator(_tensor)]


# ---------------------------------------------------------------------------- artifacts

class ManifestFile(Schema):
    path: str
    size: Count
    sha256: Sha256


class Manifest(Schema):
    artifact: str
    schema_version: int
    producer: dict[str, Any] = {}
    files: list[ManifestFile]


class RawEntry(Schema):
    image: str
    label: str


class TestEntry(Schema):
    image: str


class RawTask(Schema):
    """An MSD task's ``dataset.json``, as far as preprocess reads it: what download may
    publish is what preprocess accepts."""
    modality: Annotated[dict[str, str], _index_map(1, MAX_CHANNELS)]
    labels: Labels
    training: list[RawEntry] = Field(min_length=1)
    test: list[str | TestEntry] = []
    numTraining: Count | None = None
    numTest: Count | None = None

    @model_validator(mode="after")
    def _counts(self) -> "RawTask":
        for key, entries in (("numTraining", self.training), ("numTest", self.test)):
            stated = getattr(self, key)
            if stated is not None and stated != len(entries):
                raise ValueError(f"{key} is {stated} but the list has {len(entries)}")
        return self


class DatasetCase(Schema):
    name: str = Field(min_length=1, max_length=255)
    image: str
    label: str
    spacing: list[Annotated[float, Field(gt=0, allow_inf_nan=False)]] = \
        Field(min_length=3, max_length=3)
    shape: list[Side] = Field(min_length=4, max_length=4)     # the image's (C, D, H, W)


class Split(Schema):
    train: list[str]
    val: list[str]


class Dataset(Schema):
    """The ``dataset`` artifact's ``dataset.json`` (format in ``steps.dataset``): what
    preprocess publishes and train, convert and quantize read."""
    format_version: Literal[1]
    name: str = ""
    mode: Literal["default", "anchor"] = "default"
    channels: Channels
    labels: Labels
    patch_size: list[Side] = Field(min_length=2, max_length=2)
    image_dtype: Literal["float16", "float32"]
    label_dtype: Literal["uint8"] = "uint8"
    orientation: str = ""
    normalisation: dict[str, Any]
    cases: list[DatasetCase] = Field(min_length=1)
    folds: list[Split] = Field(min_length=1, max_length=N_FOLDS)

    @model_validator(mode="after")
    def _folds(self) -> "Dataset":
        """Folds name known cases and never validate on their own training cases."""
        names = [case.name for case in self.cases]
        if len(set(names)) != len(names):
            raise ValueError("case names must be unique")
        for index, fold in enumerate(self.folds):
            shared = sorted(set(fold.train) & set(fold.val))
            if shared:
                raise ValueError(f"fold {index} validates on its training case {shared[0]!r}")
            unknown = sorted(set(fold.train + fold.val) - set(names))
            if unknown:
                raise ValueError(f"fold {index} names unknown case {unknown[0]!r}")
        return self


# ------------------------------------------------------------------------------ models

class Network(Schema):
    """``steps.model.ModelConfig`` as a checkpoint stores it, bounded so that building the
    network cannot allocate without limit."""
    in_channels: int = Field(ge=1, le=MAX_CHANNELS)
    out_channels: int = Field(ge=2, le=MAX_CLASSES)
    base_filters: int = Field(ge=1, le=MAX_FILTERS)
    max_filters: int = Field(ge=1, le=MAX_FILTERS)
    levels: int = Field(ge=2, le=8)
    norm: Literal["instance", "batch", "group"]
    deep_supervision: bool
    deep_supervision_heads: int = Field(ge=0)

    @model_validator(mode="after")
    def _heads(self) -> "Network":
        """MONAI's DynUNet rule (``check_deep_supr_num``), where it builds the heads: only
        with deep supervision on."""
        if self.deep_supervision and self.deep_supervision_heads > self.levels - 2:
            raise ValueError(f"deep_supervision_heads {self.deep_supervision_heads} needs "
                             f"more than {self.levels} levels")
        return self


class HasNetwork(Schema):
    """Any checkpoint: the network it holds weights for."""
    network: Network = Field(alias="model_config")


class TrainConfig(Schema):
    fold: Fold = 0


MAX_DATA_DEPTH = 16     # a checkpoint's metrics nest 3 deep (epochs, a record, its Dice)


class JsonData(Schema):
    """A map from a checkpoint that convert copies into ``model-card.json``: JSON data only
    (maps with string keys, lists, strings, booleans, None and finite numbers, at most
    MAX_DATA_DEPTH deep), so that the card is strict JSON that its readers accept."""

    @model_validator(mode="before")
    @classmethod
    def _json_data(cls, value: Any) -> Any:
        if not isinstance(value, dict):
            return value                  # the schema names that problem itself
        stack = [(value, (), 1)]
        while stack:
            node, path, depth = stack.pop()
            here = ".".join(str(part) for part in path) or "the map"
            if isinstance(node, (dict, list, tuple)):
                if depth > MAX_DATA_DEPTH:
                    raise ValueError(f"{here} is nested deeper than {MAX_DATA_DEPTH} levels")
                items = node.items() if isinstance(node, dict) else enumerate(node)
                for key, child in items:
                    if isinstance(node, dict) and not isinstance(key, str):
                        raise ValueError(f"{here} has a key of type {type(key).__name__}, "
                                         "not a string")
                    stack.append((child, (*path, key), depth + 1))
            elif isinstance(node, float) and not -float("inf") < node < float("inf"):
                raise ValueError(f"{here} is {node}, not a finite number")
            elif node is not None and not isinstance(node, (str, int, float)):
                raise ValueError(f"{here} is a {type(node).__name__}, not JSON data (a "
                                 "number, string, boolean, null, list or map)")
        return value


class CheckpointTrainConfig(TrainConfig, JsonData):
    """``train_config`` of ``best.pt``: train's flags, copied into the model card."""


class TrainingMetrics(JsonData):
    """``metrics`` of ``best.pt`` (``steps.train.write_model``), copied into the model card."""
    best_mean_dice: Finite | None = None
    best_epoch: Count | None = None
    fold: Fold | None = None
    epochs: list[dict[str, Any]] = []
    epoch: dict[str, Any] | None = None


class ModelCheckpoint(HasNetwork):
    """``best.pt``/``last.pt`` of the ``model`` artifact (``steps.train.model_payload``)."""
    model_state: dict[str, Tensor]
    train_config: CheckpointTrainConfig = CheckpointTrainConfig()
    metrics: TrainingMetrics = TrainingMetrics()
    dataset_manifest_sha256: Sha256 | None = None
    format_version: Literal[1] = 1
    channels: Channels | None = None
    labels: Labels | None = None
    patch_size: list[Side] | None = None


class Progress(Schema):
    epoch: Count
    step: Count
    epoch_loss: Finite
    epoch_steps: Count
    best_dice: Finite
    best_epoch: Count
    stale_epochs: Count
    history: list[dict[str, Any]]


class Rng(Schema):
    torch: Tensor
    python: list[int]
    python_version: int
    python_gauss: float | None
    numpy: list[Any] = Field(min_length=5, max_length=5)


class TrainCheckpoint(HasNetwork):
    """A resumable ``ckpt-*.pt`` (``steps.train.Trainer._checkpoint_state``)."""
    model_state: dict[str, Tensor]
    optimizer_state: dict[str, Any]
    scheduler_state: dict[str, Any]
    scaler_state: dict[str, Any] | None = None
    progress: Progress
    rng: Rng
    best_file: str | None = None
    threads: int | None = Field(None, ge=1, le=4096)   # the CPU run's count (steps.train)
    train_config: TrainConfig
    format_version: Literal[1]


class BestWeights(Schema):
    """``best-epochNNNN.pt`` beside the checkpoints."""
    model_state: dict[str, Tensor]
    epoch: Count


class Contract(Schema):
    """The preprocessing contract in the ONNX model's ``metadata_props`` (``steps.convert``)."""
    channels: Channels
    labels: Labels
    size_multiple: int = Field(ge=1, le=1024)
    mode: Literal["default", "anchor"] = "default"


class ModelCardTraining(Schema):
    config: TrainConfig = TrainConfig()


class ModelCard(Schema):
    """``model-card.json`` of the ``exported`` artifact, as far as quantize and evaluate read
    it; ``folds``: an ensemble's (steps.ensemble), whose training held no fold out."""
    format_version: Literal[1] = 1
    size_multiple: int = Field(ge=1, le=1024)
    training: ModelCardTraining = ModelCardTraining()
    folds: list[Fold] | None = Field(None, min_length=2, max_length=N_FOLDS)


def _having(*names: str):
    """A map that holds at least the keys ``names`` (others are ignored, as newer keys)."""
    def check(table: dict) -> dict:
        missing = [n for n in names if n not in table]
        if missing:
            raise ValueError(f"lacks {missing} (needs {list(names)})")
        return table
    return AfterValidator(check)


_LABEL_NAMES = tuple(metrics.LABELS.values())
_DICE_NAMES = (*_LABEL_NAMES, *metrics.REGIONS)      # each label and each BraTS region
_HD95_NAMES = tuple(metrics.REGIONS)


class CaseFigures(Schema):
    """One case's figures (steps.metrics.case_metrics): Dice of every label and region, HD95
    of every region, as the pool's means, page and outputs index them."""
    dice: Annotated[dict[str, Finite], _having(*_DICE_NAMES)]
    hd95: Annotated[dict[str, Finite], _having(*_HD95_NAMES)]
    empty: list[str]
    # each label's Dice with largest components kept (steps.metrics.postprocessed)
    largest_component: Annotated[
        dict[Literal[metrics.VARIANTS], Annotated[dict[str, Finite], _having(*_LABEL_NAMES)]],
        _having(*metrics.VARIANTS)]


class Means(Schema):
    """Means over cases; None where no case is left (nnU-Net's mean of a label no case has)."""
    dice: Annotated[dict[str, Finite | None], _having(*_DICE_NAMES)]
    hd95: Annotated[dict[str, Finite | None], _having(*_HD95_NAMES)]


class Evaluation(Schema):
    """``evaluation.json`` of the ``evaluation`` artifact (``steps.evaluate.summary``), as
    far as the pool of the folds' evaluations reads it."""
    format_version: Literal[1]
    fold: Fold
    trained_on_by: Count
    cases: dict[str, CaseFigures] = Field(min_length=1)
    mean: Means
    mean_nnunet: Means


class PostprocessingDecision(Schema):
    """``postprocessing`` of ``pooled.json`` (steps.metrics.decide_postprocessing)."""
    foreground_largest_component: bool
    largest_component_labels: list[Literal[tuple(metrics.LABELS.values())]]


class Pooled(Schema):
    """``pooled.json`` of the ``pooled-evaluation`` artifact (``steps.evaluate.pooled``), as
    far as steps.ensemble reads it."""
    format_version: Literal[1]
    folds: list[Fold] = Field(min_length=2, max_length=N_FOLDS)
    cases: dict[str, CaseFigures] = Field(min_length=1)
    mean: Means
    postprocessing: PostprocessingDecision


class Postprocessing(Schema):
    """The model's ``postprocessing`` metadata (steps.ensemble, read by steps.predict): label
    groups, each's largest connected component kept, in order (nnU-Net v1's
    ``for_which_classes``)."""
    keep_largest_component: list[list[Annotated[int, Field(ge=1, le=255)]]] = Field(
        max_length=16)


class CacheMark(Schema):
    """download's ``.verified`` mark beside a cached archive."""
    size: Count
    sha256: Sha256
