"""Whole-volume evaluation of exported models on one fold's held-out cases, as nnU-Net
validates a fold (and, given the five folds' models, predicts with their ensemble).

    python -m steps.evaluate --exported DIR --dataset DIR --evaluation DIR
        [--overlap 0.5] [--mirroring true|false] [--with-exported DIR ... --fold K]
    python -m steps.evaluate pool --evaluation DIR [DIR ...] --pooled DIR

Each held-out case of the ``dataset`` artifact, image (C, D, H, W) and label (D, H, W), is
segmented one axial slice (C, H, W) at a time, as the 2D network was trained:

- **sliding window**: windows of the training patch (``patch_size``, rounded up to the
  network's size multiple) step over each slice, ``overlap`` apart (nnU-Net's 0.5); their
  softmaxes are blended with a Gaussian of sigma 1/8 of the window, nnU-Net's weighting
  (MONAI's ``sliding_window_inference``, mode "gaussian");
- **mirroring** (switchable): each window is also predicted flipped along W, along H and along
  both (nnU-Net's mirror axes in 2D), and the four softmaxes are averaged, flipped back;
- **ensemble**: with further models (``--with-exported``), their softmaxes are averaged too (nnU-Net
  v1's ensemble of the folds' softmaxes);
- the label is the argmax of the blended softmax.

The figures are :mod:`steps.metrics`': Dice per label and per BraTS region, HD95 per region,
per case and averaged over cases, with nnU-Net's mean beside ours (it leaves out the cases
where a label is absent from both truth and prediction). The output artifact ``evaluation``
holds ``evaluation.json`` (:func:`summary`'s keys) and ``evaluation.html``, which opens with
the table and shows, per region, the held-out slice with the most of it: truth and prediction.
``pool`` joins the folds' evaluations (each fold scored by its own model) into the
cross-validation table: ``pooled.json`` and ``pooled.html``, the means over every held-out
case first, then each fold's.
"""
from __future__ import annotations

import argparse
import html
import sys
import time
from pathlib import Path
from typing import Any, Iterable, Sequence

import numpy as np
import torch
from monai.inferers import sliding_window_inference

from steps import limits, metrics, params, predict, schemas
from steps.artifacts import check_disjoint, manifest_digest, publish, require, write_outputs
from steps.dataset import Source, fold_names, open_cases, read_dataset
from steps.errors import OneLineArgumentParser, StepError, run_main
from steps.report import plot_overlays

STEP = "evaluate"
RESULT_FILE = "evaluation.json"
PAGE_FILE = "evaluation.html"
POOLED_FILE = "pooled.json"
POOLED_PAGE = "pooled.html"
OVERLAYS_FILE = "overlays.png"
FORMAT_VERSION = 1
SIGMA_SCALE = 0.125      # nnU-Net's Gaussian: sigma = patch / 8
# Flipped axes of an (N, C, H, W) window: none, W, H, both (nnU-Net 2D's mirror axes (0, 1)).
MIRRORS = ((), (3,), (2,), (2, 3))
SLICES_PER_CALL = 16     # slices that go through one sliding-window pass


