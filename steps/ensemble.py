"""The folds' models as one ONNX model that predicts with their mean softmax (nnU-Net v1's
ensemble of the five folds), so that predict, evaluate and quantize take it as they take one
fold's model.

    python -m steps.ensemble --exported DIR --with-exported DIR [...] --dataset DIR
        [--pooled DIR] --ensemble DIR

The graph: each model's own graph, its names prefixed ``member<k>.`` (onnx.compose.add_prefix),
all fed the one input ``image`` (N, C, H, W); each model's logits (N, K, H, W) through a
softmax over axis 1; their mean p; the output ``logits`` = log(p). Since softmax(log p) = p, a
reader that takes the softmax of ``logits`` (steps.evaluate) gets the mean softmax itself, and
the argmax is the mean's.

Output: an ``exported`` artifact, which every reader of one takes: ``unet2d.onnx`` with the
folds' preprocessing contract, ``parity.json`` (the ensemble's softmax against the mean of
the folds' own, run one by one, on slices of every case of the dataset: at most
:data:`PARITY_TOLERANCE` apart) and ``model-card.json`` listing the folds, each with its
figures and the digest of the artifact it came from. With ``--pooled`` (the folds' pooled
evaluation) the card holds the cross-validation figures and the postprocessing decided on
them, the model's ``postprocessing`` metadata the label groups whose largest connected
component steps.predict keeps, and ``cross-validation.json`` / ``.html`` are the pool's table.
"""
from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import onnx
from onnx import compose, helper

from steps import evaluate, limits, metrics, predict, schemas
from steps.artifacts import check_disjoint, manifest_digest, publish, require
from steps.dataset import open_cases, read_metadata
from steps.errors import OneLineArgumentParser, StepError, run_main

STEP = "ensemble"
PARITY_FILE = "parity.json"
CV_FILE, CV_PAGE = "cross-validation.json", "cross-validation.html"   # with --pooled
PARITY_TOLERANCE = 1e-4       # largest |ensemble softmax - mean of the folds' softmaxes|
PARITY_SLICES = 16
_TINY = 1e-30                 # keeps log(p) finite where a mean softmax underflows to 0


def merged(models: list[onnx.ModelProto]) -> onnx.ModelProto:
    """One graph: input ``image``, output ``logits`` = log(mean over ``models`` of
    softmax(their logits, axis 1)); the first model's metadata_props and opsets. The k-th
    model's names are prefixed ``member<k>.``."""
    nodes, initializers, functions, softmaxes = [], [], {}, []
    for k, model in enumerate(models):
        prefix = predict.MEMBER_PREFIX.format(k)
        prefixed = compose.add_prefix(model, prefix)
        graph = prefixed.graph
        nodes.append(helper.make_node("Identity", [predict.INPUT_NAME],
                                      [prefix + predict.INPUT_NAME]))
        nodes.extend(graph.node)
        initializers.extend(graph.initializer)
        nodes.append(helper.make_node("Softmax", [prefix + predict.OUTPUT_NAME],
                                      [f"{prefix}softmax"], axis=1))
        softmaxes.append(f"{prefix}softmax")
        for function in prefixed.functions:
            functions[(function.domain, function.name)] = function
    nodes += [helper.make_node("Mean", softmaxes, ["mean_softmax"]),
              helper.make_node("Max", ["mean_softmax", "tiny"], ["floored"]),
              helper.make_node("Log", ["floored"], [predict.OUTPUT_NAME])]
    initializers.append(onnx.numpy_helper.from_array(np.array(_TINY, dtype=np.float32), "tiny"))
    first = models[0].graph
    graph = helper.make_graph(nodes, "unet2d-ensemble", [first.input[0]], [first.output[0]],
                              initializers)
    model = helper.make_model(graph, opset_imports=models[0].opset_import,
                              functions=list(functions.values()))
    model.ir_version = models[0].ir_version
    helper.set_model_props(model, {p.key: p.value for p in models[0].metadata_props})
    return model


