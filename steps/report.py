"""The train step's report: loss and Dice curves, validation overlays and one HTML page.

All figures use matplotlib's Agg backend (no display). Inputs are the per-epoch records of
``metrics.json`` and a few validation slices: image (H, W) float, truth and prediction (H, W)
int labels.
"""
from __future__ import annotations

import html
from pathlib import Path
from typing import Any

import numpy as np

_COLOURS = np.array([[0, 0, 0, 0], [1.0, 0.85, 0.1, 0.5], [0.1, 0.6, 1.0, 0.6],
                     [1.0, 0.15, 0.15, 0.7]])


def _pyplot():
    # Lazy: the Agg backend must be chosen before pyplot is first imported.
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def plot_curves(epochs: list[dict[str, Any]], label_names: dict[str, str], path: Path) -> None:
    """Training loss and validation Dice (mean and per class) against epoch; the Dice of
    the validated epochs only (``--skip-first-n-eval``)."""
    plt = _pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    left.plot([e["epoch"] for e in epochs], [e["loss"] for e in epochs], marker="o")
    left.set(title="training loss (Dice + CE)", xlabel="epoch", ylabel="loss")
    validated = [e for e in epochs if "mean_dice" in e]
    x = [e["epoch"] for e in validated]
    right.plot(x, [e["mean_dice"] for e in validated], marker="o", label="mean", linewidth=2)
    for cls, name in label_names.items():
        right.plot(x, [e["dice"][cls] for e in validated], marker=".", label=f"{cls} {name}")
    right.set(title="validation Dice", xlabel="epoch", ylabel="Dice", ylim=(0, 1))
    right.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def _overlay(ax, image: np.ndarray, label: np.ndarray, title: str) -> None:
    ax.imshow(image, cmap="gray")
    ax.imshow(_COLOURS[np.clip(label, 0, len(_COLOURS) - 1)], interpolation="nearest")
    ax.set_title(title, fontsize=8)
    ax.axis("off")


def plot_overlays(samples: list[dict[str, Any]], path: Path) -> None:
    """One row per sample: truth and prediction over the first channel (e.g. FLAIR)."""
    plt = _pyplot()
    rows = max(1, len(samples))
    fig, axes = plt.subplots(rows, 2, figsize=(6, 3 * rows), squeeze=False)
    for row, sample in zip(axes, samples):
        name = f"{sample['case']} slice {sample['slice']}"
        _overlay(row[0], sample["image"], sample["truth"], f"{name}: truth")
        _overlay(row[1], sample["image"], sample["prediction"], f"{name}: prediction")
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)


def summary_rows(metrics: dict[str, Any], label_names: dict[str, str]) -> str:
    """The table the report opens with: the best epoch's mean Dice and Dice per label, and
    where the run trained, as HTML rows (header cell, value)."""
    best = next((e for e in metrics["epochs"] if e["epoch"] == metrics.get("best_epoch")
                 and "dice" in e), None)
    rows = [("best mean Dice", f"{metrics['best_mean_dice']:.4f} (epoch {best['epoch']})"
             if best else "– (not validated)")]
    rows += [(f"Dice {name}", f"{best['dice'][c]:.4f}" if best else "–")
             for c, name in label_names.items()]
    processes = metrics.get("world_size", 1)
    rows.append(("trained on", f"{metrics.get('device', '?')}, {metrics.get('precision', '?')}, "
                               f"{processes} process{'es' if processes != 1 else ''}, "
                               f"{len(metrics['epochs'])} epochs"))
    return "".join(f"<tr><th>{html.escape(k)}</th><td>{html.escape(v)}</td></tr>"
                   for k, v in rows)


def write_report(out: Path, metrics: dict[str, Any], label_names: dict[str, str],
                 samples: list[dict[str, Any]]) -> None:
    """Write ``curves.png``, ``overlays.png`` and ``report.html`` (which shows them by their
    relative names) into the folder ``out``, made here."""
    out.mkdir(exist_ok=True)
    epochs = metrics["epochs"]
    plot_curves(epochs, label_names, out / "curves.png")
    plot_overlays(samples, out / "overlays.png")
    def dice(e: dict[str, Any]) -> list[str]:
        if "mean_dice" not in e:                      # not validated
            return ["–"] * (1 + len(label_names))
        return [f"{e['mean_dice']:.4f}", *(f"{e['dice'][c]:.4f}" for c in label_names)]

    rows = "".join(
        "<tr>" + "".join(f"<td>{v}</td>" for v in (
            e["epoch"], f"{e['loss']:.4f}", *dice(e), f"{e['img_per_s']:.1f}",
            f"{e['seconds']:.1f}")) + "</tr>" for e in epochs)
    heads = "".join(f"<th>Dice {html.escape(n)}</th>" for n in label_names.values())
    summary = summary_rows(metrics, label_names)
    page = f"""<!doctype html>
<html><head><meta charset="utf-8"><title>U-Net training report</title>
<style>body{{font-family:sans-serif;margin:2em}} table{{border-collapse:collapse}}
td,th{{border:1px solid #ccc;padding:3px 8px;text-align:right}}</style></head><body>
<h1>U-Net training report</h1>
<table class="summary">{summary}</table>
<h2>Curves</h2><img src="curves.png" alt="loss and Dice curves">
<h2>Epochs</h2>
<table><tr><th>epoch</th><th>loss</th><th>mean Dice</th>{heads}<th>img/s</th><th>s</th></tr>
{rows}</table>
<h2>Validation slices (left truth, right prediction)</h2>
<img src="overlays.png" alt="validation overlays">
</body></html>
"""
    (out / "report.html").write_text(page)