def window(patch_size: Sequence[int], multiple: int) -> tuple[int, int]:
    """The sliding window (h, w): the training patch rounded up to the network's multiple."""
    return tuple(-(-side // multiple) * multiple for side in patch_size)


def softmax(logits: np.ndarray) -> np.ndarray:
    """Softmax over axis 1 of (N, K, H, W) logits, float32."""
    shifted = np.exp(logits - logits.max(axis=1, keepdims=True))
    return shifted / shifted.sum(axis=1, keepdims=True)


def window_softmax(sessions: list, x: np.ndarray, n_classes: int,
                   mirroring: bool) -> np.ndarray:
    """Mean softmax (N, K, h, w) of ``sessions`` on windows ``x`` (N, C, h, w), over the
    mirrorings too when ``mirroring``."""
    flips = MIRRORS if mirroring else MIRRORS[:1]
    total = np.zeros((x.shape[0], n_classes) + x.shape[2:], dtype=np.float32)
    for session in sessions:
        for axes in flips:
            seen = np.ascontiguousarray(np.flip(x, axes)) if axes else x
            logits = predict.run_model(session, seen, "the model")
            if logits.shape != total.shape:
                raise StepError(f"the model returned logits {list(logits.shape)} for input "
                                f"{list(seen.shape)}; the dataset needs {n_classes} classes "
                                "at the input's size")
            total += np.flip(softmax(logits), axes) if axes else softmax(logits)
    return total / (len(sessions) * len(flips))


def pad_to_window(x: np.ndarray, size: tuple[int, int], fill: np.ndarray) -> np.ndarray:
    """(N, C, H, W) padded at the bottom/right to at least ``size`` with ``fill`` (C,), the
    background's z-score, so that the sliding window never pads with another value."""
    n, c, h, w = x.shape
    out = np.empty((n, c, max(h, size[0]), max(w, size[1])), dtype=np.float32)
    out[:] = fill.reshape(1, c, 1, 1)
    out[..., :h, :w] = x
    return out


def segment(sessions: list, image: np.ndarray, size: tuple[int, int], n_classes: int,
            overlap: float = 0.5, mirroring: bool = True) -> np.ndarray:
    """Labels (D, H, W) uint8 of a normalised image (C, D, H, W): the argmax of the
    Gaussian-blended sliding-window softmax, slice by slice."""
    channels, depth, height, width = image.shape
    limits.check_memory(4 * 3 * min(SLICES_PER_CALL, depth) * (channels + 2 * n_classes)
                        * max(height, size[0]) * max(width, size[1]), "a case's softmax")
    fill = predict.background_fill(image)

    def predictor(windows: torch.Tensor) -> torch.Tensor:
        return torch.from_numpy(window_softmax(sessions, windows.numpy(), n_classes,
                                               mirroring))

    labels = np.empty((depth, height, width), dtype=np.uint8)
    for start in range(0, depth, SLICES_PER_CALL):
        slices = np.asarray(image[:, start:start + SLICES_PER_CALL], dtype=np.float32)
        x = pad_to_window(slices.transpose(1, 0, 2, 3), size, fill)
        with torch.no_grad():
            blended = sliding_window_inference(
                torch.from_numpy(x), size, sw_batch_size=SLICES_PER_CALL, predictor=predictor,
                overlap=overlap, mode="gaussian", sigma_scale=SIGMA_SCALE)
        labels[start:start + SLICES_PER_CALL] = \
            blended[..., :height, :width].argmax(dim=1).numpy()
    return labels


class RegionSlices:
    """Per BraTS region, the held-out slice with the most truth voxels of it, kept as the
    cases go by (one slice each, not the cases): overlay samples for
    ``steps.report.plot_overlays``, image (H, W) of the first channel."""

    def __init__(self) -> None:
        self.best: dict[str, tuple[int, dict[str, Any]]] = {}

    def add(self, name: str, image: np.ndarray, truth: np.ndarray,
            prediction: np.ndarray) -> None:
        """One case: image (C, D, H, W), truth and prediction (D, H, W)."""
        for region, labels in metrics.REGIONS.items():
            counts = np.isin(truth, labels).sum(axis=(1, 2))
            index = int(counts.argmax())
            if counts[index] > self.best.get(region, (0, None))[0]:
                self.best[region] = (int(counts[index]), {
                    "case": f"{region}: {name}", "slice": index,
                    "image": np.asarray(image[0, index], dtype=np.float32),
                    "truth": truth[index].copy(), "prediction": prediction[index].copy()})

    def samples(self) -> list[dict[str, Any]]:
        return [self.best[r][1] for r in metrics.REGIONS if r in self.best]


def means(cases: Iterable[dict]) -> dict[str, dict]:
    """Ours (``mean``: both-empty counted as Dice 1 and 0 mm) and nnU-Net's (``mean_nnunet``:
    both-empty left out; None where no case is left) over the cases' figures."""
    cases = list(cases)
    nnunet = metrics.mean_over_cases(cases, empty_both="skip")
    return {"mean": metrics.mean_over_cases(cases),
            "mean_nnunet": {m: {k: None if v != v else v for k, v in table.items()}
                            for m, table in nnunet.items()}}


def summary(per_case: dict[str, dict], fold: int, inference: dict[str, Any],
            models: list[dict[str, Any]], dataset: str) -> dict[str, Any]:
    """``evaluation.json`` (schemas.Evaluation): the fold, how it was inferred, each model's
    folds and provenance, how many of those folds' models trained on these cases, each
    case's figures and their :func:`means`."""
    trained_on_by = sum(f != fold for m in models for f in m["folds"])
    return {"format_version": FORMAT_VERSION, "fold": fold, "inference": inference,
            "models": models, "trained_on_by": trained_on_by,
            "dataset_manifest_sha256": dataset, "cases": per_case,
            **means(per_case.values())}


ROWS = [("dice", name) for name in (*metrics.REGIONS, *metrics.LABELS.values())] + \
       [("hd95", name) for name in metrics.REGIONS]
STYLE = ("body{font-family:sans-serif;margin:2em} table{border-collapse:collapse} "
         "td,th{border:1px solid #ccc;padding:3px 8px;text-align:right}")
EMPTY_RULE = (f"Regions in Task01's labels: WT = 1+2+3, TC = 2+3, ET = 3. Both empty: Dice 1, "
              f"HD95 0; one empty: Dice 0, HD95 {metrics.EMPTY_HD95_MM:.2f} mm.")


def table(lines: list[tuple[str, dict[str, dict]]]) -> str:
    """An HTML table: one row per (title, figures), one column per figure of ROWS."""
    head = "".join(f"<th>{'HD95 mm' if m == 'hd95' else 'Dice'} {html.escape(n)}</th>"
                   for m, n in ROWS)
    rows = "".join(
        f"<tr><th>{html.escape(title)}</th>" + "".join(
            f"<td>{'–' if figures[m][n] is None else f'{figures[m][n]:.4f}'}</td>"
            for m, n in ROWS) + "</tr>\n" for title, figures in lines)
    return f"<table><tr><th></th>{head}</tr>\n{rows}</table>"


def mean_lines(result: dict[str, Any]) -> list[tuple[str, dict]]:
    return [("mean", result["mean"]),
            ("mean, nnU-Net's (both-empty left out)", result["mean_nnunet"])]


def html_page(title: str, body: str) -> str:
    return (f'<!doctype html>\n<html><head><meta charset="utf-8"><title>{html.escape(title)}'
            f"</title>\n<style>{STYLE}</style></head><body>\n{body}\n</body></html>\n")


def page(result: dict[str, Any]) -> str:
    """``evaluation.html``: the table first (mean over the held-out cases), then the cases."""
    folds = ", ".join(str(f) for m in result["models"] for f in m["folds"])
    inference = result["inference"]
    return html_page(f"U-Net evaluation, fold {result['fold']}", f"""\
<h1>Fold {result['fold']}: {len(result['cases'])} held-out cases, whole volumes</h1>
{table(mean_lines(result))}
<p>Models of folds {folds} ({result['trained_on_by']} of them trained on these cases);
sliding window {inference['window']} with overlap {inference['overlap']}, Gaussian blending,
mirroring {"on" if inference['mirroring'] else "off"}. {EMPTY_RULE}</p>
<h2>Per region, the held-out slice with the most of it (left truth, right prediction)</h2>
<img src="{OVERLAYS_FILE}" alt="truth and prediction per region">
<h2>Cases</h2>
{table(list(result['cases'].items()))}""")


# ------------------------------------------------------------------------------ the pool

def read_result(folder: Path) -> dict[str, Any]:
    """An ``evaluation`` artifact's ``evaluation.json``, checked against schemas.Evaluation."""
    require(folder, "evaluation")
    where = f"artifact 'evaluation' at {folder}: {RESULT_FILE}"
    result = schemas.read_json(folder / RESULT_FILE, where)
    schemas.validate(schemas.Evaluation, result, where)
    return result


def pooled(results: list[dict[str, Any]]) -> dict[str, Any]:
    """The folds' held-out cases pooled, as nnU-Net's cross-validation summary: each fold
    scored by its own model (``trained_on_by`` 0), no fold twice, no case in two folds; the
    means over every case, and each fold's own. Each case holds every label's and region's
    figures (schemas.CaseFigures, checked by :func:`read_result`)."""
    folds = [r["fold"] for r in results]
    if len(set(folds)) != len(folds):
        raise StepError(f"--evaluation: folds {folds}: a fold is given twice")
    seen = [r["fold"] for r in results if r["trained_on_by"]]
    if seen:
        raise StepError(f"--evaluation: fold {seen[0]} was scored by models that trained on its "
                        "cases; the pool takes each fold scored by its own model")
    cases: dict[str, dict] = {}
    for result in results:
        for name, figures in result["cases"].items():
            if name in cases:
                raise StepError(f"--evaluation: case '{name}' is held out by two folds")
            cases[name] = figures
    names = {m: sorted(next(iter(cases.values()))[m]) for m in ("dice", "hd95")}
    odd = next((n for n, f in cases.items() if {m: sorted(f[m]) for m in names} != names), None)
    if odd:
        raise StepError(f"--evaluation: case '{odd}' has other figures than the rest "
                        f"({names})")
    return {"format_version": FORMAT_VERSION, "folds": folds, "cases": cases,
            "per_fold": {str(r["fold"]): {"cases": len(r["cases"]), "mean": r["mean"]}
                         for r in results}, **means(cases.values()),
            "postprocessing": metrics.decide_postprocessing(cases.values())}


def pooled_page(result: dict[str, Any]) -> str:
    per_fold = [(f"fold {k}, {v['cases']} cases", v["mean"])
                for k, v in result["per_fold"].items()]
    return html_page("U-Net cross-validation", f"""\
<h1>{len(result['folds'])} folds pooled: {len(result['cases'])} held-out cases, whole volumes</h1>
{table(mean_lines(result))}
<p>Each fold's cases scored by the model that held it out. {EMPTY_RULE}</p>
{postprocessing_lines(result["postprocessing"])}
<h2>Folds (our mean)</h2>
{table(per_fold)}
<h2>Cases</h2>
{table(list(result['cases'].items()))}""")


def region_outputs(result: dict[str, Any]) -> dict[str, str]:
    """The mean Dice per BraTS region as the step's output parameters (``dice_wt`` ...)."""
    dice = result["mean"]["dice"]
    return {f"dice_{r.lower()}": f"{dice[r]:.4f}" for r in metrics.REGIONS}


def postprocessing_lines(decision: dict[str, Any]) -> str:
    """The postprocessing decision (metrics.decide_postprocessing) as the page says it."""
    kept, means = decision["largest_component_labels"], decision["mean_dice"]
    rows = [(title, means[key]) for key, title in (
        ("raw", "as predicted"), ("foreground", "the foreground's largest component kept"),
        ("then_per_label", "then each label's largest component"))]
    head = "".join(f"<th>Dice {html.escape(n)}</th>" for n in metrics.LABELS.values())
    body = "".join(f"<tr><th>{html.escape(t)}</th>" + "".join(
        f"<td>{'–' if dice[n] is None else f'{dice[n]:.4f}'}</td>"
        for n in metrics.LABELS.values()) + "</tr>\n"
        for t, dice in rows)
    return (f"<h2>Postprocessing (nnU-Net v1's rule, on these pooled cases)</h2>\n"
            f"<p>Keep the foreground's largest connected component: "
            f"{'yes' if decision['foreground_largest_component'] else 'no'}; then each "
            f"label's largest component for: {', '.join(kept) or 'no label'}.</p>\n"
            f"<table><tr><th></th>{head}</tr>\n{body}</table>")


def pool_main(argv: Sequence[str]) -> int:
    p = OneLineArgumentParser(prog="python -m steps.evaluate pool",
                              description="The folds' evaluations pooled into one table.")
    p.add_argument("--evaluation", required=True, type=Path, nargs="+", metavar="DIR",
                   help="each fold's `evaluation` artifact")
    p.add_argument("--pooled", required=True, type=Path, metavar="DIR",
                   help="output artifact directory (absent or empty): pooled.json and "
                        "pooled.html")
    args = p.parse_args(argv)
    check_disjoint({"--pooled": args.pooled},
                   {f"--evaluation {e}": e for e in args.evaluation})
    result = pooled([read_result(folder) for folder in args.evaluation])
    with publish(args.pooled, "pooled-evaluation", STEP, {"folds": result["folds"]}) as out:
        schemas.write_json(out / POOLED_FILE, result)
        (out / POOLED_PAGE).write_text(pooled_page(result))
        write_outputs(out, STEP, region_outputs(result))
    dice = result["mean"]["dice"]
    print(f"evaluate pool: folds {result['folds']}, {len(result['cases'])} cases, Dice WT "
          f"{dice['WT']:.4f} TC {dice['TC']:.4f} ET {dice['ET']:.4f}", file=sys.stderr)
    return 0


def open_models(folders: list[Path], labels: dict[str, str]) -> tuple[list, list, int]:
    """The ``exported`` artifacts' ONNX sessions, their provenance, and the one size
    multiple they share; each model's classes must be the dataset's labels."""
    sessions, models, multiples = [], [], set()
    for folder in folders:
        require(folder, "exported")
        card = predict.read_card(folder)
        path = folder / predict.ONNX_FILE
        session = predict.open_session(path)
        contract = predict.read_contract(session, path)
        if contract["labels"] != labels:
            raise StepError(f"--exported {folder}: the model's labels {contract['labels']} "
                            f"are not the dataset's {labels}")
        sessions.append(session)
        multiples.add(int(contract["size_multiple"]))
        folds = card.get("folds") or [card.get("training", {}).get("config", {}).get("fold", 0)]
        models.append({"folds": folds, "exported_manifest_sha256": manifest_digest(folder)})
    if len(multiples) != 1:
        raise StepError(f"--exported: the models need different size multiples {multiples}")
    return sessions, models, multiples.pop()


def held_out(folders: list[Path], models: list[dict], fold: int | None) -> int:
    """The fold to evaluate on: ``--fold``, else the one model's own. A single model is held
    to its own fold, whose cases it never trained on; an ensemble (several models, or one of
    steps.ensemble) needs ``--fold``, and the result says how many of its members trained on
    those cases (``trained_on_by``)."""
    single = len(models) == 1 and len(models[0]["folds"]) == 1
    if fold is None:
        if not single:
            raise StepError("--fold is needed with an ensemble of models")
        return models[0]["folds"][0]
    if single and models[0]["folds"][0] != fold:
        raise StepError(f"--fold {fold}: the model in {folders[0]} was trained with fold "
                        f"{models[0]['folds'][0]} held out; fold {fold}'s cases are in its "
                        "training set")
    return fold


def build_parser() -> argparse.ArgumentParser:
    p = params.step_parser(STEP, __doc__)
    p.add_argument("--with-exported", type=Path, action="append", default=[], metavar="DIR",
                   help="a further `exported` artifact; the models' ensemble is evaluated "
                        "(their softmaxes averaged), on --fold")
    p.add_argument("--fold", type=int, default=None,
                   help="held-out fold (default: the one model's own)")
    return p


def evaluate(args: argparse.Namespace) -> tuple[dict[str, Any], str]:
    """(the result, what a dataset read by key fetched: only the fold's held-out cases)."""
    folders = [args.exported, *args.with_exported]
    check_disjoint({"--evaluation": args.evaluation},
                   {"--dataset": args.dataset, **{f"--exported {e}": e for e in folders}})
    with read_dataset(args.dataset, args.evaluation.parent) as (dataset, meta):
        return evaluate_fold(args, folders, dataset, meta), dataset.moved_note()


def evaluate_fold(args: argparse.Namespace, folders: list[Path], dataset: Source,
                  meta: dict[str, Any]) -> dict[str, Any]:
    """Segment the held-out cases of the models' fold, score them and publish
    ``evaluation``; the result."""
    labels = dict(meta["labels"])
    sessions, models, multiple = open_models(folders, labels)
    fold = held_out(folders, models, args.fold)
    _, names = fold_names(meta, fold)
    if not names:
        raise StepError(f"artifact 'dataset' at {dataset}: fold {fold} has no held-out case")
    size = window(meta["patch_size"], multiple)
    slices, per_case = RegionSlices(), {}
    for case in open_cases(dataset, meta, names):
        prediction = segment(sessions, case.image, size, len(labels), args.overlap,
                             args.mirroring)
        truth = np.asarray(case.label)
        per_case[case.name] = metrics.case_metrics(prediction, truth, case.spacing)
        per_case[case.name]["largest_component"] = {
            variant: metrics.label_dice(kept, truth)
            for variant, kept in metrics.postprocessed(prediction).items()}
        slices.add(case.name, case.image, truth, prediction)
    inference = {"window": list(size), "overlap": args.overlap, "blend": "gaussian, sigma 1/8",
                 "mirroring": args.mirroring}
    result = summary(per_case, fold, inference, models, dataset.manifest_sha256())
    recorded = {"fold": fold, "overlap": args.overlap, "mirroring": args.mirroring}
    with publish(args.evaluation, "evaluation", STEP, recorded) as out:
        schemas.write_json(out / RESULT_FILE, result)
        plot_overlays(slices.samples(), out / OVERLAYS_FILE)
        (out / PAGE_FILE).write_text(page(result))
        write_outputs(out, STEP, region_outputs(result))
    return result


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["pool"]:
        return pool_main(argv[1:])
    args = build_parser().parse_args(argv)
    limits.set_threads()
    start = time.perf_counter()
    result, moved = evaluate(args)
    dice = result["mean"]["dice"]
    print(f"evaluate: fold {result['fold']}, {len(result['cases'])} cases, Dice WT "
          f"{dice['WT']:.4f} TC {dice['TC']:.4f} ET {dice['ET']:.4f}, "
          f"{time.perf_counter() - start:.1f} s{moved}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(run_main(main))