def read_models(folders: list[Path]) -> tuple[list[onnx.ModelProto], list[dict[str, Any]]]:
    """Each ``exported`` artifact's model and card; all must share one contract (metadata)
    and hold out different folds."""
    models, cards = [], []
    for folder in folders:
        require(folder, "exported")
        cards.append(predict.read_card(folder))
        path = folder / predict.ONNX_FILE
        predict.read_contract(predict.open_session(path), path)   # open_session checks the graph
        models.append(onnx.load(str(path)))
    props = [{p.key: p.value for p in m.metadata_props} for m in models]
    for folder, other in zip(folders[1:], props[1:]):
        if other != props[0]:
            raise StepError(f"--with-exported {folder}: its preprocessing contract differs "
                            f"from --exported {folders[0]}'s; an ensemble needs one")
    folds = [card["training"]["config"]["fold"] for card in cards]
    if len(set(folds)) != len(folds) or any(card.get("folds") for card in cards):
        raise StepError(f"the models hold out folds {folds}: an ensemble takes one model per "
                        "fold, each trained with its fold held out")
    return models, cards


def parity(path: Path, folders: list[Path], dataset: Path, n_classes: int) -> dict[str, Any]:
    """The ensemble's softmax against the mean of the folds' own (each run alone) on
    PARITY_SLICES slices spread over the dataset's cases; a StepError past the tolerance."""
    meta = read_metadata(dataset)
    cases = open_cases(dataset, meta)
    picks = [(c, d) for c in cases for d in (c.image.shape[1] // 3, 2 * c.image.shape[1] // 3)]
    picks = picks[:: max(1, len(picks) // PARITY_SLICES)][:PARITY_SLICES]
    folds = [predict.open_session(f / predict.ONNX_FILE) for f in folders]
    ensemble = predict.open_session(path)
    multiple = int(predict.read_contract(ensemble, path)["size_multiple"])
    worst = 0.0
    for case, d in picks:
        # a stored slice is as wide as its case's brain (at least the patch), not a multiple
        # of the network's: padded with the background, as predict and evaluate pad it
        image = case.image[:, d]
        x = predict.pad_to_multiple(np.asarray(image[None], dtype=np.float32), multiple,
                                    predict.background_fill(image))
        mean = evaluate.window_softmax(folds, x, n_classes, mirroring=False)
        got = evaluate.window_softmax([ensemble], x, n_classes, mirroring=False)
        worst = max(worst, float(np.abs(got - mean).max()))
    if not worst <= PARITY_TOLERANCE:
        raise StepError(f"the ensemble's softmax is {worst:.3g} from the mean of the folds' "
                        f"(tolerance {PARITY_TOLERANCE}); nothing published")
    return {"slices": len(picks), "max_abs_softmax_diff": worst,
            "tolerance": PARITY_TOLERANCE, "passed": True,
            "reference": "mean of each fold's onnxruntime softmax, run alone"}


def read_pooled(folder: Path, folds: list[int]) -> dict[str, Any]:
    """The folds' ``pooled-evaluation`` (steps.evaluate pool), checked against
    schemas.Pooled; it must pool exactly the ensemble's folds."""
    require(folder, "pooled-evaluation")
    if not (folder / evaluate.POOLED_PAGE).is_file():
        raise StepError(f"--pooled {folder}: {evaluate.POOLED_PAGE} is missing (not an "
                        "artifact of steps.evaluate pool)")
    where = f"--pooled {folder}: {evaluate.POOLED_FILE}"
    pooled = schemas.read_json(folder / evaluate.POOLED_FILE, where)
    schemas.validate(schemas.Pooled, pooled, where)
    if sorted(pooled["folds"]) != sorted(folds):
        raise StepError(f"{where} pools folds {pooled['folds']}, the ensemble's are {folds}")
    return pooled


def with_postprocessing(model: onnx.ModelProto, groups: list[list[int]]) -> onnx.ModelProto:
    """The decided postprocessing as the model's ``postprocessing`` metadata, which
    steps.predict applies (schemas.Postprocessing); nothing where nothing was decided."""
    if groups:
        model.metadata_props.add(key="postprocessing",
                                 value=json.dumps({"keep_largest_component": groups}))
    return model


def card(cards: list[dict[str, Any]], folders: list[Path], figures: dict[str, Any],
         pooled: dict[str, Any] | None, groups: list[list[int]]) -> dict[str, Any]:
    """The ensemble's model card: the first fold's, with the folds listed in place of one
    training run, and their pooled cross-validation with its postprocessing decision."""
    out = {k: v for k, v in cards[0].items() if k not in ("training", "parity", "provenance")}
    files = {"onnx": predict.ONNX_FILE, "parity": PARITY_FILE}
    if pooled is not None:
        files |= {"cross_validation": CV_FILE, "cross_validation_page": CV_PAGE}
        out["cross_validation"] = {
            "folds": pooled["folds"], "cases": len(pooled["cases"]), "mean": pooled["mean"],
            "per_fold": pooled.get("per_fold"), "postprocessing": {
                **pooled["postprocessing"],
                "keep_largest_component": groups,
                "applied_by": "steps.predict, from the model's 'postprocessing' metadata"}}
    out.update(name="unet2d-ensemble",
               folds=[c["training"]["config"]["fold"] for c in cards],
               ensemble={"method": "mean of the folds' softmaxes (nnU-Net v1)",
                         "output": "logits = log of the mean softmax: its softmax is the mean, "
                                   "its argmax the label",
                         "members": [{"fold": c["training"]["config"]["fold"],
                                      "exported_manifest_sha256": manifest_digest(f),
                                      "training": c.get("training", {})}
                                     for c, f in zip(cards, folders)]},
               parity=figures, files=files)
    return out


def build_parser() -> argparse.ArgumentParser:
    p = OneLineArgumentParser(prog="python -m steps.ensemble",
                              description=__doc__.split("\n\n")[0])
    p.add_argument("--exported", required=True, type=Path, metavar="DIR",
                   help="one fold's `exported` artifact")
    p.add_argument("--with-exported", required=True, type=Path, action="append",
                   metavar="DIR", help="another fold's (repeat for each)")
    p.add_argument("--dataset", required=True, type=Path, metavar="DIR",
                   help="the `dataset` artifact: slices for the parity check")
    p.add_argument("--pooled", type=Path, metavar="DIR",
                   help="the folds' `pooled-evaluation` (steps.evaluate pool): its figures "
                        "go into the card and its postprocessing decision into the model")
    p.add_argument("--ensemble", required=True, type=Path, metavar="DIR",
                   help="output artifact directory (absent or empty)")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    limits.set_threads()
    folders = [args.exported, *args.with_exported]
    inputs = {"--dataset": args.dataset, **{f"--exported {f}": f for f in folders}}
    check_disjoint({"--ensemble": args.ensemble},
                   {**inputs, **({"--pooled": args.pooled} if args.pooled else {})})
    models, cards = read_models(folders)
    folds = [c["training"]["config"]["fold"] for c in cards]
    pooled = read_pooled(args.pooled, folds) if args.pooled else None
    groups = metrics.decided_groups(pooled["postprocessing"]) if pooled else []
    n_classes = len(json.loads(dict((p.key, p.value) for p in models[0].metadata_props)
                               ["labels"]))
    with publish(args.ensemble, "exported", STEP, {"folds": len(folders)}) as out:
        onnx.save(with_postprocessing(merged(models), groups), str(out / predict.ONNX_FILE))
        figures = parity(out / predict.ONNX_FILE, folders, args.dataset, n_classes)
        schemas.write_json(out / PARITY_FILE, figures)
        schemas.write_json(out / predict.CARD_FILE,
                           card(cards, folders, figures, pooled, groups))
        if args.pooled:     # the release's own copy of the table it was judged by
            for source, name in ((evaluate.POOLED_FILE, CV_FILE), (evaluate.POOLED_PAGE, CV_PAGE)):
                shutil.copyfile(args.pooled / source, out / name)
    print(f"ensemble: folds {folds} in "
          f"{args.ensemble / predict.ONNX_FILE}; softmax parity {figures['max_abs_softmax_diff']:.2g}",
          file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(run_main(main))
